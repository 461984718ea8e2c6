"""Why is the compiled decode step launch-bound? Counts kernels per step and time per step (H200).
PROBE_BATCH (1) sets the batch (the same 32-token prompt in every row); FASTPPL_DECODE the decode options."""
import os

import torch

from fastppl.generate import Sampling, generate
from fastppl.models.loading import random_native

dev = torch.device("cuda")
model = random_native("gpt2", 0, dev).to(torch.bfloat16).eval()
prompt = [list(range(1000, 1032))] * int(os.environ.get("PROBE_BATCH", 1))
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
# what the step's kernels are: per kernel name, launches and GPU microseconds per decode step (32 steps profiled)
steps = 32
rows = sorted(cuda_kernels, key=lambda e: -e.self_device_time_total)
print(f"{'kernel':90s} {'per step':>8s} {'us/step':>8s}")
for e in rows[:40]:
    print(f"{e.key[:90]:90s} {e.count / steps:8.2f} {e.self_device_time_total / steps:8.1f}")
print(f"total per step: {sum(e.count for e in cuda_kernels) / steps:.1f} kernels, "
      f"{sum(e.self_device_time_total for e in cuda_kernels) / steps:.1f} us GPU")
