"""Fused linear + cross-entropy variants at the scorer's shapes, against the shipped kernel (H200; PYTHONPATH=src).

Expected before the run: the shipped kernel (128 x 256 x 64, 8 warps, 3 stages) spends ~1/4 of its time in the
online-logsumexp epilogue, which does not overlap the tensor-core work; warp specialisation of the vocabulary
loop (Triton's tl.range(warp_specialize=True)) could overlap them (up to ~20 %), base-2 exponentials save one
multiply per logit (~2 %). Each variant is checked against a float64 reference before it is timed."""
import json
import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from fastppl.engine.fused_loss import fused_token_nll
from gpu_common import median_cuda_ms

LOG2E: tl.constexpr = 1.4426950408889634
LN2: tl.constexpr = 0.6931471805599453


@triton.jit
def _variant_kernel(hidden_ptr, weight_ptr, target_ptr, out_ptr, N, V, C, stride_hn, stride_wv,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    EXP2: tl.constexpr, WS: tl.constexpr, K_STAGES: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < N
    targets = tl.load(target_ptr + rows, mask=row_ok, other=0)
    running_max = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    running_sum = tl.zeros((BLOCK_M,), tl.float32)
    target_logit = tl.zeros((BLOCK_M,), tl.float32)
    ks = tl.arange(0, BLOCK_K)
    for v_start in tl.range(0, V, BLOCK_N, warp_specialize=WS):
        cols = v_start + tl.arange(0, BLOCK_N)
        col_ok = cols < V
        logits = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for k_start in tl.range(0, C, BLOCK_K, num_stages=K_STAGES):
            k = k_start + ks
            h = tl.load(hidden_ptr + rows[:, None] * stride_hn + k[None, :],
                        mask=row_ok[:, None] & (k[None, :] < C), other=0.0)
            w = tl.load(weight_ptr + cols[None, :] * stride_wv + k[:, None],
                        mask=col_ok[None, :] & (k[:, None] < C), other=0.0)
            logits = tl.dot(h, w, logits)
        is_target = cols[None, :] == targets[:, None]
        target_logit += tl.sum(tl.where(is_target, logits, 0.0), axis=1)
        if EXP2:
            logits = logits * LOG2E              # base-2 units from here on
        logits = tl.where(col_ok[None, :], logits, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(logits, axis=1))
        if EXP2:
            running_sum = running_sum * tl.exp2(running_max - new_max) + tl.sum(
                tl.exp2(logits - new_max[:, None]), axis=1)
        else:
            running_sum = running_sum * tl.exp(running_max - new_max) + tl.sum(
                tl.exp(logits - new_max[:, None]), axis=1)
        running_max = new_max
    if EXP2:
        nll = (running_max + tl.log2(running_sum)) * LN2 - target_logit
    else:
        nll = running_max + tl.log(running_sum) - target_logit
    tl.store(out_ptr + rows, nll, mask=row_ok)


def variant(h, w, t, block_m=128, block_n=256, block_k=64, warps=8, stages=3, exp2=False, ws=False, k_stages=3):
    N, C = h.shape
    V = w.shape[0]
    out = torch.empty(N, dtype=torch.float32, device=h.device)
    _variant_kernel[(triton.cdiv(N, block_m),)](h, w, t, out, N, V, C, h.stride(0), w.stride(0),
                                                BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, EXP2=exp2,
                                                WS=ws, K_STAGES=k_stages, num_warps=warps, num_stages=stages)
    return out


# (name, kernel options or None for the shipped defaults, or a dict for the experimental copy above)
VARIANTS = [
    ("shipped kernel (defaults)", "shipped", {}),
    ("shipped, k 32, 4 stages", "shipped", dict(block_k=32, num_stages=4)),
    ("experimental copy, warp-specialised vocab loop", "variant", dict(ws=True)),
]
if os.environ.get("LOSS_VARIANTS") == "all":   # the first session-2 sweep (docs/BENCHMARKS.md)
    VARIANTS += [("copy (tl.range loops)", "variant", {}), ("ws, k 32, k_stages 4", "variant", dict(ws=True, block_k=32, k_stages=4))]

results = []
dev = torch.device("cuda")
torch.manual_seed(0)
for shape_name, (N, C, V) in {"gpt2 64x1024": (65536, 768, 50257), "llama-1b 8x2048": (16384, 2048, 128256)}.items():
    h = torch.randn(N, C, device=dev, dtype=torch.bfloat16)
    w = torch.randn(V, C, device=dev, dtype=torch.bfloat16) * 0.05
    t = torch.randint(0, V, (N,), device=dev)
    check = slice(0, 1024)
    ref = F.cross_entropy(F.linear(h[check].double(), w.double()), t[check], reduction="none")
    flops = 2 * N * C * V
    for name, kind, options in VARIANTS:
        kernel = fused_token_nll if kind == "shipped" else variant
        fn = lambda kernel=kernel, o=options: kernel(h, w, t, **o)   # noqa: E731
        try:
            out = fn()
            err = ((out[check].double() - ref).norm() / ref.norm()).item()
            ms = median_cuda_ms(fn) if err < 1e-4 else float("nan")
            row = dict(shape=shape_name, variant=name, ms=ms, tflops=flops / ms / 1e9, rel_err=err)
        except Exception as ex:   # a variant this Triton cannot compile
            row = dict(shape=shape_name, variant=name, ms=float("nan"), tflops=float("nan"), rel_err=float("nan"),
                       error=str(ex).strip().splitlines()[-1][:100] if str(ex).strip() else type(ex).__name__)
        results.append(row)
        print(row, flush=True)
    del h, w, t

if os.environ.get("OUT"):
    json.dump(results, open(os.path.join(os.environ["OUT"], "loss_variants.json"), "w"), indent=1)
print("\n| shape | variant | ms | TFLOP/s | rel err vs fp64 |")
print("| --- | --- | --- | --- | --- |")
for r in results:
    note = f" ({r['error']})" if "error" in r else ""
    print(f"| {r['shape']} | {r['variant']}{note} | {r['ms']:.2f} | {r['tflops']:.0f} | {r['rel_err']:.1e} |")
