"""fastppl bench --corpus docs on the CPU: a tiny corpus through every mode, the NLL check, the report."""
import dataclasses
import json

import numpy as np
import pytest
import torch

from fastppl.bench.documents import ModeResult, chunked_corpus, docs_report, format_docs_table
from fastppl.cli import main


@pytest.mark.slow
def test_tiny_docs_bench_through_the_cli(tmp_path, capsys):
    # ctx 128, not 64: at ctx 64 the only bucket is 64 and bucketed is padded; 9 documents (3,069 tokens), whose
    # paddings order as packed < bucketed < padded at this ctx and batch size (not every count's do)
    out = tmp_path / "docs.json"
    rc = main(["bench", "--corpus", "docs", "--model", "random:gpt2-tiny", "--documents", "9", "--ctx", "128",
               "--batch-size", "4", "--device", "cpu", "--json", str(out), "--quiet"])
    assert rc == 0
    report = json.loads(out.read_text())
    rows = {r["name"]: r for r in report["rows"]}
    assert list(rows) == ["packed", "bucketed", "padded", "baseline", "dense"]
    assert report["corpus"] == "docs" and report["documents"] == 9 and report["ctx"] == 128
    assert report["dtype"] == "float32" and report["nll_tolerance"] == 1e-6
    # the same tokens with the same contexts: one total NLL, whatever the batching (fp32)
    checked = [rows[m]["nll_sum"] for m in report["nll_checked_modes"]]
    assert report["nll_checked_modes"] == ["packed", "bucketed", "padded", "baseline"]
    assert max(checked) - min(checked) <= 1e-6 * abs(checked[0])
    assert report["nll_agrees"] and report["nll_max_relative_difference"] <= 1e-6
    # dense reads the same tokens as one stream: other contexts, nearly the same NLL of random weights
    assert rows["dense"]["nll_sum"] == pytest.approx(rows["packed"]["nll_sum"], rel=1e-2)
    assert all(r["tokens"] == report["tokens"] > 0 and r["tokens_per_second"] > 0 for r in rows.values())
    assert rows["packed"]["nll"] == pytest.approx(rows["packed"]["nll_sum"] / report["tokens"])
    waste = {name: r["padding_waste"] for name, r in rows.items()}
    assert 0 <= waste["packed"] <= waste["bucketed"] < waste["padded"]
    assert report["packed_padding_waste"] == waste["packed"]
    assert report["packed_over_dense"] == pytest.approx(
        rows["packed"]["tokens_per_second"] / rows["dense"]["tokens_per_second"])
    assert report["packed_over_baseline"] == pytest.approx(
        rows["packed"]["tokens_per_second"] / rows["baseline"]["tokens_per_second"])
    assert set(report["targets_met"]) == {"packed_over_dense", "packed_over_baseline", "packed_padding_waste"}
    table = capsys.readouterr().out
    assert "packed / dense" in table and "packed / baseline" in table and "agree" in table


def test_chunked_corpus_scores_every_token_once_from_bos():
    documents = [np.arange(5), np.arange(10, 13)]
    corpus = chunked_corpus(documents, ctx=3, bos_id=99)
    assert corpus.streams[0].tolist() == [99, 0, 1, 2, 3, 4] and corpus.target_offsets == [0, 5]
    assert sum(r.window.n_scored for r in corpus.refs) == corpus.n_tokens == 8
    assert corpus.window_lengths.max() <= 3


def test_disagreeing_nll_is_reported_and_fails(capsys):
    results = [ModeResult(name, 1.0, nll, 0.0, 1, None, "") for name, nll in
               (("packed", 100.0), ("bucketed", 100.0), ("padded", 100.0), ("baseline", 100.1), ("dense", 99.0))]
    report = docs_report(results, 10, device=torch.device("cpu"), dtype=torch.float32, model="random:gpt2-tiny",
                         documents=2, ctx=8, batch_size=1, loss="chunked", compile="off")
    assert not report["nll_agrees"] and report["nll_max_relative_difference"] == pytest.approx(1e-3)
    assert "DISAGREE" in format_docs_table(report)


def test_per_position_ratio_counts_the_context_that_windows_re_read():
    # packed: 12 positions read in 2 s for 10 tokens; dense: 10 positions in 1 s
    results = [ModeResult(name, seconds, 100.0, 0.0, 1, None, "", positions) for name, seconds, positions in
               (("packed", 2.0, 12), ("bucketed", 1.0, 12), ("padded", 1.0, 12), ("baseline", 1.0, 12),
                ("dense", 1.0, 10))]
    report = docs_report(results, 10, device=torch.device("cpu"), dtype=torch.float32, model="random:gpt2-tiny",
                         documents=2, ctx=8, batch_size=1, loss="chunked", compile="off")
    assert report["packed_over_dense"] == pytest.approx(0.5)
    assert report["packed_over_dense_per_position"] == pytest.approx(0.6)
    table = format_docs_table(report)
    assert "per position read: packed / dense 60.0 %" in table and "re-reads context" in table
    fits = [dataclasses.replace(r, positions=10) if r.name == "packed" else r for r in results]
    table = format_docs_table(docs_report(fits, 10, device=torch.device("cpu"), dtype=torch.float32,
                                          model="random:gpt2-tiny", documents=2, ctx=8, batch_size=1,
                                          loss="chunked", compile="off"))
    assert "no window re-reads context" in table and "right-aligned" not in table


def test_dense_only_options_are_refused(capsys):
    assert main(["bench", "--corpus", "docs", "--peers", "fastppl", "--device", "cpu"]) == 2
    assert "fastppl: error: --peers do not apply to --corpus docs (--peers: the peers' bench (--corpus dense)); " \
        "drop them" in capsys.readouterr().err
