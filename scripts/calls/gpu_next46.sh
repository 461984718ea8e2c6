#!/bin/bash
# Session 18, last calls: on an H200, issue 3's bench with --tune-products on, then off (medians of 3 rounds); on any
# card, `fastppl eval --split all` from process start, cold then warm (the fused loss now launches two kernels).
. scripts/calls/eval_wall.sh   # PYTHONPATH, FASTPPL_SHARED_DATA, run_eval
export FASTPPL_CACHE_DIR=/tmp/fastppl-cache-$(date +%s)
name=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$name"
bench() {
  timeout 170 python3 -m fastppl bench --model random:gpt2 --tokens 2097152 --peers hf-compiled,fastppl --rounds 3 \
    --tune-products $1 --json $OUT/bench64_$1.json > $OUT/bench64_$1.log 2> $OUT/bench64_$1.err
  echo "bench $1 rc $?"; tail -4 $OUT/bench64_$1.log
}
case "$name" in *H200*) bench on ;; esac
for run in cold warm1 warm2 warm3; do run_eval $run python3 -m fastppl; done
case "$name" in *H200*) bench off ;; esac
