#!/bin/bash
# For the next session's first GPU call (not run yet): the kernel profile of the batch-64 decode step with the
# default (two-buffer) cache, which session 5 could only take with the slow views layout, and the MLP epilogue
# in the decode step, which ran out of time twice. ~300 s.
export PYTHONPATH=src FASTPPL_SHARED_DATA=$PWD/.devcache/data
T0=$(date +%s); stamp() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
stamp probe64; PROBE_BATCH=64 timeout 120 python3 scripts/gpu_decode_probe.py > $OUT/probe64.log 2>&1; echo "rc $?"; grep -E "^decode|total per step" $OUT/probe64.log
grep -A 20 "us/step" $OUT/probe64.log | cut -c1-60,91-110
stamp decode; DECODE_BUDGET_S=150 DECODE_ONLY="index_copy (default),MLP epilogue,bucket 64" timeout 170 python3 scripts/gpu_decode_variants.py > $OUT/decode6.log 2>&1; echo "rc $?"; grep -v -i warn $OUT/decode6.log | grep -v "^{" | tail -9
stamp done
