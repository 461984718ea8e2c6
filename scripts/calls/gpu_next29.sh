#!/bin/bash
# Session 15, call 2: the GPU tests (session 14's never ran; the fused decode step's dependent launches, bit for bit
# against plain launches); the decode steps with and without programmatic dependent launch
# (scripts/gpu_decode_pdl.py) and issue 5's batch-1 bench; issue 3's last ~2 % (scripts/gpu_scorer_sweep.py: the MLP
# product's kernel, the LayerNorm's tiling, the bench's loop against the bare scorer, rows per batch); whether a
# cuBLASLt workspace of 0 removes the memset before each product and what it costs.
. scripts/calls/eval_wall.sh   # PYTHONPATH, FASTPPL_SHARED_DATA
nvidia-smi --query-gpu=name,clocks.sm,power.draw,power.limit --format=csv,noheader
timeout 240 python3 -m pytest -q -m gpu tests/test_fused_decode.py tests/test_fused_loss.py tests/test_fused_norm.py tests/test_gpu.py > $OUT/pytest.log 2>&1; echo "pytest rc $?"
timeout 150 python3 scripts/gpu_decode_pdl.py > $OUT/decode_pdl.log 2>&1; echo "decode_pdl rc $?"
timeout 120 python3 -m fastppl bench --generate --batch-sizes 1 --new-tokens 128 --quiet --json $OUT/bench_gen.json > $OUT/bench_gen.log 2>&1; echo "bench gen rc $?"
timeout 150 python3 scripts/gpu_scorer_sweep.py > $OUT/sweep.log 2>&1; echo "sweep rc $?"
WS="import time, torch, sys; sys.path.insert(0, 'scripts')
from gpu_common import dense_gpt2_scorer, median_cuda_ms
_, score, (i, t, m) = dense_gpt2_scorer(64, 1024)
h = torch.randn(65536, 768, device='cuda', dtype=torch.bfloat16); w = torch.randn(3072, 768, device='cuda', dtype=torch.bfloat16); b = torch.zeros(3072, device='cuda', dtype=torch.bfloat16)
with torch.inference_mode():
    g = median_cuda_ms(lambda: torch._addmm_activation(b, h, w.t(), use_gelu=True), 20)
    for _ in range(20): score(i, t, m)
    torch.cuda.synchronize(); s = time.perf_counter()
    for _ in range(40): score(i, t, m)
    torch.cuda.synchronize(); print(f'gelu product {g:.3f} ms, scorer {(time.perf_counter() - s) / 40 * 1e3:.2f} ms per batch')"
for ws in default 0 default; do
  if [ $ws = default ]; then unset CUBLASLT_WORKSPACE_SIZE; else export CUBLASLT_WORKSPACE_SIZE=$ws; fi
  echo "workspace $ws: $(timeout 50 python3 -c "$WS" 2>&1 | tail -1)"
done
unset CUBLASLT_WORKSPACE_SIZE
tail -3 $OUT/pytest.log
grep -E "^\||^FAILED|fused Triton" $OUT/decode_pdl.log
grep -E "^ *1 |batch|fastppl|transformers" $OUT/bench_gen.log | tail -6
grep -E "^\|" $OUT/sweep.log
