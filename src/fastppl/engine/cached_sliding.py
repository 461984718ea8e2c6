"""Sliding-window scoring that reuses keys and values (rotary models only): each window runs the model
over its new tokens only (at most `stride` of them) and takes the keys and values of the ctx - 1 - stride
tokens before them from a cache, instead of recomputing the whole window.

What it computes. The plain sliding window (fastppl.data.windows.sliding_windows) recomputes every
window from scratch: a token's hidden states at layer >= 1 depend on the tokens before it *in that
window*. Here a cached token keeps the states it got when it was new, when its window started earlier,
so from layer 1 on it carries context from before the current window (as in Transformer-XL's segment
recurrence). Only the keys and values of layer 0 do not depend on context, so the two agree exactly for
a one-layer model (tested) and differ, slightly, for deeper ones. This is why --kv-cache auto keeps the
exact, uncached sliding window; --kv-cache on opts in.

What stays exact: every token is scored once, by the same window as in sliding_windows; a query attends
to exactly the tokens of that window that precede it (from the window's start, not the whole cache);
and the positions are the window's own, 0 .. ctx-2, because keys are cached unrotated and rotated on
every read at their position in the current window. Positions therefore never grow with the document
(fp32 angles of position 10^6 would be off by up to 0.03 rad).

GPT-2 cannot do this at all: its positions are absolute embeddings added at the input, so a cached
token's states were computed at its position in an earlier window and cannot be moved to its new one.

Layout. Rows of the batch hold whole documents (longest first, each to the least loaded row). A row's
cache is a ring of ctx - 1 slots plus one scratch slot for padding: the token with row serial s (its
index in the concatenation of the row's documents) lives in slot s mod (ctx - 1), and the slot table
(B, L) records each slot's serial, so the attention mask is "serial in [window start, query]" -- which
also hides whatever earlier documents left behind. The ring never overwrites a token a query may see:
a chunk's visible range spans at most ctx - 1 serials.

    stream    0 1 2 3 4 5 6 7 8 9 ...     ctx = 7, stride = 2: windows read [0,6) [2,8) [4,10) ...
    step 1    q q                         window 0 in chunks of <= stride new tokens, all seeing from 0
    step 2    k k q q
    step 3    k k k k q q
    step 4        k k k k q q             window 1: new 6 7, seeing 2 .. themselves
    step 5            k k k k q q         window 2: new 8 9, seeing 4 .. themselves
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Sequence

import numpy as np
import torch
import torch.nn as nn

from ..data.batching import WindowRef
from ..errors import FastpplError
from ..models.kv_cache import CacheStep, remove_kv_cache, setup_kv_cache
from .loss import chunked_token_nll
from .score import DeviceSums, accumulate, to_device


def is_rotary(model: nn.Module) -> bool:
    """Native rotary models expose rope_cos_sin (fastppl.models.llama)."""
    return callable(getattr(model, "rope_cos_sin", None))


def choose_kv_cache(setting: str, window: str, model: nn.Module) -> tuple[bool, str]:
    """(use the cached sliding window or not, why) for --kv-cache auto|on|off."""
    if setting == "off":
        return False, "off (--kv-cache off)"
    if setting == "auto":
        if window == "sliding" and is_rotary(model):
            return False, ("off (auto: cached windows carry context from before the window from layer 1 on, "
                           "so they are not the exact sliding window; --kv-cache on opts in)")
        return False, "off (auto)"
    assert window == "sliding", "EvalConfig refuses --kv-cache on with other windows"
    if not is_rotary(model):
        from ..models.registry import spec_of
        why = ("with absolute position embeddings (GPT-2) cached tokens cannot move to their new window positions"
               if spec_of(model) is not None else
               "the cache is fastppl's native models' own, and this model runs through transformers")
        raise FastpplError(f"--kv-cache on needs a native rotary model (Llama, Qwen2, Qwen3, Mistral), "
                           f"not {type(model).__name__}: {why}")
    return True, "on (--kv-cache on)"


@dataclass(frozen=True)
class Chunk:
    doc: int
    begin: int           # new inputs: stream[begin:end]; their targets are stream[begin+1:end+1]
    end: int
    window_start: int    # the window's first stream index: each query sees window_start .. itself


def plan_chunks(refs: Sequence[WindowRef], chunk_len: int) -> dict[int, list[Chunk]]:
    """Each document's chunks, in order. A window's new inputs are exactly its scored positions."""
    by_doc: dict[int, list[Chunk]] = {}
    for ref in sorted(refs, key=lambda r: (r.doc, r.window.start)):
        w = ref.window
        for begin in range(w.start + w.score_from, w.start + w.length, chunk_len):
            chunk = Chunk(ref.doc, begin, min(begin + chunk_len, w.start + w.length), w.start)
            by_doc.setdefault(ref.doc, []).append(chunk)
    return by_doc


def assign_rows(by_doc: dict[int, list[Chunk]], n_rows: int) -> list[list[Chunk]]:
    """Whole documents to rows: longest first, each to the row with the fewest chunks so far."""
    rows: list[list[Chunk]] = [[] for _ in range(n_rows)]
    for doc in sorted(by_doc, key=lambda d: (-len(by_doc[d]), d)):
        min(rows, key=len).extend(by_doc[doc])
    return [row for row in rows if row]


@dataclass
class StepInputs:
    input_ids: np.ndarray      # (B, S) int64
    targets: np.ndarray        # (B, S) int64
    score_mask: np.ndarray     # (B, S) bool
    positions: np.ndarray      # (B, S) int64: position in the window (0 on padding)
    query_serial: np.ndarray   # (B, S) int64: row serial of the input, -1 on padding
    slots: np.ndarray          # (B, S) int64: ring slot, the scratch slot on padding
    window_serial: np.ndarray  # (B,) int64: row serial of the window start
    token_index: np.ndarray    # (B, S) int64: corpus index of the target, -1 on padding
    n_scored: int


def iter_steps(rows: list[list[Chunk]], streams: Sequence[np.ndarray], stream_offsets: Sequence[int],
               chunk_len: int, ring: int) -> Iterator[StepInputs]:
    """The inputs of each forward: row r runs its t-th chunk in step t (padding once it has none left)."""
    B, S = len(rows), chunk_len
    # serial base of each (row, document): documents follow each other in a row
    base: dict[tuple[int, int], int] = {}
    for r, row in enumerate(rows):
        total = 0
        for chunk in row:
            if (r, chunk.doc) not in base:
                base[(r, chunk.doc)] = total
                total += len(streams[chunk.doc])
    for t in range(max(len(row) for row in rows)):
        x = StepInputs(
            input_ids=np.zeros((B, S), np.int64), targets=np.zeros((B, S), np.int64),
            score_mask=np.zeros((B, S), bool), positions=np.zeros((B, S), np.int64),
            query_serial=np.full((B, S), -1, np.int64), slots=np.full((B, S), ring, np.int64),
            window_serial=np.zeros(B, np.int64), token_index=np.full((B, S), -1, np.int64), n_scored=0)
        for r, row in enumerate(rows):
            if t >= len(row):
                continue
            c = row[t]
            n, stream, b = c.end - c.begin, streams[c.doc], base[(r, c.doc)]
            x.input_ids[r, :n] = stream[c.begin:c.end]
            x.targets[r, :n] = stream[c.begin + 1:c.end + 1]
            x.score_mask[r, :n] = True
            x.positions[r, :n] = np.arange(c.begin, c.end) - c.window_start
            x.query_serial[r, :n] = b + np.arange(c.begin, c.end)
            x.slots[r, :n] = x.query_serial[r, :n] % ring
            x.window_serial[r] = b + c.window_start
            # target stream index j of document d is corpus token stream_offsets[d] + j - 1
            x.token_index[r, :n] = stream_offsets[c.doc] + np.arange(c.begin, c.end)
            x.n_scored += n
        yield x


def make_step_fn(model: nn.Module, slot_serial: torch.Tensor, chunk_rows: int = 8192):
    """(input_ids, targets, score_mask, positions, query_serial, slots, window_serial) -> (B, S) fp32 NLL,
    0 where not scored; updates the caches and the slot table (B, L) in place."""
    weight = model.lm_head.weight
    bias = getattr(model.lm_head, "bias", None)

    def step(input_ids, targets, score_mask, positions, query_serial, slots, window_serial):
        B, S = input_ids.shape
        slot_serial.scatter_(1, slots, query_serial)
        keys = slot_serial[:, None, :]                                             # (B, 1, L)
        visible = (keys >= window_serial[:, None, None]) & (keys <= query_serial[:, :, None])   # (B, S, L)
        visible = visible | (query_serial < 0)[:, :, None]   # padding queries see all: finite, never NaN
        key_positions = (slot_serial - window_serial[:, None]).clamp(min=0)       # (B, L) in the window
        key_rope = model.rope_cos_sin(key_positions, weight.dtype)
        hidden = model(input_ids, positions, cache_step=CacheStep(slots, visible[:, None], key_rope))
        nll = chunked_token_nll(hidden.reshape(B * S, -1), weight, targets.reshape(B * S), bias, chunk_rows)
        return torch.where(score_mask, nll.view(B, S), 0.0)

    return step


@torch.inference_mode()
def score_cached_sliding(
    model: nn.Module, refs: Sequence[WindowRef], streams: Sequence[np.ndarray], stream_offsets: Sequence[int],
    ctx: int, stride: int, batch_size: int, sums: DeviceSums, device: torch.device,
    on_step: Optional[Callable[[int], None]] = None, compile_fn: Optional[Callable] = None,
    chunk_rows: int = 8192, document_starts: Optional[np.ndarray] = None,
) -> int:
    """Score the sliding windows `refs` with cached keys and values into sums; returns the number of forwards.
    stream_offsets as in fastppl.data.batching.make_batch; document_starts (n_documents,): each document's
    first index in the corpus' token array, for the per-document sums."""
    assert is_rotary(model), "cached sliding windows need a rotary model"
    chunk_len = min(stride, ctx - 1)
    rows = assign_rows(plan_chunks(refs, chunk_len), batch_size)
    ring = ctx - 1                     # slots 0 .. ctx-2; slot ctx-1 takes padding
    B, n_steps = len(rows), max(len(row) for row in rows)
    setup_kv_cache(model, B, ring + 1)
    try:
        slot_serial = torch.full((B, ring + 1), -1, dtype=torch.int64, device=device)
        step_fn = make_step_fn(model, slot_serial, chunk_rows)
        if compile_fn is not None:
            step_fn = compile_fn(step_fn)
        for x in iter_steps(rows, streams, stream_offsets, chunk_len, ring):
            inputs = [to_device(a, device) for a in (x.input_ids, x.targets, x.score_mask, x.positions,
                                                       x.query_serial, x.slots, x.window_serial)]
            nll = step_fn(*inputs)                                                  # (B, S) fp32
            target_document = None
            if document_starts is not None:   # the document of each scored target, from its corpus index
                target_document = np.where(x.token_index >= 0,
                                           np.searchsorted(document_starts, x.token_index, side="right") - 1, -1)
            accumulate(sums, nll, inputs[2], device, inputs[3], target_document, x.token_index)
            if on_step is not None:
                on_step(x.n_scored)
    finally:
        remove_kv_cache(model)
    return n_steps
