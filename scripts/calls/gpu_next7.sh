#!/bin/bash
# Session 6, second GPU call: the fused decode step's GPU tests at MAX_BATCH = 2, batch-1 warps and chunk
# sizes, then bench --generate at batch 1 with the fastest of them, in the same process. ~250 s.
export PYTHONPATH=src FASTPPL_SHARED_DATA=$PWD/.devcache/data
T0=$(date +%s); stamp() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
stamp tests; timeout 150 python3 -m pytest -q -x --durations=5 tests/test_fused_decode.py > $OUT/tests.log 2>&1; echo "rc $?"; tail -9 $OUT/tests.log
stamp timing; FUSED_BATCHES=1,2 FUSED_BUDGET_S=120 FUSED_BENCH=1 timeout 260 python3 scripts/gpu_fused_decode.py > $OUT/fused.log 2>&1; echo "rc $?"; grep -v -i warn $OUT/fused.log | grep -v "^{" | tail -22
stamp done
