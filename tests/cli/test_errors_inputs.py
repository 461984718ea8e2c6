"""Inputs that are not what a run can read, at every entry point: a FIFO (open() waits for a writer that never
comes), a device, a binary file (a sparse file of NULs, which used to be read whole), and a bootstrap that
cannot finish. Each is one line "fastppl: error: ...", exit code 2, no output file, at once. A FIFO that a run
opened anyway is opened by a writer after a few seconds, so that a regression fails instead of hanging."""
import contextlib
import json
import os
import threading

import pytest
from cli_errors import TINY, _assert_user_error, _main

from fastppl.cli import main


@contextlib.contextmanager
def writers_for(fifos, every: float = 2.0):
    """Opens and closes each FIFO for writing every `every` seconds while the block runs: a reader waiting on
    one reads an empty file and goes on (and the test fails) instead of waiting forever."""
    done = threading.Event()

    def unblock():
        while not done.wait(every):
            for fifo in fifos:
                with contextlib.suppress(OSError):   # ENXIO: nobody is reading
                    os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    thread = threading.Thread(target=unblock, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def _checkpoint(tmp_path, tokenizer_dir, fifo_name):
    """A tokenizer directory made a checkpoint directory (a config.json beside it), with fifo_name a FIFO."""
    directory = tmp_path / "checkpoint"
    directory.mkdir()
    for f in tokenizer_dir.iterdir():
        (directory / f.name).write_bytes(f.read_bytes())
    (directory / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 32, "n_layer": 1,
                                                       "n_head": 2, "vocab_size": 50257}))
    (directory / "model.safetensors").write_bytes(b"")
    (directory / fifo_name).unlink(missing_ok=True)
    os.mkfifo(directory / fifo_name)
    return directory, directory / fifo_name


def _fifo(tmp_path, name):
    os.mkfifo(tmp_path / name)
    return tmp_path / name, tmp_path / name


def _in_directory(tmp_path, name):
    directory = tmp_path / "documents"
    directory.mkdir()
    (directory / "a.txt").write_text("A document of the directory.")
    os.mkfifo(directory / name)
    return directory, directory / name


def _with_json(args, path):
    """args and an output that must stay unwritten (compare writes none of its own)."""
    return args if args[0] == "compare" else args + ["--json", str(path)]


def _report(tmp_path, tokenizer_dir):
    """A real report and per-document file, to compare against."""
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": f"Document {i} of four, with some words."})
                                                 + "\n" for i in range(4)))
    report, docs = tmp_path / "good.json", tmp_path / "good.jsonl"
    assert main(["eval", "--model", TINY, "--tokenizer", str(tokenizer_dir), "--device", "cpu", "--quiet",
                 "--data", str(tmp_path / "docs.jsonl"), "--ctx", "16", "--json", str(report),
                 "--per-doc", str(docs)]) == 0
    return report, docs


