"""Exact tokenisation of a long text in parallel: the text is cut where the tokenizer itself splits it, so that the
pieces' ids, concatenated, are those of one `encode` of the whole text; the pieces go through `encode_batch` on all
cores, a bounded group at a time (memory: the text, the ids, and two groups' encodings).

A cut at position q is taken only when it changes no id near it: with `L` characters of left context and `R` of
right context,

    encode(text[q-L:q+R]) == encode(text[q-L:q]) + encode(text[q:q+R])      for L = 256 and L = 257

The whole tokenizer runs in that check (normalizer, added tokens, pre-tokenizer, model), so a special token
straddling q, a normalizer that acts on a text's first character (Prepend, Strip) or a pre-tokenizer that glues the
characters around q fails it. Two left contexts of different lengths catch pre-tokenizers that group from the left
(Llama-3's digits in threes). Candidate cuts are the tokenizer's own pre-token starts near each target. A text with
no cut that passes, or a tokenizer without a pre-tokenizer, is encoded whole (`Encoded.whole_reason` says why).
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Iterator, Optional

import numpy as np

PIECE_CHARS = 1 << 16             # a piece's target length; short enough that a group feeds every core
# pieces per encode_batch call: enough for every core, few enough to bound the encodings held at once (two groups)
GROUP_PIECES = max(32, 8 * (os.cpu_count() or 1))
SEARCH_CHARS = 256                # candidates are looked for this far either side of a target
TARGETS_AT_ONCE = 256
CANDIDATES = 4                    # nearest candidates tried per target before the target is dropped
LEFT_CONTEXTS = (256, 257)
RIGHT_CONTEXT = 256


@dataclass
class Encoded:
    ids: np.ndarray                 # (n,) int64
    pieces: int                     # 1 when the text was encoded whole
    whole_reason: Optional[str]     # why a long text was encoded whole (None: cut, or short)


def _ids(encoding) -> np.ndarray:
    return np.asarray(encoding.ids, dtype=np.uint32)   # the tokenizer's own type; int64 once joined


def _candidates(backend, text: str, target: int) -> list[int]:
    """Pre-token starts near target, nearest first (absolute positions)."""
    left = target - SEARCH_CHARS
    starts = [left + start for _, (start, _) in backend.pre_tokenizer.pre_tokenize_str(
        text[left:target + SEARCH_CHARS])]
    return sorted((q for q in starts if q > left), key=lambda q: abs(q - target))[:CANDIDATES]


def _check_texts(text: str, q: int) -> list[str]:
    """[right, then for each left context: window, left] around a candidate cut q."""
    right = text[q:q + RIGHT_CONTEXT]
    texts = [right]
    for left_chars in LEFT_CONTEXTS:
        left = text[q - left_chars:q]
        texts += [left + right, left]
    return texts


def _cut_is_exact(checks: list) -> bool:
    """checks: the encodings of _check_texts."""
    right = checks[0].ids
    return all(checks[k].ids == checks[k + 1].ids + right for k in range(1, len(checks), 2))


def iter_cuts(backend, text: str) -> Iterator[int]:
    """Positions 0 < q < len(text) where the text may be cut without changing its ids, in increasing order; found
    a few hundred targets at a time, so that encoding can start before the last is found."""
    low, high = max(LEFT_CONTEXTS) + SEARCH_CHARS, len(text) - RIGHT_CONTEXT - SEARCH_CHARS
    targets = range(max(PIECE_CHARS, low), high, PIECE_CHARS)
    for first in range(0, len(targets), TARGETS_AT_ONCE):
        pending = {t: _candidates(backend, text, t) for t in targets[first:first + TARGETS_AT_ONCE]}
        found = []
        for round_ in range(CANDIDATES):
            tried = [(t, c[round_]) for t, c in pending.items() if len(c) > round_]
            if not tried:
                break
            checks = backend.encode_batch_fast([s for _, q in tried for s in _check_texts(text, q)],
                                               add_special_tokens=False)
            per_cut = 1 + 2 * len(LEFT_CONTEXTS)
            for k, (target, q) in enumerate(tried):
                if _cut_is_exact(checks[per_cut * k:per_cut * (k + 1)]):
                    found.append(q)
                    del pending[target]
        yield from sorted(set(found))


def find_cuts(backend, text: str) -> list[int]:
    return list(iter_cuts(backend, text))


def _groups(first_cut: int, cuts: Iterator[int], end: int) -> Iterator[list[tuple[int, int]]]:
    """The pieces' (start, stop), GROUP_PIECES at a time."""
    group, start = [(0, first_cut)], first_cut
    for cut in cuts:
        if cut > start:   # targets are PIECE_CHARS apart and their candidates nearer than that: never equal
            group.append((start, cut))
            start = cut
        if len(group) == GROUP_PIECES:
            yield group
            group = []
    yield group + [(start, end)]


def encode_in_pieces(backend, text: str) -> Encoded:
    """The ids of one encode(text, add_special_tokens=False), computed in parallel pieces where the text allows.
    One thread runs the tokenizer on a group of pieces (on every core) while this one turns the last group's
    encodings into ids and finds the next cuts."""
    if len(text) < 2 * PIECE_CHARS:   # one piece
        return Encoded(_whole(backend, text), 1, None)
    if backend.pre_tokenizer is None:
        return Encoded(_whole(backend, text), 1, "the tokenizer has no pre-tokenizer to cut the text at")
    cuts = iter_cuts(backend, text)
    first_cut = next(cuts, None)
    if first_cut is None:
        return Encoded(_whole(backend, text), 1, "no cut point keeps the tokenizer's ids unchanged")
    parts, n_pieces, encoding = [], 0, None
    with ThreadPoolExecutor(max_workers=1) as encoder:
        for group in _groups(first_cut, cuts, len(text)):
            n_pieces += len(group)
            next_encoding = encoder.submit(backend.encode_batch_fast, [text[a:b] for a, b in group],
                                           add_special_tokens=False)
            if encoding is not None:
                parts += [_ids(e) for e in encoding.result()]
            encoding = next_encoding
        parts += [_ids(e) for e in encoding.result()]
    return Encoded(np.concatenate(parts, dtype=np.int64), n_pieces, None)


def encode_short_texts(backend, texts: list[str]) -> list[np.ndarray]:
    """The ids of each text (short: one piece each), encoded together with encode_batch on all cores, a group of
    about GROUP_PIECES pieces' worth of characters at a time."""
    ids, group, group_chars = [], [], 0
    for text in texts + [None]:   # None: the end, which flushes the last group
        if group and (text is None or group_chars + len(text) > GROUP_PIECES * PIECE_CHARS):
            ids += [_ids(e).astype(np.int64) for e in backend.encode_batch_fast(group, add_special_tokens=False)]
            group, group_chars = [], 0
        if text is not None:
            group.append(text)
            group_chars += len(text)
    return ids


def _whole(backend, text: str) -> np.ndarray:
    return _ids(backend.encode(text, add_special_tokens=False)).astype(np.int64)
