#!/bin/bash
# Session 18, after the review: the tuner's GPU tests; issue 3's bench with --tune-products off and on in one call
# (medians of 3 rounds each, on whichever card came); eval's report with auto and a stored pick.
. scripts/calls/eval_wall.sh   # PYTHONPATH, FASTPPL_SHARED_DATA, issue3_bench
export FASTPPL_CACHE_DIR=/tmp/fastppl-cache-$(date +%s)
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 120 python3 -m pytest -q -m gpu tests/test_gpu.py -k "cublaslt or tuned or mlp_epilogue or residual" 2>&1 | tail -2
for tune in off on; do issue3_bench $tune; done
timeout 60 python3 -m fastppl $EVAL --json $OUT/eval_auto.json > /dev/null 2> $OUT/eval_auto.err
echo "eval auto rc $?"; python3 -c "import json; r=json.load(open('$OUT/eval_auto.json')); print(r['products'])"
