"""Issue 3's last ~2 % (H200; PYTHONPATH=src). Session 15's first call put fastppl at 1,955,155 tokens/s, 1.47x compiled
transformers (targets 2.0 M and 1.5x), with 29.4 ms of kernels per 64 x 1024 batch in a short profile. Three
candidates, each timed here in one process, interleaved:

1. The MLP's first product with cuBLASLt's bias + GELU epilogue runs at ~606 TFLOP/s (6.1 ms a batch) where the
   other products run at 725-740 (profile: a 192 x 192 tile, where the others take 256 x 128). Does cuBLAS pick a
   faster kernel for fewer rows (the product in row chunks), and what do the plain product and the bias-only one
   take? Expected: a chunking that reaches ~700 TFLOP/s would save ~0.8 ms a batch.
2. The LayerNorm kernel (25 a batch, 65 us each: ~3 TB/s for 200 MB) with more rows per program and more warps.
   Expected: ~50 us each at 4 TB/s, -0.35 ms a batch.
3. The scorer as `fastppl bench` runs it (host batches, pinned copies, the device sums) against the bare scorer on
   device-resident inputs: whether the bench's 33.5 ms a batch against the trace's 31.3 is the loop around it.
4. 32, 64 and 128 rows a batch: whether fastppl's own batch size (eval's auto picks the largest that fits) moves
   the rate. Expected: within 1 % (the products are already 65,536 rows tall).

Prints tables; writes $OUT/scorer_sweep.json."""
import json
import os
import time

import numpy as np
import torch

import fastppl.accel.fused_norm as fused_norm
from gpu_common import dense_gpt2_scorer, interleaved_rounds_ms, median_cuda_ms
from fastppl.data.batching import Batch
from fastppl.engine.score import DeviceSums, score_batches

dev = torch.device("cuda")
results = {}
model, score, (inputs, targets, mask) = dense_gpt2_scorer(64, 1024)
M, C = 65536, 768
h = torch.randn(M, C, device=dev, dtype=torch.bfloat16)
fc = model.blocks[0].mlp.fc
W, b = fc.weight, fc.bias
flops = 2 * M * C * W.shape[0]

# 1. the MLP's first product
def gelu_chunks(rows):
    def run():
        for start in range(0, M, rows):
            torch._addmm_activation(b, h[start:start + rows], W.t(), use_gelu=True)
    return run

gemm = {}
with torch.inference_mode():
    for rows in (65536, 32768, 16384, 8192, 4096):
        gemm[f"bias + GELU epilogue, chunks of {rows} rows"] = median_cuda_ms(gelu_chunks(rows), 20)
    gemm["bias epilogue only (addmm)"] = median_cuda_ms(lambda: torch.addmm(b, h, W.t()), 20)
    gemm["no bias (mm)"] = median_cuda_ms(lambda: torch.mm(h, W.t()), 20)
    gemm["addmm, then GELU kernel"] = median_cuda_ms(
        lambda: torch.nn.functional.gelu(torch.addmm(b, h, W.t()), approximate="tanh"), 20)
results["mlp_fc"] = {k: dict(ms=v, tflops=flops / v / 1e9) for k, v in gemm.items()}
print("| MLP fc product, 65,536 x 768 x 3,072 | ms | TFLOP/s |\n| --- | --- | --- |")
for k, v in results["mlp_fc"].items():
    print(f"| {k} | {v['ms']:.3f} | {v['tflops']:.0f} |")

# 2. the LayerNorm kernel alone and in the scorer
norm = model.blocks[0].ln_2
x = torch.randn(M, C, device=dev, dtype=torch.bfloat16)
delta = torch.randn(1, C, device=dev, dtype=torch.float32)
settings = [(4, 4), (8, 4), (8, 8), (16, 8), (2, 4), (1, 2), (16, 16)]


def set_norm(rows, warps):
    fused_norm.ROWS_PER_PROGRAM, fused_norm.LAYER_NORM_WARPS = rows, warps


ln = {}
with torch.inference_mode():
    for rows, warps in settings:
        set_norm(rows, warps)
        ln[(rows, warps)] = dict(alone_us=1e3 * median_cuda_ms(
            lambda: fused_norm.add_layer_norm(x, delta, norm, store_sum=False), 50))
    timed = interleaved_rounds_ms(lambda: score(inputs, targets, mask),
                                  {setting: (lambda s=setting: set_norm(*s)) for setting in settings})
    for setting, times in timed.items():
        ln[setting]["rounds"] = times
set_norm(4, 4)
results["layer_norm"] = {f"{r} rows, {w} warps": v for (r, w), v in ln.items()}
print("\n| LayerNorm kernel | us alone (65,536 x 768) | scorer ms per batch (median of 3 rounds of 20) |\n| --- | --- | --- |")
for k, v in results["layer_norm"].items():
    v["scorer_ms"] = sorted(v["rounds"])[1]
    print(f"| {k} | {v['alone_us']:.1f} | {v['scorer_ms']:.2f} |")

# 3. the bench's loop against the bare scorer
rows_host = np.random.default_rng(0).integers(0, 50257, (64 * 32, 1025)).astype(np.int64)
T = 1024
ones = np.ones((64, T), dtype=bool)
index = np.full((64, T), -1, dtype=np.int64)
batches = [Batch(np.ascontiguousarray(rows_host[i:i + 64, :T]), np.ascontiguousarray(rows_host[i:i + 64, 1:]),
                 ones, index, 64 * T, 64) for i in range(0, len(rows_host), 64)]


def bench_loop():
    sums = DeviceSums.zeros(T, dev)
    score_batches(score, batches, sums, dev)
    sums.nll_sum.item()


def bare_loop():
    total = torch.zeros((), dtype=torch.float64, device=dev)
    for _ in range(len(batches)):
        total += score(inputs, targets, mask).sum(dtype=torch.float64)
    total.item()


loops = {"bench path (score_batches over 32 host batches)": bench_loop, "bare scorer, 32 device batches": bare_loop}
loop_ms = {k: [] for k in loops}
with torch.inference_mode():
    for _ in range(3):
        for name, fn in loops.items():
            torch.cuda.synchronize()
            t = time.perf_counter()
            fn()
            loop_ms[name].append((time.perf_counter() - t) / len(batches) * 1e3)
results["loops"] = loop_ms
print("\n| loop | ms per batch, 3 rounds |\n| --- | --- |")
for k, v in loop_ms.items():
    print(f"| {k} | {' / '.join(f'{x:.2f}' for x in v)} |")
# 4. rows per batch: the bench runs every peer at 64 x 1024; fastppl eval picks its own (auto: the largest that fits)
per_batch = {}
with torch.inference_mode():
    for rows in (32, 64, 128):
        ids = torch.randint(0, 50257, (rows, 1025), device=dev)
        args = (ids[:, :T].contiguous(), ids[:, 1:].contiguous(), torch.ones(rows, T, dtype=torch.bool, device=dev))
        for _ in range(5):
            score(*args)
        times = []
        for _ in range(3):
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(2048 // rows):
                score(*args)
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t) / (2048 // rows * rows * T) * 1e9)
        per_batch[rows] = sorted(times)[1]
results["ns_per_token_by_rows"] = per_batch
print("\n| rows x 1024 | ns per token (median of 3 rounds of 2,048 rows) | tokens/s |\n| --- | --- | --- |")
for rows, ns in per_batch.items():
    print(f"| {rows} | {ns:.1f} | {1e9 / ns:,.0f} |")
if os.environ.get("OUT"):
    json.dump(results, open(os.path.join(os.environ["OUT"], "scorer_sweep.json"), "w"), indent=1, default=str)
