"""fastppl.report.summary: the lines printed on stdout, from a stored report (tests/fixtures) with its varying
fields filled in, and from a run with error bars, a bootstrap and groups."""
import json
import math
from pathlib import Path

import pytest

from fastppl.cli import main
from fastppl.report.summary import _figure, summary

PINNED = Path(__file__).resolve().parents[1] / "fixtures" / "eval_report_gpt2_tiny.json"


@pytest.fixture
def report() -> dict:
    stored = json.loads(PINNED.read_text())["report"]
    stored.update(wall_seconds=1.5, scoring_seconds=1.0, tokens_per_second=180.0, peak_host_memory_bytes=2**30,
                  config={"model": "random:gpt2-tiny", "data": ["docs.jsonl"], "split": "all"},
                  environment={"device_name": "cpu (x86_64)"})
    return stored


def test_the_summary_of_a_report(report):
    lines = summary(report).splitlines()
    assert lines[0] == "model       random:gpt2-tiny  (float32, cpu (x86_64))"
    assert lines[1] == "data        docs.jsonl  split=all  4 document(s)"
    assert lines[2] == "windows     chunked ctx=16  13 windows"
    assert lines[3].startswith("batching    padded  5 batches  padding waste 15.4% (padded tokens / real tokens)"
                               "  batch size 3 (--batch-size)")
    assert lines[4] == "tokens      180 scored of 180  (680 bytes)"
    assert lines[5] == f"nll         {report['nll']:.6f} ± {report['nll_stderr']:.6f} nats/token"
    assert lines[9] == "speed       180 tokens/s  (1.50 s wall, compile off (auto: CPU), peak n/a)"
    assert lines[10].startswith("bootstrap   95%: nll [") and "(100 resamples of 4 documents, seed 0)" in lines[10]
    assert "by domain" in lines[12] and lines[-2].startswith("(micro average)") and \
        lines[-1].startswith("(macro average)")


def test_optional_lines_show_only_when_the_report_has_them(report):
    report.update(bootstrap=None, groups=None, documents_skipped=2, resumed_from_batch=3,
                  kv_cache="on (--kv-cache on)", tokens_forwarded=200, tokens_forwarded_without_cache=800,
                  protocol={"name": "llama.cpp", "reported": {"line": "Final estimate: PPL = 1.0 +/- 0.1"}})
    out = summary(report)
    assert "bootstrap" not in out and "by domain" not in out
    assert "4 document(s) (2 skipped: no token to score)" in out and "resumed after batch 3" in out
    assert "protocol    llama.cpp: Final estimate: PPL = 1.0 +/- 0.1" in out
    assert "kv cache    on (--kv-cache on): 200 token positions run instead of 800 (4.0x fewer)" in out


def test_figures_that_are_unknown_or_huge():
    assert _figure(math.nan, ".4f") == "n/a" and _figure(None, ".4f") == "n/a"
    assert _figure(12.5, ".4f") == "12.5000" and _figure(2.5e13, ".4f") == "2.5000e+13"
    assert _figure(math.inf, ".4f") == "inf"


def test_a_report_without_error_bars_prints_no_plus_minus(report):
    report.update(nll_stderr=math.nan, ppl_stderr=None, bits_per_byte_stderr=math.nan)
    out = summary(report)
    assert f"nll         {report['nll']:.6f} nats/token" in out and "±" not in out.split("bootstrap")[0]


def test_summary_shows_error_bars_bootstrap_and_groups(tmp_path, tokenizer_dir, records, capsys):
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    report = tmp_path / "run.json"
    assert main(["eval", "--model", "random:gpt2-tiny", "--tokenizer", str(tokenizer_dir), "--data", str(data),
                 "--ctx", "32", "--device", "cpu", "--quiet", "--group-by", "source", "--bootstrap", "100",
                 "--json", str(report)]) == 0
    out = capsys.readouterr().out
    result = json.loads(report.read_text())
    assert f"nll         {result['nll']:.6f} ± {result['nll_stderr']:.6f} nats/token" in out
    assert f"perplexity  {result['ppl']:.4f} ± {result['ppl_stderr']:.4f}" in out
    assert "bootstrap   95%: nll [" in out and "(100 resamples of 10 documents, seed 0)" in out
    assert "by source" in out and "(micro average)" in out and "(macro average)" in out
    for source in {r["source"] for r in records}:
        assert f"\n{source} " in out


def test_block_protocols_print_no_word_perplexity(report):
    """A protocol's blocks score part of the text (llama.cpp: the second half of each), while words count all of it."""
    assert "word ppl    " in summary(report)
    report.update(window="blocks")
    lines = summary(report).splitlines()
    assert "word ppl" not in "\n".join(lines) and lines[8] == f"byte ppl    {report['byte_perplexity']:.6f}"


def test_a_word_perplexity_past_the_float_range_prints_its_exponent(report):
    report.update(words=1, nll_sum=2345.67, word_perplexity=float("inf"))
    assert "word ppl    exp(2,345.7)  (1 word)   byte ppl" in summary(report)
    report.update(words=2, word_perplexity=12.5)
    assert "word ppl    12.5000  (2 words)" in summary(report)


def test_a_streamed_run_says_its_waves_and_copies(report):
    assert not any(line.startswith("placement") for line in summary(report).splitlines())   # resident: no line
    report.update(placement="streamed", placement_reason="auto: the weights (140.00GiB) exceed 90% of the device's",
                  streaming=dict(waves=3, bytes_streamed=420_000_000_000, copy_seconds=7.5, copy_seconds_hidden=7.25,
                                 blocks_rest_in="pinned host memory"))
    line = next(line for line in summary(report).splitlines() if line.startswith("placement"))
    assert line == ("placement   streamed (auto: the weights (140.00GiB) exceed 90% of the device's): 3 waves, "
                    "420.00 GB into the block buffers in 7.50 s, 7.25 s of it behind compute; the blocks rest in "
                    "pinned host memory")
