"""Start-up work in the background, while the main thread reads the corpus and the tokenizer, which need no
GPU: the CUDA driver context and the cuBLAS handle on one thread, and Triton's first use (its import, the
hash of its own sources that keys its kernel cache, and fastppl's kernel modules) on another."""
from __future__ import annotations

import threading

import torch


def _warm_up_cuda(device: torch.device) -> None:
    try:
        with torch.cuda.device(device):
            x = torch.ones(64, 64, device=device, dtype=torch.bfloat16)
            (x @ x).sum().item()   # context, allocator, cuBLAS(Lt) handle
    except Exception:   # the main thread meets the same failure where it can name it
        pass


def _warm_up_triton() -> None:
    """The first Triton kernel of a process hashed Triton's sources (0.35 s) and imported it (0.2 s) on the H200
    (docs/BENCHMARKS.md, session 11); both are cached for the process, and hashing runs without the GIL."""
    try:
        import triton   # noqa: F401
        try:
            from triton.runtime.cache import triton_key
        except ImportError:   # older Triton
            from triton.compiler.compiler import triton_key
        triton_key()   # functools.lru_cache: the kernel launches later find it
        from ..engine import fused_loss   # noqa: F401  (the kernels' @triton.jit definitions)
        from . import fused_norm   # noqa: F401
    except Exception:   # no Triton, or another layout of it: the kernels pay their first use themselves
        pass


def _thread(target, name: str, *args) -> threading.Thread:
    # not a daemon: an early error exit must not tear the interpreter down mid-way through a CUDA call
    thread = threading.Thread(target=target, args=args, name=name)
    thread.start()
    return thread


def start_cuda_warm_up(device: torch.device) -> list[threading.Thread]:
    """The started threads on CUDA (callers need not join them: CUDA's lazy init and imports are locked),
    else none."""
    if device.type != "cuda":
        return []
    if device.index is None and torch.cuda.is_initialized():
        # "cuda" means the caller's current device, which is per thread (before init it is device 0)
        device = torch.device("cuda", torch.cuda.current_device())
    return [_thread(_warm_up_cuda, "fastppl-cuda-warm-up", device),
            _thread(_warm_up_triton, "fastppl-triton-warm-up")]
