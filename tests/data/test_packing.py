"""Batch plans (pure): the packer, buckets, padding waste, the batch arrays of a plan, the synthetic corpus."""
import numpy as np
import pytest

from fastppl.data.batching import WindowRef, batch_from_plan, document_segments, make_batch
from fastppl.data.packing import (
    BATCHING_MODES, best_fit_decreasing, bucket_lengths, padding_waste, padding_waste_by_mode, plan_batches,
    resolve_batching,
)
from fastppl.data.synthetic import synthetic_document_lengths, synthetic_documents
from fastppl.data.windows import Window, chunked_windows, sliding_windows
from fastppl.errors import FastpplError


def _check_rows(lengths, row_of, column_of, capacity):
    """Every item in one row, inside the row, overlapping no other item."""
    occupied = {}
    for item, (row, column) in enumerate(zip(row_of, column_of)):
        assert 0 <= column and column + lengths[item] <= capacity
        for c in range(column, column + lengths[item]):
            assert (row, c) not in occupied, f"items {occupied[(row, c)]} and {item} overlap"
            occupied[(row, c)] = item
    assert sorted(set(row_of)) == list(range(max(row_of) + 1))   # rows are numbered without gaps


def test_best_fit_decreasing_golden():
    # longest first: 6 -> row 0; 5 -> new row 1; 4 fits row 0 exactly (free 4 < 5); 3, 2 fill row 1
    row_of, column_of = best_fit_decreasing([5, 3, 4, 2, 6], 10)
    assert row_of.tolist() == [1, 1, 0, 1, 0]
    assert column_of.tolist() == [0, 5, 6, 8, 0]


