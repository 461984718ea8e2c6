"""One generation step and its pieces: left padding and its attention mask, sampling, the prefill, and
decode_one_token, eager or compiled (fastppl.generate runs them in a loop).

Prompts of different lengths are left-padded to a common length P, so that at every step all rows
write the same cache slot and one input_pos serves the whole batch (the shapes never change, which
is what a CUDA graph needs). A row's padding is masked out of every attention, and its positions
start at its first real token:

    slot        0    1    2    3  |  4    5    6       (P = 4, then decode steps)
    row 0       a0   a1   a2   a3 |  x    x    x       pad 0: positions 0 1 2 3 4 5 6
    row 1       --   --   b0   b1 |  y    y    y       pad 2: positions 0 0 0 1 2 3 4; slots 0, 1 hidden

A padding query attends to itself only (never to nothing, which would make NaN that then leaks into
the real rows' attention through 0 * NaN).
"""
from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from .errors import FastpplError
from .models.kv_cache import CacheStep

LOGITS_ALIGN = 64         # aligned_lm_head: the vocabulary product's width rounded up to this


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0           # 0 = greedy (argmax)
    top_k: Optional[int] = None        # keep the k most likely ids
    top_p: Optional[float] = None      # keep the smallest set of most likely ids whose probability reaches top_p
    seed: Optional[int] = 0            # when sampling, reseeds torch's RNG (reproducible on one device and setting)

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise FastpplError(f"--temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise FastpplError(f"--top-k must be >= 1, got {self.top_k}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise FastpplError(f"--top-p must be in (0, 1], got {self.top_p}")


def sample(logits: torch.Tensor, temperature: float = 0.0, top_k: Optional[int] = None,
           top_p: Optional[float] = None) -> torch.Tensor:
    """(B, V) fp32 logits -> (B,) token ids, without a host sync."""
    if temperature <= 0:
        return logits.argmax(dim=-1)
    # shifted to a row maximum of 0 first (softmax, top-k and top-p do not change): a tiny temperature then
    # sends the others to -inf, not every logit to +-inf and the probabilities to NaN
    # (and a temperature below the dtype's smallest normal number would round to 0 in it: 0 / 0)
    temperature = max(temperature, torch.finfo(logits.dtype).tiny)
    logits = (logits - logits.amax(dim=-1, keepdim=True)) / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth_largest = torch.topk(logits, top_k, dim=-1).values[:, -1:]            # (B, 1)
        logits = logits.masked_fill(logits < kth_largest, -math.inf)
    if top_p is not None and top_p < 1:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs                  # of the more likely ids
        drop_sorted = mass_before >= top_p           # the most likely id always stays (mass_before = 0)
        drop = drop_sorted.scatter(-1, order, drop_sorted)                         # back to id order
        logits = logits.masked_fill(drop, -math.inf)
    probs = logits.softmax(dim=-1)
    # exponential race: argmax_i p_i / E_i with E_i ~ Exp(1) is a draw from p (multinomial would sync).
    # E = -log(u) with u clamped away from 0 is never 0, so p_i = 0 is never drawn.
    exponential = -torch.rand_like(probs).clamp_(min=torch.finfo(probs.dtype).tiny).log()
    return (probs / exponential).argmax(dim=-1)


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """(B, P) int64 ids, right-aligned, and (B,) int64 padding counts."""
    P = max(len(p) for p in prompts)
    ids = np.full((len(prompts), P), pad_id, dtype=np.int64)
    pad = np.zeros(len(prompts), dtype=np.int64)
    for row, prompt in enumerate(prompts):
        ids[row, P - len(prompt):] = prompt
        pad[row] = P - len(prompt)
    return ids, pad


def padded_mask(pad: torch.Tensor, query_slots: torch.Tensor, cache_len: int) -> torch.Tensor:
    """(B, 1, T, L) bool: query in slot i of row b sees slot j iff j <= i and j is not padding of row b
    (a padding query sees itself only)."""
    key_slots = torch.arange(cache_len, device=pad.device)
    i, j = query_slots[:, None], key_slots[None, :]                            # (T, 1), (1, L)
    causal = j <= i                                                            # (T, L)
    real = j[None] >= pad[:, None, None]                                       # (B, 1, L)
    return (causal & (real | (j == i)))[:, None]                              # (B, 1, T, L)


def _logits(model: nn.Module, hidden: torch.Tensor, aligned_head: Optional[tuple] = None) -> torch.Tensor:
    """fp32 logits (B, V) of the last position of hidden (B, T, C); through aligned_head's (weight, bias) when
    given (aligned_lm_head), cut back to the V real ids."""
    plain_head = (model.lm_head.weight, getattr(model.lm_head, "bias", None))
    weight, bias = plain_head if aligned_head is None else aligned_head
    return F.linear(hidden[:, -1], weight, bias)[:, :plain_head[0].shape[0]].float()


# model -> (the lm_head tensors the copy was made from, their versions, the padded (weight, bias))
_aligned_heads: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def aligned_lm_head(model: nn.Module) -> Optional[tuple]:
    """(weight, bias) of lm_head with zero rows appended up to a multiple of LOGITS_ALIGN ids, or None when V
    already is one, or when the weights are inference tensors (they keep no version counter, so a change
    to them in place could not be seen). Kept per model while its lm_head is unchanged, so that a compiled
    step's CUDA graph sees the same tensors (marked static: never copied into the graph's inputs) at every call.
    The padding ids' logits are cut before sampling. GPT-2's 50,257 ids give cuBLAS an output row it cannot
    align; the compiled step over the padded head, measured on an H200: -14 % a step at batch 8 and 64, -9 %
    at 128."""
    weight, bias = model.lm_head.weight, getattr(model.lm_head, "bias", None)
    extra = -weight.shape[0] % LOGITS_ALIGN
    sources = (weight,) if bias is None else (weight, bias)
    if extra == 0 or any(t.is_inference() for t in sources):
        return None
    cached = _aligned_heads.get(model)
    # the cache holds the source tensors, so their memory cannot be reused by a new weight at the same address
    # (a model converted with .half().float(), or .data replaced); in-place changes bump the version
    if cached is not None and len(cached[0]) == len(sources) and all(
            old.data_ptr() == new.data_ptr() and old.dtype == new.dtype and old.device == new.device
            and version == new._version for old, new, version in zip(cached[0], sources, cached[1])):
        return cached[2]
    with torch.no_grad():
        padded = (torch.cat([weight, weight.new_zeros(extra, weight.shape[1])]),
                  None if bias is None else torch.cat([bias, bias.new_zeros(extra)]))
    if weight.is_cuda:
        for tensor in padded:
            if tensor is not None:
                torch._dynamo.mark_static_address(tensor)
    _aligned_heads[model] = (tuple(t.detach() for t in sources), tuple(t._version for t in sources), padded)
    return padded


def prefill(model: nn.Module, ids: torch.Tensor, pad: torch.Tensor, cache_len: int,
            sampling: Sampling) -> torch.Tensor:
    """Run the left-padded prompts (B, P) through the model, filling cache slots 0 .. P-1; (B,) first tokens."""
    B, P = ids.shape
    slots = torch.arange(P, device=ids.device)
    positions = (slots[None, :] - pad[:, None]).clamp(min=0)                  # (B, P)
    step = CacheStep(slots=slots, mask=padded_mask(pad, slots, cache_len))   # (P,) slots: every row the same
    hidden = model(ids, positions, cache_step=step)
    logits = _logits(model, hidden)
    # one host sync per generation: NaN logits would silently become token 0 at every step
    if not bool(torch.isfinite(logits).all()):
        raise FastpplError("the model's logits are not finite (NaN or inf): its weights or config.json are broken, "
                           "or the dtype overflows; try --dtype fp32")
    return sample(logits, sampling.temperature, sampling.top_k, sampling.top_p)


def decode_one_token(
    model: nn.Module, token: torch.Tensor, input_pos: torch.Tensor, pad: torch.Tensor, finished: torch.Tensor,
    cache_len: int, eos_id: int, temperature: float, top_k: Optional[int], top_p: Optional[float],
    aligned_head: Optional[tuple] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One step: token (B, 1) goes into cache slot input_pos (1,); -> next token (B,), finished (B,).
    cache_len is the attached cache's length. A finished row keeps emitting eos_id (its outputs are cut at
    the first one). aligned_head: see aligned_lm_head."""
    positions = (input_pos[None, :] - pad[:, None]).clamp(min=0)              # (B, 1)
    mask = padded_mask(pad, input_pos, cache_len)                             # (B, 1, 1, cache_len), every layer's
    # (1,) slots: every row writes the same slot, which index_copy_ writes without a per-row index
    hidden = model(token, positions, cache_step=CacheStep(slots=input_pos, mask=mask))
    next_token = sample(_logits(model, hidden, aligned_head), temperature, top_k, top_p)
    next_token = torch.where(finished, eos_id, next_token)
    return next_token, finished | (next_token == eos_id)


_compiled_decode: list = []   # decode_one_token under torch.compile, compiled once per process


def compiled_decode_one_token():
    """decode_one_token under torch.compile with Inductor's CUDA graphs (mode="reduce-overhead"), compiled
    once per process, per shape."""
    from .accel.compile import allow_shapes
    # one graph per (batch, cache length): a process that generates at many shapes must not hit Dynamo's
    # default limit of 8, which under fullgraph=True is an error (raised on every call: cheap, and it holds
    # if something lowered the limit since)
    allow_shapes(64)
    if not _compiled_decode:
        import os
        from .config import cache_dir
        # kept across runs, as for the scorer (fastppl.accel.compile)
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir() / "inductor"))
        os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "1")
        _compiled_decode.append(torch.compile(decode_one_token, mode="reduce-overhead", fullgraph=True))
    return _compiled_decode[0]
