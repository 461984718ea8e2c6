#!/bin/bash
# Session 13, call 4: the descriptor path's tile choices; the Llama-1B shape against compiled transformers; all
# GPU tests and two eval runs on the new fused loss (descriptors for 16-bit inputs only). At b524d36, which this
# call ran, the dense bench ignored --compile (fastppl's row ran eager); since 4f89a71 the row compiles.
. scripts/calls/eval_wall.sh   # PYTHONPATH, FASTPPL_SHARED_DATA, D, EVAL, now, run_eval
timeout 120 python3 scripts/gpu_loss_configs.py > $OUT/loss_configs.log 2>&1; echo "loss_configs rc $?"
timeout 200 python3 -m fastppl bench --model random:llama-1b --peers hf-compiled,fastppl --tokens 262144 --compile on \
  --quiet --json $OUT/bench_llama.json > $OUT/bench_llama.log 2>&1; echo "bench llama rc $?"
run_eval cold python3 -m fastppl
run_eval warm python3 -m fastppl
timeout 200 python3 -m pytest -q -m gpu tests/test_gpu.py tests/test_fused_loss.py 2>&1 | tail -3
grep -l Traceback $OUT/*.err
tail -16 $OUT/loss_configs.log
tail -4 $OUT/bench_llama.log
