"""Exact tokenisation of a long text in parallel: the text is cut where fastppl.data.cut_rules proves that a cut
changes no id, so that the pieces' ids, concatenated, are those of one `encode` of the whole text; the pieces go
through `encode_batch` on all cores, a bounded group at a time (memory: the text, the ids, and two groups'
encodings). A tokenizer outside those rules, or a text without a place they allow, is encoded whole, and
`Encoded.whole_reason` says why.

Each allowed cut is checked once more, as a guard: with `L` characters of left context and `R` of right context,

    encode(text[q-L:q+R]) == encode(text[q-L:q]) + encode(text[q:q+R])      for L = 256 and L = 257

Parallel work runs on threads of fastppl's own, each with its share of a group (the tokenizer releases the GIL),
so that it does not depend on TOKENIZERS_PARALLELISM: with it off, `encode_batch` alone runs on one thread.
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Iterator, Optional

import numpy as np

from .cut_rules import AddedTokenWindow, cut_candidates, unprovable_reason

PIECE_CHARS = 1 << 16             # a piece's target length; short enough that a group feeds every core
# pieces per encode_batch call: enough for every core, few enough to bound the encodings held at once (two groups)
GROUP_PIECES = max(32, 8 * (os.cpu_count() or 1))
SEARCH_CHARS = 256                # candidates are looked for this far either side of a target
TARGETS_AT_ONCE = 256
CANDIDATES = 4                    # nearest candidates tried per target before the target is dropped
LEFT_CONTEXTS = (256, 257)
RIGHT_CONTEXT = 256
THREADS = os.cpu_count() or 1


NO_CUT = ("no place to cut: a cut needs a space between two ASCII letters or digits, away from added tokens, where "
          "the ids stay unchanged")


@dataclass
class Encoded:
    ids: np.ndarray                 # (n,) int64
    pieces: int                     # 1 when the text was encoded whole
    whole_reason: Optional[str]     # why a long text was encoded whole (None: cut, or short)


def _ids(encoding) -> np.ndarray:
    return np.asarray(encoding.ids, dtype=np.uint32)   # the tokenizer's own type; int64 once joined


def encode_batch(backend, texts: list[str]) -> list:
    """backend.encode_batch_fast(texts) on THREADS threads of fastppl's own, each with a share of about as many
    characters: all cores work whether or not TOKENIZERS_PARALLELISM lets the tokenizer use its own."""
    if THREADS < 2 or len(texts) < 2:
        return backend.encode_batch_fast(texts, add_special_tokens=False)
    total, shares, share, share_chars = sum(map(len, texts)), [], [], 0
    for text in texts:
        share.append(text)
        share_chars += len(text)
        if share_chars * THREADS >= total * (len(shares) + 1) and len(shares) < THREADS - 1:
            shares.append(share)
            share = []
    shares = [s for s in shares + [share] if s]
    with ThreadPoolExecutor(max_workers=len(shares), thread_name_prefix="fastppl-encode") as threads:
        encoded = threads.map(lambda part: backend.encode_batch_fast(part, add_special_tokens=False), shares)
        return [encoding for share_encodings in encoded for encoding in share_encodings]


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
    a few hundred targets at a time, so that encoding can start before the last is found. The tokenizer must be
    one that fastppl.data.cut_rules applies to (unprovable_reason(backend) is None)."""
    low, high = max(LEFT_CONTEXTS) + SEARCH_CHARS, len(text) - RIGHT_CONTEXT - SEARCH_CHARS
    targets = range(max(PIECE_CHARS, low), high, PIECE_CHARS)
    added_tokens = AddedTokenWindow.of(backend)
    for first in range(0, len(targets), TARGETS_AT_ONCE):
        pending = {t: cut_candidates(text, t, SEARCH_CHARS, added_tokens, CANDIDATES)
                   for t in targets[first:first + TARGETS_AT_ONCE]}
        found = []
        for round_ in range(CANDIDATES):
            tried = [(t, c[round_]) for t, c in pending.items() if len(c) > round_]
            if not tried:
                break
            checks = encode_batch(backend, [s for _, q in tried for s in _check_texts(text, q)])
            per_cut = 1 + 2 * len(LEFT_CONTEXTS)
            for k, (target, q) in enumerate(tried):
                if _cut_is_exact(checks[per_cut * k:per_cut * (k + 1)]):
                    found.append(q)
                    del pending[target]
        yield from sorted(set(found))


def find_cuts(backend, text: str) -> list[int]:
    return [] if unprovable_reason(backend) else list(iter_cuts(backend, text))


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
    unprovable = unprovable_reason(backend)
    if unprovable:
        return Encoded(_whole(backend, text), 1, unprovable)
    cuts = iter_cuts(backend, text)
    first_cut = next(cuts, None)
    if first_cut is None:
        return Encoded(_whole(backend, text), 1, NO_CUT)
    parts, n_pieces, encoding = [], 0, None
    with ThreadPoolExecutor(max_workers=1) as encoder:
        for group in _groups(first_cut, cuts, len(text)):
            n_pieces += len(group)
            next_encoding = encoder.submit(encode_batch, backend, [text[a:b] for a, b in group])
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
            ids += [_ids(e).astype(np.int64) for e in encode_batch(backend, group)]
            group, group_chars = [], 0
        if text is not None:
            group.append(text)
            group_chars += len(text)
    return ids


def _whole(backend, text: str) -> np.ndarray:
    return _ids(backend.encode(text, add_special_tokens=False)).astype(np.int64)
