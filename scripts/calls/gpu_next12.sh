#!/bin/bash
# Session 9: the compiled decode step with the vocabulary product padded to 64-aligned ids (aligned_logits),
# against the plain one; then fastppl bench --generate at batch 64 with it on (the env variable).
export PYTHONPATH=src FASTPPL_SHARED_DATA=$PWD/.devcache/data
T0=$(date +%s); stamp() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
stamp tests; timeout 100 python3 -m pytest -q tests/test_generate.py -k "aligned" 2>&1 | tail -3
stamp aligned; timeout 240 python3 scripts/gpu_aligned_logits.py 2>&1 | grep -v -i warn | tail -12
stamp bench; FASTPPL_DECODE=aligned_logits=1 timeout 150 python3 -m fastppl bench --generate --batch-sizes 64 \
  --new-tokens 128 --quiet --json $OUT/bench_generate_aligned.json 2>&1 | tail -6
stamp done
