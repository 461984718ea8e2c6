#!/bin/bash
# Session 7, second call: the fused decode step above batch 2 (tensor-core tiles): GPU tests, fp32 tokens
# vs eager at GPT-2 124M, fused vs compiled at batch 1-128, then a sweep of the tiles at batch 64 and 2.
export PYTHONPATH=src FASTPPL_SHARED_DATA=$PWD/.devcache/data
T0=$(date +%s); stamp() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
stamp tests; timeout 200 python3 -m pytest -q -x tests/test_fused_decode.py > $OUT/tests.log 2>&1; echo "rc $?"; tail -2 $OUT/tests.log
grep -E "^E |FAILED" $OUT/tests.log | head -10
stamp fused; FUSED_SWEEP=dot FUSED_SWEEP_BATCHES=64,2 FUSED_BUDGET_S=300 timeout 380 python3 scripts/gpu_fused_decode.py > $OUT/fused.log 2>&1; echo "rc $?"
grep -E "fp32|Error|error" $OUT/fused.log | head; sed -n '/^variant/,$p' $OUT/fused.log
stamp done
