#!/bin/bash
# Written in session 16 for the next session's first call (~7 minutes), on the H200 (session 16's one call ran on an
# H100, after ~50 minutes of machines that did not start).
# 1. Issue 5, batch 1: the fused step with dependent launches (now the default; H100 0.311 -> 0.261 ms a step) against
#    transformers' static cache in the same run; batch 64 for the record.
# 2. Issue 3: the dense bench against compiled transformers at the default 64 rows and at 128 rows (+1.1 % for
#    fastppl on the H100's sweep, within its noise; both peers get the same batch).
. scripts/calls/eval_wall.sh   # PYTHONPATH, FASTPPL_SHARED_DATA
nvidia-smi --query-gpu=name,clocks.sm,power.draw,power.limit --format=csv,noheader
timeout 90 python3 -m pytest -q -m gpu tests/test_fused_decode.py > $OUT/pytest.log 2>&1; echo "pytest rc $?"
timeout 170 python3 -m fastppl bench --generate --batch-sizes 1,64 --new-tokens 128 --quiet --json $OUT/bench_gen.json \
  > $OUT/bench_gen.log 2>&1; echo "bench gen rc $?"
timeout 130 python3 -m fastppl bench --model random:gpt2 --tokens 2097152 --peers hf-compiled,fastppl --quiet \
  --json $OUT/bench.json > $OUT/bench.log 2>&1; echo "bench rc $?"
timeout 150 python3 -m fastppl bench --model random:gpt2 --tokens 2097152 --peers hf-compiled,fastppl --batch-size 128 \
  --quiet --json $OUT/bench128.json > $OUT/bench128.log 2>&1; echo "bench 128 rc $?"
tail -2 $OUT/pytest.log
tail -8 $OUT/bench_gen.log
grep -E "^hf|^fastppl|^what" $OUT/bench.log | tail -3
grep -E "^hf|^fastppl|^what" $OUT/bench128.log | tail -3
