"""The fused loss as committed before session 13 (pointer loads, natural-log exponentials; a copy saved as
.devcache/old_fused_loss.py by
`git show 15decd7:src/fastppl/engine/fused_loss.py > .devcache/old_fused_loss.py`, passed as OLD_FUSED_LOSS) against the new one (tensor-descriptor loads where
they fit, base-2 exponentials of one multiply-add), interleaved over 5 rounds at the scorer's shapes (H200).
Expected before the run, from gpu_loss_tma.py's variants: GPT-2 9.5 -> ~8.9 ms, Llama-1B 15.6 -> ~14.4 ms."""
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


KERNELS = {"before (pointer loads, exp)": old.fused_token_nll,
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
    times = {name: [] for name in KERNELS}
    errs = {name: ((k(h, w, t)[check].double() - ref).norm() / ref.norm()).item() for name, k in KERNELS.items()}
    for _ in range(5):
        for name, k in KERNELS.items():
            times[name].append(median_cuda_ms(lambda k=k: k(h, w, t)))
    for name in KERNELS:
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
