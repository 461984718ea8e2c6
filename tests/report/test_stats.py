"""Error bars: standard errors against a direct computation on the per-token NLL, bootstrap intervals against a
brute-force loop and reproducible with their seed (per-group results: test_groups.py; the summary: test_summary.py)."""
import functools
import json
import math

import numpy as np
import pytest

from fastppl import EvalConfig, evaluate, pipeline
from fastppl.cli import main
from fastppl.data.tokenize import load_tokenizer
from fastppl.errors import FastpplError
from fastppl.report.stats import (Units, bits_per_byte, bootstrap, mean_standard_error, nll_per_token,
                                  paired_difference)

CTX = 32

_load_tokenizer_once = functools.lru_cache(load_tokenizer)


@pytest.fixture(autouse=True)
def _tokenizer_loaded_once(monkeypatch):
    monkeypatch.setattr(pipeline, "load_tokenizer", _load_tokenizer_once)


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def run(tokenizer_dir, data, **overrides):
    settings = dict(model="random:gpt2-tiny", tokenizer=str(tokenizer_dir), data=[str(d) for d in data], ctx=CTX,
                    device="cpu", quiet=True, batch_size=4, per_token="(returned, not written)",
                    per_doc="(returned, not written)")
    settings.update(overrides)
    return evaluate(EvalConfig(**settings))


@pytest.mark.slow
def test_standard_errors_equal_a_direct_computation_on_the_per_token_nll(tmp_path, tokenizer_dir, records,
                                                                         sharpened_random_models):
    for window in ("chunked", "sliding"):
        result = run(tokenizer_dir, [write_jsonl(tmp_path / "docs.jsonl", records)], window=window)
        per_token = result.per_token.astype(np.float64)
        scored = per_token[~np.isnan(per_token)]
        assert len(scored) == result["tokens_scored"]
        direct = scored.std(ddof=1) / math.sqrt(len(scored))
        assert result["nll_stderr"] == pytest.approx(direct, rel=1e-9)
        assert result["ppl_stderr"] == pytest.approx(math.exp(scored.mean()) * direct, rel=1e-9)   # delta method
        assert result["bits_per_byte_stderr"] == pytest.approx(
            direct * len(scored) / math.log(2) / result["bytes"], rel=1e-9)
        assert 0 < direct < scored.std()


def test_mean_standard_error_of_too_few_or_equal_values():
    assert math.isnan(mean_standard_error(3.0, 9.0, 1))
    assert mean_standard_error(6.0, 12.0, 3) == 0.0   # three 2s: no spread
    values = np.array([1.0, 2.0, 4.0, 8.0])
    assert mean_standard_error(values.sum(), (values ** 2).sum(), 4) == pytest.approx(values.std(ddof=1) / 2)


def brute_force_bootstrap(nll_sums, tokens, replicates, seed):
    """One resample at a time: k draws of the k units with replacement, the ratio of their sums."""
    rng = np.random.default_rng(seed)
    draws = rng.integers(0, len(nll_sums), size=(replicates, len(nll_sums)))
    ratios = [sum(nll_sums[i] for i in row) / sum(tokens[i] for i in row) for row in draws]
    return list(np.percentile(ratios, [2.5, 97.5]))


@pytest.mark.slow
def test_bootstrap_over_documents_equals_a_brute_force_loop_and_is_reproducible(tmp_path, tokenizer_dir, records,
                                                                                sharpened_random_models):
    data = write_jsonl(tmp_path / "docs.jsonl", records)
    result = run(tokenizer_dir, [data], bootstrap=300, bootstrap_seed=7)
    boot = result["bootstrap"]
    assert (boot["unit"], boot["units"], boot["replicates"], boot["seed"]) == ("document", len(records), 300, 7)
    per_doc = result.per_doc
    expected = brute_force_bootstrap([d["nll_sum"] for d in per_doc], [d["tokens"] for d in per_doc], 300, 7)
    assert boot["nll"] == pytest.approx(expected, rel=1e-12)
    assert boot["ppl"] == pytest.approx([math.exp(x) for x in expected], rel=1e-12)
    assert boot["nll"][0] < result["nll"] < boot["nll"][1]
    assert boot["bits_per_byte"][0] < result["bits_per_byte"] < boot["bits_per_byte"][1]
    # the same seed, the same interval; another seed, another one
    assert run(tokenizer_dir, [data], bootstrap=300, bootstrap_seed=7)["bootstrap"]["nll"] == boot["nll"]
    assert run(tokenizer_dir, [data], bootstrap=300, bootstrap_seed=8)["bootstrap"]["nll"] != boot["nll"]
    assert run(tokenizer_dir, [data])["bootstrap"] is None


