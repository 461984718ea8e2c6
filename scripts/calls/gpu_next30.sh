#!/bin/bash
# Session 16, call 2 (~6 minutes): issue 5 at batch 64, the compiled decode step's attention. The split-KV kernel's
# GPU tests; scripts/gpu_decode_attention.py (cuDNN, SDPA's efficient kernel, split_kv with three chunk sizes,
# attend_bucket, Inductor PDL); then the bench at batch 64, default and split_kv, in the same call (the peer's ratio).
. scripts/calls/eval_wall.sh   # PYTHONPATH, FASTPPL_SHARED_DATA
nvidia-smi --query-gpu=name,clocks.sm,power.draw,power.limit --format=csv,noheader
timeout 120 python3 -m pytest -q tests/test_kv_cache.py tests/test_generate.py -k "split_kv or kernels_masks" > $OUT/pytest_attn.log 2>&1; echo "pytest rc $?"
timeout 300 python3 scripts/gpu_decode_attention.py > $OUT/decode_attention.log 2>&1; echo "decode_attention rc $?"
FASTPPL_DECODE=attention=split_kv timeout 120 python3 -m fastppl bench --generate --batch-sizes 64 --new-tokens 128 --quiet --json $OUT/bench_split.json > $OUT/bench_split.log 2>&1; echo "bench split rc $?"
tail -2 $OUT/pytest_attn.log
grep -E "^\||FAILED|failed|block 64" $OUT/decode_attention.log | head -40
tail -5 $OUT/bench_split.log
