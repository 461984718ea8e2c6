"""benchmarks/llama_cpp_peer.py: its reading of llama-perplexity's output, on logs a CPU build of llama.cpp printed
(tests/fixtures/llama_cpp: SmolLM2-135M-Instruct Q4_1 over 4 chunks of TinyShakespeare; the script's tiny random
Q4_K file against its F16 copy, --kl-divergence-base then --kl-divergence), checked against the lines as printed;
the GGUF files it writes; and with $LLAMA_PERPLEXITY (the path of a llama-perplexity binary) the script end to end."""
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LOGS = Path(__file__).parent / "fixtures" / "llama_cpp"


@pytest.fixture(scope="module")
def peer():
    spec = importlib.util.spec_from_file_location("llama_cpp_peer", ROOT / "benchmarks" / "llama_cpp_peer.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module   # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _printed(log: str, starts: str) -> str:
    """The text after `starts` on the one line of the log holding it (the log's own words, not the parser's)."""
    (line,) = [line for line in (LOGS / log).read_text().splitlines() if starts in line]
    return line.split(starts, 1)[1]


def _printed_bits_per_weight(log: str) -> float:
    """llama.cpp's loader line "file size   = 92.10 MiB (5.74 BPW)"."""
    return float(_printed(log, "file size   = ").split("(")[1].split()[0])


def _seconds(log: str, holding: str) -> float:
    """The timestamp (minutes.seconds.ms.us) of the line holding `holding`."""
    stamp = next(line for line in (LOGS / log).read_text().splitlines() if holding in line).split()[0]
    minutes, seconds, ms, us = (int(part) for part in stamp.split("."))
    return minutes * 60 + seconds + ms / 1e3 + us / 1e6


def test_a_perplexity_runs_log_gives_its_ppl_chunks_bits_per_weight_and_scoring_time(peer):
    figures = peer.parse_llama_perplexity((LOGS / "smollm2_q4_1_ppl.log").read_text())
    ppl, plus_minus = _printed("smollm2_q4_1_ppl.log", "Final estimate: PPL = ").split(" +/- ")
    assert figures["ppl"] == float(ppl) and figures["ppl_plus_minus"] == float(plus_minus)
    settings = dict(part.split("=") for part in _printed("smollm2_q4_1_ppl.log", " chunks, ").split(", "))
    chunks = int(_printed("smollm2_q4_1_ppl.log", "calculating perplexity over ").split()[0])
    assert (figures["chunks"], figures["ctx"], figures["n_seq"]) == (chunks, int(settings["n_ctx"]),
                                                                     int(settings["n_seq"]))
    assert figures["bits_per_weight"] == _printed_bits_per_weight("smollm2_q4_1_ppl.log")
    seconds = _seconds("smollm2_q4_1_ppl.log", "Final estimate") - _seconds("smollm2_q4_1_ppl.log",
                                                                            "calculating perplexity over")
    assert figures["seconds"] == pytest.approx(seconds, abs=1e-9)
    assert figures["tokens_per_second"] == pytest.approx(chunks * int(settings["n_ctx"]) / seconds)
    assert figures["divergence"] == {}


def test_a_kl_divergence_runs_log_gives_every_statistic_under_fastppls_names(peer):
    from fastppl.engine.divergence import COLUMNS
    from fastppl.report.divergence import divergence_statistics
    import numpy as np
    d = peer.parse_llama_perplexity((LOGS / "tiny_q4_k_kld.log").read_text())["divergence"]
    fastppl_names = set(divergence_statistics(np.random.default_rng(0).uniform(0, 1, (20, len(COLUMNS)))))
    lines = (LOGS / "tiny_q4_k_kld.log").read_text().split("====== Perplexity statistics")[1].splitlines()
    # the statistics' lines, not the timestamped ones after them
    printed = [line for line in lines if ":" in line and not re.match(r"\d+\.\d+\.\d+\.\d+ [A-Z] ", line)]
    assert set(d) <= fastppl_names and len(d) == len(printed) + sum("±" in line for line in printed)
    value, error = _printed("tiny_q4_k_kld.log", "Mean    KLD:").split("±")
    assert (d["kld_mean"], d["kld_mean_error"]) == (float(value), float(error))
    assert d["kld_p99"] == float(_printed("tiny_q4_k_kld.log", "99.0%   KLD:"))
    assert d["kld_p0.1"] == float(_printed("tiny_q4_k_kld.log", " 0.1%   KLD:"))
    same, same_error = _printed("tiny_q4_k_kld.log", "Same top p:").rstrip(" %").split("±")
    assert d["same_top1"] == pytest.approx(float(same) / 100) and d["same_top1_error"] == pytest.approx(
        float(same_error) / 100)
    assert d["ln_ppl_correlation"] == pytest.approx(float(_printed("tiny_q4_k_kld.log", "PPL(base))):").rstrip("%"))
                                                    / 100)
    ratio, ratio_error = _printed("tiny_q4_k_kld.log", "Mean PPL(Q)/PPL(base)         :").split("±")
    assert (d["ppl_ratio"], d["ppl_ratio_error"]) == (float(ratio), float(ratio_error))
    assert d["delta_p_p75"] == pytest.approx(float(_printed("tiny_q4_k_kld.log", "75.0%   Δp:").rstrip("%")) / 100)
    # its time ends where the statistics are printed (their lines carry no timestamp; the next line's does)
    assert peer.parse_llama_perplexity((LOGS / "tiny_q4_k_kld.log").read_text())["seconds"] > 0


def test_a_log_without_a_result_is_one_line_naming_its_last_lines(peer):
    with pytest.raises(peer.PeerError, match="printed no 'Final estimate'.*failed to load model"):
        peer.parse_llama_perplexity("0.00.001.000 I llama_model_load: error\nmain: failed to load model\n")


def test_the_written_q4_k_file_and_its_f16_copy_are_the_bits_per_weight_llama_cpp_printed(peer, tmp_path,
                                                                                          tokenizer_dir):
    """The tiny shape written as the fixtures' run wrote it: llama.cpp printed 4.50 and 16.00 BPW for the pair; the
    F16 copy holds the Q4_K file's values (fastppl loads both to the same weights)."""
    pytest.importorskip("gguf")
    import torch
    from fastppl.models import load_model
    from fastppl.models.bits import bits_per_weight
    quantized, base = tmp_path / "q4_k.gguf", tmp_path / "f16.gguf"
    assert peer.main(["write", "--shape", "tiny", str(quantized), "--base", str(base), "--tokenizer-dir",
                      str(tokenizer_dir), "--device", "cpu"]) == 0
    printed = {log: _printed_bits_per_weight(log) for log in ("tiny_q4_k_kld.log", "tiny_f16_kld_base.log")}
    assert round(bits_per_weight(str(quantized)), 2) == printed["tiny_q4_k_kld.log"]
    assert round(bits_per_weight(str(base)), 2) == printed["tiny_f16_kld_base.log"]
    q, f = (load_model(str(p), "native", torch.float32).state_dict() for p in (quantized, base))
    for name, values in q.items():
        assert torch.equal(values.half().float(), f[name]), name
        assert torch.isfinite(values).all() and values.abs().max() <= 1   # norms 1, weights ~0.02


def _run_script(*arguments, cwd):
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "llama_cpp_peer.py"), *arguments], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=600)


