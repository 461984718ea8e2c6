#!/bin/bash
# Session 13, call 5: `fastppl bench` with --compile for fastppl's row: the Llama-1B shape compiled against
# compiled transformers, and GPT-2's dense bench again on the new fused loss (a second measurement).
. scripts/calls/eval_wall.sh   # PYTHONPATH, FASTPPL_SHARED_DATA
timeout 260 python3 -m fastppl bench --model random:llama-1b --peers hf-compiled,fastppl --tokens 262144 --compile on \
  --quiet --json $OUT/bench_llama.json > $OUT/bench_llama.log 2>&1; echo "bench llama rc $?"
timeout 150 python3 -m fastppl bench --model random:gpt2 --peers hf-compiled,fastppl --tokens 2097152 \
  --quiet --json $OUT/bench_gpt2.json > $OUT/bench_gpt2.log 2>&1; echo "bench gpt2 rc $?"
tail -4 $OUT/bench_llama.log; tail -4 $OUT/bench_gpt2.log
