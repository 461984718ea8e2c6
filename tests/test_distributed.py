"""Data-parallel evaluation: the pure parts (shard_plans, environment, --nproc) and, with 2 CPU processes on
gloo, the reference test (two ranks = one process) and the failure protocol."""
import json
from dataclasses import dataclass
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from fastppl.cli import main
from fastppl.distributed import (LaunchEnv, launch_env, rank_device, shard_plans, timeout_seconds,
                                 torchrun_command, without_nproc)
from fastppl.errors import FastpplError

SRC = Path(__file__).resolve().parents[1] / "src"
FAULTS = Path(__file__).resolve().parent / "fixtures" / "faults"   # sitecustomize: a rank that fails
TEXT = ("It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of "
        "foolishness, it was the epoch of belief, it was the epoch of incredulity. ") * 6
DOCS = [
    "The quick brown fox jumps over the lazy dog, and then the dog wakes up and chases the fox around.",
    "A",
    "Call me Ishmael. Some years ago, never mind how long precisely, having little or no money in my purse, "
    "and nothing particular to interest me on shore, I thought I would sail about a little.",
    "In the beginning.",
    "It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in want "
    "of a wife. " * 3,
]


# ---------------------------------------------------------------------------------------------------------
# shard_plans (pure)

@dataclass(frozen=True)
class Plan:        # what shard_plans reads of a planned batch
    n_rows: int
    seq_len: int
    name: int = 0


def _plans(shapes):
    return [Plan(rows, seq, i) for i, (rows, seq) in enumerate(shapes)]


@pytest.mark.parametrize("shapes, world", [
    ([(8, 64)] * 13 + [(3, 64)], 2),                            # does not divide evenly
    ([(8, 64)] * 13 + [(3, 64)], 3),
    ([(8, 1024), (8, 512), (16, 128), (8, 128), (2, 64), (1, 64), (8, 32)], 4),   # bucketed: shapes differ
    ([(8, 64), (2, 64)], 5),                                    # more ranks than batches
    ([], 3),
])
def test_shard_plans_partitions_the_batches_and_balances_padded_tokens(shapes, world):
    plans = _plans(shapes)
    shares = [shard_plans(plans, rank, world) for rank in range(world)]
    assert sorted(p.name for share in shares for p in share) == list(range(len(plans)))   # each batch exactly once
    for share in shares:                                                                # planned order kept
        assert [p.name for p in share] == sorted(p.name for p in share)
    loads = [sum(p.n_rows * p.seq_len for p in share) for share in shares]
    if plans:   # greedy onto the lightest: no rank exceeds the lightest by more than the largest batch
        assert max(loads) - min(loads) <= max(p.n_rows * p.seq_len for p in plans)
    if len(plans) < world:
        assert sum(1 for share in shares if not share) == world - len(plans)


def test_shard_plans_is_the_identity_on_one_rank_and_golden():
    plans = _plans([(8, 64), (8, 64), (8, 64), (4, 64), (2, 64)])
    assert shard_plans(plans, 0, 1) == plans
    # onto the rank with the fewest padded tokens so far; ties to the lower rank
    assert [p.name for p in shard_plans(plans, 0, 2)] == [0, 2]
    assert [p.name for p in shard_plans(plans, 1, 2)] == [1, 3, 4]
    with pytest.raises(AssertionError):
        shard_plans(plans, 2, 2)


# ---------------------------------------------------------------------------------------------------------
# environment and --nproc (pure)

def test_launch_env():
    assert launch_env({}) is None
    assert launch_env({"WORLD_SIZE": "1", "RANK": "0"}) is None
    env = {"WORLD_SIZE": "4", "RANK": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "n1", "MASTER_PORT": "29500",
           "TORCHELASTIC_RESTART_COUNT": "1"}
    assert launch_env(env) == LaunchEnv(rank=2, world_size=4, local_rank=0, local_rank_given=True, restart=1)
    with pytest.raises(FastpplError, match="MASTER_ADDR"):
        launch_env({"WORLD_SIZE": "2", "RANK": "0", "MASTER_PORT": "1"})
    with pytest.raises(FastpplError, match="outside"):
        launch_env({**env, "RANK": "4"})
    with pytest.raises(FastpplError, match="not an integer"):
        launch_env({**env, "WORLD_SIZE": "two"})


