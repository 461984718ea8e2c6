#!/bin/bash
# Written in session 15 for its call 2, which never ran (the device was taken back mid-start, then no time was left):
# the next session's first call, ~7 minutes. The GPU tests (the fused decode step's, its dependent launches bit for
# bit against plain launches among them; session 14's residual and MLP-epilogue tests, never run); issue 5's batch-1
# bench with dependent launches (FASTPPL_DECODE: they are off by default until measured); the decode steps with and without them (scripts/gpu_decode_pdl.py); issue 3's last ~2 %
# (scripts/gpu_scorer_sweep.py: the MLP product's kernel, the LayerNorm's tiling, the bench's loop against the bare
# scorer, rows per batch).
. scripts/calls/eval_wall.sh   # PYTHONPATH, FASTPPL_SHARED_DATA
nvidia-smi --query-gpu=name,clocks.sm,power.draw,power.limit --format=csv,noheader
timeout 120 python3 -m pytest -q -m gpu tests/test_fused_decode.py tests/test_fused_norm.py > $OUT/pytest.log 2>&1; echo "pytest rc $?"
FASTPPL_DECODE=dependent_launch=1 timeout 100 python3 -m fastppl bench --generate --batch-sizes 1 --new-tokens 128 --quiet --json $OUT/bench_gen.json > $OUT/bench_gen.log 2>&1; echo "bench gen rc $?"
timeout 90 python3 scripts/gpu_decode_pdl.py > $OUT/decode_pdl.log 2>&1; echo "decode_pdl rc $?"
timeout 60 python3 -m pytest -q -m gpu tests/test_gpu.py -k "residual or epilogue" > $OUT/pytest_gpu.log 2>&1; echo "pytest gpu rc $?"
timeout 110 python3 scripts/gpu_scorer_sweep.py > $OUT/sweep.log 2>&1; echo "sweep rc $?"
tail -2 $OUT/pytest.log; tail -2 $OUT/pytest_gpu.log
grep -E "^\||^FAILED|^fused" $OUT/decode_pdl.log
tail -6 $OUT/bench_gen.log
grep -E "^\|" $OUT/sweep.log
