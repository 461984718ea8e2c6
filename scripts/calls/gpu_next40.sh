#!/bin/bash
# Session 18, call 5: cuBLASLt's candidates under other SM count targets; on an H200, issue 3's bench with
# --tune-products on and off, each medians of 3 rounds.
. scripts/calls/eval_wall.sh   # PYTHONPATH, FASTPPL_SHARED_DATA, issue3_bench
export FASTPPL_CACHE_DIR=/tmp/fastppl-cache-$(date +%s)
name=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$name"
timeout 200 python3 scripts/gpu_cublaslt_sm_targets.py 2>&1 | tail -8
case "$name" in *H200*) ;; *) echo "not an H200: no bench"; exit 0 ;; esac
for tune in on off; do issue3_bench $tune; done