def test_rank_device_and_timeout():
    env = LaunchEnv(rank=1, world_size=2, local_rank=1, local_rank_given=True, restart=0)
    assert rank_device("cpu", env).type == "cpu"
    assert timeout_seconds({}) == 600.0
    assert timeout_seconds({"FASTPPL_DIST_TIMEOUT": "2.5"}) == 2.5
    with pytest.raises(FastpplError, match="positive"):
        timeout_seconds({"FASTPPL_DIST_TIMEOUT": "0"})


def test_rank_device_on_gpus(monkeypatch):
    """Each rank takes cuda:LOCAL_RANK, and the ways that cannot work are refused (no GPU needed: one is faked)."""
    import fastppl.distributed as distributed
    import torch
    monkeypatch.setattr(distributed, "resolve_device", torch.device)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    rank1 = LaunchEnv(rank=1, world_size=2, local_rank=1, local_rank_given=True, restart=0)
    assert rank_device("cuda", rank1) == torch.device("cuda", 1)
    with pytest.raises(FastpplError, match="names one GPU, but each of the 2 processes needs its own"):
        rank_device("cuda:0", rank1)
    with pytest.raises(FastpplError, match="LOCAL_RANK is not set"):
        rank_device("cuda", LaunchEnv(rank=1, world_size=2, local_rank=0, local_rank_given=False, restart=0))
    with pytest.raises(FastpplError, match="LOCAL_RANK 2 but only 2 GPU"):
        rank_device("cuda", LaunchEnv(rank=2, world_size=3, local_rank=2, local_rank_given=True, restart=0))


def test_nproc_is_removed_from_the_relaunched_command():
    argv = ["eval", "--model", "m", "--nproc", "2", "--data", "d", "--nproc=3", "--npr", "4", "--quiet"]
    assert without_nproc(argv) == ["eval", "--model", "m", "--data", "d", "--quiet"]
    command = torchrun_command(2, ["eval", "--model", "m"])
    assert command[:3] == [sys.executable, "-m", "fastppl.launch"]
    assert command[3:] == ["--standalone", "--nproc-per-node", "2", "-m", "fastppl", "eval", "--model", "m"]


def test_nproc_is_capped_by_the_cores_this_process_may_use(tmp_path, capsys, monkeypatch):
    """The affinity's cores (a container's share), not the host's: gloo ranks beyond them only wait."""
    text = tmp_path / "t.txt"
    text.write_text("Some text.")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0}, raising=False)
    assert main(["eval", "--model", "random:gpt2-tiny", "--data", str(text), "--device", "cpu", "--nproc", "2"]) == 2
    assert capsys.readouterr().err == ("fastppl: error: --nproc 2 is more processes than the 1 CPU cores this process "
                                       "may use; use one per GPU (or at most one per core)\n")


