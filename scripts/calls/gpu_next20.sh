#!/bin/bash
# Session 13, call 1: the fused loss's variants (TMA loads, polynomial exponentials, no-epilogue bound), the
# wall-vs-kernel gap of the dense scorer against the SM clock, and HEAD's GPU tests and eval runs.
. scripts/calls/eval_wall.sh   # PYTHONPATH, D, EVAL, now, run_eval
timeout 280 python3 scripts/gpu_loss_tma.py > $OUT/loss_tma.log 2>&1; echo "loss_tma rc $?"
timeout 100 python3 scripts/gpu_gap.py > $OUT/gap.log 2>&1; echo "gap rc $?"
run_eval cold python3 -m fastppl
run_eval warm python3 -m fastppl
timeout 180 python3 -m pytest -q -m gpu tests/test_gpu.py 2>&1 | tail -2
grep -l Traceback $OUT/*.err
tail -20 $OUT/gap.log
sed -n '/^| shape/,$p' $OUT/loss_tma.log; grep -i error $OUT/loss_tma.log | head -5
