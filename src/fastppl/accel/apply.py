"""The one place that decides and applies fastppl's performance transforms for a built model and a run: the loss
kernel, torch.compile, the batching mode, the fused GPT-2 MLP epilogue and residual norms and the fused Llama trunk
(CUDA, eager), and tuned cuBLASLt products. `fastppl eval` (fastppl.pipeline) and `fastppl bench` call these same
functions, so the bench times what eval runs."""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
import os
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch
import torch.nn as nn

from ..data.packing import resolve_batching
from ..engine.loss import fused_loss_available, resolve_loss
from ..engine.score import ScoreFn, make_score_fn
from ..errors import FastpplError
from ..models.attention import varlen_available
from ..models.registry import spec_of
from ..models.spec import PLAIN_SPLIT, LayerSplit
from . import compile_cache, cublaslt, linear
from .compile import compile_score_fn, model_family, use_compile
from .fused_mlp import fuse_mlp_epilogue, unfuse_mlp_epilogue


@dataclass
class Acceleration:
    """The transforms a run applies, each with what the report says of it."""
    loss: str                   # "fused" or "chunked"
    compiled: bool
    compile_reason: str
    batching: str               # "packed", "bucketed" or "padded"
    batching_reason: str
    mlp_epilogue: str = "plain"
    residual_norms: str = "plain"


def fused_trunk_enabled() -> bool:
    """The fused Llama trunk is on unless FASTPPL_FUSED_LLAMA_TRUNK=0 (the plain modules, to compare or bisect)."""
    return os.environ.get("FASTPPL_FUSED_LLAMA_TRUNK") != "0"


def fused_divergence_enabled(device: torch.device) -> bool:
    """With --reference-model on CUDA the fused divergence kernel (engine/fused_divergence.py) may compute both
    models' columns, unless FASTPPL_FUSED_DIVERGENCE=0 (the chunked path: to compare, to bisect, or for the top-k
    overlaps, which only it computes)."""
    return fused_loss_available(device) and os.environ.get("FASTPPL_FUSED_DIVERGENCE") != "0"


FUSED_DIVERGENCE = "fused divergence kernel (Triton)"
CHUNKED_DIVERGENCE = "chunked projection, divergence in torch"


def divergence_path(device: torch.device, dtype: torch.dtype) -> tuple[bool, str]:
    """(whether the fused divergence kernel runs, what the report's loss says): the kernel where it is enabled, in
    16-bit; in fp32 the chunked path, which is faster there (on an H100 at Llama-3's vocabulary, 181 against 806 ms
    a block of rows: the kernel's fp32 tile products run without tensor cores), unless FASTPPL_FUSED_DIVERGENCE=1
    asks for the kernel."""
    if not fused_divergence_enabled(device):
        return False, CHUNKED_DIVERGENCE
    if dtype == torch.float32 and os.environ.get("FASTPPL_FUSED_DIVERGENCE") != "1":
        return False, (f"{CHUNKED_DIVERGENCE} (auto: fp32, where the fused divergence kernel is slower than the "
                       "chunked path; FASTPPL_FUSED_DIVERGENCE=1 runs it)")
    return True, FUSED_DIVERGENCE


def takes_document_ids(model: nn.Module) -> bool:
    """Whether the model's forward can keep packed documents apart (the native architectures can)."""
    return "document_ids" in inspect.signature(model.forward).parameters


def choose_acceleration(model: nn.Module, device: torch.device, dtype: torch.dtype, *, loss: str = "auto",
                        compile: str = "auto", batching: str = "padded", n_scored: int, n_positions: int,
                        n_documents: int = 1) -> Acceleration:
    """The loss, compile and batching choices for a run scoring n_scored of the n_positions it reads, over
    n_documents documents with something to score (each setting as its flag: auto, or what it names)."""
    loss = resolve_loss(loss, device)
    warm = compile == "auto" and device.type == "cuda" and compile_cache.has_artifacts(
        compile_cache.cache_key(model, loss))
    compiled, compile_reason = use_compile(compile, device, n_scored, loss, model_family(model),
                                           scored_share=n_scored / n_positions, warm_cache=warm)
    # asked only where auto could pack: its first call imports torch's varlen module (0.3 s on the H200)
    varlen = n_documents > 1 and varlen_available(device, dtype)
    batching, batching_reason = resolve_batching(batching, n_documents, takes_document_ids(model), varlen, compiled)
    if compiled and batching == "packed" and device.type == "cuda":
        # FlexAttention document masks inside the compiled scorer hit an illegal memory access in
        # Inductor on torch 2.11 (tests/models/test_document_attention.py on the GPU); eager packing is exact.
        # varlen rows stay eager too: each batch's segment count and longest segment would recompile
        compiled, compile_reason = False, "off (packed rows run eager: compiled FlexAttention failed on torch 2.11)"
    return Acceleration(loss, compiled, compile_reason, batching, batching_reason)


def apply_fusions(model: nn.Module, device: torch.device, acceleration: Acceleration) -> Acceleration:
    """On CUDA with an eager scorer: GPT-2's MLP bias + GELU in the first product's epilogue, and its residual
    adds inside the projections with the bias sums in the LayerNorms; the Llama family's fused trunk. Fusions
    applied before are undone first, so that one model can be accelerated again for another choice (the bench's
    variants)."""
    unfuse_mlp_epilogue(model)
    if getattr(model, "fused_norms", None) is not None:   # of an earlier choice (fused_norm imports Triton: only then)
        from .fused_norm import unfuse_residual_norms
        unfuse_residual_norms(model)
    if getattr(model, "fused_trunk", None) is not None:
        from .fused_llama import unfuse_llama_trunk
        unfuse_llama_trunk(model)
    mlp, norms = "plain", "plain"
    if device.type == "cuda" and not acceleration.compiled:
        from .fused_llama import fuse_llama_trunk
        from .fused_norm import fuse_residual_norms
        if fuse_mlp_epilogue(model):
            mlp = "fused bias+GELU (cuBLASLt)"
        if fuse_residual_norms(model):
            norms = "residual adds inside the projections (cuBLAS), bias sums in the LayerNorms (Triton)"
        elif fused_trunk_enabled() and fuse_llama_trunk(model):
            norms = FUSED_TRUNK
    return dataclasses.replace(acceleration, mlp_epilogue=mlp, residual_norms=norms)


