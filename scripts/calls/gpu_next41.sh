#!/bin/bash
# Session 18, call 6: the tuner with and without the no-workspace candidates (no memset before each product) in the
# dense scorer; the GPU tests of accel.cublaslt; on an H200, issue 3's bench with --tune-products on and off.
. scripts/calls/eval_wall.sh   # PYTHONPATH, FASTPPL_SHARED_DATA, issue3_bench
export FASTPPL_CACHE_DIR=/tmp/fastppl-cache-$(date +%s)
name=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$name"
timeout 200 python3 scripts/gpu_tuned_products.py 2>&1 | tail -14
timeout 120 python3 -m pytest -q -m gpu tests/test_gpu.py -k "cublaslt or tuned" 2>&1 | tail -2
case "$name" in *H200*) ;; *) echo "not an H200: no bench"; exit 0 ;; esac
for tune in on off; do issue3_bench $tune; done
