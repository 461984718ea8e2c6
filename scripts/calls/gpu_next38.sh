#!/bin/bash
# Session 18, calls 2-3: the dense scorer with tuned cuBLASLt products against torch's picks; issue 3's bench with
# --tune-products on; eval's report of it.
. scripts/calls/eval_wall.sh   # PYTHONPATH, FASTPPL_SHARED_DATA
export FASTPPL_CACHE_DIR=/tmp/fastppl-cache-$(date +%s)
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 200 python3 scripts/gpu_tuned_products.py 2>&1 | tail -40
timeout 240 python3 -m fastppl bench --model random:gpt2 --tokens 2097152 --peers hf-compiled,fastppl --rounds 3 \
  --tune-products on --json $OUT/bench64_tuned.json > $OUT/bench64_tuned.log 2> $OUT/bench64_tuned.err
echo "bench rc $?"; tail -5 $OUT/bench64_tuned.log; tail -3 $OUT/bench64_tuned.err
timeout 90 python3 -m fastppl $EVAL --tune-products on --json $OUT/eval_tuned.json > /dev/null 2> $OUT/eval_tuned.err
echo "eval rc $?"; python3 -c "import json; r=json.load(open('$OUT/eval_tuned.json')); print(r['products'], r['nll'], r['tokens_per_second'])"
tail -3 $OUT/eval_tuned.err
