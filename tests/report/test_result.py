"""fastppl.report.result: the --json report's fields pinned (names, order and values) against a stored report of a
small random:gpt2-tiny run, so that a change to how the result is assembled cannot rename, reorder or drop one; the
EvalResult's typed fields against that report; the position, corpus and memory figures on their own. After a
deliberate change of the report, `PYTHONPATH=src python tests/report/test_result.py` rewrites the stored report."""
import json
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from fastppl import evaluate
from fastppl.cli import main
from fastppl.config import EvalConfig
from fastppl.engine.score import DeviceSums
from fastppl.report.files import finite_or_null
from fastppl.report.result import EvalResult, by_position, corpus_metrics, tokenization_note

PINNED = Path(__file__).resolve().parents[1] / "fixtures" / "eval_report_gpt2_tiny.json"
# fields whose values depend on the machine, the clock or the run's paths: their names are pinned, not their values
VARIES = {"wall_seconds", "scoring_seconds", "tokens_per_second", "peak_host_memory_bytes", "per_doc_path"}
VARIES_INSIDE = {"stage_seconds", "environment"}
VARIES_MARK = "(varies)"


def pinned_form(report: dict) -> dict:
    """The report with the values that vary from run to run replaced by VARIES_MARK (keys and order kept)."""
    out = {}
    for key, value in report.items():
        if key in VARIES:
            value = VARIES_MARK
        elif key in VARIES_INSIDE:
            value = {k: VARIES_MARK for k in value}
        elif key == "config":   # EvalConfig.to_dict(), whose fields are EvalConfig's (checked on its own)
            value = VARIES_MARK
        out[key] = value
    return out


def assert_same(actual, expected, where="report"):
    """Equal values, dict keys in the same order, floats to 1e-5 (the CPU's fp32 sums may differ in the last bits)."""
    if isinstance(expected, dict):
        assert isinstance(actual, dict), where
        assert list(actual) == list(expected), f"{where}: fields or their order differ"
        for key in expected:
            assert_same(actual[key], expected[key], f"{where}.{key}")
    elif isinstance(expected, list):
        assert isinstance(actual, list) and len(actual) == len(expected), where
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_same(a, e, f"{where}[{i}]")
    elif isinstance(expected, float) and not isinstance(actual, bool):
        assert actual == pytest.approx(expected, rel=1e-5, abs=1e-9), where
    else:
        assert actual == expected, where


def write_corpus(path: Path, shakespeare: Path) -> Path:
    """Four documents of two domains, of 16 to 78 tokens."""
    text = shakespeare.read_text()
    documents = [{"id": f"doc-{i}", "domain": "ab"[i % 2], "text": text[900 * i:900 * i + length]}
                 for i, length in enumerate((120, 300, 60, 200))]
    path.write_text("".join(json.dumps(d) + "\n" for d in documents))
    return path


@pytest.fixture
def corpus(tmp_path, shakespeare):
    return write_corpus(tmp_path / "docs.jsonl", shakespeare)


def eval_report(tmp_path, tokenizer_dir, corpus, monkeypatch) -> tuple[dict, list, np.ndarray]:
    """The --json report, --per-doc records and --per-token array of a small run."""
    monkeypatch.setenv("FASTPPL_CACHE_DIR", str(tmp_path / "cache"))   # tokenized here, not from the cache
    out = tmp_path / "report.json"
    assert main(["eval", "--model", "random:gpt2-tiny", "--data", str(corpus), "--tokenizer", str(tokenizer_dir),
                 "--device", "cpu", "--dtype", "fp32", "--ctx", "16", "--batch-size", "3", "--batching", "padded",
                 "--bootstrap", "100", "--group-by", "domain", "--per-doc", str(tmp_path / "docs.out.jsonl"),
                 "--per-token", str(tmp_path / "tokens.npy"), "--json", str(out), "--quiet"]) == 0
    per_doc = [json.loads(line) for line in (tmp_path / "docs.out.jsonl").read_text().splitlines()]
    return json.loads(out.read_text()), per_doc, np.load(tmp_path / "tokens.npy")


def test_the_json_report_keeps_its_fields_order_and_values(tmp_path, tokenizer_dir, corpus, monkeypatch, capsys):
    report, per_doc, per_token = eval_report(tmp_path, tokenizer_dir, corpus, monkeypatch)
    pinned = json.loads(PINNED.read_text())
    assert_same(pinned_form(report), pinned["report"])
    assert_same(per_doc, pinned["per_doc"])
    config = EvalConfig(model="random:gpt2-tiny", data=[str(corpus)], tokenizer=str(tokenizer_dir), device="cpu",
                        dtype="fp32", ctx=16, batch_size=3, batching="padded", bootstrap=100, group_by="domain",
                        per_doc=str(tmp_path / "docs.out.jsonl"), per_token=str(tmp_path / "tokens.npy"), quiet=True)
    assert report["config"] == config.to_dict()
    scored = per_token[~np.isnan(per_token)].astype(np.float64)
    assert per_token.dtype == np.float32 and len(per_token) == report["tokens_total"]
    assert len(scored) == report["tokens_scored"]
    assert math.fsum(scored) == pytest.approx(report["nll_sum"], rel=1e-5)
    assert "nll " in capsys.readouterr().out   # the summary printed


