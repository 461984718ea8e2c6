#!/bin/bash
# Session 17, call 3 (~6 minutes). Issue 3's bench as medians of 3 rounds (bench --rounds), both peers at the
# same rows a batch: 64 (the issue's peers' batch) and 128.
. scripts/calls/eval_wall.sh   # PYTHONPATH, FASTPPL_SHARED_DATA
nvidia-smi --query-gpu=name,clocks.sm,power.draw,power.limit --format=csv,noheader
for rows in 64 128; do
  timeout 270 python3 -m fastppl bench --model random:gpt2 --tokens 2097152 --peers hf-compiled,fastppl \
    --batch-size $rows --rounds 3 --json $OUT/bench$rows.json > $OUT/bench$rows.log 2> $OUT/bench$rows.err; echo "bench $rows rc $?"
done
for rows in 64 128; do echo "== $rows"; tail -3 $OUT/bench$rows.log; done
