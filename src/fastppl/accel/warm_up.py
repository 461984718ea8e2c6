"""CUDA start-up in the background: the driver context and the cuBLAS handles are created on a thread
while the main thread reads the corpus and the tokenizer, which need no GPU."""
from __future__ import annotations

import threading

import torch


def _warm_up(device: torch.device) -> None:
    try:
        with torch.cuda.device(device):
            x = torch.ones(64, 64, device=device, dtype=torch.bfloat16)
            (x @ x).sum().item()   # context, allocator, cuBLAS(Lt) handle
    except Exception:   # the main thread meets the same failure where it can name it
        pass


def start_cuda_warm_up(device: torch.device) -> threading.Thread | None:
    """A started daemon thread on CUDA (callers need not join it: CUDA's lazy init is locked), else None."""
    if device.type != "cuda":
        return None
    thread = threading.Thread(target=_warm_up, args=(device,), name="fastppl-cuda-warm-up", daemon=True)
    thread.start()
    return thread
