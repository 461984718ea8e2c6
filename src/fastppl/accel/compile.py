"""torch.compile applied to the scoring function, with Inductor's caches kept under fastppl's cache dir."""
from __future__ import annotations

import os

import torch

from ..config import cache_dir

# Below this many scored tokens a cold compile costs more than it saves (measured: docs/BENCHMARKS.md).
COMPILE_MIN_TOKENS = 4_000_000


def use_compile(setting: str, device: torch.device, n_tokens: int) -> tuple[bool, str]:
    """(compile or not, why) for --compile auto|on|off."""
    if setting == "on":
        return True, "on (--compile on)"
    if setting == "off":
        return False, "off (--compile off)"
    if device.type != "cuda":
        return False, "off (auto: CPU)"
    if n_tokens < COMPILE_MIN_TOKENS:
        return False, f"off (auto: {n_tokens:,} tokens are too few to repay compilation)"
    return True, "on (auto)"


def compile_score_fn(fn):
    # a persistent cache makes the second run of the same shapes reuse the compiled kernels
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir() / "inductor"))
    os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "1")
    return torch.compile(fn, dynamic=False)


def allow_shapes(n_shapes: int) -> None:
    """Let the compiled scorer keep one graph per batch shape (bucketed runs have several) instead of
    falling back to eager after Dynamo's default limit of 8 recompiles."""
    import torch._dynamo.config as dynamo_config
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(dynamo_config, name):
            setattr(dynamo_config, name, max(getattr(dynamo_config, name), n_shapes + 1))
