#!/usr/bin/env bash
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1 FASTPPL_CACHE_DIR=/tmp/fastppl-cache
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
TORCH_LOGS=perf_hints,recompiles timeout 200 python3 scripts/gpu_decode_probe.py > $OUT/probe.txt 2>&1
grep -iE "skipping cudagraph|cudagraph|recompil" $OUT/probe.txt | sort | uniq -c | head -12
grep -vE "^\s*$" $OUT/probe.txt | grep -vi "cudagraph\|recompil" | tail -26