@pytest.mark.parametrize("seed", range(5))
def test_best_fit_decreasing_places_every_item_once(seed):
    rng = np.random.default_rng(seed)
    capacity = int(rng.integers(8, 64))
    lengths = rng.integers(1, capacity + 1, size=int(rng.integers(1, 200))).tolist()
    row_of, column_of = best_fit_decreasing(lengths, capacity)
    _check_rows(lengths, row_of, column_of, capacity)
    # best fit decreasing never needs more than 11/9 OPT + 1 rows; OPT >= ceil(sum / capacity)
    assert max(row_of) + 1 <= 11 / 9 * -(-sum(lengths) // capacity) + 1 + 1e-9
    again = best_fit_decreasing(lengths, capacity)
    assert np.array_equal(again[0], row_of) and np.array_equal(again[1], column_of)


def test_bucket_lengths():
    assert bucket_lengths(1024) == [64, 96, 128, 192, 256, 384, 512, 768, 1024]
    assert bucket_lengths(100) == [64, 96, 100]
    assert bucket_lengths(32) == [32]


@pytest.mark.parametrize("mode", BATCHING_MODES)
@pytest.mark.parametrize("seed", range(3))
def test_plan_batches_covers_every_window_once(mode, seed):
    rng = np.random.default_rng(seed)
    ctx, batch_size = 256, 4
    lengths = rng.integers(1, ctx + 1, size=150)
    plans = plan_batches(lengths, mode, ctx, batch_size)
    seen = np.concatenate([p.windows for p in plans])
    assert sorted(seen.tolist()) == list(range(len(lengths)))
    for p in plans:
        assert p.packed == (mode == "packed")
        assert (p.rows < p.n_rows).all()
        assert p.n_rows * p.seq_len <= batch_size * ctx          # tokens per batch never grow
        occupied = np.zeros((p.n_rows, p.seq_len), dtype=int)
        for w, r, c in zip(p.windows, p.rows, p.columns):
            assert c + lengths[w] <= p.seq_len
            occupied[r, c:c + lengths[w]] += 1
        assert occupied.max() <= 1
        if mode != "packed":
            assert (np.bincount(p.rows) == 1).all() and (p.columns == 0).all()
        if mode == "padded":
            assert p.seq_len == ctx and p.n_rows == batch_size
        if mode == "bucketed":   # the smallest bucket that holds the window
            buckets = bucket_lengths(ctx)
            assert all(min(b for b in buckets if b >= lengths[w]) == p.seq_len for w in p.windows)
    # longest rows first: the first batch has the largest shape and the longest window
    assert plans[0].seq_len == max(p.seq_len for p in plans)
    assert lengths[plans[0].windows].max() == lengths.max()


def test_plan_batches_is_deterministic_and_takes_few_rows_for_few_windows():
    lengths = [3, 9, 3, 7, 1]
    for mode in BATCHING_MODES:
        a, b = plan_batches(lengths, mode, 16, 8), plan_batches(lengths, mode, 16, 8)
        assert [p.windows.tolist() for p in a] == [p.windows.tolist() for p in b]
    assert plan_batches(lengths, "padded", 16, 8)[0].n_rows == 5
    packed = plan_batches(lengths, "packed", 16, 8)
    assert len(packed) == 1 and packed[0].n_rows == 2         # 23 tokens in two rows of 16
    assert plan_batches([], "packed", 16, 8) == []


def test_padding_waste_golden():
    assert padding_waste(plan_batches([10, 5], "padded", 10, 2), [10, 5]) == pytest.approx(5 / 15)
    assert padding_waste(plan_batches([5, 5], "packed", 10, 2), [5, 5]) == 0.0
    assert padding_waste(plan_batches([5, 5], "padded", 10, 2), [5, 5]) == 1.0
    # whole padding rows of the last batch are waste too: 3 windows of 10 in batches of 2 rows
    assert padding_waste(plan_batches([10, 10, 10], "padded", 10, 2), [10] * 3) == pytest.approx(1 / 3)


def test_resolve_batching():
    assert resolve_batching("auto", 1, True)[0] == "padded"
    assert resolve_batching("auto", 5, True)[0] == "bucketed"   # measured faster than packed on the H200
    # with variable-length flash attention packed rows run at (almost) dense speed without padding
    assert resolve_batching("auto", 5, True, varlen=True)[0] == "packed"
    mode, why = resolve_batching("auto", 5, True, varlen=True, compiles=True)   # packed rows would run eager
    assert mode == "bucketed" and "compiles" in why
    assert "compiles" not in resolve_batching("auto", 5, False, varlen=True, compiles=True)[1]
    assert resolve_batching("auto", 1, True, varlen=True)[0] == "padded"
    assert resolve_batching("auto", 5, False, varlen=True)[0] == "bucketed"   # the model cannot take them
    assert resolve_batching("packed", 5, True)[0] == "packed"
    assert resolve_batching("auto", 5, False)[0] == "bucketed"
    assert resolve_batching("bucketed", 5, True)[0] == "bucketed"
    with pytest.raises(FastpplError, match="document_ids"):
        resolve_batching("packed", 5, False)


def test_packed_batch_positions_restart_and_documents_stay_apart():
    streams = [np.arange(100, 106), np.arange(200, 204), np.arange(300, 312)]   # BOS-less toy streams
    refs = [WindowRef(0, Window(0, 5, 0)), WindowRef(1, Window(0, 3, 0)),
            WindowRef(2, Window(0, 6, 0)), WindowRef(2, Window(5, 6, 1))]
    offsets = [1, 50, 80]
    plans = plan_batches([r.window.length for r in refs], "packed", 12, 2)   # rows: 6 + 6, 5 + 3
    assert len(plans) == 1
    batch = batch_from_plan(plans[0], refs, streams, offsets)
    padded = make_batch(refs, streams, offsets, len(refs), 12)
    for slot, (w, row, column) in enumerate(zip(plans[0].windows, plans[0].rows, plans[0].columns)):
        span = slice(column, column + refs[w].window.length)
        length = refs[w].window.length
        assert batch.position_ids[row, span].tolist() == list(range(length))
        assert (batch.document_ids[row, span] == slot).all()
        # the same tokens, targets, mask and token indices as the window's own padded row
        for name in ("input_ids", "targets", "score_mask", "token_index", "target_document"):
            assert np.array_equal(getattr(batch, name)[row, span], getattr(padded, name)[w, :length]), name
    # two windows of one document are two attention spans, and padding is a span of its own
    assert len(set(batch.document_ids[batch.document_ids >= 0].tolist())) == 4
    assert (batch.document_ids == -1).sum() == 2 * 12 - 20
    assert batch.n_scored == padded.n_scored == 5 + 3 + 6 + 5
    assert padded.position_ids is None and padded.document_ids is None


def _segments_brute_force(document_ids):
    """(cu_seqlens, max_seqlen) by walking every row token by token."""
    starts = []
    B, T = document_ids.shape
    for row in range(B):
        for column in range(T):
            if column == 0 or document_ids[row, column] != document_ids[row, column - 1]:
                starts.append(row * T + column)
    cu = starts + [B * T]
    return cu, max(b - a for a, b in zip(cu, cu[1:]))


def test_document_segments_golden():
    ids = np.array([[0, 0, 0, 1, 1, -1, -1], [2] * 7])
    cu_seqlens, max_seqlen = document_segments(ids)
    assert cu_seqlens.dtype == np.int32 and cu_seqlens.tolist() == [0, 3, 5, 7, 14] and max_seqlen == 7
    # whole padding rows are one segment each, never one across rows
    cu_seqlens, max_seqlen = document_segments(np.array([[0, 1, 1, -1], [-1] * 4, [-1] * 4]))
    assert cu_seqlens.tolist() == [0, 1, 3, 4, 8, 12] and max_seqlen == 4


@pytest.mark.parametrize("seed", range(6))
def test_packed_batch_segments_match_a_brute_force(seed):
    """Single-token documents, documents that fill a row exactly, end-of-row padding and padding rows."""
    rng = np.random.default_rng(seed)
    ctx, batch_size = 24, 3
    lengths = rng.integers(1, ctx + 1, size=int(rng.integers(1, 30))).tolist() + [1, 1, ctx, 10, 14]
    streams = [np.arange(n + 1) for n in lengths]
    refs = [WindowRef(d, Window(0, n, 0)) for d, n in enumerate(lengths)]
    for plan in plan_batches(lengths, "packed", ctx, batch_size):
        batch = batch_from_plan(plan, refs, streams, [0] * len(streams))
        cu_seqlens, max_seqlen = _segments_brute_force(batch.document_ids)
        assert batch.cu_seqlens.tolist() == cu_seqlens and batch.max_seqlen == max_seqlen
        assert batch.cu_seqlens.dtype == np.int32 and batch.cu_seqlens[-1] == plan.n_rows * ctx
        # every window is exactly one segment, and every other segment is padding
        segments = {(int(a), int(b)) for a, b in zip(batch.cu_seqlens[:-1], batch.cu_seqlens[1:])}
        windows = {(int(r) * ctx + int(c), int(r) * ctx + int(c) + lengths[w])
                   for w, r, c in zip(plan.windows, plan.rows, plan.columns)}
        assert windows <= segments
        assert all((batch.document_ids.reshape(-1)[a:b] == -1).all() for a, b in segments - windows)
    padded = batch_from_plan(plan_batches(lengths, "padded", ctx, batch_size)[0], refs, streams, [0] * len(streams))
    assert padded.cu_seqlens is None and padded.max_seqlen is None


def test_synthetic_corpus_is_seeded_and_log_uniform():
    lengths = synthetic_document_lengths()
    assert len(lengths) == 10_000 and lengths.min() == 20 and lengths.max() == 1500
    # log-uniform: the median is near the geometric mean of the ends, sqrt(20 * 1500) = 173
    assert 160 < np.median(lengths) < 186
    assert np.array_equal(lengths, synthetic_document_lengths(seed=0))
    assert not np.array_equal(lengths, synthetic_document_lengths(seed=1))
    docs = synthetic_documents(n_documents=50, vocab_size=1000, seed=3)
    assert [len(d) for d in docs] == synthetic_document_lengths(50, seed=3).tolist()
    assert all(d.min() >= 0 and d.max() < 1000 for d in docs)


def test_synthetic_corpus_padding_waste_by_mode():
    """The bench corpus through the three modes (chunked windows with BOS, ctx 1024, 64 rows): packing
    wastes under 2 % (the target), padding to ctx more than the real tokens."""
    windows = [w.length for n in synthetic_document_lengths() for w in chunked_windows(int(n), 1024)]
    waste = padding_waste_by_mode(windows, 1024, 64)
    assert waste["packed"] < 0.02 < waste["bucketed"] < 0.5 < 1.0 < waste["padded"]


def test_sliding_windows_plan_like_chunked():
    lengths = [w.length for n in (5, 40, 70) for w in sliding_windows(n, 32, 8)]
    for mode in BATCHING_MODES:
        plans = plan_batches(lengths, mode, 32, 3)
        assert sorted(np.concatenate([p.windows for p in plans]).tolist()) == list(range(len(lengths)))
