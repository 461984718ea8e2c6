"""The report of `fastppl eval`: its --json fields pinned (names, order and values) against a stored report of a
small random:gpt2-tiny run, so that a change to how the result is assembled cannot rename, reorder or drop one."""
import json
import math
from pathlib import Path

import numpy as np
import pytest

from fastppl.cli import main
from fastppl.config import EvalConfig

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


@pytest.fixture
def corpus(tmp_path, shakespeare):
    text = shakespeare.read_text()
    documents = [{"id": f"doc-{i}", "domain": "ab"[i % 2], "text": text[900 * i:900 * i + length]}
                 for i, length in enumerate((120, 300, 60, 200))]
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps(d) + "\n" for d in documents))
    return path


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
