#!/bin/bash
# Session 18: on an H200, issue 3's bench with --tune-products on and off (medians of 3 rounds); on another card,
# the fused loss's vocabulary segments alone and in the scorer, and the fused-loss GPU tests.
. scripts/calls/eval_wall.sh   # PYTHONPATH, FASTPPL_SHARED_DATA, issue3_bench
export FASTPPL_CACHE_DIR=/tmp/fastppl-cache-$(date +%s)
name=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$name"
case "$name" in
  *H200*)
    for tune in on off; do issue3_bench $tune; done ;;
  *) timeout 200 python3 scripts/gpu_loss_segments.py 2>&1 | tail -7
     timeout 150 python3 -m pytest -q -m gpu tests/test_fused_loss.py 2>&1 | tail -2 ;;
esac
