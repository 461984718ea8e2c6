"""fastppl.report.paired: which runs compare per token, the bootstrap units a report carries (checked), and the
paired table's differences against paired_difference computed directly."""
from types import SimpleNamespace

import numpy as np
import pytest

from fastppl.errors import FastpplError
from fastppl.report.paired import paired_table, per_token_comparable, plus_minus, resampled_units, same_text
from fastppl.report.stats import Units, bits_per_byte, nll_per_token, paired_difference


def _units(nll_sum, tokens, n_bytes, kind="document") -> Units:
    return Units(kind, np.arange(len(nll_sum)), np.array(nll_sum, dtype=np.float64), np.array(tokens),
                 np.array(n_bytes))


def _run(label, units=None, digest="abc", tokens_scored=100):
    boot = None if units is None else {"level": 0.95, "replicates": 200, "seed": 3, "resampled": units.to_dict()}
    return SimpleNamespace(label=label, path=f"{label}.json",
                           result={"corpus_sha256": digest, "tokens_scored": tokens_scored, "bootstrap": boot})


BASE = _units([30.0, 12.0, 50.0, 8.0], [10, 5, 20, 4], [40, 20, 80, 15])
BETTER = _units([27.0, 11.0, 46.0, 7.5], [10, 5, 20, 4], [40, 20, 80, 15])


def test_same_text_and_per_token_comparable():
    assert same_text({"corpus_sha256": "x"}, {"corpus_sha256": "x"})
    assert not same_text({"corpus_sha256": None}, {"corpus_sha256": None})   # unknown text is no match
    assert not same_text({"corpus_sha256": "x"}, {"corpus_sha256": "y"})
    assert per_token_comparable({"tokens_scored": 5}, {"tokens_scored": 5})
    assert not per_token_comparable({"tokens_scored": 5}, {"tokens_scored": 6})
    assert plus_minus(None) == "" and plus_minus(0.5) == " ± 0.500000"


def test_resampled_units_read_back_and_malformed_ones_are_refused():
    assert resampled_units(_run("a")) is None
    units = resampled_units(_run("a", BASE))
    np.testing.assert_array_equal(units.nll_sum, BASE.nll_sum)
    broken = _run("a", BASE)
    broken.result["bootstrap"]["resampled"]["tokens"] = [10, 5]   # lengths differ
    with pytest.raises(FastpplError, match="a.json: its 'bootstrap' field"):
        resampled_units(broken)
    zero = _run("a", _units([1.0, 2.0], [0, 3], [4, 5]))   # a unit without tokens
    with pytest.raises(FastpplError):
        resampled_units(zero)


def test_paired_table_rows_equal_paired_difference():
    table = paired_table([_run("base", BASE), _run("better", BETTER)])
    expected = paired_difference(BASE, BETTER, nll_per_token, 200, 3)
    assert table.startswith("paired differences against base (95% bootstrap interval, seed 3)")
    row = table.splitlines()[-1]
    assert row.split()[:3] == ["better", "ΔNLL", f"{expected['difference']:+.6f}"]
    assert f"[{expected['interval'][0]:+.6f}, {expected['interval'][1]:+.6f}]" in row
    assert f"{expected['lower_share']:.1%} of 200 resamples of 4 documents" in row


def test_other_tokenizers_pair_by_bits_per_byte_and_other_texts_not_at_all():
    other_tokens = _run("other", BETTER, tokens_scored=90)
    row = paired_table([_run("base", BASE), other_tokens]).splitlines()[-1]
    expected = paired_difference(BASE, BETTER, bits_per_byte, 200, 3)
    assert row.split()[:3] == ["other", "Δbits/byte", f"{expected['difference']:+.6f}"]
    row = paired_table([_run("base", BASE), _run("elsewhere", BETTER, digest="def")]).splitlines()[-1]
    assert "n/a" in row and "no units to pair" in row


def test_no_table_without_a_second_run_or_the_first_runs_bootstrap():
    assert paired_table([_run("base", BASE)]) is None
    assert paired_table([_run("base"), _run("better", BETTER)]) is None
