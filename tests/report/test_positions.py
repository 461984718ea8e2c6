"""Loss by log-spaced buckets of window positions: the edges, the sums against the per-token dump's, the figure."""
import importlib.util
import json
import math

import numpy as np
import pytest

from fastppl.cli import main
from fastppl.data.corpus import load_documents
from fastppl.data.tokenize import load_tokenizer
from fastppl.data.windows import chunked_windows, sliding_windows
from fastppl.report.positions import bucket_means, loss_by_position_buckets, position_bucket_edges

needs_matplotlib = pytest.mark.skipif(
    importlib.util.find_spec("matplotlib") is None, reason="matplotlib is not installed")


def test_the_first_eight_positions_are_buckets_of_their_own_then_four_an_octave():
    assert position_bucket_edges(20) == [0, 1, 2, 3, 4, 5, 6, 7, 8, 10, 11, 13, 16, 19, 20]
    assert position_bucket_edges(1) == [0, 1]
    assert position_bucket_edges(8) == [0, 1, 2, 3, 4, 5, 6, 7, 8]
    long = position_bucket_edges(131072)
    assert long[0] == 0 and long[-1] == 131072 and all(a < b for a, b in zip(long, long[1:]))
    for octave in range(3, 17):   # from 8 tokens read on, four buckets in each doubling of the context
        assert sum(1 for e in long if 2 ** octave <= e < 2 ** (octave + 1)) == 4, octave
    assert len(long) - 1 == 64
    assert position_bucket_edges(2, per_octave=1) == [0, 1, 2]


def test_buckets_sum_their_positions_and_divide_once():
    nll_sum = np.array([3.0, 2.0, 1.5, 0.0, 4.0, 1.0, 2.0, 2.0, 1.0, 3.0])
    count = np.array([1, 1, 1, 0, 2, 1, 1, 1, 1, 2], dtype=np.float64)
    buckets = loss_by_position_buckets(nll_sum, count)
    assert [b["positions"] for b in buckets] == [[p, p + 1] for p in range(8)] + [[8, 10]]
    assert buckets[3] == {"positions": [3, 4], "tokens": 0, "nll_sum": 0.0, "nll": None}
    assert buckets[-1] == {"positions": [8, 10], "tokens": 3, "nll_sum": 4.0, "nll": 4.0 / 3}
    x, means = bucket_means(buckets)
    assert len(x) == 8 and means[-1] == 4.0 / 3 and x[-1] == math.sqrt(9 * 10)   # tokens read 9 .. 10


def _window_positions(token_counts, window, ctx, stride=None):
    """(n_tokens,) window position at which each corpus token is scored, -1 if none: window position p predicts
    stream index start + p + 1 (fastppl.data.windows)."""
    positions = np.full(sum(token_counts), -1, dtype=np.int64)
    offset, has_bos = 0, window == "chunked"
    for n in token_counts:
        windows = chunked_windows(n, ctx) if window == "chunked" else sliding_windows(n + has_bos, ctx, stride)
        for w in windows:
            for p in range(w.score_from, w.length):
                positions[offset + w.start + p + 1 - has_bos] = p
        offset += n
    return positions


@pytest.mark.parametrize("window_args", [["--window", "chunked", "--batch-size", "3"],
                                         pytest.param(["--window", "sliding", "--stride", "24", "--batch-size", "5"],
                                                      marks=pytest.mark.slow)],
                         ids=["chunked", "sliding-stride24"])
def test_bucket_sums_equal_the_per_token_dumps_grouped_sums(tmp_path, tokenizer_dir, window_args):
    lines = ["To be, or not to be, that is the question:", "Whether 'tis nobler in the mind to suffer " * 9,
             "The slings and arrows of outrageous fortune, " * 14, "Against a sea " * 40]
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in lines))
    ctx, out, dump = 48, tmp_path / "r.json", tmp_path / "t.npy"
    rc = main(["eval", "--model", "random:gpt2-tiny", "--tokenizer", str(tokenizer_dir), "--data", str(data),
               "--ctx", str(ctx), "--device", "cpu", "--quiet", "--json", str(out), "--per-token", str(dump),
               *window_args])
    assert rc == 0
    buckets = json.loads(out.read_text())["nll_by_position_buckets"]
    per_token = np.load(dump)
    tokenizer = load_tokenizer(str(tokenizer_dir))
    counts = [len(tokenizer.encode(d.text)) for d in load_documents(str(data))]
    positions = _window_positions(counts, window_args[1], ctx, stride=24)
    assert np.array_equal(positions >= 0, ~np.isnan(per_token))
    assert [b["positions"] for b in buckets] == [[a, b] for a, b in zip(position_bucket_edges(ctx),
                                                                          position_bucket_edges(ctx)[1:])]
    for bucket in buckets:
        start, stop = bucket["positions"]
        inside = per_token[(positions >= start) & (positions < stop)]
        assert bucket["tokens"] == inside.size
        # fp32 token NLLs summed in float64 are exact at these counts, in any order: equal, not close
        assert bucket["nll_sum"] == math.fsum(inside.astype(np.float64).tolist()), bucket
    assert sum(b["tokens"] for b in buckets) == np.count_nonzero(positions >= 0)


def _figure_lines(figure):
    return [line.get_label() for axes in figure.axes for line in axes.get_lines()]


@needs_matplotlib
def test_the_figure_draws_the_buckets_and_a_long_windows_positions_faintly():
    from fastppl.report.plot import MANY_POSITIONS, loss_by_position_figure
    ctx = MANY_POSITIONS * 4
    rng = np.random.default_rng(0)
    nll_sum, count = rng.uniform(2, 4, ctx), np.ones(ctx)
    result = {"nll": 3.0, "ppl": math.exp(3.0), "nll_by_position": list(nll_sum),
              "nll_by_position_buckets": loss_by_position_buckets(nll_sum, count)}
    figure = loss_by_position_figure(result)
    lines = {line.get_label(): line for line in figure.axes[0].get_lines()}
    per_position = lines["this run: mean NLL by position"]
    by_bucket = lines["this run: mean NLL by log-spaced bucket of positions"]
    assert per_position.get_alpha() < 1 and len(by_bucket.get_xdata()) == len(position_bucket_edges(ctx)) - 1
    del result["nll_by_position"]   # a report of buckets alone is drawn too
    assert "this run: mean NLL by log-spaced bucket of positions" in _figure_lines(loss_by_position_figure(result))