FUSED_TRUNK = "residual adds inside the projections (cuBLAS); RMSNorm, RoPE and SwiGLU in Triton kernels"


def streamed_split(model: nn.Module, device: torch.device,
                   acceleration: Acceleration) -> tuple[LayerSplit, Acceleration]:
    """The forward the layer-major path runs a block at a time: the fused Llama trunk where the resident path
    would run it (CUDA, eager, fused_trunk_enabled), so that both compute the same; else the plain blocks. GPT-2's
    fused norms carry the biases' sums across blocks, so its blocks stream plain."""
    if device.type == "cuda" and not acceleration.compiled and fused_trunk_enabled():
        from .fused_llama import fused_trunk_split
        split = fused_trunk_split(model)
        if split is not None:
            return split, dataclasses.replace(acceleration, residual_norms=FUSED_TRUNK)
    return PLAIN_SPLIT, acceleration


def score_fn_for(model: nn.Module, acceleration: Acceleration, chunk_rows: int = 8192) -> ScoreFn:
    """The scoring function of the chosen loss, compiled when the run compiles."""
    score_fn = make_score_fn(model, chunk_rows, acceleration.loss)
    return compile_score_fn(score_fn, compile_cache.cache_key(model, acceleration.loss)) if acceleration.compiled \
        else score_fn


def choose_tuning(setting: str, model: nn.Module, device: torch.device, dtype: torch.dtype, compiled: bool,
                  kv_cache: bool = False) -> cublaslt.TuningChoice:
    """--tune-products for this run: tuned cuBLASLt products for fastppl's native models' eager batches only."""
    tuning = cublaslt.use_tuning(setting, device, dtype, compiled)
    spec = spec_of(model)
    if tuning.mode != "off" and (spec is None or not spec.tuned_products):
        return cublaslt.TuningChoice("off", "torch's picks (tuning is for fastppl's native models)")
    if tuning.mode != "off" and kv_cache:
        return cublaslt.TuningChoice("off", "torch's picks (the cached sliding rows change shape at every stride)")
    return tuning


@contextlib.contextmanager
def tuned_products(model: nn.Module, tuning: cublaslt.TuningChoice) -> Iterator[Callable[[], str]]:
    """Within the block the model's products run through the tuner when tuning is on. Yields a function giving
    what the report says of the products (torch's picks, or which tuned kernels ran)."""
    if tuning.mode == "off":
        yield lambda: tuning.reason
        return
    linear.route_linears(model)
    tuner = linear.start_tuning(cublaslt.picks_store())
    try:
        yield lambda: f"{tuning.reason}: {tuner.summary()}"
    finally:
        linear.stop_tuning()
        linear.unroute_linears(model)


def divergence_loss_for(model: nn.Module, reference: nn.Module, acceleration: Acceleration,
                        batching_setting: str) -> tuple[Acceleration, Optional[Callable]]:
    """With --reference-model: what computes both models' columns, the fused kernel on CUDA
    (divergence_path: in 16-bit; None: the torch formula), and the batching both forwards take."""
    fused, loss = divergence_path(model.lm_head.weight.device, model.lm_head.weight.dtype)
    acceleration = dataclasses.replace(acceleration, loss=loss)
    if acceleration.batching == "packed" and not takes_document_ids(reference):
        if batching_setting == "packed":
            raise FastpplError("--batching packed needs both models' forwards to take document_ids (the native "
                               "backend); use --batching bucketed with this --reference-model")
        acceleration = dataclasses.replace(acceleration, batching="bucketed", batching_reason=(
            "bucketed (auto: the reference model cannot keep packed documents apart)"))
    fused_fn = None
    if fused:
        from ..engine.fused_divergence import fused_divergence_op as fused_fn
    return acceleration, fused_fn


def divergence_score_fn_for(model: nn.Module, reference: nn.Module, acceleration: Acceleration,
                            batching_setting: str, chunk_rows: int = 8192) -> tuple[Acceleration, ScoreFn]:
    """With --reference-model: the reference gets the model's fusions, the batching one both forwards take, and
    the scorer of both models' divergence (fastppl.engine.divergence, with divergence_loss_for's kernel); compiled
    when the run compiles."""
    from ..engine.divergence import make_divergence_score_fn
    device = next(reference.parameters()).device
    reference_fusions = apply_fusions(reference, device, acceleration)
    acceleration, fused_fn = divergence_loss_for(model, reference, acceleration, batching_setting)
    if reference_fusions.mlp_epilogue != acceleration.mlp_epilogue:   # a report line for the model under test
        acceleration = dataclasses.replace(acceleration, mlp_epilogue=acceleration.mlp_epilogue + " (model only)")
    score_fn = make_divergence_score_fn(model, reference, chunk_rows, fused_fn)
    if acceleration.compiled:
        what = "divergence-fused" if fused_fn is not None else "divergence"
        score_fn = compile_score_fn(score_fn, compile_cache.cache_key(model, what, reference))
    return acceleration, score_fn
