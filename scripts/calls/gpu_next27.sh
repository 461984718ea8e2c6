#!/bin/bash
# Session 14, call 2 (at d940902; the last ~6 minutes of the session's device time): where the dense scorer's time
# goes now, kernel by kernel and between kernels (the loss-tile sweep, scripts/gpu_loss_configs.py, did not fit).
. scripts/calls/eval_wall.sh   # PYTHONPATH, FASTPPL_SHARED_DATA
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 45 python3 scripts/gpu_profile_scorer.py > $OUT/profile.log 2>&1; echo "profile rc $?"
timeout 45 python3 scripts/gpu_gaps_trace.py > $OUT/gaps.log 2>&1; echo "gaps rc $?"
grep -E "^\||GPU time" $OUT/profile.log | head -16
grep -v Warning $OUT/gaps.log | grep -v "^\s*$" | tail -22
