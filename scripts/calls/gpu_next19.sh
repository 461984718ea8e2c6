#!/bin/bash
# Session 12, call 4: the Triton warm-up as committed (Triton imported on the main thread before `import torch`, its
# cache key hashed on a thread), 8 warm runs (an import race would show as a failed run), against it switched off.
export PYTHONPATH=src FASTPPL_SHARED_DATA=$PWD/.devcache/data
D=$FASTPPL_SHARED_DATA
now() { date +%s.%N; }
EVAL="eval --model random:gpt2 --data $D/tinyshakespeare.txt --tokenizer $D/gpt2-tokenizer --split all --quiet"
run_eval() {   # name, then the command
  local name=$1; shift; local s=$(now)
  timeout 60 "$@" $EVAL --json $OUT/$name.json > /dev/null 2>$OUT/$name.err; local rc=$?; local e=$(now)
  python3 - "$OUT/$name.json" "$name" "$rc" "$s" "$e" <<'PY'
import json, os, sys
path, name, rc, s, e = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4]), float(sys.argv[5])
r = json.load(open(path)); st = r.get("stage_seconds", {})
print(f"{name:14s} rc {rc} wall {e - s:5.2f} s  teardown {e - os.path.getmtime(path):4.2f} s  "
      f"in evaluate {sum(st.values()):4.2f} s  batch {r.get('batch_size')}  "
      + "  ".join(f"{k} {v:.2f}" for k, v in st.items()) + f"  nll {r['nll']:.6f}")
PY
}
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
