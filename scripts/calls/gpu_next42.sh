#!/bin/bash
# Session 18, H200 tries: issue 3's bench with --tune-products on and off (medians of 3 rounds), only on an H200.
. scripts/calls/eval_wall.sh   # PYTHONPATH, FASTPPL_SHARED_DATA, issue3_bench
export FASTPPL_CACHE_DIR=/tmp/fastppl-cache-$(date +%s)
name=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$name"
case "$name" in *H200*) ;; *) echo "not an H200: nothing run"; exit 0 ;; esac
for tune in on off; do issue3_bench $tune; done
