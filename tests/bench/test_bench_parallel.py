"""fastppl bench --nproc: the pure parts, and one end-to-end run of 1 and 2 CPU processes on gloo."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fastppl.bench.parallel import (NLL_SUM_TOLERANCE, child_environment, corpus_tokens, parse_process_counts,
                                    run_row, usable_counts)
from fastppl.errors import FastpplError

SRC = Path(__file__).resolve().parents[2] / "src"


def test_process_counts_always_start_with_the_one_process_baseline():
    assert parse_process_counts("2") == [1, 2]
    assert parse_process_counts("8,1,4,2,4") == [1, 2, 4, 8]
    assert parse_process_counts("1") == [1]
    for bad in ("two", "0", "2,-1", "2,,4"):
        with pytest.raises(FastpplError, match="--nproc"):
            parse_process_counts(bad)


def test_counts_above_the_visible_gpus_are_skipped_on_cuda_only():
    lines = []
    assert usable_counts([1, 2, 4, 8], "cuda", 4, lines.append) == ([1, 2, 4], [8])
    assert lines == ["skipping --nproc 8: only 4 GPU(s) are visible"]
    assert usable_counts([1, 2, 4, 8], "cpu", 0, lines.append) == ([1, 2, 4, 8], [])


def test_the_corpus_splits_into_equal_whole_batches_for_every_count():
    assert corpus_tokens(4096, 64, 8, [1, 2]) == 4096
    assert corpus_tokens(4097, 64, 8, [1, 2]) == 5120
    n = corpus_tokens(10_000_000, 1024, 64, [1, 2, 4, 8])
    assert n >= 10_000_000 and n % (1024 * 64 * 8) == 0 and n - 10_000_000 < 1024 * 64 * 8
    assert corpus_tokens(1, 64, 8, [1, 3, 4]) == 64 * 8 * 12


def test_child_processes_keep_nvlink_multicast_off(monkeypatch):
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")
    assert child_environment()["NCCL_NVLS_ENABLE"] == "0"


def _report(nproc, tokens, seconds, nll_sum):
    return {"tokens_scored": tokens, "scoring_seconds": seconds, "nll_sum": nll_sum, "nll": nll_sum / tokens,
            "world_size": nproc, "wall_seconds": seconds + 1, "stage_seconds": {}, "batches": 4, "batch_size": 8,
            "loss": "chunked", "compile": "off", "peak_memory_bytes": None}


def test_speedup_efficiency_and_the_nll_sum_check():
    one = run_row(_report(1, 1000, 2.0, 5000.0), 1, 3.0, None)
    assert (one["tokens_per_second"], one["speedup"], one["efficiency"]) == (500.0, 1.0, 1.0)
    four = run_row(_report(4, 1000, 0.625, 5000.0 * (1 + 1e-13)), 4, 2.0, one)
    assert four["speedup"] == pytest.approx(3.2) and four["efficiency"] == pytest.approx(0.8)
    assert four["nll_sum_relative_difference"] == pytest.approx(1e-13, rel=1e-3) and four["nll_sum_equal"]
    off = run_row(_report(2, 1000, 1.0, 5000.0 * (1 + 10 * NLL_SUM_TOLERANCE)), 2, 2.0, one)
    assert not off["nll_sum_equal"]


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(SRC) + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    return env


@pytest.mark.slow   # two ranks under torchrun
def test_bench_nproc_2_on_cpu_equals_one_process(tmp_path, tokenizer_dir):
    out = tmp_path / "bench.json"
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "fastppl", "bench", "--nproc", "2", "--device", "cpu", "--model", "random:gpt2-tiny",
         "--tokens", "4096", "--seq", "64", "--batch-size", "8", "--tokenizer", str(tokenizer_dir),
         "--json", str(out)],
        env=_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    assert report["process_counts"] == [1, 2] and report["skipped_process_counts"] == []
    assert report["tokens"] == 4096 and report["seq_len"] == 64 and report["device"] == "cpu"
    one, two = report["runs"]
    assert (one["nproc"], one["world_size"], two["nproc"], two["world_size"]) == (1, 1, 2, 2)
    for run in report["runs"]:
        assert run["tokens_scored"] == 4096 and run["batches"] == 8 and run["batch_size"] == 8
        assert run["scoring_seconds"] > 0
        assert run["tokens_per_second"] == pytest.approx(4096 / run["scoring_seconds"])
    assert two["speedup"] == pytest.approx(two["tokens_per_second"] / one["tokens_per_second"])
    assert two["efficiency"] == pytest.approx(two["speedup"] / 2)
    # the two ranks score exactly the batches of the one process: only the order of the float64 sums differs
    assert abs(two["nll_sum"] - one["nll_sum"]) <= 1e-12 * abs(one["nll_sum"])
    assert two["nll_sum_equal"] and report["nll_sum_equal"]
    assert "processes" in done.stdout and "efficiency" in done.stdout
    assert time.perf_counter() - started < 90


@pytest.mark.slow   # a process of its own
def test_bench_nproc_errors_are_one_line(tmp_path, tokenizer_dir):
    done = subprocess.run(
        [sys.executable, "-m", "fastppl", "bench", "--nproc", "2,x", "--device", "cpu",
         "--tokenizer", str(tokenizer_dir)], env=_env(), capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stderr.strip().startswith("fastppl: error: --nproc '2,x'")
    # a failing run stops the bench with that run's error (here: windows longer than the model's positions)
    done = subprocess.run(
        [sys.executable, "-m", "fastppl", "bench", "--nproc", "2", "--device", "cpu", "--model", "random:gpt2-tiny",
         "--tokens", "1024", "--seq", "512", "--batch-size", "1", "--tokenizer", str(tokenizer_dir),
         "--json", str(tmp_path / "no.json")], env=_env(), capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1].startswith("fastppl: error: the 1-process run failed: --ctx 512")
    assert done.stderr.count("fastppl: error:") == 1, done.stderr   # the run's own error line is not echoed too
    assert not (tmp_path / "no.json").exists()
