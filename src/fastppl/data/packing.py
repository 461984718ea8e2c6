"""Batch plans: which window goes into which row and column of which batch, for each batching mode.

Pure functions of the window lengths (no tokens, no tensors). The plan, and with it the meaning of
"the first k batches" for a resumed run, is a deterministic function of (lengths, mode, ctx, batch size).

padded    one window per row; rows of ctx tokens, batch_size rows; windows longest first.
bucketed  one window per row; a row is as long as the smallest bucket that holds its window (powers of two
          and 1.5 x powers of two, up to ctx), and a batch has batch_size * ctx // bucket rows, so that
          tokens per batch stay about the same. One shape per bucket.
packed    several windows per row of ctx tokens (best-fit decreasing), batch_size rows. The model gets
          position ids that restart at every window and document ids that keep attention inside each window
          (distinct windows of one long document get distinct ids: each reads only its own context):

              columns        0 1 2 3 4 5 6 7 8 9
              row 0          a a a a a b b b . .      a, b, c: windows;  . : padding
              position ids   0 1 2 3 4 0 1 2 0 0
              document ids   0 0 0 0 0 1 1 1 -1 -1
              row 1          c c c c c c c c c c
"""
from __future__ import annotations

from bisect import bisect_left, insort
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..errors import FastpplError

BATCHING_MODES = ("packed", "bucketed", "padded")
SMALLEST_BUCKET = 64   # shorter windows share the 64 bucket: a few padded tokens are cheaper than a shape


@dataclass(frozen=True)
class BatchPlan:
    n_rows: int
    seq_len: int
    windows: np.ndarray    # (n,) int64: indices into the run's window list
    rows: np.ndarray       # (n,) int64: row of each window
    columns: np.ndarray    # (n,) int64: column of each window's first token
    packed: bool           # rows may hold several windows: pass position ids and document ids


