#!/bin/bash
# Session 7, third call: the tensor-core tiles with small tiles, whole-row LayerNorm statistics and deep
# pipelines; fp32 tokens vs eager, fused vs compiled at batch 1-128, a kernel profile at batch 64, a sweep.
export PYTHONPATH=src FASTPPL_SHARED_DATA=$PWD/.devcache/data
T0=$(date +%s); stamp() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
stamp fused; FUSED_BATCHES=1,2,4,16,64,128 FUSED_SWEEP=dot FUSED_SWEEP_BATCHES=64 FUSED_PROFILE=64 FUSED_BUDGET_S=330 \
  timeout 450 python3 scripts/gpu_fused_decode.py > $OUT/fused.log 2>&1; echo "rc $?"
grep -E "fp32|Error|error|budget" $OUT/fused.log | head; sed -n '/^fused step, batch/,$p' $OUT/fused.log
stamp tests; timeout 100 python3 -m pytest -q -x tests/test_fused_decode.py > $OUT/tests.log 2>&1; echo "rc $?"; tail -2 $OUT/tests.log
grep -E "^E |FAILED" $OUT/tests.log | head -10
stamp done
