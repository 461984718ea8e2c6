#!/bin/bash
# Session 18: on an H200, issue 3's bench with --tune-products on and off (medians of 3 rounds); on another card,
# the decode step's products at batch 64 against cuBLASLt's candidates (issue 5).
. scripts/calls/eval_wall.sh   # PYTHONPATH, FASTPPL_SHARED_DATA, issue3_bench
export FASTPPL_CACHE_DIR=/tmp/fastppl-cache-$(date +%s)
name=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$name"
case "$name" in
  *H200*)
    for tune in on off; do issue3_bench $tune; done ;;
  *) timeout 120 python3 scripts/gpu_decode_products.py 2>&1 | tail -9 ;;
esac
