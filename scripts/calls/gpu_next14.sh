#!/bin/bash
# Session 11, call 1: where the 3.4 s outside `evaluate` go (interpreter, imports, CUDA context, teardown),
# and what skipping --batch-size auto's probe batch (the memory bound) moves. GPU tests of the bound first.
. scripts/calls/eval_wall.sh   # PYTHONPATH, D, EVAL, now, run_eval
T0=$(date +%s); stamp() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
secs() { python3 -c "print(f'{$2 - $1:.2f}')"; }
stamp gpu-tests
timeout 200 python3 -m pytest -q -s tests/test_gpu.py -k "memory_bound or auto_batch_size" 2>&1 | grep -E "MiB|passed|failed|Error" | tail -12
stamp start-up
for what in "pass" "import torch" "import torch; torch.zeros(1, device='cuda').sum().item()" \
            "import fastppl.cli, fastppl.pipeline" "import fastppl.pipeline, torch; torch.zeros(1, device='cuda').sum().item()"; do
  for i in 1 2; do s=$(now); python3 -c "$what"; echo "start-up $i  $(secs $s $(now)) s  $what"; done
done
python3 -X importtime -c "import fastppl.cli, fastppl.pipeline" 2>$OUT/importtime.txt
sort -t'|' -k2 -n -r $OUT/importtime.txt | head -12
FORCE_PROBE="import sys, fastppl.pipeline as p; p.scoring_memory_bound = lambda *a, **k: None; from fastppl.cli import main; sys.exit(main(sys.argv[1:]))"
stamp eval
run_eval cold-bound python3 -m fastppl
for i in 1 2 3; do run_eval warm-bound-$i python3 -m fastppl; run_eval warm-probe-$i python3 -c "$FORCE_PROBE"; done
stamp done
