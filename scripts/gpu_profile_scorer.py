"""Where the eager GPT-2 124M scorer (as `fastppl eval` runs it: fused loss, MLP epilogue, fused residual norms unless FUSED_NORMS=0) spends GPU time at
batch 64 x 1024, kernel by kernel (torch.profiler over 3 batches). H200, PYTHONPATH=src."""
import json
import os

import torch
from torch.profiler import ProfilerActivity, profile

from gpu_common import dense_gpt2_scorer

B, T = 64, 1024
model, score, (inputs, targets, mask) = dense_gpt2_scorer(B, T, fused_norms=os.environ.get("FUSED_NORMS", "1") == "1")
with torch.inference_mode():
    for _ in range(3):
        score(inputs, targets, mask)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            score(inputs, targets, mask)
        torch.cuda.synchronize()
kernels = {}
for event in prof.events():
    if event.device_type == torch.autograd.DeviceType.CUDA:
        k = kernels.setdefault(event.name, [0, 0.0])
        k[0] += 1
        k[1] += event.device_time / 1e3   # ms
total = sum(v[1] for v in kernels.values())
rows = sorted(kernels.items(), key=lambda kv: -kv[1][1])
print(f"\nGPU time per batch: {total / 3:.2f} ms over {sum(v[0] for v in kernels.values()) / 3:.0f} kernels")
print("| kernel | per batch | ms per batch | share |")
print("| --- | --- | --- | --- |")
for name, (count, ms) in rows[:18]:
    print(f"| {name[:90]} | {count / 3:.0f} | {ms / 3:.2f} | {ms / total:.1%} |")
if os.environ.get("OUT"):
    json.dump([dict(name=n, count=c / 3, ms=m / 3) for n, (c, m) in rows], open(os.path.join(os.environ["OUT"], "scorer_profile.json"), "w"), indent=1)
