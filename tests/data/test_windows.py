"""fastppl.data.windows: golden cases (the docstring's worked examples, edge cases) and exhaustive
property checks against brute-force restatements of lm-evaluation-harness and the HF guide."""
from collections import Counter

import pytest

from fastppl.data.windows import Window, chunked_windows, sliding_windows
from fixtures.window_references import hf_guide_pairs, lm_eval_rolling_pairs, window_pairs


# ---------------------------------------------------------------------------------------- golden
def test_chunked_docstring_example():
    # 7 tokens, ctx 3: stream [B t0 .. t6]; the last window is right-aligned and scores t6 only
    assert chunked_windows(7, 3) == [Window(0, 3, 0), Window(3, 3, 0), Window(4, 3, 2)]


def test_sliding_docstring_example():
    # 7 tokens, no BOS, ctx 4, stride 2
    assert sliding_windows(7, 4, 2) == [Window(0, 3, 0), Window(2, 3, 1), Window(4, 2, 1)]


@pytest.mark.parametrize("n_tokens, ctx, expected", [
    (0, 4, []),                                              # nothing to score
    (1, 4, [Window(0, 1, 0)]),                               # B -> t0
    (2, 4, [Window(0, 2, 0)]),                               # n < ctx: one short window
    (3, 3, [Window(0, 3, 0)]),                               # n == ctx
    (4, 3, [Window(0, 3, 0), Window(1, 3, 2)]),              # n == ctx + 1: right-aligned tail of 1
    (6, 3, [Window(0, 3, 0), Window(3, 3, 0)]),              # ctx divides n: no overlap
    (3, 1, [Window(0, 1, 0), Window(1, 1, 0), Window(2, 1, 0)]),  # ctx 1: bigram conditioning
])
def test_chunked_golden(n_tokens, ctx, expected):
    assert chunked_windows(n_tokens, ctx) == expected


@pytest.mark.parametrize("n_stream, ctx, stride, expected", [
    (0, 4, 2, []),
    (1, 4, 2, []),                                           # one token: nothing to predict it from
    (2, 4, 2, [Window(0, 1, 0)]),                            # s0 -> s1
    (3, 8, 4, [Window(0, 2, 0)]),                            # n < ctx
    (4, 4, 2, [Window(0, 3, 0)]),                            # n == ctx
    (5, 4, 2, [Window(0, 3, 0), Window(2, 2, 1)]),           # n == ctx + 1
    # stride == ctx: the guide's windows do not overlap, so each window's first token (s0, s3, s6)
    # has no context inside its window and is never scored
    (7, 3, 3, [Window(0, 2, 0), Window(3, 2, 0)]),
    (5, 3, 1, [Window(0, 2, 0), Window(1, 2, 1), Window(2, 2, 1)]),   # stride 1
])
def test_sliding_golden(n_stream, ctx, stride, expected):
    assert sliding_windows(n_stream, ctx, stride) == expected


def test_window_scored_targets():
    w = Window(start=4, length=3, score_from=2)   # reads s4 s5 s6, scores the prediction of s7
    assert w.n_scored == 1 and list(w.scored_targets()) == [7]


# ------------------------------------------------------------------------------------ properties
CHUNKED_CASES = [(n, ctx) for n in range(0, 41) for ctx in range(1, 13)] + [
    (n, ctx) for n in (255, 256, 257, 1000, 1023, 1024, 1025) for ctx in (1, 7, 64, 256, 1024)]
SLIDING_CASES = [(n, ctx, stride) for n in range(0, 41) for ctx in range(2, 13) for stride in range(1, ctx + 1)] + [
    (n, ctx, stride) for n in (255, 256, 257, 1025) for ctx in (64, 256) for stride in (1, 31, ctx // 2, ctx)]


def _check_window_shape(w: Window, ctx: int, n_stream: int) -> None:
    assert 1 <= w.length <= ctx
    assert 0 <= w.score_from < w.length
    assert w.start >= 0 and w.start + w.length < n_stream   # the last read token still has a target


def test_chunked_properties():
    for n, ctx in CHUNKED_CASES:
        windows = chunked_windows(n, ctx)
        for w in windows:
            _check_window_shape(w, ctx, n + 1)
        # every token t_k (stream index k + 1) is scored exactly once
        counts = Counter(j for w in windows for j in w.scored_targets())
        assert sorted(counts) == list(range(1, n + 1)) and set(counts.values()) <= {1}, (n, ctx)
        if n == 0:
            assert windows == []
            continue
        # windows come in order, each reads min(ctx, n) tokens; all but the last score everything
        assert all(w.length == min(ctx, n) for w in windows), (n, ctx)
        assert all(w.score_from == 0 for w in windows[:-1]), (n, ctx)
        assert windows[0].start == 0                          # the first is conditioned on BOS
        last = windows[-1]
        assert last.start + last.length == n                  # right-aligned: reads up to t_{n-2}
        assert last.n_scored == n - ctx * (len(windows) - 1) if n > ctx else last.n_scored == n
        # the same (context, target) pairs as lm-evaluation-harness loglikelihood_rolling
        assert window_pairs(windows) == lm_eval_rolling_pairs(n, ctx), (n, ctx)


def test_sliding_properties():
    for n, ctx, stride in SLIDING_CASES:
        windows = sliding_windows(n, ctx, stride)
        for w in windows:
            _check_window_shape(w, ctx, n)
        pairs = window_pairs(windows)
        # exactly the HF guide's (context, target) pairs, in the same order
        assert pairs == hf_guide_pairs(n, ctx, stride), (n, ctx, stride)
        targets = [j for _, j in pairs]
        assert len(targets) == len(set(targets)), (n, ctx, stride)      # nothing scored twice
        # what is scored: all but s0 with overlapping windows; with stride == ctx the windows
        # do not overlap and each window's first token is lost too
        unscored = {0} | ({k for k in range(ctx, n, ctx)} if stride == ctx else set())
        assert set(targets) == set(range(n)) - unscored, (n, ctx, stride)
        for start, j in pairs:
            context = j - start                         # target j is predicted from s[start:j]
            assert context <= ctx - 1                   # the guide's window of ctx holds the target
            assert context >= min(j, ctx - stride)      # at least ctx - S tokens once available


def test_sliding_with_bos_scores_every_token():
    # with --bos the stream is [BOS] + tokens: stream index 0 is BOS, so every token is a target
    for n_tokens in range(1, 30):
        for ctx, stride in ((4, 2), (5, 1), (8, 7)):
            targets = [j for w in sliding_windows(n_tokens + 1, ctx, stride) for j in w.scored_targets()]
            assert targets == list(range(1, n_tokens + 1))


def test_contract_is_asserted():
    with pytest.raises(AssertionError):
        sliding_windows(10, 4, 5)        # stride > ctx would skip tokens silently
    with pytest.raises(AssertionError):
        sliding_windows(10, 4, 0)
    with pytest.raises(AssertionError):
        chunked_windows(10, 0)
