#!/bin/bash
# Session 15, call 2: the GPU tests (session 14's never ran; the fused decode step's dependent launches, bit for bit
# against plain launches); the decode steps with and without programmatic dependent launch
# (scripts/gpu_decode_pdl.py) and issue 5's batch-1 bench; issue 3's last ~2 % (scripts/gpu_scorer_sweep.py: the MLP
# product's kernel, the LayerNorm's tiling, the bench's loop against the bare scorer, rows per batch).
. scripts/calls/eval_wall.sh   # PYTHONPATH, FASTPPL_SHARED_DATA
nvidia-smi --query-gpu=name,clocks.sm,power.draw,power.limit --format=csv,noheader
timeout 180 python3 -m pytest -q -m gpu tests/test_fused_decode.py tests/test_fused_loss.py tests/test_fused_norm.py tests/test_gpu.py > $OUT/pytest.log 2>&1; echo "pytest rc $?"
timeout 130 python3 scripts/gpu_decode_pdl.py > $OUT/decode_pdl.log 2>&1; echo "decode_pdl rc $?"
timeout 110 python3 -m fastppl bench --generate --batch-sizes 1 --new-tokens 128 --quiet --json $OUT/bench_gen.json > $OUT/bench_gen.log 2>&1; echo "bench gen rc $?"
timeout 140 python3 scripts/gpu_scorer_sweep.py > $OUT/sweep.log 2>&1; echo "sweep rc $?"
tail -3 $OUT/pytest.log
grep -E "^\||^FAILED|fused Triton" $OUT/decode_pdl.log
grep -E "^ *1 |batch|fastppl|transformers" $OUT/bench_gen.log | tail -6
grep -E "^\|" $OUT/sweep.log
