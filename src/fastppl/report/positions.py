"""The loss by position that long-context papers plot: the NLL summed over log-spaced buckets of window positions, so
that a window of 128k positions is a few dozen points, each the sum of many tokens, rather than 128k noisy ones.

Buckets are counted in tokens read (position + 1): the first eight positions are buckets of their own (the loss falls
fastest there), after which each doubling of the context is cut into BUCKETS_PER_OCTAVE buckets. With ctx 20:

    tokens read   1 2 3 4 5 6 7 8 | 9-10 | 11 | 12-13 | 14-16 | 17-19 | 20
    positions     0 1 2 3 4 5 6 7 | 8-9  | 10 | 11-12 | 13-15 | 16-18 | 19
"""
from __future__ import annotations

import math
from typing import Optional

import numpy as np

BUCKETS_PER_OCTAVE = 4


def position_bucket_edges(ctx: int, per_octave: int = BUCKETS_PER_OCTAVE) -> list[int]:
    """Window positions 0 .. ctx-1 cut at the returned edges (first 0, last ctx): bucket k holds positions
    [edges[k], edges[k+1]). The cuts fall where round(2 ** (j / per_octave)) tokens have been read."""
    assert ctx >= 1 and per_octave >= 1
    edges, j = [0], 0
    while edges[-1] < ctx:
        tokens_read = round(2 ** (j / per_octave))
        j += 1
        if tokens_read > edges[-1]:
            edges.append(min(tokens_read, ctx))
    return edges


def loss_by_position_buckets(position_nll_sum: np.ndarray, position_count: np.ndarray,
                             per_octave: int = BUCKETS_PER_OCTAVE) -> list[dict]:
    """Each bucket of window positions: its positions [start, stop), the tokens scored there, their NLL sum (float64,
    the run's own sums added up) and mean NLL (None where nothing was scored)."""
    assert len(position_nll_sum) == len(position_count)
    buckets = []
    edges = position_bucket_edges(len(position_nll_sum), per_octave)
    for start, stop in zip(edges[:-1], edges[1:]):
        tokens = int(np.asarray(position_count[start:stop], dtype=np.float64).sum())
        nll_sum = float(np.asarray(position_nll_sum[start:stop], dtype=np.float64).sum())
        buckets.append({"positions": [start, stop], "tokens": tokens, "nll_sum": nll_sum,
                        "nll": nll_sum / tokens if tokens else None})
    return buckets


def bucket_centre(bucket: dict) -> float:
    """Where a bucket sits on a log axis of tokens read: the geometric mean of its first and last."""
    start, stop = bucket["positions"]
    return math.sqrt((start + 1) * stop)


def bucket_means(buckets: Optional[list[dict]]) -> tuple[list[float], list[float]]:
    """(x, mean NLL) of the buckets that scored something, for a plot."""
    scored = [b for b in buckets or [] if b.get("tokens")]
    return [bucket_centre(b) for b in scored], [b["nll_sum"] / b["tokens"] for b in scored]