@pytest.mark.slow
def test_evaluate_gives_typed_fields_that_the_report_repeats(tmp_path, tokenizer_dir, corpus):
    result = evaluate(EvalConfig(model="random:gpt2-tiny", data=[str(corpus)], tokenizer=str(tokenizer_dir),
                                 device="cpu", ctx=16, batch_size=3, per_token="(kept)", per_doc="(kept)", quiet=True))
    assert isinstance(result, EvalResult)
    report = result.to_dict()
    assert not [key for key in report if key.startswith("_")]   # --per-token and --per-doc's data are fields
    assert dict(result) == report and result["nll"] == result.metrics.nll and "divergence" not in result
    assert (result.metrics.tokens_scored, result.corpus.documents, result.how_it_ran.batch_size) == (
        report["tokens_scored"], 4, 3)
    assert result.timings.stage_seconds is report["stage_seconds"] and "scoring" in result.timings.stage_seconds
    assert result.by_position.tokens == report["tokens_by_position"] and len(result.by_position.nll) == 16
    assert result.per_token.shape == (result.metrics.tokens_total,)
    assert [d["id"] for d in result.per_doc] == [f"doc-{i}" for i in range(4)]
    assert math.fsum(d["nll_sum"] for d in result.per_doc) == pytest.approx(result.metrics.nll_sum, rel=1e-9)
    json.dumps(finite_or_null(report), allow_nan=False)   # the report is plain JSON
    plain = evaluate(EvalConfig(model="random:gpt2-tiny", data=[str(corpus)], tokenizer=str(tokenizer_dir),
                                device="cpu", ctx=16, batch_size=3, quiet=True))
    assert plain.per_token is None and plain.per_doc is None and plain["nll_sum"] == result["nll_sum"]


def test_a_divergence_run_adds_its_section_last_and_its_per_token_columns(tmp_path, tokenizer_dir, corpus):
    result = evaluate(EvalConfig(model="random:gpt2-tiny", reference_model="random:gpt2-tiny", reference_seed=1,
                                 data=[str(corpus)], tokenizer=str(tokenizer_dir), device="cpu", ctx=16,
                                 batch_size=3, per_token="(kept)", quiet=True))
    assert list(result.to_dict())[-2:] == ["protocol", "divergence"]
    assert result.divergence["nll"] == result.metrics.nll and result["divergence"] is result.divergence
    from fastppl.engine.divergence import COLUMNS
    assert result.per_token.shape == (result.metrics.tokens_total, len(COLUMNS))


def test_by_position_divides_the_sums_once_and_leaves_unscored_positions_empty():
    sums = DeviceSums.zeros(4, torch.device("cpu"))
    sums.position_nll_sum += torch.tensor([6.0, 3.0, 0.0, 2.0], dtype=torch.float64)
    sums.position_nll_sq_sum += torch.tensor([20.0, 9.0, 0.0, 4.0], dtype=torch.float64)
    sums.position_count += torch.tensor([2.0, 1.0, 0.0, 1.0], dtype=torch.float64)
    positions = by_position(sums)
    assert positions.nll == [3.0, 3.0, None, 2.0] and positions.tokens == [2, 1, 0, 1]
    assert positions.nll_std == pytest.approx([1.0, 0.0, None, 0.0])   # sqrt(20 / 2 - 3^2); the rest constant


def test_corpus_metrics_arithmetic():
    plan = SimpleNamespace(n_scored=4, n_tokens=5)
    figures = corpus_metrics(8.0, plan, n_bytes=16, n_words=2)
    assert figures["nll"] == 2.0 and figures["ppl"] == pytest.approx(math.exp(2.0))
    assert figures["bits_per_token"] == pytest.approx(2 / math.log(2))
    assert figures["bits_per_byte"] == pytest.approx(8 / math.log(2) / 16)
    assert figures["word_perplexity"] == pytest.approx(math.exp(4.0))
    assert math.isnan(corpus_metrics(8.0, plan, n_bytes=0, n_words=0)["bits_per_byte"])


@pytest.mark.parametrize("whole, encoded, cached, note", [
    ("a tokenizer that merges across any cut", 3, 0, "whole texts: a tokenizer that merges across any cut"),
    (None, 0, 3, "from the token cache (an earlier run's ids)"),
    (None, 2, 1, "exact, long texts in parallel pieces"),
])
def test_tokenization_note(whole, encoded, cached, note):
    tokenizer = SimpleNamespace(whole_text_reason=whole, texts_encoded=encoded, texts_from_cache=cached)
    assert tokenization_note(tokenizer) == note


@pytest.mark.slow   # a process of its own
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux: getrusage's peak survives fork and exec")
def test_host_peak_is_the_programs_own_not_its_parents():
    """A process started by one that holds a lot (a benchmark that built the checkpoint, a notebook) reports its
    own peak: getrusage's ru_maxrss gives the parent's resident memory at the fork when that was larger."""
    import subprocess
    held = bytearray(800 * 2**20)
    held[::4096] = b"\1" * len(held[::4096])   # resident, not only reserved
    code = "from fastppl.report.result import peak_host_memory_bytes as peak; print(peak())"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert int(done.stdout) < 500 * 2**20 < len(held)   # the child imports torch: about 230 MB


if __name__ == "__main__":
    # after a deliberate change of the report's fields: rewrite the stored report from this checkout's run
    #   PYTHONPATH=src python tests/report/test_result.py
    import sys as _sys
    import tempfile
    _sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from conftest import SHAKESPEARE, TOKENIZER_DIR
    with tempfile.TemporaryDirectory() as directory, pytest.MonkeyPatch.context() as patch:
        data = write_corpus(Path(directory) / "docs.jsonl", SHAKESPEARE)
        report, per_doc, _ = eval_report(Path(directory), TOKENIZER_DIR, data, patch)
    PINNED.write_text(json.dumps({"report": pinned_form(report), "per_doc": per_doc}, indent=1) + "\n")
    print(f"wrote {PINNED}")
