#!/bin/bash
# Session 13, call 6: the dense scorer's idle time between kernels, from a profiler timeline.
export PYTHONPATH=src
timeout 120 python3 scripts/gpu_gaps_trace.py > $OUT/gaps.log 2>&1; echo "gaps rc $?"
grep -v Warning $OUT/gaps.log | tail -40
