#!/bin/bash
# Session 6, third GPU call: the fp32 check of the fused step at GPT-2 124M and bench --generate at batch 1
# with the defaults (CHUNK = 32), a second sample of the peer ratio. ~150 s.
export PYTHONPATH=src FASTPPL_SHARED_DATA=$PWD/.devcache/data
FUSED_BATCHES=1 FUSED_SWEEP_BATCHES=none FUSED_BUDGET_S=0 FUSED_BENCH=1 timeout 200 python3 scripts/gpu_fused_decode.py > $OUT/fused.log 2>&1; echo "rc $?"; grep -v -i warn $OUT/fused.log | grep -E "fp32|batch|fastppl|hf-|target|failures|fused  " | tail -14
