"""Error bars: the standard error of the mean NLL from the run's sums, and percentile bootstrap intervals over
units of the corpus (its documents, or the windows of a single document), for one run or the paired
difference of two runs.

The standard error treats the scored tokens as independent draws, as llama.cpp's `PPL = x ± y` does:

    se(nll) = sqrt((Σx²/n - (Σx/n)²) / (n - 1))      (= the sample standard deviation / sqrt(n))
    se(ppl) = ppl · se(nll)                           (the delta method: d exp(m) = exp(m) dm)

Tokens of one document are not independent, so the bootstrap resamples whole units instead: each resample
draws as many units as there are, with replacement, and its statistic is a ratio of sums (Σ nll_sum / Σ tokens),
as the run's own figure is. The interval is the 2.5 and 97.5 percentiles over the resamples, which are drawn
and reduced a block at a time: only the values of each tail that a percentile reads are kept (TailPercentiles),
so that memory grows with 5 % of the resamples (under 1 byte a resample and statistic), not with all of them."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator, Optional

import numpy as np

from ..config import MIN_BOOTSTRAP
from ..errors import FastpplError
from .metrics import perplexity

if TYPE_CHECKING:   # compare reads reports with this module and needs no torch
    from ..data.corpus import Document
    from ..data.streams import WindowPlan
    from ..data.tokenize import Tokenizer
    from ..engine.score import DeviceSums

LEVEL = 0.95
# index draws held in memory at once: resamples are drawn in blocks of about this many
DRAW_BLOCK = 1 << 22
# index draws of one bootstrap at most (resamples x units): 20 to 50 million a second on one core
MAX_DRAWS = 10**9


def mean_standard_error(nll_sum: float, nll_sq_sum: float, n: int) -> float:
    """The standard error of the mean of n values from their sum and sum of squares (NaN below 2 values)."""
    if n < 2:
        return math.nan
    mean = nll_sum / n
    # float64 rounding can make a near-constant sample's variance slightly negative
    return math.sqrt(max(nll_sq_sum / n - mean * mean, 0.0) / (n - 1))


def standard_errors(nll_sum: float, nll_sq_sum: float, n_scored: int, n_bytes: int) -> dict:
    """The standard errors of nll, ppl (delta method) and bits per byte (bytes held fixed)."""
    se = mean_standard_error(nll_sum, nll_sq_sum, n_scored)
    try:
        ppl_se = math.exp(nll_sum / n_scored) * se
    except OverflowError:
        ppl_se = math.inf
    return {"nll_stderr": se, "ppl_stderr": ppl_se,
            "bits_per_byte_stderr": se * n_scored / math.log(2) / n_bytes if n_bytes else math.nan}


@dataclass
class Units:
    """What the bootstrap resamples: one entry per unit (a document, or a window of a single document)."""
    kind: str              # "document" or "window"
    index: np.ndarray      # (k,) int64: the document's index in the corpus, or the window's in the document
    nll_sum: np.ndarray    # (k,) float64
    tokens: np.ndarray     # (k,) int64
    bytes: np.ndarray      # (k,) int64

    def to_dict(self) -> dict:
        return {"kind": self.kind, "index": self.index.tolist(), "nll_sum": self.nll_sum.tolist(),
                "tokens": self.tokens.tolist(), "bytes": self.bytes.tolist()}

    @classmethod
    def from_dict(cls, record: dict) -> "Units":
        return cls(str(record["kind"]), np.asarray(record["index"], dtype=np.int64),
                   np.asarray(record["nll_sum"], dtype=np.float64), np.asarray(record["tokens"], dtype=np.int64),
                   np.asarray(record["bytes"], dtype=np.int64))

    def subset(self, keep: np.ndarray) -> "Units":
        return Units(self.kind, self.index[keep], self.nll_sum[keep], self.tokens[keep], self.bytes[keep])


def resamples(n_units: int, replicates: int, seed: int) -> Iterator[np.ndarray]:
    """(rows, n_units) blocks of unit indices, drawn with replacement; the same seed gives the same draws."""
    rng = np.random.default_rng(seed)
    rows = max(1, min(replicates, DRAW_BLOCK // max(n_units, 1)))
    for start in range(0, replicates, rows):
        yield rng.integers(0, n_units, size=(min(rows, replicates - start), n_units))


def nll_per_token(units: Units, draw: np.ndarray) -> np.ndarray:
    return units.nll_sum[draw].sum(axis=1) / units.tokens[draw].sum(axis=1)


def bits_per_byte(units: Units, draw: np.ndarray) -> np.ndarray:
    return units.nll_sum[draw].sum(axis=1) / math.log(2) / units.bytes[draw].sum(axis=1)


class TailPercentiles:
    """The interval's two percentiles of n values given a block at a time, equal bit for bit to np.percentile of
    all the values (its linear method), holding only the values of each tail that they read.

    numpy's q-th percentile of n values is the two order statistics around the virtual index h = (n - 1) q,
    interpolated by h's fraction: the lower percentile reads the floor(h) + 2 smallest values, the upper one the
    n - floor(h) largest. Each tail keeps that many, merged with new blocks once as many are waiting (so each
    value is partitioned a bounded number of times)."""

    def __init__(self, n_values: int):
        assert n_values > 0, "a percentile of no values"
        tail = (1 - LEVEL) / 2 * 100
        self.n = n_values
        # as numpy computes it: q / 100, then (n - 1) q
        self.virtual = [float((n_values - 1) * q) for q in np.true_divide([tail, 100 - tail], 100)]
        below = [min(math.floor(h), n_values - 1) for h in self.virtual]
        self.keep_low, self.keep_high = min(below[0] + 2, n_values), n_values - below[1]
        self.low, self.high = np.zeros(0), np.zeros(0)   # the kept tails
        self.waiting: list[np.ndarray] = []
        self.n_waiting = self.n_seen = 0
        self.has_nan = False

    def add(self, values: np.ndarray) -> None:
        values = np.asarray(values, dtype=np.float64)
        self.has_nan |= bool(np.isnan(values).any())
        self.waiting.append(values)
        self.n_waiting += len(values)
        self.n_seen += len(values)
        if self.n_waiting >= max(self.keep_low, self.keep_high, 1 << 16):
            self._merge()

    def _merge(self) -> None:
        for side in ("low", "high"):
            values = np.concatenate([getattr(self, side), *self.waiting])
            keep = self.keep_low if side == "low" else self.keep_high
            if len(values) > keep:   # NaN sorts last, as in numpy's partition: it is only ever in the high tail
                cut = keep - 1 if side == "low" else len(values) - keep
                values = np.partition(values, cut)
                values = values[:keep] if side == "low" else values[-keep:]
            setattr(self, side, values)
        self.waiting, self.n_waiting = [], 0

    def interval(self) -> list[float]:
        assert self.n_seen == self.n, f"{self.n_seen} values given of {self.n}"
        self._merge()
        if self.has_nan:   # as numpy: a NaN anywhere makes every percentile NaN
            return [math.nan, math.nan]
        low, high = np.sort(self.low), np.sort(self.high)
        return [_at_virtual_index(low, math.floor(self.virtual[0]), self.virtual[0], self.n),
                _at_virtual_index(high, 0, self.virtual[1], self.n)]


def _at_virtual_index(ascending: np.ndarray, below: int, virtual: float, n: int) -> float:
    """numpy's linear percentile at virtual index h of n values, given its values in order with the one at
    floor(h) at `below`: numpy's own interpolation between the two values around h (a quantile of those two alone
    at h's fraction computes exactly that); from h = n - 1 on, numpy interpolates the largest value with itself."""
    if virtual >= n - 1:
        return float(np.quantile(np.repeat(ascending[-1:], 2), 0.0))
    return float(np.quantile(ascending[below:below + 2], virtual - math.floor(virtual)))


