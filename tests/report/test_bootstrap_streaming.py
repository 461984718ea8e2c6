"""The bootstrap's percentiles, reduced a block of resamples at a time: equal bit for bit to np.percentile over
all the resamples, and held in memory that grows with the tails the percentiles read, not with every resample."""
import tracemalloc

import numpy as np
import pytest

from fastppl.report import stats
from fastppl.report.stats import LEVEL, TailPercentiles, Units, bootstrap, nll_per_token, paired_difference

TAIL = (1 - LEVEL) / 2 * 100


def _units(nll_sum):
    return Units("document", np.arange(7), np.array(nll_sum), np.array([2, 5, 1, 20, 3, 1, 9]),
                 np.array([9, 21, 3, 80, 13, 5, 40]))


FIRST = _units([3.5, 10.25, 0.75, 44.0, 8.0, 2.5, 19.0])
OTHER = _units([3.0, 11.0, 0.5, 40.0, 9.0, 2.0, 18.0])


def test_intervals_are_those_all_resamples_held_at_once_gave():
    """The values that np.percentile over every resample held in memory gave for these units and seeds."""
    result = bootstrap(FIRST, 1000, 7)
    assert result["nll"] == [1.9210263157894736, 2.2738392857142857]
    assert result["bits_per_byte"] == [0.6492127684000336, 0.7909191087107008]
    paired = paired_difference(FIRST, OTHER, nll_per_token, 1000, 3)
    assert paired["interval"] == [-0.2038636363636363, 0.10344827586206895]
    assert paired["lower_share"] == 0.837 and paired["difference"] == -0.10975609756097571


@pytest.mark.parametrize("n", [1, 2, 3, 39, 40, 41, 100, 999, 1000, 1001, 80_001])
@pytest.mark.parametrize("values", ["normal", "ties", "infinite", "nan"])
def test_tail_percentiles_equal_numpys_over_all_values(n, values):
    rng = np.random.default_rng(n)
    data = rng.normal(size=n) if values in ("normal", "nan") else rng.integers(0, 4, size=n).astype(float)
    if values == "infinite":
        data[rng.integers(0, n, size=max(1, n // 50))] = np.inf
    if values == "nan":
        data[rng.integers(0, n)] = np.nan
    tails, start = TailPercentiles(n), 0
    while start < n:   # blocks of uneven sizes, some larger than the tails, some smaller
        size = int(rng.integers(1, 70_000))
        tails.add(data[start:start + size])
        start += size
    with np.errstate(invalid="ignore"):   # numpy's interpolation between two infinities is NaN, and so is ours
        expected = np.percentile(data, [TAIL, 100 - TAIL])
        np.testing.assert_array_equal(tails.interval(), expected)


def test_memory_grows_with_the_tails_not_with_the_resamples(monkeypatch):
    """2,000,000 resamples: two statistics of 8 bytes each would hold 32 MB at once; their tails hold 5 %."""
    monkeypatch.setattr(stats, "DRAW_BLOCK", 1 << 14)   # small blocks, so that the kept values dominate
    units = Units("document", np.arange(3), np.array([1.0, 2.0, 4.0]), np.array([1, 2, 3]), np.array([4, 8, 12]))
    tracemalloc.start()
    try:
        result = bootstrap(units, 2_000_000, 0)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 12e6, f"{peak / 1e6:.1f} MB at the peak"
    assert result["nll"][0] < result["nll"][1]
