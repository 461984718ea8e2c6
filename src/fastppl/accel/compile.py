"""torch.compile applied to the scoring function, with its caches kept under fastppl's cache dir (compile_cache)."""
from __future__ import annotations

from typing import Optional

import torch

from ..models.registry import SPECS, spec_of
from . import compile_cache

# Below this many scored tokens a cold compile costs more than it saves: compile seconds divided by the
# seconds per token it saves, measured per compile family (each family's ModelSpec says its family and figures).
COMPILE_MIN_TOKENS = {(spec.compile_family, loss): tokens for spec in SPECS
                      for loss, tokens in spec.compile_min_tokens.items()}
# With a warm compile cache for this model, loss and device (accel/compile_cache.py: Dynamo still traces, Inductor's
# code and Triton's kernels are read back), a compile costs about a quarter of a cold one, and so repays after a
# quarter of the tokens. An estimate from Inductor's documented cache hits, to be measured on the GPU
# (tests/accel/test_compile_cache.py times a cold and a warm process).
WARM_COMPILE_SHARE = 0.25


def model_family(model) -> str:
    """The key of COMPILE_MIN_TOKENS: the native model's compile family, "gpt2" for any other model."""
    spec = spec_of(model)
    return spec.compile_family if spec is not None else "gpt2"


def use_compile(setting: str, device: torch.device, n_tokens: int, loss: str = "chunked",
                family: str = "gpt2", scored_share: float = 1.0, warm_cache: bool = False) -> tuple[bool, str]:
    """(compile or not, why) for --compile auto|on|off. scored_share: scored positions over positions read
    (about stride / ctx for sliding windows); warm_cache: the compile cache holds this model's scorer."""
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
    minimum = int(COMPILE_MIN_TOKENS[family, loss] * (WARM_COMPILE_SHARE if warm_cache else 1))
    warm = " with the warm compile cache" if warm_cache else ""
    if n_tokens < minimum:
        return False, (f"off (auto: {n_tokens:,} tokens are too few to repay compiling this model with the "
                       f"{loss} loss{warm}; it pays from {minimum:,})")
    return True, f"on (auto{warm})"


def compile_score_fn(fn, cache_key: Optional[str] = None):
    """fn under torch.compile, with the caches of accel/compile_cache.py: the second process of the same shapes
    reuses the compiled code. With a cache_key (compile_cache.cache_key), the key's artifacts file is loaded first
    and the scorer's compile_record says how long compiling took and where its code came from."""
    compile_cache.configure_caches()
    record = None
    if cache_key is not None:
        record = compile_cache.CompileRecord(cache_key, compile_cache.load_artifacts(cache_key))
    from ..engine.fused_divergence import register_compiled_op as register_divergence_op
    from ..engine.fused_loss import register_compiled_op
    register_compiled_op()   # the fused loss (and the fused divergence) as one opaque op inside the graph
    register_divergence_op()
    compiled = torch.compile(fn, dynamic=False)

    def compiled_score(*args):
        # takes no scored_rows (engine.score): static shapes, the loss on every position, since a gathered
        # row count that changes from batch to batch would compile one graph per count
        return compiled(*args) if record is None else record.timed_call(compiled, *args)

    compiled_score.compile_record = record
    return compiled_score


def finish_compiled_run(score_fn, stage_seconds: dict) -> str:
    """After scoring with a compiled scorer: its new code saved for the next process, stage_seconds["compile"]
    set, and what the report's compile line adds ("; compiled in 8.1 s, from the cache"); "" for another scorer."""
    record = getattr(score_fn, "compile_record", None)
    if record is None:
        return ""
    compile_cache.finish(record)
    stage_seconds["compile"] = record.seconds
    return record.note()


_shapes_allowed = 0   # over every compiled run of this process: a table's cells each add their graphs


def allow_shapes(n_shapes: int) -> None:
    """Let the compiled scorer keep one graph per batch shape (bucketed runs have several) instead of
    falling back to eager after Dynamo's default limit of 8 recompiles; counted over the process, since the
    runs of a table (fastppl.table) compile one scorer function for other models and shapes."""
    global _shapes_allowed
    _shapes_allowed += n_shapes
    import torch._dynamo.config as dynamo_config
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(dynamo_config, name):
            setattr(dynamo_config, name, max(getattr(dynamo_config, name), _shapes_allowed + 1))
