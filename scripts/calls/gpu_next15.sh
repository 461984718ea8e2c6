#!/bin/bash
# Session 11, call 2: the interpreter teardown skipped (cli.run's os._exit), 3 warm runs; then cProfile of
# evaluate() to see what the first scoring batch's 0.6 s of first use is.
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
print(f"{name:12s} rc {rc} wall {e - s:5.2f} s  teardown {e - os.path.getmtime(path):4.2f} s  "
      f"in evaluate {sum(st.values()):4.2f} s  batch {r.get('batch_size')}  "
      + "  ".join(f"{k} {v:.2f}" for k, v in st.items()) + f"  nll {r['nll']:.6f}")
PY
}
run_eval cold python3 -m fastppl
for i in 1 2 3; do run_eval fast-exit-$i python3 -m fastppl; run_eval plain-exit-$i python3 -c "import sys; from fastppl.cli import main; sys.exit(main(sys.argv[1:]))"; done
python3 scripts/gpu_first_use.py > /dev/null 2>&1
python3 scripts/gpu_first_use.py > $OUT/profile.txt 2>&1
head -60 $OUT/profile.txt | cut -c1-160