def bootstrap(units: Units, replicates: int, seed: int) -> dict:
    """The bootstrap intervals of one run's nll, ppl and bits per byte (the report's "bootstrap")."""
    has_bytes = bool(units.bytes.sum())
    nll, bpb = TailPercentiles(replicates), TailPercentiles(replicates)
    for draw in resamples(len(units.index), replicates, seed):
        nll.add(nll_per_token(units, draw))
        if has_bytes:
            bpb.add(bits_per_byte(units, draw))
    nll_interval = nll.interval()
    return {"level": LEVEL, "replicates": replicates, "seed": seed, "unit": units.kind, "units": len(units.index),
            "nll": nll_interval, "ppl": [perplexity(x) for x in nll_interval],
            "bits_per_byte": bpb.interval() if has_bytes else None,
            "resampled": units.to_dict()}


def paired_difference(first: Units, other: Units, statistic: Callable[[Units, np.ndarray], np.ndarray],
                      replicates: int, seed: int) -> Optional[dict]:
    """other's statistic minus first's over the same resampled units, with its interval and the share of
    resamples in which other is lower; None when the units cannot be paired (other units or windows)."""
    if first.kind != other.kind:
        return None
    shared, first_at, other_at = np.intersect1d(first.index, other.index, return_indices=True)
    a, b = first.subset(first_at), other.subset(other_at)
    # windows pair only when they hold the same tokens: one tokenizer, one window plan
    if len(shared) < 2 or (first.kind == "window" and not (
            len(shared) == len(first.index) == len(other.index) and np.array_equal(a.tokens, b.tokens))):
        return None
    everything = np.arange(len(shared))[None, :]
    estimate = float(statistic(b, everything)[0] - statistic(a, everything)[0])
    deltas, n_lower = TailPercentiles(replicates), 0
    for draw in resamples(len(shared), replicates, seed):
        delta = statistic(b, draw) - statistic(a, draw)
        deltas.add(delta)
        n_lower += int(np.count_nonzero(delta < 0))
    return {"difference": estimate, "interval": deltas.interval(), "lower_share": n_lower / replicates,
            "units": len(shared), "unit": first.kind, "replicates": replicates, "seed": seed}