@pytest.mark.parametrize("device, message", [
    ("cuda", "--nproc 3 is more processes than the 2 visible GPU(s); use at most 2, one per GPU"),
    ("auto", "--nproc 3 is more processes than the 2 visible GPU(s); use at most 2, one per GPU"),
    ("cuda:1", "--device cuda:1 names one GPU, but each of the 3 processes needs its own; pass --device cuda"),
])
def test_nproc_on_gpus_is_capped_by_the_gpus_before_torchrun_starts(tmp_path, capsys, monkeypatch, device, message):
    """A rank per GPU: more ranks than GPUs were started, then failed one by one (LOCAL_RANK beyond the GPUs)."""
    import fastppl.distributed
    text = tmp_path / "t.txt"
    text.write_text("Some text.")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(fastppl.distributed, "relaunch_under_torchrun", lambda *a: pytest.fail("torchrun started"))
    assert main(["eval", "--model", "random:gpt2-tiny", "--data", str(text), "--device", device, "--nproc", "3"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"fastppl: error: {message}") and err.count("\n") == 1, err


def test_nproc_below_one_is_an_error(tmp_path, tokenizer_dir, capsys):
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    assert main(["eval", "--model", "random:gpt2-tiny", "--data", str(text), "--nproc", "0"]) == 2
    assert "--nproc must be at least 1" in capsys.readouterr().err


@pytest.mark.parametrize("extra, flag", [(["--resume", "ckpt"], "--resume"),
                                         (["--window", "sliding", "--kv-cache", "on"], "--kv-cache on")])
def test_nproc_refuses_one_process_options_before_starting_torchrun(tmp_path, capsys, extra, flag, monkeypatch):
    import fastppl.distributed as distributed
    monkeypatch.setattr(distributed, "relaunch_under_torchrun", lambda *a: pytest.fail("torchrun was started"))
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    monkeypatch.chdir(tmp_path)
    assert main(["eval", "--model", "random:llama-tiny", "--data", str(text), "--nproc", "2", *extra]) == 2
    assert capsys.readouterr().err == (f"fastppl: error: {flag} runs in one process only; drop it or run without "
                                       "--nproc / torchrun\n")
    assert not (tmp_path / "ckpt").exists()


# ---------------------------------------------------------------------------------------------------------
# two processes (gloo) against one

def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join([str(FAULTS), str(SRC), env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


def run_cli_jobs_on_two_ranks(jobs: list, tmp_path, timeout: int) -> subprocess.CompletedProcess:
    """Every (argv, exit code) job through the CLI in one torchrun job of 2 processes, started once; the finished
    job, whose stderr holds every rank's."""
    runner = tmp_path / "run_cases.py"
    runner.write_text("import json, sys\nfrom fastppl.cli import main\n"
                      "for argv, rc in json.load(open(sys.argv[1])):\n    assert main(argv) == rc, argv\n")
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(runner), str(tmp_path / "jobs.json")], env=_env(), capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def _corpus(tmp_path):
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    short = tmp_path / "short.txt"
    short.write_text("Only one window here.")
    return text, docs, short


def _cases(tmp_path, tokenizer_dir):
    """name -> argv without outputs. The windows of `text` (ctx 32) do not divide evenly between 2 ranks;
    `short` has one window, so rank 1 has nothing to score."""
    text, docs, short = _corpus(tmp_path)
    common = ["--model", "random:gpt2-tiny", "--tokenizer", str(tokenizer_dir), "--device", "cpu", "--quiet"]
    return {
        "chunked": ["eval", *common, "--data", str(text), "--ctx", "32", "--batch-size", "3", "--bootstrap", "100"],
        "sliding": ["eval", *common, "--data", str(text), "--window", "sliding", "--ctx", "32", "--stride", "12"],
        "sliding_bos": ["eval", *common, "--data", str(text), "--window", "sliding", "--ctx", "24", "--bos"],
        "docs_chunked": ["eval", *common, "--data", str(docs), "--ctx", "16", "--batch-size", "2", "--bootstrap",
                         "100"],
        "docs_sliding": ["eval", *common, "--data", str(docs), "--window", "sliding", "--ctx", "16", "--stride", "5"],
        "one_window": ["eval", *common, "--data", str(short), "--ctx", "64"],
    }


def _outputs(directory: Path, name: str) -> list[str]:
    return ["--json", str(directory / f"{name}.json"), "--per-token", str(directory / f"{name}.npy"),
            "--per-doc", str(directory / f"{name}.jsonl")]


def _assert_same(one: Path, two: Path, name: str):
    a = json.loads((one / f"{name}.json").read_text())
    b = json.loads((two / f"{name}.json").read_text())
    assert b["world_size"] == 2 and "world_size" not in a
    for key in ("tokens_scored", "tokens_total", "bytes", "words", "documents", "windows", "ctx", "stride",
                "tokens_by_position"):
        assert a[key] == b[key], key
    for key in ("nll_sum", "nll", "bits_per_byte", "word_perplexity", "nll_stderr", "ppl_stderr"):
        assert b[key] == pytest.approx(a[key], rel=1e-12, abs=0), key
    if a["bootstrap"] or b["bootstrap"]:   # the same units' sums, resampled with the same seed
        assert a["bootstrap"]["resampled"]["tokens"] == b["bootstrap"]["resampled"]["tokens"]
        for key in ("nll", "ppl", "bits_per_byte"):
            assert b["bootstrap"][key] == pytest.approx(a["bootstrap"][key], rel=1e-12, abs=0), key
    for key in ("nll_by_position", "nll_by_position_std"):   # the std needs every rank's squared sums
        for x, y in zip(a[key], b[key], strict=True):
            assert (x is None and y is None) or y == pytest.approx(x, rel=1e-12, abs=0), key
    # every document's sums reach rank 0's file, not only rank 0's share of them
    per_doc_one, per_doc_two = [[json.loads(line) for line in (d / f"{name}.jsonl").read_text().splitlines()]
                                for d in (one, two)]
    assert len(per_doc_one) == len(per_doc_two) == a["documents"] - a["documents_skipped"]
    for x, y in zip(per_doc_one, per_doc_two, strict=True):
        assert x.keys() == y.keys() and x["id"] == y["id"] and x["tokens"] == y["tokens"], (x, y)
        assert y["nll_sum"] == pytest.approx(x["nll_sum"], rel=1e-12, abs=0), (x, y)
    per_token_one, per_token_two = np.load(one / f"{name}.npy"), np.load(two / f"{name}.npy")
    assert per_token_one.dtype == per_token_two.dtype and per_token_one.shape == per_token_two.shape
    assert np.array_equal(per_token_one, per_token_two, equal_nan=True)   # identical, not merely close


@pytest.mark.slow
def test_two_ranks_equal_one_process(tmp_path, tokenizer_dir):
    cases = _cases(tmp_path, tokenizer_dir)
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir()
    two.mkdir()
    for name, argv in cases.items():
        assert main(argv + _outputs(one, name)) == 0

    # every case in one torchrun job (2 processes started once), each through the CLI; last, a bad input,
    # which every rank validates alike and rejects with the same error before any collective
    jobs = [(argv + _outputs(two, name), 0) for name, argv in cases.items()]
    jobs.append((cases["chunked"] + ["--ctx", "1000"] + _outputs(two, "bad"), 2))
    done = run_cli_jobs_on_two_ranks(jobs, tmp_path, timeout=120)
    for name in cases:
        _assert_same(one, two, name)
    bad = "fastppl: error: --ctx 1000 exceeds the model's maximum of 256 positions; lower --ctx"
    assert done.stderr.count(bad) == 2                    # one line from each rank
    assert not (two / "bad.json").exists() and not (two / "bad.npy").exists()


@pytest.mark.slow
def test_nproc_shortcut_runs_torchrun(tmp_path, tokenizer_dir):
    argv = _cases(tmp_path, tokenizer_dir)["docs_chunked"]
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir()
    two.mkdir()
    assert main(argv + _outputs(one, "docs_chunked")) == 0
    done = subprocess.run([sys.executable, "-m", "fastppl", *argv, "--nproc", "2", *_outputs(two, "docs_chunked")],
                          env=_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("perplexity") == 1          # only rank 0 prints the summary
    _assert_same(one, two, "docs_chunked")


@pytest.mark.slow
def test_nproc_bad_input_is_one_line_and_exit_2(tmp_path, tokenizer_dir):
    """Every rank meets the same bad input: rank 0 says it once, and --nproc exits 2 as one process does. Before,
    each rank printed it, then torchrun's ChildFailedError report and traceback followed, and the status was 1."""
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    done = subprocess.run([sys.executable, "-m", "fastppl", "eval", "--model", "random:gpt2-tiny", "--tokenizer",
                           str(tokenizer_dir), "--device", "cpu", "--data", str(empty), "--nproc", "2"],
                          env=_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr == f"fastppl: error: {empty}: is empty (or whitespace only); pass a file with text in it\n"
    assert done.stdout == ""


# ---------------------------------------------------------------------------------------------------------
# failures: every rank stops quickly, the first error is shown, no report is written

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch_without_torchrun(argv, **extra_env) -> list[subprocess.CompletedProcess]:
    """Two ranks started by hand (as an scheduler's own launcher would), so that what stops rank 0 is
    fastppl's failure protocol and not torchrun killing it."""
    return _launch_ranks([argv, argv], **extra_env)


def _launch_ranks(argv_by_rank, cwd_by_rank=(None, None), **extra_env) -> list[subprocess.CompletedProcess]:
    """_launch_without_torchrun with each rank's own arguments and working directory."""
    port = str(_free_port())
    processes = [subprocess.Popen(
        [sys.executable, "-m", "fastppl", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        cwd=cwd, env=_env(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=port, **extra_env),
    ) for rank, (argv, cwd) in enumerate(zip(argv_by_rank, cwd_by_rank))]
    results = []
    for p in processes:
        try:
            stdout, stderr = p.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            for q in processes:
                q.kill()
            raise AssertionError("a rank hung")
        results.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    return results


def _long_job(tmp_path, tokenizer_dir) -> list[str]:
    # batch size 1 and ctx 16: rank 0 still has many batches to go when rank 1 fails at its first
    text, _, _ = _corpus(tmp_path)
    return ["eval", "--model", "random:gpt2-tiny", "--tokenizer", str(tokenizer_dir), "--device", "cpu", "--quiet",
            "--data", str(text), "--ctx", "16", "--batch-size", "1", "--json", str(tmp_path / "r.json")]


@pytest.mark.slow
def test_a_failing_rank_stops_the_other_with_its_error(tmp_path, tokenizer_dir):
    rank0, rank1 = _launch_without_torchrun(_long_job(tmp_path, tokenizer_dir), FASTPPL_FAULT="rank-fails:1:error")
    assert rank1.returncode == 2
    assert rank1.stderr.strip() == "fastppl: error: injected failure on rank 1 (FASTPPL_FAULT)"
    assert rank0.returncode == 2
    assert rank0.stderr.strip() == "fastppl: error: rank 1 failed: injected failure on rank 1 (FASTPPL_FAULT)"
    assert not (tmp_path / "r.json").exists()


@pytest.mark.slow
def test_a_crashing_rank_makes_the_others_exit_as_a_crash_not_as_bad_input(tmp_path, tokenizer_dir):
    """Rank 0 reports rank 1's RuntimeError with rank 1's status (1), not 2, which means bad input."""
    rank0, rank1 = _launch_without_torchrun(_long_job(tmp_path, tokenizer_dir), FASTPPL_FAULT="rank-fails:1:raise")
    assert rank1.returncode == 1 and "RuntimeError: injected failure on rank 1" in rank1.stderr
    assert rank0.returncode == 1
    assert rank0.stderr.strip() == ("fastppl: error: rank 1 failed: RuntimeError: injected failure on rank 1 "
                                    "(FASTPPL_FAULT)")


@pytest.mark.slow
def test_a_killed_rank_ends_the_job_after_the_timeout(tmp_path, tokenizer_dir):
    started = time.monotonic()
    rank0, rank1 = _launch_without_torchrun(_long_job(tmp_path, tokenizer_dir),
                                            FASTPPL_FAULT="rank-fails:1:kill", FASTPPL_DIST_TIMEOUT="2")
    assert rank1.returncode == -9
    assert rank0.returncode == 1   # a lost process, not bad input (2)
    assert "rank(s) 1 did not get to the end of scoring within 2 s" in rank0.stderr
    assert time.monotonic() - started < 60
    assert not (tmp_path / "r.json").exists()


@pytest.mark.slow
def test_under_torchrun_a_raising_rank_fails_the_job(tmp_path, tokenizer_dir):
    # torchrun stops the other rank as soon as one exits non-zero and exits 1 itself; --nproc passes that on
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "fastppl", *_long_job(tmp_path, tokenizer_dir), "--nproc", "2"],
                          env=_env(FASTPPL_FAULT="rank-fails:1:raise"), capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert "RuntimeError: injected failure on rank 1 (FASTPPL_FAULT)" in done.stderr
    assert time.monotonic() - started < 60
    assert not (tmp_path / "r.json").exists()


@pytest.mark.slow
def test_nproc_names_a_rank_killed_by_a_signal_in_one_line(tmp_path, tokenizer_dir):
    """kill -9 of a rank gave exit 137 and nothing on stderr: torchrun's launcher says which rank died and how."""
    done = subprocess.run([sys.executable, "-m", "fastppl", *_long_job(tmp_path, tokenizer_dir), "--nproc", "2"],
                          env=_env(FASTPPL_FAULT="rank-fails:1:kill"), capture_output=True, text=True, timeout=120)
    assert done.returncode == 128 + signal.SIGKILL, done.stderr[-3000:]
    assert done.stderr == ("fastppl: error: rank 1 was killed by SIGKILL (signal 9) (kill -9, or the system's "
                           "out-of-memory killer: see dmesg); the job stopped and wrote no result\n")
    assert done.stdout == "" and not (tmp_path / "r.json").exists()


@pytest.mark.slow
def test_nproc_interrupted_says_so_once(tmp_path, tokenizer_dir):
    """Ctrl-C reaches the terminal's process group (here: the fastppl process's own); before, the launcher's
    traceback and each rank's "fastppl: interrupted" followed, with TCPStore's C++ frames at times."""
    done = subprocess.run([sys.executable, "-m", "fastppl", *_long_job(tmp_path, tokenizer_dir), "--nproc", "2"],
                          env=_env(FASTPPL_FAULT="interrupt-after-batches:2"), capture_output=True, text=True,
                          timeout=120, start_new_session=True)
    assert done.returncode == 130, done.stderr[-3000:]
    assert done.stderr == "fastppl: interrupted\n"
    assert done.stdout == "" and not (tmp_path / "r.json").exists()


# ---------------------------------------------------------------------------------------------------------
# ranks that read other inputs: one line from rank 0 naming the rank and what differs, exit 2, no report

def _rank_job(tmp_path, tokenizer_dir, model="random:gpt2-tiny", data="text.txt", *extra) -> list[str]:
    return ["eval", "--model", model, "--tokenizer", str(tokenizer_dir), "--device", "cpu", "--quiet", "--data", data,
            "--ctx", "16", "--batch-size", "4", "--json", str(tmp_path / "r.json"), *extra]


def _assert_refused(ranks, tmp_path, fragment):
    assert [r.returncode for r in ranks] == [2, 2], [r.stderr for r in ranks]
    lines = ranks[0].stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fastppl: error: rank 1 has other ") and fragment in lines[0], \
        ranks[0].stderr
    assert "than rank 0; give every rank the same arguments, files and model" in lines[0]
    assert ranks[1].stderr == "" and not (tmp_path / "r.json").exists()


@pytest.mark.slow
def test_a_rank_with_another_model_is_refused(tmp_path, tokenizer_dir):
    (tmp_path / "text.txt").write_text(TEXT)
    ranks = _launch_ranks([_rank_job(tmp_path, tokenizer_dir), _rank_job(tmp_path, tokenizer_dir, "random:llama-tiny")],
                          (tmp_path, tmp_path))
    _assert_refused(ranks, tmp_path, "other model weights than rank 0")


@pytest.mark.slow
def test_a_rank_whose_copy_of_the_corpus_differs_in_one_character_is_refused(tmp_path, tokenizer_dir):
    """Each machine reads its own copy under the same name: the document ids agree, the texts do not."""
    copies = [tmp_path / "machine0", tmp_path / "machine1"]
    for copy, text in zip(copies, (TEXT, TEXT.replace("a", "e", 1))):
        copy.mkdir()
        (copy / "text.txt").write_text(text)
    ranks = _launch_ranks([_rank_job(tmp_path, tokenizer_dir)] * 2, copies)
    _assert_refused(ranks, tmp_path, "other corpus")


@pytest.mark.slow
def test_a_rank_with_another_ctx_or_seed_is_refused_by_name(tmp_path, tokenizer_dir):
    (tmp_path / "text.txt").write_text(TEXT)
    job = _rank_job(tmp_path, tokenizer_dir)
    other = [value if value != "16" else "32" for value in job] + ["--seed", "1"]
    ranks = _launch_ranks([job, other], (tmp_path, tmp_path))
    _assert_refused(ranks, tmp_path, "other --ctx, --seed, model weights, windows than rank 0")


@pytest.mark.slow
def test_a_rank_failing_in_the_batch_size_probe_stops_the_other_with_one_line(tmp_path, tokenizer_dir):
    """The ranks agree on --batch-size auto through a barrier that watches for failures, not a bare collective
    that would leave rank 0 waiting for a rank that is gone."""
    job = [value for value in _long_job(tmp_path, tokenizer_dir) if value not in ("--batch-size", "1")]
    rank0, rank1 = _launch_without_torchrun(job, FASTPPL_FAULT="probe-fails:1")
    assert rank1.returncode == 2 and rank0.returncode == 2, (rank0.stderr, rank1.stderr)
    assert rank0.stderr.strip() == ("fastppl: error: rank 1 failed: injected failure in the batch-size probe on "
                                    "rank 1 (FASTPPL_FAULT)"), rank0.stderr
    assert not (tmp_path / "r.json").exists()


@pytest.mark.slow
def test_two_ranks_streamed_equal_one_process_resident(tmp_path, tokenizer_dir):
    """Under torchrun each rank streams over its own batches, in waves of its own; the merged sums are one
    resident process'."""
    cases = _cases(tmp_path, tokenizer_dir)
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir()
    two.mkdir()
    streamed = ["--placement", "streamed", "--max-gpu-memory", "300MiB"]
    names = ("chunked", "docs_sliding")
    for name in names:
        assert main(cases[name] + _outputs(one, name)) == 0
    run_cli_jobs_on_two_ranks([(cases[name] + streamed + _outputs(two, name), 0) for name in names], tmp_path,
                              timeout=180)
    for name in names:
        _assert_same(one, two, name)
        assert json.loads((two / f"{name}.json").read_text())["placement"] == "streamed"
