#!/usr/bin/env bash
# One device call: checks, loss timings, the bench table, end-to-end eval timings. Results under $OUT.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1 FASTPPL_CACHE_DIR=/tmp/fastppl-cache NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
nvidia-smi --query-gpu=name,clocks.sm,memory.used --format=csv | tee $OUT/gpu.txt
python3 scripts/gpu_check.py 2>&1 | tee $OUT/check.log
python3 -m fastppl bench --model random:gpt2 --tokens 2097152 --naive-tokens 262144 --variants --json $OUT/bench.json 2>&1 | tee $OUT/bench.log
