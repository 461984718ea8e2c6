#!/bin/bash
# Session 17, call 4 (~4 minutes on an H200): issue 3's bench, medians of 3 rounds at 64 rows, and issue 5's
# generation bench, meant for the H200 (calls 1-3 got H100s). Stops at once on another card, so that a wrong card
# costs only its start.
. scripts/calls/eval_wall.sh   # PYTHONPATH, FASTPPL_SHARED_DATA
name=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$name"
case "$name" in *H200*) ;; *) echo "not an H200: nothing run"; exit 0 ;; esac
timeout 200 python3 -m fastppl bench --model random:gpt2 --tokens 2097152 --peers hf-compiled,fastppl \
  --rounds 3 --json $OUT/bench64.json > $OUT/bench64.log 2> $OUT/bench64.err; echo "bench 64 rc $?"
timeout 170 python3 -m fastppl bench --generate --batch-sizes 1,64 --new-tokens 128 --quiet --json $OUT/bench_gen.json \
  > $OUT/bench_gen.log 2>&1; echo "bench gen rc $?"
tail -3 $OUT/bench64.log
tail -9 $OUT/bench_gen.log
