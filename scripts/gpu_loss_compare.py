"""The fused loss against an earlier copy of it, interleaved over 5 rounds at the scorer's shapes (H200). The copy is
saved as .devcache/old_fused_loss.py, e.g. by `git show HEAD:src/fastppl/engine/fused_loss.py > .devcache/old_fused_loss.py`,
and passed as OLD_FUSED_LOSS; the new one runs through both of its load paths."""
import importlib.util
import json
import os
import statistics

import torch
import torch.nn.functional as F

from fastppl.engine.fused_loss import fused_token_nll
from gpu_common import median_cuda_ms

spec = importlib.util.spec_from_file_location("old_fused_loss", os.environ["OLD_FUSED_LOSS"])
old = importlib.util.module_from_spec(spec)
spec.loader.exec_module(old)


KERNELS = {"old copy": old.fused_token_nll,
           "new, pointer loads": lambda *a: fused_token_nll(*a, tma=False),
           "new (descriptors)": lambda *a: fused_token_nll(*a, tma=True)}   # forced: fp32 defaults to pointers now
rows = []
dev = torch.device("cuda")
torch.manual_seed(0)
for shape, (N, C, V, dtype) in {"gpt2 64x1024 bf16": (65536, 768, 50257, torch.bfloat16),
                                "llama-1b 8x2048 bf16": (16384, 2048, 128256, torch.bfloat16),
                                "gpt2 8192 rows fp32": (8192, 768, 50257, torch.float32)}.items():
    h = torch.randn(N, C, device=dev, dtype=dtype)
    w = (torch.randn(V, C, device=dev) * 0.05).to(dtype)
    t = torch.randint(0, V, (N,), device=dev)
    check = torch.cat([torch.arange(0, 512), torch.arange(N - 512, N)]).to(dev)
    ref = F.cross_entropy(F.linear(h[check].double(), w.double()), t[check], reduction="none")
    # fp32 through descriptors ran 20x slower (BENCHMARKS session 13) and is never chosen: not timed again
    kernels = {name: k for name, k in KERNELS.items() if dtype != torch.float32 or "descriptors" not in name}
    times = {name: [] for name in kernels}
    errs = {name: ((k(h, w, t)[check].double() - ref).norm() / ref.norm()).item() for name, k in kernels.items()}
    for _ in range(5):
        for name, k in kernels.items():
            times[name].append(median_cuda_ms(lambda k=k: k(h, w, t)))
    for name in kernels:
        ms = statistics.median(times[name])
        rows.append(dict(shape=shape, kernel=name, ms=ms, tflops=2 * N * C * V / ms / 1e9, rel_err=errs[name],
                         rounds=times[name]))
    del h, w, t
if os.environ.get("OUT"):
    json.dump(rows, open(os.path.join(os.environ["OUT"], "loss_compare.json"), "w"), indent=1)
print("| shape | kernel | ms (median of 5 rounds) | TFLOP/s | rel err vs fp64 |")
print("| --- | --- | --- | --- | --- |")
for r in rows:
    print(f"| {r['shape']} | {r['kernel']} | {r['ms']:.2f} | {r['tflops']:.0f} | {r['rel_err']:.1e} |")