def test_a_llama_perplexity_that_cannot_run_is_one_line(tmp_path, shakespeare):
    done = _run_script("run", "--llama-perplexity", str(tmp_path / "no-such-binary"), "--model",
                       str(tmp_path / "m.gguf"), "--data", str(shakespeare), "--work-dir", str(tmp_path),
                       cwd=tmp_path)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.startswith(f"llama_cpp_peer: error: {tmp_path / 'no-such-binary'}: no such file")
    assert len(done.stderr.strip().splitlines()) == 1


@pytest.mark.skipif(not os.environ.get("LLAMA_PERPLEXITY"), reason="set LLAMA_PERPLEXITY to a llama-perplexity binary")
def test_the_script_end_to_end_on_a_tiny_q4_k_file_and_its_f16_base(tmp_path, tokenizer_dir, shakespeare):
    text = tmp_path / "text.txt"
    text.write_text(shakespeare.read_text()[:12000])
    assert _run_script("write", "--shape", "tiny", "q.gguf", "--base", "f.gguf", "--tokenizer-dir",
                       str(tokenizer_dir), "--device", "cpu", cwd=tmp_path).returncode == 0
    done = _run_script("run", "--llama-perplexity", os.environ["LLAMA_PERPLEXITY"], "--model", "q.gguf", "--base",
                       "f.gguf", "--data", str(text), "--ctx", "128", "--chunks", "4", "--llama-args", "",
                       "--device", "cpu", "--work-dir", str(tmp_path / "work"), "--json", "figures.json",
                       cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = {cells[0]: cells[1:] for cells in ([cell.strip() for cell in line.strip("|").split("|")]
                                              for line in done.stdout.splitlines() if line.startswith("| "))}
    assert rows["chunks of ctx"][:3] == ["4", "4", "same"]
    import json
    figures = json.loads((tmp_path / "figures.json").read_text())
    theirs, ours = figures["llama.cpp ppl"], figures["fastppl ppl"]
    assert ours["ppl"] == pytest.approx(theirs["ppl"], rel=0.01)   # within what 8-bit activations move it
    assert figures["llama.cpp kld"]["divergence"]["kld_mean"] < 1e-3
    assert figures["fastppl divergence"]["divergence"]["kld_mean"] < 1e-6   # equal weights, fp32: rounding only
