#!/bin/bash
# Session 18, call 4: the GPU tests (tuned cuBLASLt products among them) and, on an H200, issue 3's bench with
# --tune-products on and off, each medians of 3 rounds.
. scripts/calls/eval_wall.sh   # PYTHONPATH, FASTPPL_SHARED_DATA, issue3_bench
export FASTPPL_CACHE_DIR=/tmp/fastppl-cache-$(date +%s)
name=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$name"
timeout 240 python3 -m pytest -q -m gpu tests/test_gpu.py tests/test_fused_norm.py -x 2>&1 | tail -4
case "$name" in *H200*) ;; *) echo "not an H200: no bench"; exit 0 ;; esac
for tune in on off; do issue3_bench $tune; done
