"""Output paths through the CLI: unwritable, repeated, or over an input, each is refused before the run; a failed
write leaves no partial file."""
import json
import os
from pathlib import Path

import pytest
from cli_errors import (
    TINY,
    _args,
    _assert_user_error,
    _copy_checkpoint,
    _main,
)

from fastppl.cli import main
from fastppl.report.files import write_json, write_jsonl


def test_json_in_a_missing_directory(tmp_path, text, tokenizer_dir, capsys):
    outputs = (tmp_path / "no-such-dir" / "r.json", tmp_path / "t.npy")
    _assert_user_error(*_main(capsys, _args(TINY, text, outputs, tokenizer_dir)), outputs, "does not exist")
    assert not (tmp_path / "no-such-dir").exists()


def test_json_in_a_read_only_directory(unwritable_dir, tmp_path, text, tokenizer_dir, capsys):
    outputs = (unwritable_dir / "r.json", tmp_path / "t.npy")
    rc, err = _main(capsys, _args(TINY, text, outputs, tokenizer_dir))
    assert rc == 2 and err.count("\n") == 1 and "cannot create files in" in err and "Traceback" not in err
    assert not any(p.exists() for p in outputs)


def test_per_token_in_a_read_only_directory(unwritable_dir, tmp_path, text, tokenizer_dir, capsys):
    outputs = (tmp_path / "r.json", unwritable_dir / "t.npy")
    rc, err = _main(capsys, _args(TINY, text, outputs, tokenizer_dir))
    assert rc == 2 and err.startswith("fastppl: error: --per-token") and "Traceback" not in err
    assert not any(p.exists() for p in outputs)


def test_json_path_is_a_directory(tmp_path, text, tokenizer_dir, capsys):
    outputs = (tmp_path, tmp_path / "t.npy")
    rc, err = _main(capsys, _args(TINY, text, outputs, tokenizer_dir))
    assert rc == 2 and "is a directory" in err and not (tmp_path / "t.npy").exists()


def test_non_finite_values_are_written_as_null_so_that_strict_parsers_read_the_report(tmp_path):
    def refuse(constant):
        raise ValueError(f"bare {constant} in the report")
    report = {"nll": 3.0, "bits_per_byte": float("nan"), "by_position": [1.0, float("inf"), None],
              "nested": {"rate": float("-inf"), "pair": (2.5, float("nan"))}}
    write_json(str(tmp_path / "r.json"), report)
    written = json.loads((tmp_path / "r.json").read_text(), parse_constant=refuse)
    assert written == {"nll": 3.0, "bits_per_byte": None, "by_position": [1.0, None, None],
                       "nested": {"rate": None, "pair": [2.5, None]}}
    write_jsonl(str(tmp_path / "d.jsonl"), [{"id": "a", "bits_per_byte": float("nan")}, {"id": "b", "nll": 1.5}])
    lines = (tmp_path / "d.jsonl").read_text().splitlines()
    assert [json.loads(line, parse_constant=refuse) for line in lines] == [{"id": "a", "bits_per_byte": None},
                                                                         {"id": "b", "nll": 1.5}]


def test_a_failed_write_leaves_no_partial_file(tmp_path):
    target = tmp_path / "r.json"
    with pytest.raises(TypeError):
        write_json(str(target), {"nll": 1.0, "oops": object()})   # fails half-way through json.dump
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_one_output_that_cannot_be_written_leaves_none_of_the_others(tmp_path, text, tokenizer_dir, capsys):
    out = tmp_path / "out"
    out.mkdir()
    rc, err = _main(capsys, ["eval", "--model", TINY, "--data", str(text), "--tokenizer", str(tokenizer_dir),
                             "--device", "cpu", "--quiet", "--per-token", str(out / "t.npy"),
                             "--per-doc", str(out / "d.jsonl"), "--json", "/dev/full"])
    assert rc == 2 and "cannot write /dev/full" in err and err.count("\n") == 1, err
    assert list(out.iterdir()) == []


def test_output_paths_must_be_distinct_non_empty_and_not_an_input(tmp_path, text, tokenizer_dir, capsys):
    out = tmp_path / "out"
    out.mkdir()
    base = ["eval", "--model", TINY, "--data", str(text), "--tokenizer", str(tokenizer_dir), "--device", "cpu",
            "--quiet"]
    before = text.read_bytes()
    for extra, fragment in [
        (["--json", str(text)], "would overwrite input"),
        (["--json", str(out / "same"), "--per-doc", str(out / "same")], "the same file as --json"),
        (["--json", ""], "--json: empty path"),
        (["--json", str(text / "report.json")], "is a file, not a directory"),
    ]:
        _assert_user_error(*_main(capsys, base + extra), (out / "same",), fragment)
    assert text.read_bytes() == before


def test_path_too_long_is_a_one_line_error(tmp_path, text, outputs, tokenizer_dir, capsys):
    long_name = "a" * 300
    _assert_user_error(*_main(capsys, _args(TINY, tmp_path / f"{long_name}.txt", outputs, tokenizer_dir)),
                       outputs, "too long")
    json_path, npy_path = outputs
    args = _args(TINY, text, outputs, tokenizer_dir)
    args[args.index("--json") + 1] = str(json_path.parent / f"{long_name}.json")
    _assert_user_error(*_main(capsys, args), outputs, "too long")