@pytest.mark.slow
def test_bootstrap_of_a_single_document_resamples_its_windows(tmp_path, tokenizer_dir, shakespeare,
                                                             sharpened_random_models):
    text = tmp_path / "one.txt"
    text.write_text(shakespeare.read_text()[:3000])   # ASCII: every token's bytes add up to the text's
    for window, extra in (("chunked", {}), ("sliding", {"stride": 12})):
        result = run(tokenizer_dir, [text], window=window, bootstrap=200, per_token=None, **extra)
        boot = result["bootstrap"]
        units = boot["resampled"]
        assert boot["unit"] == "window" and boot["units"] == result["windows"] == len(units["nll_sum"])
        assert sum(units["tokens"]) == result["tokens_scored"] and sum(units["bytes"]) == result["bytes"]
        assert math.fsum(units["nll_sum"]) == pytest.approx(result["nll_sum"], rel=1e-12)
        assert result.per_token is None   # kept for the windows' sums, not written
        expected = brute_force_bootstrap(units["nll_sum"], units["tokens"], 200, 0)
        assert boot["nll"] == pytest.approx(expected, rel=1e-12)


def test_paired_difference_resamples_the_same_units_for_both_runs():
    rng = np.random.default_rng(0)
    tokens = rng.integers(50, 500, size=40)
    nll_a = tokens * rng.normal(3.0, 0.3, size=40)
    a = Units("document", np.arange(40), nll_a, tokens, tokens * 4)
    b = Units("document", np.arange(40), nll_a - tokens * 0.05, tokens, tokens * 4)   # 0.05 nats/token better
    paired = paired_difference(a, b, nll_per_token, 500, 0)
    assert paired["difference"] == pytest.approx(-0.05)
    assert paired["interval"] == pytest.approx([-0.05, -0.05])   # a constant shift: no spread when paired
    assert paired["lower_share"] == 1.0
    # unpaired, each run's own interval is wide: pairing is what removes the documents' spread
    one = bootstrap(a, 500, 0)
    assert one["nll"][0] < nll_a.sum() / tokens.sum() < one["nll"][1] and one["nll"][1] - one["nll"][0] > 0.05
    by_bytes = paired_difference(a, b, bits_per_byte, 500, 0)
    assert by_bytes["difference"] == pytest.approx(-0.05 / 4 / math.log(2))
    # documents pair by their index; windows only when they hold the same tokens
    assert paired_difference(a, b.subset(np.arange(30)), nll_per_token, 100, 0)["units"] == 30
    windows = Units("window", np.arange(40), nll_a, tokens, tokens * 4)
    assert paired_difference(windows, Units("window", np.arange(40), nll_a, tokens + 1, tokens * 4),
                             nll_per_token, 100, 0) is None
    assert paired_difference(a, windows, nll_per_token, 100, 0) is None


@pytest.mark.parametrize("argv, message", [
    (["--bootstrap", "5"], "--bootstrap must be 0 (off) or at least 100, got 5"),
    (["--bootstrap", "-1"], "--bootstrap: must be at least 0"),
    (["--bootstrap-seed", "-3"], "--bootstrap-seed: must be at least 0"),
    (["--group-by", "source"], "--group-by applies to .jsonl files and hf: datasets"),
    (["--id-field", "id"], "--id-field applies to .jsonl files and hf: datasets"),
])
def test_bad_statistics_options_are_one_line_errors(tmp_path, tokenizer_dir, capsys, argv, message):
    text = tmp_path / "t.txt"
    text.write_text("Some text to score.")
    try:
        code = main(["eval", "--model", "random:gpt2-tiny", "--tokenizer", str(tokenizer_dir), "--data", str(text),
                     "--device", "cpu", *argv])
    except SystemExit as exit:   # argparse's own checks exit from inside the parser
        code = exit.code
    err = capsys.readouterr().err
    assert code == 2 and message in err and err.startswith("fastppl: ") and err.count("\n") == 1, err


def test_group_by_in_the_api_refuses_a_corpus_without_fields(tmp_path, tokenizer_dir):
    text = tmp_path / "t.txt"
    text.write_text("Some text to score.")
    with pytest.raises(FastpplError, match="group_by applies to .jsonl files and hf: datasets"):
        run(tokenizer_dir, [text], group_by="source")
