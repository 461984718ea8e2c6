#!/bin/bash
# Session 12: start-up with Triton's first use on a warm-up thread (against the same code with that thread
# switched off), 4 warm runs each, interleaved; a cProfile of evaluate(); the GPU tests.
. scripts/calls/eval_wall.sh   # PYTHONPATH, D, EVAL, now, run_eval
NO_TRITON_WARM_UP="import fastppl.accel.warm_up as w; w._warm_up_triton = lambda: None; from fastppl.cli import run; run()"
run_eval cold python3 -m fastppl
for i in 1 2 3 4; do
  run_eval triton-warm-$i python3 -m fastppl
  run_eval no-triton-$i python3 -c "$NO_TRITON_WARM_UP"
done
python3 scripts/gpu_first_use.py > $OUT/profile.txt 2>&1
timeout 300 python3 -m pytest -q -m gpu tests/test_gpu.py 2>&1 | tail -3
head -45 $OUT/profile.txt | cut -c1-150
