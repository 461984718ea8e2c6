"""Why is the compiled decode step launch-bound? Counts kernels per step and time per step (H200)."""
import time

import torch

from fastppl.generate import Sampling, generate
from fastppl.models.loading import random_native

dev = torch.device("cuda")
model = random_native("gpt2", 0, dev).to(torch.bfloat16).eval()
prompt = [list(range(1000, 1032))]
g = generate(model, prompt, 64, Sampling(), eos_id=None, compile=True)          # compile + capture
g = generate(model, prompt, 256, Sampling(), eos_id=None, compile=True)
print(f"decode {g.decode_tokens_per_second:,.0f} tok/s, {1e3 * g.decode_seconds / (g.decode_steps - g.decode_warmup_steps):.3f} ms/step")
from torch.profiler import ProfilerActivity, profile
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    generate(model, prompt, 33, Sampling(), eos_id=None, compile=True)
events = prof.key_averages()
cuda_kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
print("distinct CUDA kernels", len(cuda_kernels), "launches", sum(e.count for e in cuda_kernels))
print(events.table(sort_by="self_cpu_time_total", row_limit=14))
