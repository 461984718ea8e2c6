"""Batches of windows as fixed-shape arrays (B, T): right-padded rows, and whole padding rows at the
end of the last batch, so that a compiled scorer sees one shape for the whole run (one per bucket when
bucketed). A packed batch (see fastppl.data.packing) holds several windows per row and carries position
ids that restart at each window and document ids that keep attention inside each window, and the same
documents as segments of the flattened rows for variable-length attention (document_segments)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

import numpy as np

from .packing import BatchPlan
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
    target_document: Optional[np.ndarray] = None   # (B, T) int64: document of the scored target, -1 if unscored
    position_ids: Optional[np.ndarray] = None      # (B, T) int64, packed only: position inside the window
    document_ids: Optional[np.ndarray] = None      # (B, T) int64, packed only: window id within the batch, -1 padding
    cu_seqlens: Optional[np.ndarray] = None        # (n_segments + 1,) int32, packed only: see document_segments
    max_seqlen: Optional[int] = None               # packed only: the longest segment


def document_segments(document_ids: np.ndarray) -> tuple[np.ndarray, int]:
    """(cu_seqlens, max_seqlen) of a packed batch's (B, T) document ids: the runs of equal ids along each
    row of the flattened B*T tokens, as variable-length attention reads them. A row boundary always starts a
    segment, so the padding at the end of a row (ids -1) is a segment of its own, as is a whole padding row:

        row 0   a a a b b . .        ids  0 0 0 1 1 -1 -1
        row 1   c c c c c c c             2 2 2 2 2  2  2
        cu_seqlens = [0, 3, 5, 7, 14]   max_seqlen = 7

    cu_seqlens is int32: its first entries are the segment starts and its last is B*T."""
    B, T = document_ids.shape
    flat = document_ids.reshape(-1)
    starts = np.ones(B * T, dtype=bool)
    starts[1:] = flat[1:] != flat[:-1]
    starts[::T] = True
    cu_seqlens = np.append(np.flatnonzero(starts), B * T).astype(np.int32)
    return cu_seqlens, int(np.diff(cu_seqlens).max())


def _empty_batch(n_rows: int, seq_len: int, packed: bool) -> Batch:
    shape = (n_rows, seq_len)
    return Batch(
        input_ids=np.zeros(shape, dtype=np.int64), targets=np.zeros(shape, dtype=np.int64),
        score_mask=np.zeros(shape, dtype=bool), token_index=np.full(shape, -1, dtype=np.int64),
        n_scored=0, n_windows=0, target_document=np.full(shape, -1, dtype=np.int64),
        position_ids=np.zeros(shape, dtype=np.int64) if packed else None,
        document_ids=np.full(shape, -1, dtype=np.int64) if packed else None,
    )


def _place(batch: Batch, ref: WindowRef, stream: np.ndarray, stream_offset: int, row: int, column: int) -> None:
    """Write one window into batch[row, column : column + length]."""
    w = ref.window
    assert column + w.length <= batch.input_ids.shape[1] and w.start + w.length < len(stream)
    span = slice(column, column + w.length)
    scored = slice(column + w.score_from, column + w.length)
    batch.input_ids[row, span] = stream[w.start:w.start + w.length]
    batch.targets[row, span] = stream[w.start + 1:w.start + w.length + 1]
    batch.score_mask[row, scored] = True
    first_target = w.start + w.score_from + 1
    batch.token_index[row, scored] = stream_offset + np.arange(first_target, w.start + w.length + 1) - 1
    batch.target_document[row, scored] = ref.doc
    batch.n_scored += w.n_scored
    batch.n_windows += 1


def make_batch(
    refs: Sequence[WindowRef], streams: Sequence[np.ndarray], stream_offsets: Sequence[int],
    batch_size: int, seq_len: int,
) -> Batch:
    """stream_offsets[d]: flat corpus index of stream d's index 0 target minus 1, i.e. target stream
    index j of document d is corpus token stream_offsets[d] + j - 1 (see Stream in fastppl.data.streams)."""
    batch = _empty_batch(batch_size, seq_len, packed=False)
    for row, ref in enumerate(refs):
        _place(batch, ref, streams[ref.doc], stream_offsets[ref.doc], row, 0)
    return batch


def iter_batches(
    refs: Sequence[WindowRef], streams: Sequence[np.ndarray], stream_offsets: Sequence[int],
    batch_size: int, seq_len: int,
) -> Iterator[Batch]:
    for begin in range(0, len(refs), batch_size):
        yield make_batch(refs[begin:begin + batch_size], streams, stream_offsets, batch_size, seq_len)


def batch_from_plan(
    plan: BatchPlan, refs: Sequence[WindowRef], streams: Sequence[np.ndarray], stream_offsets: Sequence[int],
) -> Batch:
    """The arrays of one planned batch; plan.windows index refs."""
    batch = _empty_batch(plan.n_rows, plan.seq_len, plan.packed)
    for slot, (window, row, column) in enumerate(zip(plan.windows, plan.rows, plan.columns)):
        ref = refs[window]
        _place(batch, ref, streams[ref.doc], stream_offsets[ref.doc], int(row), int(column))
        if plan.packed:
            length = ref.window.length
            batch.position_ids[row, column:column + length] = np.arange(length)
            batch.document_ids[row, column:column + length] = slot
    if plan.packed:
        batch.cu_seqlens, batch.max_seqlen = document_segments(batch.document_ids)
    return batch
