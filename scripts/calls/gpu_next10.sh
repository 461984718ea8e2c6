#!/bin/bash
# Session 7, first call: session 6's unverified review fixes (gpu_next9.sh), then the batch-64 kernel profile
# of the compiled decode step with the default two-buffer cache (gpu_next5.sh's first half, never run).
export PYTHONPATH=src FASTPPL_SHARED_DATA=$PWD/.devcache/data
T0=$(date +%s); stamp() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
stamp tests; bash scripts/calls/gpu_next9.sh
stamp probe64; PROBE_BATCH=64 timeout 150 python3 scripts/gpu_decode_probe.py > $OUT/probe64.log 2>&1; echo "rc $?"
grep -E "^decode|total per step" $OUT/probe64.log
grep -A 30 "us/step" $OUT/probe64.log | cut -c1-70,91-110
stamp done
