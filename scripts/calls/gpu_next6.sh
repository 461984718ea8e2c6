#!/bin/bash
# Session 6, first GPU call: the fused Triton decode step's GPU tests, its timing against the compiled step
# (and tilings), then bench --generate in the same call. ~450 s.
export PYTHONPATH=src FASTPPL_SHARED_DATA=$PWD/.devcache/data
T0=$(date +%s); stamp() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
stamp tests; timeout 200 python3 -m pytest -q -x tests/test_fused_decode.py > $OUT/tests.log 2>&1; echo "rc $?"; tail -4 $OUT/tests.log
grep -E "Error|assert" $OUT/tests.log | head -8
stamp timing; FUSED_BUDGET_S=170 timeout 230 python3 scripts/gpu_fused_decode.py > $OUT/fused.log 2>&1; echo "rc $?"; grep -v -i warn $OUT/fused.log | grep -v "^{" | tail -24
stamp bench; timeout 170 python3 -m fastppl.cli bench --generate --batch-sizes 1,64 --new-tokens 128 --json $OUT/bench_generate.json > $OUT/bench.log 2>&1; echo "rc $?"; tail -12 $OUT/bench.log
stamp done
