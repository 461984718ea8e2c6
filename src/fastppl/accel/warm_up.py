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
    """A started thread on CUDA (callers need not join it: CUDA's lazy init is locked), else None."""
    if device.type != "cuda":
        return None
    if device.index is None and torch.cuda.is_initialized():
        # "cuda" means the caller's current device, which is per thread (before init it is device 0)
        device = torch.device("cuda", torch.cuda.current_device())
    # not a daemon: an early error exit must not tear the interpreter down mid-way through a CUDA call
    thread = threading.Thread(target=_warm_up, args=(device,), name="fastppl-cuda-warm-up")
    thread.start()
    return thread