@pytest.mark.slow
def test_a_fifo_as_output_is_written_in_place_and_a_symlink_followed(tmp_path, text, tokenizer_dir, capsys):
    """--json and --per-doc into one FIFO (as into /dev/stdout) are written to it, not replaced by a regular
    file; a --json symlink keeps being a symlink, to the new report."""
    import json
    import threading
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    received, done = [], threading.Event()

    def read_every_writer():   # each output opens, writes and closes the FIFO: read until told to stop
        while not done.is_set():
            with open(fifo) as f:
                received.append(f.read())

    reader = threading.Thread(target=read_every_writer)
    reader.start()
    base = ["eval", "--model", TINY, "--data", str(text), "--tokenizer", str(tokenizer_dir), "--device", "cpu",
            "--quiet"]
    try:
        rc = main(base + ["--json", str(fifo), "--per-doc", str(fifo)])
    finally:
        done.set()
        open(fifo, "w").close()   # unblocks the reader's last open
        reader.join(timeout=30)
    everything = "".join(received)
    assert rc == 0 and fifo.is_fifo() and '"nll_sum"' in everything and '"id"' in everything
    real, link = tmp_path / "real.json", tmp_path / "link.json"
    real.write_text("old")
    link.symlink_to(real)
    assert main(base + ["--json", str(link)]) == 0
    assert link.is_symlink() and "nll_sum" in json.loads(real.read_text())


@pytest.mark.parametrize("flag", ["--json", "--per-token", "--per-doc"])
def test_an_output_of_dash_is_refused_not_written_as_a_file_named_dash(tmp_path, text, tokenizer_dir, capsys,
                                                                       monkeypatch, flag):
    monkeypatch.chdir(tmp_path)
    rc, err = _main(capsys, ["eval", "--model", TINY, "--data", str(text), "--tokenizer", str(tokenizer_dir),
                             "--device", "cpu", "--quiet", "--ctx", "16", flag, "-"])
    assert rc == 2 and f"{flag} -: outputs go to files" in err and err.count("\n") == 1, err
    assert not (tmp_path / "-").exists()


def test_compare_plot_over_an_input_report_is_refused(tmp_path, capsys):
    report = tmp_path / "a.png"          # a report under any name: the plot must not overwrite it
    report.write_text("{}")
    rc, err = _main(capsys, ["compare", str(report), "--plot", str(report)])
    assert rc == 2 and "would overwrite input" in err and report.read_text() == "{}"


def test_an_output_inside_a_data_directory_is_refused(tmp_path, tokenizer_dir, capsys):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("Tomorrow, and tomorrow, and tomorrow.\n")
    rc, err = _main(capsys, ["eval", "--model", TINY, "--data", str(corpus), "--tokenizer", str(tokenizer_dir),
                             "--device", "cpu", "--quiet", "--json", str(corpus / "a.txt")])
    assert rc == 2 and "would overwrite input" in err and (corpus / "a.txt").read_text().startswith("Tomorrow")


def test_an_output_over_a_file_the_run_reads_is_refused(tmp_path, checkpoint, tokenizer_dir, shakespeare, capsys):
    """The tokenizer's, the model's and a built-in corpus' files are inputs too: a report must not replace them."""
    tokenizer = tmp_path / "tok"
    _copy_checkpoint(tokenizer_dir, tokenizer)
    model = _copy_checkpoint(checkpoint, tmp_path / "model")
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    (data_dir / "tinyshakespeare.txt").write_bytes(shakespeare.read_bytes())
    text = tmp_path / "t.txt"
    text.write_text("Out, out, brief candle!\n")
    base = ["eval", "--device", "cpu", "--quiet", "--ctx", "32"]
    cases = [
        ([*base, "--model", TINY, "--tokenizer", str(tokenizer), "--data", str(text)], tokenizer / "tokenizer.json"),
        ([*base, "--model", str(model), "--tokenizer", str(tokenizer_dir), "--data", str(text)], model / "config.json"),
        ([*base, "--model", TINY, "--tokenizer", str(tokenizer_dir), "--data", "tinyshakespeare", "--data-dir",
          str(data_dir), "--split", "val"], data_dir / "tinyshakespeare.txt"),
    ]
    for args, target in cases:
        before = target.read_bytes()
        rc, err = _main(capsys, [*args, "--json", str(target)])
        assert rc == 2 and "would overwrite input" in err and err.count("\n") == 1, err
        assert target.read_bytes() == before
    # a new file beside them is fine
    assert _main(capsys, [*cases[0][0], "--json", str(tokenizer / "report.json")])[0] == 0


def test_resume_directory_is_kept_apart_from_inputs_and_outputs(tmp_path, tokenizer_dir, capsys):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("Life's but a walking shadow, a poor player.\n")
    resume = tmp_path / "resume"
    base = ["eval", "--model", TINY, "--tokenizer", str(tokenizer_dir), "--device", "cpu", "--quiet",
            "--data", str(corpus)]
    for extra, fragment in [
        (["--resume", str(corpus)], "--resume"),   # the checkpoint would join the corpus
        (["--resume", str(resume), "--json", str(resume / "checkpoint.npz")], "is or lies inside --resume"),
        (["--resume", str(resume), "--json", str(resume)], "is or lies inside --resume"),
    ]:
        rc, err = _main(capsys, [*base, *extra])
        assert rc == 2 and fragment in err and err.count("\n") == 1, err
        assert sorted(p.name for p in corpus.iterdir()) == ["a.txt"] and not resume.exists()

