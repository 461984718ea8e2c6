#!/bin/bash
# Session 12, call 2: the warm-up threads joined before the first kernel (so that Triton's cache key is not computed twice),
# against the same code with the Triton thread switched off, 4 warm runs each, interleaved; the floor of this machine; a profile.
. scripts/calls/eval_wall.sh   # PYTHONPATH, D, EVAL, now, run_eval
NO_TRITON_WARM_UP="import fastppl.accel.warm_up as w; w._warm_up_triton = lambda: None; from fastppl.cli import run; run()"
run_eval cold python3 -m fastppl
for i in 1 2; do
  s=$(now); python3 -c "import torch"; m=$(now); python3 -c "import torch; torch.ones(1, device='cuda').sum().item()"; e=$(now)
  python3 -c "print(f'floor: import torch {$m - $s:.2f} s, + CUDA init {$e - $m:.2f} s')"
done
for i in 1 2 3 4; do
  run_eval triton-warm-$i python3 -m fastppl
  run_eval no-triton-$i python3 -c "$NO_TRITON_WARM_UP"
done
python3 scripts/gpu_first_use.py > $OUT/profile.txt 2>&1
head -45 $OUT/profile.txt | cut -c1-150
