"""--resume: a run killed with SIGKILL at random batches and started again ends with exactly the result of an
uninterrupted run, counting no window twice; a checkpoint of other arguments is refused."""
import json
import os
import random
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fastppl.cli import main
from fastppl.resume import CHECKPOINT_FILE

SRC = Path(__file__).resolve().parents[1] / "src"
FAULTS = Path(__file__).resolve().parent / "fixtures" / "faults"   # sitecustomize: SIGKILL after N batches
# everything a resumed run must reproduce bit for bit
EXACT_FIELDS = ("nll_sum", "nll", "ppl", "tokens_scored", "bytes", "words", "word_perplexity", "byte_perplexity",
                "bits_per_byte", "nll_by_position", "nll_by_position_std", "tokens_by_position", "windows", "batches",
                "padding_waste")


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory, shakespeare):
    directory = tmp_path_factory.mktemp("resume-docs")
    text = shakespeare.read_text()
    rng = random.Random(0)
    for i in range(16):   # 10 to 300 tokens or so: short documents and ones longer than ctx
        begin = rng.randrange(0, len(text) - 2000)
        (directory / f"{i:02d}.txt").write_text(text[begin:begin + rng.randrange(40, 1200)])
    return directory


def eval_args(tokenizer_dir, corpus_dir, out_dir: Path, *extra):
    return ["eval", "--model", "random:gpt2-tiny", "--tokenizer", str(tokenizer_dir), "--data", str(corpus_dir),
            "--ctx", "64", "--device", "cpu", "--quiet", "--batch-size", "2", "--json", str(out_dir / "r.json"),
            "--per-doc", str(out_dir / "docs.jsonl"), "--per-token", str(out_dir / "tokens.npy"),
            "--batching", "packed", *extra]   # the mode with the most state per batch


def run_cli(args, kill_after=None, fault=None):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(FAULTS), str(SRC)]), OMP_NUM_THREADS="1")
    env.pop("FASTPPL_FAULT", None)
    if kill_after is not None:
        fault = f"kill-after-batches:{kill_after}"
    if fault is not None:
        env["FASTPPL_FAULT"] = fault
    return subprocess.run([sys.executable, "-m", "fastppl", *args], env=env, capture_output=True, text=True,
                          timeout=300)


def checkpoint_meta(directory: Path) -> tuple[dict, np.ndarray]:
    with np.load(directory / CHECKPOINT_FILE) as stored:
        return json.loads(str(stored["meta"])), stored["finished_windows"]


