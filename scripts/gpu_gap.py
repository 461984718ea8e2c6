"""Why the dense scorer's wall time per batch (35.3 ms) exceeds its kernel time (32.0 ms) (H200; PYTHONPATH=src).

CUDA graphs moved nothing (BENCHMARKS session 3), so the gap is not launch overhead. Remaining suspects: the
SM clock drops under sustained load (power or thermal limit), or the profiler's 3 batches ran at a higher clock
than a long run. This samples nvidia-smi every 100 ms while the GPU idles, while the scorer runs batches back to
back, while the fused loss and a cuBLAS matmul run alone, and prints the SM clock, power and the clock-event
reasons per phase, beside ms per batch from CUDA events and the profiler's kernel sum.
Expected: if the clock under the scorer is ~10 % below the profiled phase's, the gap is the clock."""
import datetime
import json
import os
import statistics
import subprocess
import time

import torch
from torch.profiler import ProfilerActivity, profile

from fastppl.engine.fused_loss import fused_token_nll
from gpu_common import dense_gpt2_scorer

FIELDS = "timestamp,clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active"
smi_path = os.path.join(os.environ.get("OUT", "/tmp"), "smi.csv")
smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={FIELDS}", "--format=csv,noheader,nounits", "-lms", "100"],
                       stdout=open(smi_path, "w"), stderr=subprocess.DEVNULL)
phases = []   # (name, start, end, ms per unit)


def phase(name, fn):
    torch.cuda.synchronize()
    start = datetime.datetime.now()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    n = fn()
    e.record()
    torch.cuda.synchronize()
    phases.append((name, start, datetime.datetime.now(), s.elapsed_time(e) / n if n else float("nan")))


dev = torch.device("cuda")
B, T = 64, 1024
model, score, (inputs, targets, mask) = dense_gpt2_scorer(B, T)
h = torch.randn(B * T, 768, device=dev, dtype=torch.bfloat16)
a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)


def run_scorer(n):
    def fn():
        for _ in range(n):
            score(inputs, targets, mask)
        return n
    return fn


def run_loss(n):
    def fn():
        for _ in range(n):
            fused_token_nll(h, model.lm_head.weight, targets.reshape(-1))
        return n
    return fn


def run_mm(n):
    def fn():
        for _ in range(n):
            a @ a
        return n
    return fn


with torch.inference_mode():
    run_scorer(5)(); run_loss(3)(); run_mm(3)()
    torch.cuda.synchronize()
    phase("idle 1 s", lambda: time.sleep(1.0) or 0)
    phase("scorer, 10 batches after idle", run_scorer(10))
    phase("scorer, 100 batches back to back", run_scorer(100))
    phase("idle 2 s", lambda: time.sleep(2.0) or 0)
    phase("scorer, 10 batches after idle (2)", run_scorer(10))
    phase("fused loss alone, 200 calls", run_loss(200))
    phase("cuBLAS 8192^3, 200 calls", run_mm(200))
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run_scorer(3)()
        torch.cuda.synchronize()
    kernel_ms = sum(ev.device_time for ev in prof.events() if ev.device_type == torch.autograd.DeviceType.CUDA) / 3e3
    phase("scorer, 100 batches (after the profile)", run_scorer(100))
time.sleep(0.3)
smi.terminate()
smi.wait()

samples = []
for line in open(smi_path):
    parts = [p.strip() for p in line.split(",")]
    try:
        samples.append((datetime.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f"), float(parts[1]),
                        float(parts[2]), float(parts[3]), parts[4] if len(parts) > 4 else ""))
    except (ValueError, IndexError):
        continue
rows = []
for name, start, end, ms in phases:
    inside = [s for s in samples if start <= s[0] <= end]
    clocks = [s[1] for s in inside]
    rows.append(dict(phase=name, ms_per_unit=ms, samples=len(inside),
                     sm_mhz_median=statistics.median(clocks) if clocks else None,
                     sm_mhz_min=min(clocks) if clocks else None,
                     power_w_median=statistics.median([s[2] for s in inside]) if inside else None,
                     temp_c_max=max([s[3] for s in inside]) if inside else None,
                     reasons=sorted({s[4] for s in inside})))
report = dict(kernel_ms_per_batch_profiled=kernel_ms, phases=rows)
if os.environ.get("OUT"):
    json.dump(report, open(os.path.join(os.environ["OUT"], "gap.json"), "w"), indent=1, default=str)
print(f"\nprofiled kernel time per scorer batch: {kernel_ms:.2f} ms")
print("| phase | ms per batch/call | samples | SM MHz median (min) | power W | temp C max | clock-event reasons |")
print("| --- | --- | --- | --- | --- | --- | --- |")
for r in rows:
    print(f"| {r['phase']} | {r['ms_per_unit']:.2f} | {r['samples']} | {r['sm_mhz_median']} ({r['sm_mhz_min']}) | "
          f"{r['power_w_median']} | {r['temp_c_max']} | {' '.join(r['reasons'])} |")
