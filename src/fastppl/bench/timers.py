"""Timers and memory readings shared by the benches: synchronise, reset and read the peak, the matmul ceiling."""
from __future__ import annotations

import gc
import time
from typing import Optional

import numpy as np
import torch


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak(device: torch.device) -> None:
    """Free what the last peer left (its graphs and cached blocks) and start a new peak."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak_bytes(device: torch.device) -> Optional[int]:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def matmul_ceiling(device: torch.device) -> float:
    """bf16 FLOP/s of a large square matmul (CUDA) or fp32 on the CPU; median of timed repeats."""
    n, dtype = (8192, torch.bfloat16) if device.type == "cuda" else (512, torch.float32)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    times = []
    for i in range(13):
        synchronize(device)
        t = time.perf_counter()
        a @ b
        synchronize(device)
        if i >= 3:
            times.append(time.perf_counter() - t)
    return 2 * n ** 3 / float(np.median(times))


CPU_BENCH_MINUTES = 10   # a CPU bench longer than this is refused: it would print nothing for that long


def refuse_long_cpu_bench(flops: float, device: torch.device, smaller: str, ceiling: Optional[float] = None) -> None:
    """On the CPU, a bench whose matmuls alone would take more than CPU_BENCH_MINUTES at this CPU's matmul ceiling
    (a lower bound of its time) is refused at once, in one line that says how to make it smaller."""
    if device.type != "cpu":
        return
    from ..errors import FastpplError
    ceiling = ceiling or matmul_ceiling(device)
    minutes = flops / ceiling / 60
    if minutes > CPU_BENCH_MINUTES:
        raise FastpplError(f"this bench is at least {minutes:,.0f} minutes of products on this CPU "
                           f"({ceiling / 1e9:,.0f} GFLOP/s); {smaller}, or run it on a GPU")