@pytest.mark.slow   # processes killed and rerun
def test_killed_at_random_batches_then_resumed_gives_exactly_the_uninterrupted_result(tokenizer_dir, corpus_dir,
                                                                                      tmp_path):
    reference_dir, resumed_dir, checkpoint_dir = (tmp_path / name for name in ("reference", "resumed", "ckpt"))
    reference_dir.mkdir()
    resumed_dir.mkdir()
    assert main(eval_args(tokenizer_dir, corpus_dir, reference_dir)) == 0
    reference = json.loads((reference_dir / "r.json").read_text())
    n_batches = reference["batches"]
    assert n_batches >= 12 and reference["batching"] == "packed"

    rng = random.Random(20261202)
    # checkpoints every 3 batches and never by time, so kills fall between checkpoints too
    resume = ("--resume", str(checkpoint_dir), "--checkpoint-batches", "3", "--checkpoint-seconds", "1e9")
    done = 0
    for _ in range(2):   # killed twice at random batches, then left to finish
        kill_after = rng.randint(3, (n_batches - done) // 2)
        killed = run_cli(eval_args(tokenizer_dir, corpus_dir, resumed_dir, *resume), kill_after)
        assert killed.returncode == -signal.SIGKILL, killed.stderr
        assert not (resumed_dir / "r.json").exists()         # no result from a killed run
        meta, finished = checkpoint_meta(checkpoint_dir)
        assert meta["batches_done"] == (done + kill_after) // 3 * 3   # the last checkpoint before the kill
        done = meta["batches_done"]

    meta, finished = checkpoint_meta(checkpoint_dir)
    final = run_cli(eval_args(tokenizer_dir, corpus_dir, resumed_dir, *resume))
    assert final.returncode == 0, final.stderr
    resumed = json.loads((resumed_dir / "r.json").read_text())
    for field in EXACT_FIELDS:
        assert resumed[field] == reference[field], field
    assert (resumed_dir / "docs.jsonl").read_text() == (reference_dir / "docs.jsonl").read_text()
    assert np.array_equal(np.load(resumed_dir / "tokens.npy"), np.load(reference_dir / "tokens.npy"), equal_nan=True)
    # the last run scored exactly the windows the checkpoint had not finished
    assert resumed["resumed_from_batch"] == meta["batches_done"]
    assert resumed["windows_scored_this_run"] == reference["windows"] - int(finished.sum())
    meta, finished = checkpoint_meta(checkpoint_dir)
    assert meta["batches_done"] == n_batches and finished.all()


@pytest.mark.slow
def test_finished_checkpoint_reruns_without_scoring_and_other_arguments_are_refused(
        tokenizer_dir, corpus_dir, tmp_path, capsys):
    checkpoint_dir = tmp_path / "ckpt"
    args = eval_args(tokenizer_dir, corpus_dir, tmp_path, "--resume", str(checkpoint_dir))
    assert main(args) == 0
    first = json.loads((tmp_path / "r.json").read_text())
    assert first["resumed_from_batch"] == 0 and first["windows_scored_this_run"] == first["windows"]
    assert main(args) == 0
    again = json.loads((tmp_path / "r.json").read_text())
    assert again["windows_scored_this_run"] == 0 and again["resumed_from_batch"] == first["batches"]
    assert first["tokens_per_second"] > 0 and again["tokens_per_second"] is None   # nothing timed: not 0 tokens/s
    assert "speed       n/a tokens/s" in capsys.readouterr().out
    assert all(again[field] == first[field] for field in EXACT_FIELDS)

    capsys.readouterr()
    assert main(args[:args.index("--batch-size")] + ["--batch-size", "3"] + args[args.index("--batch-size") + 2:]) == 2
    error = capsys.readouterr().err
    assert "other arguments" in error and "batch_size: 2 then, 3 now" in error and "Traceback" not in error

    whole = (checkpoint_dir / CHECKPOINT_FILE).read_bytes()
    # cut in half (a BadZipFile traceback before), empty (EOFError), not a zip at all
    for damaged in (whole[:len(whole) // 2], b"", b"not a checkpoint"):
        (checkpoint_dir / CHECKPOINT_FILE).write_bytes(damaged)
        assert main(args) == 2
        error = capsys.readouterr().err
        assert "is not a readable fastppl checkpoint" in error and error.count("\n") == 1, error

    # a zip that numpy reads, damaged inside (each was a traceback before)
    (checkpoint_dir / CHECKPOINT_FILE).write_bytes(whole)
    with np.load(checkpoint_dir / CHECKPOINT_FILE) as stored:
        good = {name: stored[name] for name in stored.files}
    meta = json.loads(str(good["meta"]))
    damages = {
        "a sum cut short": dict(good, position_nll_sum=good["position_nll_sum"][:1]),
        "a sum missing": {k: v for k, v in good.items() if k != "nll_sum"},
        "a sum of strings": dict(good, nll_sum=np.array(["x"])),
        "meta not an object": dict(good, meta=np.array("[1]")),
        "batches_done missing": dict(good, meta=np.array(json.dumps({"fingerprint": meta["fingerprint"]}))),
        "batches_done not a number": dict(good, meta=np.array(json.dumps(dict(meta, batches_done="x")))),
        "finished windows not bool": dict(good, finished_windows=good["finished_windows"].astype(np.int64)),
    }
    for what, arrays in damages.items():
        with open(checkpoint_dir / CHECKPOINT_FILE, "wb") as f:
            np.savez(f, **arrays)
        assert main(args) == 2, what
        error = capsys.readouterr().err
        assert "is not a readable fastppl checkpoint" in error and error.count("\n") == 1, (what, error)

    # NaN sums: refused at load (before, the run went on to end in "the model produced a non-finite loss")
    for name in ("nll_sum", "position_nll_sq_sum"):
        poisoned = dict(good, **{name: np.full_like(good[name], np.nan)})
        with open(checkpoint_dir / CHECKPOINT_FILE, "wb") as f:
            np.savez(f, **poisoned)
        assert main(args) == 2, name
        error = capsys.readouterr().err
        assert "its sums are not finite (NaN or infinity)" in error and error.count("\n") == 1, (name, error)

    not_a_directory = tmp_path / "file"
    not_a_directory.write_text("x")
    assert main(eval_args(tokenizer_dir, corpus_dir, tmp_path, "--resume", str(not_a_directory))) == 2
    assert "is a file" in capsys.readouterr().err


@pytest.mark.slow   # the trained checkpoint fixture (training on the CPU)
def test_a_checkpoint_of_other_text_seed_or_model_files_is_refused(
        tokenizer_dir, corpus_dir, tiny_trained_checkpoint, tmp_path, capsys):
    """Not only the arguments: the corpus's text (same file names and lengths, one character changed), a document's
    name (same texts), the random weights' seed, and the contents of a local checkpoint directory's files (retrained
    at the same path, with the same size and modification time) each make the checkpoint another run's; a new
    modification time of the same weights does not."""
    corpus = tmp_path / "corpus"
    shutil.copytree(corpus_dir, corpus)
    out = tmp_path / "out"
    out.mkdir()
    args = eval_args(tokenizer_dir, corpus, out, "--resume", str(tmp_path / "ckpt"))
    assert main(args) == 0
    capsys.readouterr()

    def refused(argv, what):
        assert main(argv) == 2
        error = capsys.readouterr().err
        assert "other arguments" in error and what in error and "Traceback" not in error, error

    first = corpus / "00.txt"
    text = first.read_text()
    first.write_text(("#" if text[0] != "#" else "%") + text[1:])      # same length, same windows
    refused(args, "corpus_sha256")
    first.write_text(text)
    assert main(args) == 0                                              # the same text again: resumed
    capsys.readouterr()
    renamed = corpus / "00a.txt"                                        # the same texts in the same order,
    first.rename(renamed)                                               # but per-document results name it
    refused(args, "document_ids_sha256")
    renamed.rename(first)
    refused(args + ["--seed", "1"], "seed")

    model = tmp_path / "model"
    shutil.copytree(tiny_trained_checkpoint, model)
    at = args.index("--model") + 1
    with_model = args[:at] + [str(model)] + args[at + 1:]
    with_model[with_model.index("--resume") + 1] = str(tmp_path / "ckpt-model")
    assert main(with_model) == 0
    capsys.readouterr()
    weights = model / "model.safetensors"
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # copied again: other mtime, same weights
    assert main(with_model) == 0
    capsys.readouterr()
    stat = weights.stat()
    raw = bytearray(weights.read_bytes())
    raw[-1] ^= 1                     # the last weight's lowest mantissa bit: retrained, same size and mtime
    weights.write_bytes(bytes(raw))
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    refused(with_model, "model_files")


def test_checkpoints_by_time_alone_and_a_checkpoint_of_another_plan_is_refused(tokenizer_dir, corpus_dir, tmp_path):
    """--checkpoint-seconds 0 with no --checkpoint-batches saves after every batch (the clock, not a count, is
    what fires); a checkpoint whose finished windows do not match this run's plan is refused, not trusted."""
    checkpoint_dir = tmp_path / "ckpt"
    args = eval_args(tokenizer_dir, corpus_dir, tmp_path, "--resume", str(checkpoint_dir), "--checkpoint-seconds", "0")
    killed = run_cli(args, kill_after=5)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    meta, finished = checkpoint_meta(checkpoint_dir)
    assert meta["batches_done"] == 5 and 0 < finished.sum() < finished.size

    path = checkpoint_dir / CHECKPOINT_FILE
    with np.load(path) as stored:
        arrays = {name: stored[name] for name in stored.files}
    arrays["finished_windows"] = ~arrays["finished_windows"]   # the same fingerprint, other windows done
    with open(path, "wb") as f:
        np.savez(f, **arrays)
    refused = run_cli(args)
    assert refused.returncode == 2 and "do not match this run's plan" in refused.stderr, refused.stderr
    assert refused.stderr.count("\n") == 1 and not (tmp_path / "r.json").exists()


@pytest.mark.slow   # the trained checkpoint fixture (training on the CPU)
def test_the_same_run_given_otherwise_is_resumed(tokenizer_dir, corpus_dir, tiny_trained_checkpoint, tmp_path,
                                                 monkeypatch, capsys):
    """Arguments are compared as resolved: --ctx 256 is the default ctx of this model, and a relative path names the
    same model (and, by default, tokenizer) as the absolute one (both were refused as other arguments)."""
    def finished_without_scoring(argv):
        assert main(argv) == 0, capsys.readouterr().err
        result = json.loads((tmp_path / "r.json").read_text())
        assert result["windows_scored_this_run"] == 0 and result["resumed_from_batch"] == result["batches"]

    args = eval_args(tokenizer_dir, corpus_dir, tmp_path, "--resume", str(tmp_path / "ckpt"))
    at = args.index("--ctx")
    default_ctx = args[:at] + args[at + 2:]
    assert main(default_ctx) == 0
    assert json.loads((tmp_path / "r.json").read_text())["ctx"] == 256
    finished_without_scoring(args[:at] + ["--ctx", "256"] + args[at + 2:])

    shutil.copytree(tiny_trained_checkpoint, tmp_path / "model")
    with_model = eval_args(tokenizer_dir, corpus_dir, tmp_path, "--resume", str(tmp_path / "ckpt-model"))
    at = with_model.index("--tokenizer")
    with_model = with_model[:at] + with_model[at + 2:]   # the model's own
    with_model[with_model.index("--model") + 1] = str(tmp_path / "model")
    assert main(with_model) == 0
    monkeypatch.chdir(tmp_path)
    finished_without_scoring([value if value != str(tmp_path / "model") else "./model" for value in with_model])


@pytest.mark.slow   # processes killed and rerun
def test_temporary_files_of_a_save_cut_by_a_kill_are_removed_by_the_next_run(tokenizer_dir, corpus_dir, tmp_path):
    """A kill between writing a checkpoint's (or an output's) temporary file and its rename left .NAME.XXXXXXXX
    files behind for good; the next run removes them, and still ends with the uninterrupted result."""
    reference_dir, out_dir, checkpoint_dir = (tmp_path / name for name in ("reference", "out", "ckpt"))
    reference_dir.mkdir()
    out_dir.mkdir()
    assert main(eval_args(tokenizer_dir, corpus_dir, reference_dir)) == 0
    args = eval_args(tokenizer_dir, corpus_dir, out_dir, "--resume", str(checkpoint_dir), "--checkpoint-batches", "3",
                     "--checkpoint-seconds", "1e9")
    temporaries = lambda directory: sorted(p.name for p in directory.iterdir() if p.name.startswith("."))  # noqa: E731

    killed = run_cli(args, fault="kill-while-writing:checkpoint.npz")   # in the first save
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert not (checkpoint_dir / CHECKPOINT_FILE).exists()
    assert [name[:-8] for name in temporaries(checkpoint_dir)] == [f".{CHECKPOINT_FILE}."]

    killed = run_cli(args, fault="kill-while-writing:docs.jsonl")       # in the writing of the outputs
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert temporaries(checkpoint_dir) == [] and (checkpoint_dir / CHECKPOINT_FILE).exists()
    assert [name[:-8] for name in temporaries(out_dir)] == [".docs.jsonl.", ".tokens.npy."]
    assert not (out_dir / "r.json").exists()

    final = run_cli(args)
    assert final.returncode == 0, final.stderr
    assert temporaries(out_dir) == [] and temporaries(checkpoint_dir) == []
    resumed, reference = (json.loads((d / "r.json").read_text()) for d in (out_dir, reference_dir))
    assert all(resumed[field] == reference[field] for field in EXACT_FIELDS)
