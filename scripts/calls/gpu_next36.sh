#!/bin/bash
# Session 17, last call (~2 minutes): issue 3's end-to-end target (fastppl eval --split all <= 5 s from process start
# with warm caches) at the session's last code, on whatever card comes: cold, then warm twice. On an H200 also the
# bench of gpu_next35.sh.
. scripts/calls/eval_wall.sh   # PYTHONPATH, FASTPPL_SHARED_DATA, run_eval
export FASTPPL_CACHE_DIR=$PWD/.devcache/fastppl-cache
name=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$name"
run_eval cold python3 -m fastppl
run_eval warm1 python3 -m fastppl
run_eval warm2 python3 -m fastppl
case "$name" in *H200*) bash scripts/calls/gpu_next35.sh ;; esac