def check_bootstrap_work(replicates: int, n_units: int, unit: str, flag: str = "--bootstrap") -> None:
    """Refuses a bootstrap of more than MAX_DRAWS draws (a minute or more), naming the most resamples that fit."""
    if replicates * n_units <= MAX_DRAWS:
        return
    fits = MAX_DRAWS // n_units
    advice = (f"use --bootstrap {fits:,} or fewer" if fits >= MIN_BOOTSTRAP else
              "drop --bootstrap (the standard error is reported without it)")
    raise FastpplError(f"{flag} {replicates:,} over {n_units:,} {unit}s would draw {replicates * n_units:,} units, "
                       f"more than the {MAX_DRAWS:,} of one run (about a minute); {advice}")


def bootstrap_unit_count(plan: WindowPlan) -> tuple[int, str]:
    """How many units a bootstrap of this plan resamples, and their kind (bootstrap_units)."""
    if len(plan.scored_documents) > 1:
        return len(plan.scored_documents), "document"
    return sum(1 for r in plan.refs if r.window.n_scored > 0), "window"


def needs_token_sums(bootstrap_replicates: int, plan: WindowPlan) -> bool:
    """Whether the run must keep per-token NLL for the bootstrap: its units are the windows of one document."""
    return bootstrap_replicates > 0 and len(plan.scored_documents) == 1


def bootstrap_units(documents: list[Document], tokens: list[np.ndarray], plan: WindowPlan, sums: DeviceSums,
                    bytes_by_document: np.ndarray, tokenizer: Tokenizer) -> Units:
    """The scored documents, or the windows of the one scored document (from the per-token NLL)."""
    scored = plan.scored_documents
    if len(scored) > 1:
        nll_by_document = sums.per_document[:-1].cpu().numpy()
        return Units("document", scored.astype(np.int64), nll_by_document[scored],
                     plan.scored_by_document[scored], bytes_by_document[scored])
    assert sums.per_token is not None, "a single document's windows need per-token NLL (needs_token_sums)"
    doc = int(scored[0])
    stream, ids = plan.streams[doc], tokens[doc]
    per_token = sums.per_token[:-1].cpu().numpy()[stream.token_offset:stream.token_offset + len(ids)]
    refs = [r.window for r in plan.refs if r.doc == doc]
    nll, n_tokens, n_bytes = [], [], []
    for w in refs:
        first = w.start + w.score_from + 1 - (1 if stream.bos else 0)   # stream index j is token j - bos
        end, left = first + w.n_scored, max(first - 8, 0)   # 8 tokens of left context, as token_n_bytes decodes
        nll.append(per_token[first:end].sum(dtype=np.float64))
        n_tokens.append(w.n_scored)
        n_bytes.append(tokenizer.n_bytes(ids[left:end].tolist()) - tokenizer.n_bytes(ids[left:first].tolist()))
    keep = np.array(n_tokens) > 0
    return Units("window", np.flatnonzero(keep), np.array(nll)[keep], np.array(n_tokens, dtype=np.int64)[keep],
                 np.array(n_bytes, dtype=np.int64)[keep])