def best_fit_decreasing(lengths: Sequence[int], capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """(row, column) of each item, packing items into rows of `capacity`: longest items first, each into
    the open row with the least free space that still holds it, else into a new row. Items of equal length
    keep their input order, so the result is deterministic. O(n log n + n * distinct free sizes)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    assert lengths.size == 0 or (lengths.min() >= 1 and lengths.max() <= capacity), "item outside 1..capacity"
    row_of = np.empty(len(lengths), dtype=np.int64)
    column_of = np.empty(len(lengths), dtype=np.int64)
    free_sizes: list[int] = []                 # sorted distinct free space of open rows (all > 0)
    rows_by_free: dict[int, list[int]] = {}    # free space -> rows with exactly that much free
    used: list[int] = []                       # tokens used in each row
    for item in np.argsort(-lengths, kind="stable"):
        size = int(lengths[item])
        k = bisect_left(free_sizes, size)
        if k < len(free_sizes):
            free = free_sizes[k]
            rows = rows_by_free[free]
            row = rows.pop()
            if not rows:
                del rows_by_free[free]
                free_sizes.pop(k)
        else:
            row, free = len(used), capacity
            used.append(0)
        row_of[item], column_of[item] = row, used[row]
        used[row] += size
        left = free - size
        if left > 0:
            if left not in rows_by_free:
                insort(free_sizes, left)
                rows_by_free[left] = []
            rows_by_free[left].append(row)
    return row_of, column_of


def bucket_lengths(ctx: int, smallest: int = SMALLEST_BUCKET) -> list[int]:
    """Row lengths of the bucketed mode, ascending: 2^k and 3 * 2^(k-1) from `smallest` up, and ctx.
    bucket_lengths(1024) == [64, 96, 128, 192, 256, 384, 512, 768, 1024]."""
    smallest = min(smallest, ctx)
    lengths = {ctx}
    power = 2
    while power < ctx:
        lengths.update(b for b in (power, power * 3 // 2) if smallest <= b < ctx)
        power *= 2
    return sorted(lengths)


def _one_window_per_row(windows: np.ndarray, seq_len: int, rows_per_batch: int) -> list[BatchPlan]:
    plans = []
    for begin in range(0, len(windows), rows_per_batch):
        chunk = windows[begin:begin + rows_per_batch]
        plans.append(BatchPlan(rows_per_batch, seq_len, chunk, np.arange(len(chunk), dtype=np.int64),
                               np.zeros(len(chunk), dtype=np.int64), packed=False))
    return plans


def plan_batches(lengths: Sequence[int], mode: str, ctx: int, batch_size: int) -> list[BatchPlan]:
    """The batches of a run, in the order they are scored; every window is in exactly one of them.
    Longest rows come first, so that the largest shape (and any out-of-memory error) shows at once."""
    assert mode in BATCHING_MODES and batch_size >= 1
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.size == 0:
        return []
    assert lengths.min() >= 1 and lengths.max() <= ctx
    longest_first = np.argsort(-lengths, kind="stable")
    if mode == "padded":
        return _one_window_per_row(longest_first, ctx, min(batch_size, len(lengths)))
    if mode == "bucketed":
        buckets = np.asarray(bucket_lengths(ctx))
        bucket_of = np.searchsorted(buckets, lengths, side="left")   # smallest bucket >= length
        plans = []
        for b in range(len(buckets) - 1, -1, -1):
            members = longest_first[bucket_of[longest_first] == b]
            if len(members):
                rows = max(1, batch_size * ctx // int(buckets[b]))
                plans.extend(_one_window_per_row(members, int(buckets[b]), min(rows, len(members))))
        return plans
    row_of, column_of = best_fit_decreasing(lengths, ctx)
    n_rows = int(row_of.max()) + 1
    rows_per_batch = min(batch_size, n_rows)
    order = np.lexsort((column_of, row_of))             # by row, then column
    batch_of = row_of[order] // rows_per_batch
    plans = []
    for chunk in np.split(order, np.flatnonzero(np.diff(batch_of)) + 1):
        first_row = row_of[chunk[0]] // rows_per_batch * rows_per_batch
        plans.append(BatchPlan(rows_per_batch, ctx, chunk, row_of[chunk] - first_row, column_of[chunk], packed=True))
    return plans


def padding_waste(plans: Sequence[BatchPlan], lengths: Sequence[int]) -> float:
    """Padded tokens / real tokens: every slot of every batch counts, including whole padding rows."""
    real = int(np.sum(lengths))
    slots = sum(p.n_rows * p.seq_len for p in plans)
    return (slots - real) / real if real else 0.0


def padding_waste_by_mode(lengths: Sequence[int], ctx: int, batch_size: int) -> dict[str, float]:
    return {mode: padding_waste(plan_batches(lengths, mode, ctx, batch_size), lengths) for mode in BATCHING_MODES}


def resolve_batching(setting: str, n_documents: int, takes_document_ids: bool,
                     varlen: bool = False, compiles: bool = False) -> tuple[str, str]:
    """(mode, why) for --batching auto|packed|bucketed|padded. n_documents: documents with something to score;
    varlen: whether packed rows would run through variable-length flash attention on this device and dtype
    (fastppl.models.attention.varlen_available); compiles: whether the run compiles its scorer, which packed
    rows would forgo (they run eager), so auto packs only runs that do not compile.

    auto: one document -> padded (its windows are full rows but the last, and plain causal attention runs the
    fastest kernels); several -> packed where varlen runs it (a flash kernel over the real tokens only, no
    padding to pay for), else bucketed: on the H200 bucketed scored the 10,000-document bench corpus at
    1.12 M tokens/s against packed-with-FlexAttention's 0.90 M, because plain causal
    SDPA on a few padded shapes beats FlexAttention's document masks on full rows despite 19 % padding."""
    if setting == "packed" and not takes_document_ids:
        raise FastpplError("--batching packed needs a model whose forward takes document_ids (the native "
                           "backend); use --batching bucketed with this model")
    if setting != "auto":
        return setting, f"{setting} (--batching {setting})"
    if n_documents <= 1:
        return "padded", "padded (auto: one document)"
    if varlen and takes_document_ids and compiles:
        return "bucketed", "bucketed (auto: several documents; this run compiles, and packed rows run eager)"
    if varlen and takes_document_ids:
        return "packed", "packed (auto: several documents; variable-length flash attention)"
    return "bucketed", ("bucketed (auto: several documents; no variable-length flash attention here, and packed "
                        "rows without it were slower on the H200)")


def split_rows(plan: BatchPlan, max_rows: int) -> list[BatchPlan]:
    """plan cut into batches of at most max_rows rows (rows keep their windows and columns): what an
    out-of-memory back-off scores instead of plan. Empty parts are dropped."""
    parts = []
    for first_row in range(0, plan.n_rows, max_rows):
        keep = (plan.rows >= first_row) & (plan.rows < first_row + max_rows)
        if keep.any():
            parts.append(BatchPlan(n_rows=min(max_rows, plan.n_rows - first_row), seq_len=plan.seq_len,
                                   windows=plan.windows[keep], rows=plan.rows[keep] - first_row,
                                   columns=plan.columns[keep], packed=plan.packed))
    return parts
