#!/bin/bash
# Session 18, last calls: on an H200, issue 3's bench with --tune-products on, then off (medians of 3 rounds); on any
# card, `fastppl eval --split all` from process start, cold then warm (the fused loss now launches two kernels).
. scripts/calls/eval_wall.sh   # PYTHONPATH, FASTPPL_SHARED_DATA, run_eval, issue3_bench
export FASTPPL_CACHE_DIR=/tmp/fastppl-cache-$(date +%s)
name=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$name"
case "$name" in *H200*) issue3_bench on ;; esac
for run in cold warm1 warm2 warm3; do run_eval $run python3 -m fastppl; done
case "$name" in *H200*) issue3_bench off ;; esac
