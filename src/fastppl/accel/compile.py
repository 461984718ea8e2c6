"""torch.compile applied to the scoring function, with Inductor's caches kept under fastppl's cache dir."""
from __future__ import annotations

import os

import torch

from ..config import cache_dir
from ..models.registry import SPECS, spec_of

# Below this many scored tokens a cold compile costs more than it saves: compile seconds divided by the
# seconds per token it saves, measured per compile family (each family's ModelSpec says its family and figures).
COMPILE_MIN_TOKENS = {(spec.compile_family, loss): tokens for spec in SPECS
                      for loss, tokens in spec.compile_min_tokens.items()}


def model_family(model) -> str:
    """The key of COMPILE_MIN_TOKENS: the native model's compile family, "gpt2" for any other model."""
    spec = spec_of(model)
    return spec.compile_family if spec is not None else "gpt2"


def use_compile(setting: str, device: torch.device, n_tokens: int, loss: str = "chunked",
                family: str = "gpt2", scored_share: float = 1.0) -> tuple[bool, str]:
    """(compile or not, why) for --compile auto|on|off. scored_share: scored positions over positions read
    (about stride / ctx for sliding windows)."""
    from ..engine.score import GATHER_BELOW
    if setting == "on":
        return True, "on (--compile on)"
    if setting == "off":
        return False, "off (--compile off)"
    if device.type != "cuda":
        return False, "off (auto: CPU)"
    if family == "gpt2" and loss == "fused" and scored_share < GATHER_BELOW:
        # measured on the H200 at stride ctx/2 and ctx/4: the eager scorer with the loss on the scored
        # positions only is 1.24x and 1.28x the compiled one, which runs it on every position
        return False, (f"off (auto: {100 * scored_share:.1f} % of the positions read are scored; the eager fused "
                       "loss on those only is faster than compiling)")
    if n_tokens < COMPILE_MIN_TOKENS[family, loss]:
        return False, (f"off (auto: {n_tokens:,} tokens are too few to repay compiling this model with the "
                       f"{loss} loss; it pays from {COMPILE_MIN_TOKENS[family, loss]:,})")
    return True, "on (auto)"


def compile_score_fn(fn):
    # a persistent cache makes the second run of the same shapes reuse the compiled kernels
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir() / "inductor"))
    os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "1")
    from ..engine.fused_loss import register_compiled_op
    register_compiled_op()   # the fused loss as one opaque op inside the graph
    compiled = torch.compile(fn, dynamic=False)

    def compiled_score(*args):
        # takes no scored_rows (engine.score): static shapes, the loss on every position, since a gathered
        # row count that changes from batch to batch would compile one graph per count
        return compiled(*args)

    return compiled_score


def allow_shapes(n_shapes: int) -> None:
    """Let the compiled scorer keep one graph per batch shape (bucketed runs have several) instead of
    falling back to eager after Dynamo's default limit of 8 recompiles."""
    import torch._dynamo.config as dynamo_config
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(dynamo_config, name):
            setattr(dynamo_config, name, max(getattr(dynamo_config, name), n_shapes + 1))
