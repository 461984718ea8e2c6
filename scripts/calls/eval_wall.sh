# Sourced by the GPU call wrappers: `fastppl eval --split all` timed from the shell, one line per run (run_eval), and
# issue 3's bench against compiled transformers (issue3_bench).
export PYTHONPATH=src FASTPPL_SHARED_DATA=$PWD/.devcache/data
D=$FASTPPL_SHARED_DATA
now() { date +%s.%N; }
EVAL="eval --model random:gpt2 --data $D/tinyshakespeare.txt --tokenizer $D/gpt2-tokenizer --split all --quiet"
run_eval() {   # name, then the command: wall, teardown after the --json file, stage_seconds, batch, nll
  local name=$1; shift; local s=$(now)
  timeout 60 "$@" $EVAL --json $OUT/$name.json > /dev/null 2>$OUT/$name.err; local rc=$?; local e=$(now)
  python3 - "$OUT/$name.json" "$name" "$rc" "$s" "$e" <<'PY'
import json, os, sys
path, name, rc, s, e = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4]), float(sys.argv[5])
r = json.load(open(path)); st = r.get("stage_seconds", {})
print(f"{name:14s} rc {rc} wall {e - s:5.2f} s  teardown {e - os.path.getmtime(path):4.2f} s  "
      f"in evaluate {sum(st.values()):4.2f} s  batch {r.get('batch_size')} ({r.get('batch_size_reason')})  "
      + "  ".join(f"{k} {v:.2f}" for k, v in st.items()) + f"  nll {r['nll']:.6f}")
PY
}
issue3_bench() {   # --tune-products value, then optionally the rows a batch (default: the bench's, 64)
  local tune=$1 rows=$2
  local name=$OUT/bench${rows:-64}_$tune
  timeout 170 python3 -m fastppl bench --model random:gpt2 --tokens 2097152 --peers hf-compiled,fastppl --rounds 3 \
    --tune-products $tune ${rows:+--batch-size $rows} --json $name.json > $name.log 2> $name.err
  echo "bench $tune${rows:+, $rows rows} rc $?"; tail -4 $name.log
}
