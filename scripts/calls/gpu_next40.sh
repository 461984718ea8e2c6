#!/bin/bash
# Session 18, call 5: cuBLASLt's candidates under other SM count targets; on an H200, issue 3's bench with
# --tune-products on and off, each medians of 3 rounds.
. scripts/calls/eval_wall.sh   # PYTHONPATH, FASTPPL_SHARED_DATA
export FASTPPL_CACHE_DIR=/tmp/fastppl-cache-$(date +%s)
name=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$name"
timeout 200 python3 scripts/gpu_cublaslt_sm_targets.py 2>&1 | tail -8
case "$name" in *H200*) ;; *) echo "not an H200: no bench"; exit 0 ;; esac
for tune in on off; do
  timeout 170 python3 -m fastppl bench --model random:gpt2 --tokens 2097152 --peers hf-compiled,fastppl --rounds 3 \
    --tune-products $tune --json $OUT/bench64_$tune.json > $OUT/bench64_$tune.log 2> $OUT/bench64_$tune.err
  echo "bench $tune rc $?"; tail -4 $OUT/bench64_$tune.log
done
