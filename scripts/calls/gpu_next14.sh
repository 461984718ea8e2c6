#!/bin/bash
# Session 11, call 1: where the 3.4 s outside `evaluate` go (interpreter, imports, CUDA context, teardown),
# and what skipping --batch-size auto's probe batch (the memory bound) moves. GPU tests of the bound first.
export PYTHONPATH=src FASTPPL_SHARED_DATA=$PWD/.devcache/data
D=$FASTPPL_SHARED_DATA
T0=$(date +%s); stamp() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
now() { date +%s.%N; }
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
EVAL="eval --model random:gpt2 --data $D/tinyshakespeare.txt --tokenizer $D/gpt2-tokenizer --split all --quiet"
FORCE_PROBE="import sys, fastppl.pipeline as p; p.scoring_memory_bound = lambda *a, **k: None; from fastppl.cli import main; sys.exit(main(sys.argv[1:]))"
run_eval() {   # name, then the command
  local name=$1; shift; local s=$(now)
  timeout 60 "$@" $EVAL --json $OUT/$name.json > /dev/null 2>$OUT/$name.err; local rc=$?; local e=$(now)
  python3 - "$OUT/$name.json" "$name" "$rc" "$s" "$e" <<'PY'
import json, os, sys
path, name, rc, s, e = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4]), float(sys.argv[5])
r = json.load(open(path)); st = r.get("stage_seconds", {})
print(f"{name:12s} rc {rc} wall {e - s:5.2f} s  teardown {e - os.path.getmtime(path):4.2f} s  "
      f"in evaluate {sum(st.values()):4.2f} s  batch {r.get('batch_size')} ({r.get('batch_size_reason')})  "
      + "  ".join(f"{k} {v:.2f}" for k, v in st.items()) + f"  nll {r['nll']:.6f}")
PY
}
stamp eval
run_eval cold-bound python3 -m fastppl
for i in 1 2 3; do run_eval warm-bound-$i python3 -m fastppl; run_eval warm-probe-$i python3 -c "$FORCE_PROBE"; done
stamp done
