#!/bin/bash
# Session 7, fourth call: the logits split at a multiple of 64 ids in the compiled decode step, then
# bench --generate at batch 1 and 64 with the defaults, and the GPU tests of the generate paths.
export PYTHONPATH=src FASTPPL_SHARED_DATA=$PWD/.devcache/data
T0=$(date +%s); stamp() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
stamp align; timeout 240 python3 scripts/gpu_logits_alignment.py > $OUT/align.log 2>&1; echo "rc $?"
grep -E "fp32|equal|Error" $OUT/align.log; sed -n '/^ *batch  *alignment/,$p' $OUT/align.log
stamp bench; timeout 200 python3 -m fastppl bench --generate --batch-sizes 1,64 --new-tokens 128 --json $OUT/bench_generate.json > $OUT/bench.log 2>&1; echo "rc $?"
tail -14 $OUT/bench.log
stamp tests; timeout 120 python3 -m pytest -q -x tests/test_fused_decode.py tests/test_generate.py -k "cuda or compiled" > $OUT/tests.log 2>&1; echo "rc $?"; tail -2 $OUT/tests.log
grep -E "^E |FAILED" $OUT/tests.log | head -10
stamp done
