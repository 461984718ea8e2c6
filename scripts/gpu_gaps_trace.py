"""Where the dense scorer's 2.3 ms per batch between kernels go (H200; PYTHONPATH=src). Session 13 call 1 measured
34.9 ms of wall per batch at the power cap against 32.6 ms of profiled kernel time, and CUDA graphs (session 3) moved
nothing, so the gaps are not launch overhead. This profiles 5 batches after 30 warm ones and lists the idle time
between consecutive kernels on the GPU's timeline, by the kernel pair around each gap, and how long the CPU takes to
enqueue one batch. Expected: either a few large gaps (a sync, an allocation, a copy) or ~13 us at each of the
~176 kernel boundaries (dependent-launch latency)."""
import collections
import json
import os
import time

import torch
from torch.profiler import ProfilerActivity, profile

from gpu_common import dense_gpt2_scorer

_, score, (inputs, targets, mask) = dense_gpt2_scorer(64, 1024)
N_PROFILED = 5
with torch.inference_mode():
    for _ in range(30):
        score(inputs, targets, mask)
    torch.cuda.synchronize()
    # CPU time to enqueue one batch, while the GPU queue is not full
    enqueue = []
    for _ in range(5):
        torch.cuda.synchronize()
        t = time.perf_counter(); score(inputs, targets, mask); enqueue.append(time.perf_counter() - t)
    for _ in range(20):
        score(inputs, targets, mask)
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(N_PROFILED):
            score(inputs, targets, mask)
        torch.cuda.synchronize()
kernels = sorted(((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                  if e.device_type == torch.autograd.DeviceType.CUDA), key=lambda k: k[0])
busy = sum(end - start for start, end, _ in kernels)
span = kernels[-1][1] - kernels[0][0]
gaps = collections.defaultdict(lambda: [0, 0.0])
sizes = []
for (s0, e0, n0), (s1, e1, n1) in zip(kernels, kernels[1:]):
    gap = s1 - e0
    sizes.append(gap)
    key = (n0[:60], n1[:60])
    gaps[key][0] += 1
    gaps[key][1] += max(gap, 0.0)
sizes.sort()
report = dict(kernels_per_batch=len(kernels) / N_PROFILED, busy_ms_per_batch=busy / 1e3 / N_PROFILED,
              span_ms_per_batch=span / 1e3 / N_PROFILED, idle_ms_per_batch=(span - busy) / 1e3 / N_PROFILED,
              enqueue_ms_per_batch=[1e3 * x for x in enqueue],
              gap_us_percentiles={p: sizes[int(p / 100 * (len(sizes) - 1))] for p in (10, 50, 90, 99, 100)},
              top_gaps=[dict(before=k[0], after=k[1], count=v[0], total_us=v[1])
                        for k, v in sorted(gaps.items(), key=lambda kv: -kv[1][1])[:15]])
if os.environ.get("OUT"):
    json.dump(report, open(os.path.join(os.environ["OUT"], "gaps_trace.json"), "w"), indent=1)
print(json.dumps({k: v for k, v in report.items() if k != "top_gaps"}, indent=1))
print("| kernel before | kernel after | gaps | total us over 5 batches |")
print("| --- | --- | --- | --- |")
for g in report["top_gaps"]:
    print(f"| {g['before']} | {g['after']} | {g['count']} | {g['total_us']:.0f} |")
