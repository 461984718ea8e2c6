#!/bin/bash
# For session 19 (prepared in session 18): issue 3's last 0.7 % on the H200. The bench with tuned products again
# (session 18: 1.490x, rounds 1.489-1.497), the loss's vocabulary segments on the H200 (9 and 12 tied on the H100),
# and both peers at 128 rows (session 17: 1.48x against 1.46x at 64). Only on an H200; stops at once elsewhere.
. scripts/calls/eval_wall.sh   # PYTHONPATH, FASTPPL_SHARED_DATA, issue3_bench
export FASTPPL_CACHE_DIR=/tmp/fastppl-cache-$(date +%s)
name=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$name"
case "$name" in *H200*) ;; *) echo "not an H200: nothing run"; exit 0 ;; esac
for rows in 64 128; do issue3_bench on $rows; done
timeout 200 python3 scripts/gpu_loss_segments.py 2>&1 | tail -6