# (entry point, how the FIFO is made: (the argument, the FIFO) from (tmp_path, tokenizer_dir), its arguments)
EVAL = ["eval", "--model", TINY, "--device", "cpu", "--quiet", "--ctx", "16"]
FIFOS = [
    ("--data .txt", lambda t, k: _fifo(t, "data.txt"), lambda a, t, k: EVAL + ["--data", a, "--tokenizer", k]),
    ("--data .jsonl", lambda t, k: _fifo(t, "data.jsonl"), lambda a, t, k: EVAL + ["--data", a, "--tokenizer", k]),
    ("--data .npy", lambda t, k: _fifo(t, "ids.npy"), lambda a, t, k: EVAL + ["--data", a, "--tokenizer", k]),
    ("--data directory member", lambda t, k: _in_directory(t, "b.txt"),
     lambda a, t, k: EVAL + ["--data", a, "--tokenizer", k]),
    ("--corpus of a table", lambda t, k: _fifo(t, "corpus.txt"),
     lambda a, t, k: EVAL + ["--corpus", a, "--corpus", str(t / "text.txt"), "--tokenizer", k]),
    ("checkpoint config.json", lambda t, k: _checkpoint(t, k, "config.json"),
     lambda a, t, k: EVAL[:2] + [a] + EVAL[3:] + ["--data", str(t / "text.txt")]),
    ("checkpoint model.safetensors", lambda t, k: _checkpoint(t, k, "model.safetensors"),
     lambda a, t, k: EVAL[:2] + [a] + EVAL[3:] + ["--data", str(t / "text.txt")]),
    ("checkpoint tokenizer_config.json", lambda t, k: _checkpoint(t, k, "tokenizer_config.json"),
     lambda a, t, k: EVAL[:2] + [a] + EVAL[3:] + ["--data", str(t / "text.txt")]),
    ("--reference-model's config.json", lambda t, k: _checkpoint(t, k, "config.json"),
     lambda a, t, k: EVAL + ["--reference-model", a, "--tokenizer", k, "--data", str(t / "text.txt")]),
    ("--tokenizer's tokenizer.json", lambda t, k: _checkpoint(t, k, "tokenizer.json"),
     lambda a, t, k: EVAL + ["--tokenizer", a, "--data", str(t / "text.txt")]),
    ("--tokenizer itself", lambda t, k: _fifo(t, "tokenizer"),
     lambda a, t, k: EVAL + ["--tokenizer", a, "--data", str(t / "text.txt")]),
    ("--model FILE.gguf", lambda t, k: _fifo(t, "model.gguf"),
     lambda a, t, k: EVAL[:2] + [a] + EVAL[3:] + ["--tokenizer", k, "--data", str(t / "text.txt")]),
    ("compare's report", lambda t, k: _fifo(t, "run.json"),
     lambda a, t, k: ["compare", str(_report(t, k)[0]), a]),
    ("compare --per-doc", lambda t, k: _fifo(t, "run.jsonl"),
     lambda a, t, k: ["compare", "--per-doc", str(_report(t, k)[1]), a]),
    ("generate --prompts", lambda t, k: _fifo(t, "prompts.txt"),
     lambda a, t, k: ["generate", "--model", TINY, "--tokenizer", k, "--device", "cpu", "--prompts", a]),
]


@pytest.mark.parametrize("make, arguments", [case[1:] for case in FIFOS], ids=[case[0] for case in FIFOS])
def test_a_fifo_is_refused_at_every_entry_point(make, arguments, tmp_path, tokenizer_dir, capsys):
    (tmp_path / "text.txt").write_text("To be, or not to be, that is the question. " * 4)
    out = tmp_path / "out"
    out.mkdir()
    given, fifo = make(tmp_path, tokenizer_dir)
    args = arguments(str(given), tmp_path, str(tokenizer_dir))
    capsys.readouterr()
    with writers_for([fifo]):
        rc, err = _main(capsys, _with_json(args, out / "r.json"))
    _assert_user_error(rc, err, (out / "r.json",), f"{fifo}: is a FIFO, not a regular file; ")


def test_a_device_is_refused_where_a_file_is_read(tmp_path, tokenizer_dir, capsys):
    """--data /dev/zero (already refused) and the same device inside a checkpoint, a tokenizer directory and
    the inputs of compare and generate."""
    directory, fifo = _checkpoint(tmp_path, tokenizer_dir, "config.json")
    fifo.unlink()
    fifo.symlink_to("/dev/zero")
    out = tmp_path / "out"
    out.mkdir()
    for args in (EVAL + ["--data", "/dev/zero", "--tokenizer", str(tokenizer_dir)],
                 EVAL[:2] + [str(directory)] + EVAL[3:] + ["--data", "/dev/zero"],
                 EVAL + ["--tokenizer", str(directory), "--data", "/dev/zero"],
                 ["compare", "/dev/zero"], ["compare", "--per-doc", "/dev/zero"],
                 ["generate", "--model", TINY, "--device", "cpu", "--prompts", "/dev/zero"]):
        rc, err = _main(capsys, _with_json(args, out / "r.json"))
        _assert_user_error(rc, err, (out / "r.json",), "is a device, not a regular file; ")


