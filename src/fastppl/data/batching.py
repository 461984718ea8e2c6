"""Batches of windows as fixed-shape arrays (B, T): right-padded rows, and whole padding rows at the
end of the last batch, so that a compiled scorer sees one shape for the whole run."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np

from .windows import Window


@dataclass(frozen=True)
class WindowRef:
    doc: int          # index of the document's stream
    window: Window


@dataclass
class Batch:
    input_ids: np.ndarray      # (B, T) int64; padding reads token 0 (masked out)
    targets: np.ndarray        # (B, T) int64
    score_mask: np.ndarray     # (B, T) bool: True where the prediction is scored
    token_index: np.ndarray    # (B, T) int64: flat index of the target in the corpus' token array, -1 if unscored
    n_scored: int
    n_windows: int             # real windows in this batch (the rest are padding rows)


def make_batch(
    refs: Sequence[WindowRef], streams: Sequence[np.ndarray], stream_offsets: Sequence[int],
    batch_size: int, seq_len: int,
) -> Batch:
    """stream_offsets[d]: flat corpus index of stream d's index 0 target minus 1, i.e. target stream
    index j of document d is corpus token stream_offsets[d] + j - 1 (see Stream in fastppl.pipeline)."""
    input_ids = np.zeros((batch_size, seq_len), dtype=np.int64)
    targets = np.zeros((batch_size, seq_len), dtype=np.int64)
    score_mask = np.zeros((batch_size, seq_len), dtype=bool)
    token_index = np.full((batch_size, seq_len), -1, dtype=np.int64)
    n_scored = 0
    for row, ref in enumerate(refs):
        w, stream = ref.window, streams[ref.doc]
        assert w.length <= seq_len and w.start + w.length < len(stream)
        input_ids[row, :w.length] = stream[w.start:w.start + w.length]
        targets[row, :w.length] = stream[w.start + 1:w.start + w.length + 1]
        score_mask[row, w.score_from:w.length] = True
        first_target = w.start + w.score_from + 1
        token_index[row, w.score_from:w.length] = stream_offsets[ref.doc] + np.arange(
            first_target, w.start + w.length + 1) - 1
        n_scored += w.n_scored
    return Batch(input_ids, targets, score_mask, token_index, n_scored, len(refs))


def iter_batches(
    refs: Sequence[WindowRef], streams: Sequence[np.ndarray], stream_offsets: Sequence[int],
    batch_size: int, seq_len: int,
) -> Iterator[Batch]:
    for begin in range(0, len(refs), batch_size):
        yield make_batch(refs[begin:begin + batch_size], streams, stream_offsets, batch_size, seq_len)
