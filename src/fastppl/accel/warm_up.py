"""Start-up work in the background: the CUDA driver context and the cuBLAS handle on one thread while the main
thread reads the corpus and the tokenizer, which need no GPU; and Triton's first use (its import, the hash of its
own sources that keys its kernel cache, and fastppl's kernel modules) on another, started by the CLI before
`import torch`. torch is imported inside the functions, so that this module can be imported before it."""
from __future__ import annotations

import importlib.util
import threading
from typing import Optional

_triton_warm_up: list[threading.Thread] = []   # the one Triton warm-up of this process


def _warm_up_cuda(device) -> None:
    import torch
    try:
        with torch.cuda.device(device):
            x = torch.ones(64, 64, device=device, dtype=torch.bfloat16)
            (x @ x).sum().item()   # context, allocator, cuBLAS(Lt) handle
    except Exception:   # the main thread meets the same failure where it can name it
        pass


def _warm_up_triton() -> None:
    """The first Triton kernel of a process hashed Triton's sources (0.35 s) and imported it (0.2–0.4 s) on the
    H200 (docs/BENCHMARKS.md, sessions 11 and 12); both are cached for the process. Triton imports without
    torch, and hashing runs without the GIL, so both overlap `import torch`."""
    try:
        import triton   # noqa: F401
        try:
            from triton.runtime.cache import triton_key
        except ImportError:   # older Triton
            from triton.compiler.compiler import triton_key
        triton_key()   # functools.lru_cache: later launches find it, once this thread has been joined
        from ..engine import fused_loss   # noqa: F401  (the kernels' @triton.jit definitions; imports torch)
        from . import fused_norm   # noqa: F401
    except Exception:   # no Triton, or another layout of it: the kernels pay their first use themselves
        pass


def start_triton_warm_up() -> Optional[threading.Thread]:
    """Triton's first use on a thread, started once per process; None without Triton. A daemon: it only imports
    and hashes, so an early exit need not wait for it."""
    if not _triton_warm_up:
        if importlib.util.find_spec("triton") is None:
            return None
        thread = threading.Thread(target=_warm_up_triton, name="fastppl-triton-warm-up", daemon=True)
        thread.start()
        _triton_warm_up.append(thread)
    return _triton_warm_up[0]


def start_cuda_warm_up(device) -> list[threading.Thread]:
    """The warm-up threads for a run on `device` (CUDA), started if need be; none off CUDA. Join them before the
    first kernel: Triton's cache key is an lru_cache, not a lock, so a kernel launched while the thread still
    hashes would hash everything again (0.7 s, docs/BENCHMARKS.md session 12)."""
    import torch
    if device.type != "cuda":
        return []
    if device.index is None and torch.cuda.is_initialized():
        # "cuda" means the caller's current device, which is per thread (before init it is device 0)
        device = torch.device("cuda", torch.cuda.current_device())
    # not a daemon: an early error exit must not tear the interpreter down mid-way through a CUDA call
    cuda = threading.Thread(target=_warm_up_cuda, args=(device,), name="fastppl-cuda-warm-up")
    cuda.start()
    triton = start_triton_warm_up()
    return [cuda] + ([triton] if triton is not None else [])
