#!/bin/bash
# Session 12, call 4: the Triton warm-up as committed (Triton imported on the main thread before `import torch`, its
# cache key hashed on a thread), 8 warm runs (an import race would show as a failed run), against it switched off.
. scripts/calls/eval_wall.sh   # PYTHONPATH, D, EVAL, now, run_eval
NO_TRITON_WARM_UP="import fastppl.accel.warm_up as w; w.start_triton_warm_up = lambda: None; from fastppl.cli import run; run()"
run_eval cold python3 -m fastppl
for i in 1 2; do
  s=$(now); python3 -c "import torch"; m=$(now); python3 -c "import torch; torch.ones(1, device='cuda').sum().item()"; e=$(now)
  python3 -c "print(f'floor: import torch {$m - $s:.2f} s, + CUDA init {$e - $m:.2f} s')"
done
for i in 1 2 3 4 5 6 7 8; do
  run_eval early-$i python3 -m fastppl
  [ $((i % 2)) = 0 ] && run_eval no-triton-$i python3 -c "$NO_TRITON_WARM_UP"
done
grep -l Traceback $OUT/*.err
timeout 300 python3 -m pytest -q -m gpu tests/test_gpu.py 2>&1 | tail -2
