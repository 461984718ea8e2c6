#!/bin/bash
# Session 13, call 6: the dense scorer's idle time between kernels, from a profiler timeline; the fused loss's
# tests with their tightened tolerances (every row within 1e-4 / 2e-5 nats) and the compiled op with a bias.
. scripts/calls/eval_wall.sh   # PYTHONPATH, FASTPPL_SHARED_DATA
timeout 120 python3 scripts/gpu_gaps_trace.py > $OUT/gaps.log 2>&1; echo "gaps rc $?"
timeout 200 python3 -m pytest -q -m gpu tests/test_fused_loss.py tests/test_gpu.py -k "fused" 2>&1 | tail -3
grep -v Warning $OUT/gaps.log | tail -32