@pytest.mark.parametrize("where", ["--data", "--data directory member", "compare", "compare --per-doc",
                                   "generate --prompts"])
def test_a_sparse_file_of_nuls_is_refused_before_it_is_read(where, tmp_path, tokenizer_dir, capsys, monkeypatch):
    """2 GiB of NUL bytes (no disk used): binary, not text, refused from its first block; it was read whole
    (and tokenised, on a machine with the memory). Here the limits on what is read are 1 GiB, so that a
    regression is refused as too large instead of using the memory."""
    import fastppl.data.corpus as corpus
    monkeypatch.setattr(corpus, "available_memory_bytes", lambda: 8 << 30)
    monkeypatch.setattr("fastppl.report.inputs.MAX_INPUT_BYTES", 1 << 30)
    sparse = tmp_path / ("documents" if where == "--data directory member" else "inputs") / "zeros.txt"
    sparse.parent.mkdir()
    with open(sparse, "wb") as f:
        f.truncate(2 << 30)
    given = sparse.parent if where == "--data directory member" else sparse
    args = {"compare": ["compare", str(given)], "compare --per-doc": ["compare", "--per-doc", str(given)],
            "generate --prompts": ["generate", "--model", TINY, "--tokenizer", str(tokenizer_dir), "--device", "cpu",
                                   "--prompts", str(given)]}.get(
        where, EVAL + ["--data", str(given), "--tokenizer", str(tokenizer_dir)])
    out = tmp_path / "out"
    out.mkdir()
    rc, err = _main(capsys, _with_json(args, out / "r.json"))
    _assert_user_error(rc, err, (out / "r.json",), f"{sparse}: holds a NUL byte", "binary")


def test_a_nul_byte_past_the_first_block_is_refused_too(tmp_path, tokenizer_dir, capsys):
    text = tmp_path / "text.txt"
    text.write_bytes(b"word " * 20_000 + b"\0 and more words")
    out = tmp_path / "out"
    out.mkdir()
    rc, err = _main(capsys, EVAL + ["--data", str(text), "--tokenizer", str(tokenizer_dir),
                                    "--json", str(out / "r.json")])
    _assert_user_error(rc, err, (out / "r.json",), f"{text}: holds a NUL byte (at byte 100,000), so it is binary")


@pytest.mark.parametrize("replicates, message", [
    (1_000_000, "--bootstrap 1,000,000 over 2,000 documents would draw 2,000,000,000 units, more than the "
                "1,000,000,000 of one run (about a minute); use --bootstrap 500,000 or fewer"),
    (200, None)])
def test_a_bootstrap_that_cannot_finish_is_refused_before_scoring(replicates, message, tmp_path, tokenizer_dir,
                                                                   capsys, monkeypatch):
    """Resamples x documents bounds the bootstrap's work: 10^6 over 2,000 documents ran for minutes, after the
    scoring; the refusal comes before it."""
    import fastppl.pipeline as pipeline
    import fastppl.report.stats as stats
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": f"Document {i}."}) + "\n" for i in range(2_000)))
    if message is None:   # past a lower limit, too few resamples fit: the advice is to drop --bootstrap
        monkeypatch.setattr(stats, "MAX_DRAWS", 100_000)
        message = "over 2,000 documents would draw 400,000 units, more than the 100,000 of one run (about a " \
                  "minute); drop --bootstrap (the standard error is reported without it)"

    def scored(*args, **kwargs):
        raise AssertionError("the corpus was scored before the refusal")
    monkeypatch.setattr(pipeline, "score", scored)
    out = tmp_path / "out"
    out.mkdir()
    rc, err = _main(capsys, EVAL + ["--data", str(data), "--tokenizer", str(tokenizer_dir), "--bootstrap",
                                    str(replicates), "--json", str(out / "r.json")])
    _assert_user_error(rc, err, (out / "r.json",), message)
