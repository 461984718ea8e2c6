"""Start-up work in the background: the CUDA driver context and the cuBLAS handle on one thread while the main
thread reads the corpus and the tokenizer, which need no GPU; and the hash of Triton's sources that keys its kernel
cache on another, started by the CLI before `import torch`. torch is imported inside the functions, so that this
module can be imported before it."""
from __future__ import annotations

import functools
import importlib.util
import threading
import time
from typing import Optional


class _TimedThread(threading.Thread):
    """A thread that keeps how long its target ran (seconds; None until it has ended), for stage_seconds."""
    seconds: Optional[float] = None

    def run(self) -> None:
        started = time.perf_counter()
        try:
            super().run()
        finally:
            self.seconds = time.perf_counter() - started


def _warm_up_cuda(device) -> None:
    import torch
    try:
        with torch.cuda.device(device):
            x = torch.ones(64, 64, device=device, dtype=torch.bfloat16)
            (x @ x).sum().item()   # context, allocator, cuBLAS(Lt) handle
    except Exception:   # the main thread meets the same failure where it can name it
        pass


def _triton_key_function():
    """Triton's cache-key function, importing Triton."""
    try:
        from triton.runtime.cache import triton_key
    except ImportError:   # older Triton
        from triton.compiler.compiler import triton_key
    return triton_key


def _hash_quietly(triton_key) -> None:
    try:
        triton_key()   # functools.lru_cache: later launches find it, once this thread has been joined
    except Exception:   # the kernels' first launch meets it again, where it can be reported
        pass


@functools.cache   # once per process: later calls return the same thread
def start_triton_warm_up() -> Optional[threading.Thread]:
    """A thread that computes Triton's cache key, started once per process; None without Triton. The first kernel
    of a process hashed Triton's sources there (0.35 s on the H200). The thread only reads files and hashes them,
    which runs without the GIL and overlaps `import torch`; Triton is imported here, on the caller's thread,
    because two threads importing at once can meet a circular import half-done (an ImportError). A daemon, so
    that an early exit need not wait for it."""
    if importlib.util.find_spec("triton") is None:
        return None
    try:
        triton_key = _triton_key_function()
    except Exception:   # a Triton that does not import: the kernels report it where they are used
        return None
    thread = threading.Thread(target=_hash_quietly, args=(triton_key,), name="fastppl-triton-warm-up", daemon=True)
    thread.start()
    return thread


def start_cuda_warm_up(device) -> list[threading.Thread]:
    """The warm-up threads for a run on `device` (CUDA), started if need be; none off CUDA. Join them before the
    first kernel: Triton's cache key is an lru_cache, not a lock, so a kernel launched while the thread still
    hashes would hash everything again (0.7 s on the H200)."""
    import torch
    if device.type != "cuda":
        return []
    if device.index is None and torch.cuda.is_initialized():
        # "cuda" means the caller's current device, which is per thread (before init it is device 0)
        device = torch.device("cuda", torch.cuda.current_device())
    # not a daemon: an early error exit must not tear the interpreter down mid-way through a CUDA call
    cuda = _TimedThread(target=_warm_up_cuda, args=(device,), name="fastppl-cuda-warm-up")
    cuda.start()
    triton = start_triton_warm_up()
    return [cuda] + ([triton] if triton is not None else [])
