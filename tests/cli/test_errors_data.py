"""Bad corpora through the CLI: missing, empty, undecodable or too short data is one line "fastppl: error: ...",
exit code 2, no traceback, and no output file."""

import pytest
from cli_errors import TINY, _args, _assert_user_error, _main

from fastppl.cli import main


@pytest.mark.parametrize("content", ["", " \n\t\n", "\u3000\u00a0\n"], ids=["empty", "ascii-spaces", "unicode-spaces"])
def test_empty_file(tmp_path, outputs, tokenizer_dir, capsys, content):
    empty = tmp_path / "empty.txt"
    empty.write_text(content, encoding="utf-8")
    _assert_user_error(*_main(capsys, _args(TINY, empty, outputs, tokenizer_dir)), outputs, "is empty")


def test_empty_jsonl(tmp_path, outputs, tokenizer_dir, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    _assert_user_error(*_main(capsys, _args(TINY, empty, outputs, tokenizer_dir)), outputs, "empty")


def test_missing_file_in_process(tmp_path, outputs, tokenizer_dir, capsys):
    _assert_user_error(*_main(capsys, _args(TINY, tmp_path / "missing.jsonl", outputs, tokenizer_dir)), outputs,
                       "no such file")


def test_a_loop_of_symbolic_links_is_named_as_one(tmp_path, outputs, tokenizer_dir, capsys):
    """pathlib reads a link that leads back to itself as missing: each was "no such file", or a traceback for an
    output path."""
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    documents = tmp_path / "documents"
    documents.mkdir()
    (documents / "a.txt").write_text("Some text to score.")
    (documents / "b.txt").symlink_to(documents / "b.txt")
    json_path, npy_path = outputs
    for args, fragment in [
        (_args(TINY, loop, outputs, tokenizer_dir),
         f"{loop}: is a loop of symbolic links, not a file; check the --data"),
        (_args(TINY, loop / "a.txt", outputs, tokenizer_dir), "a.txt: is a loop of symbolic links, not a file"),
        (_args(loop, documents, outputs, tokenizer_dir), f"{loop}: is a loop of symbolic links, not a model directory"),
        (_args(TINY, documents / "a.txt", outputs, loop), "is a loop of symbolic links, not a tokenizer directory"),
        (_args(TINY, documents, outputs, tokenizer_dir), f"{documents / 'b.txt'}: a loop of symbolic links; remove it"),
        (_args(TINY, documents / "a.txt", (loop / "r.json", npy_path), tokenizer_dir),
         f"--json {loop / 'r.json'}: is a loop of symbolic links; pick another path"),
        (_args(TINY, documents / "a.txt", outputs, tokenizer_dir, "--resume", loop),
         f"--resume {loop}: is a loop of symbolic links; pick another path"),
    ]:
        _assert_user_error(*_main(capsys, args), outputs, fragment)
    assert main(["compare", str(loop), str(loop)]) == 2
    assert f"{loop}: is a loop of symbolic links, not a file" in capsys.readouterr().err


def test_empty_directory_as_data(tmp_path, outputs, tokenizer_dir, capsys):
    # a directory is a document set (one document per file); an empty one is an error
    empty = tmp_path / "empty"
    empty.mkdir()
    _assert_user_error(*_main(capsys, _args(TINY, empty, outputs, tokenizer_dir)), outputs, "holds no files")


def test_unknown_builtin(outputs, tokenizer_dir, capsys):
    _assert_user_error(*_main(capsys, _args(TINY, "tinyshakespear", outputs, tokenizer_dir)), outputs,
                       "not a file and not a built-in corpus")


@pytest.mark.parametrize("suffix", [".txt", ".jsonl"])
def test_invalid_utf8_names_the_byte_offset(tmp_path, outputs, tokenizer_dir, capsys, suffix):
    bad = tmp_path / f"bad{suffix}"
    prefix = b'{"text": "Fair is foul, and ' if suffix == ".jsonl" else b"Fair is foul, and "
    bad.write_bytes(prefix + b"foul is \xff fair"
                    + (b'"}\n' if suffix == ".jsonl" else b"\n"))
    _assert_user_error(*_main(capsys, _args(TINY, bad, outputs, tokenizer_dir)), outputs,
                       f"byte {len(prefix) + 8} (0xff) is not valid UTF-8", "--errors replace")
    # --errors replace carries on (U+FFFD in place of the byte) and writes both files
    assert main(_args(TINY, bad, outputs, tokenizer_dir, "--errors", "replace")) == 0
    assert all(p.exists() for p in outputs)


def test_invalid_jsonl_lines(tmp_path, outputs, tokenizer_dir, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": oops}\n')
    _assert_user_error(*_main(capsys, _args(TINY, bad, outputs, tokenizer_dir)), outputs, "bad.jsonl:2: not valid JSON")
    bad.write_text('{"text": "fine"}\n{"body": "no text field"}\n')
    _assert_user_error(*_main(capsys, _args(TINY, bad, outputs, tokenizer_dir)), outputs, "no field 'text'",
                       "--text-field")


@pytest.mark.parametrize("content, window", [("a", "chunked"), ("a", "sliding"), ("Hello", "chunked")])
def test_fewer_than_two_tokens(tmp_path, outputs, tokenizer_dir, capsys, content, window):
    short = tmp_path / "short.txt"
    short.write_text(content)
    _assert_user_error(*_main(capsys, _args(TINY, short, outputs, tokenizer_dir, "--window", window)), outputs,
                       "at least 2")


def test_sliding_over_single_token_documents(tmp_path, outputs, tokenizer_dir, capsys):
    docs = tmp_path / "docs.jsonl"
    docs.write_text('{"text": "a"}\n{"text": "b"}\n')
    _assert_user_error(*_main(capsys, _args(TINY, docs, outputs, tokenizer_dir, "--window", "sliding")), outputs,
                       "no token can be scored", "--bos")


def test_an_unusable_cache_directory_is_named_with_its_variable(tmp_path, tokenizer_dir, capsys, monkeypatch):
    """The built-in corpus is kept in the cache: a FASTPPL_CACHE_DIR that is a file named the path alone before."""
    not_a_directory = tmp_path / "cache-file"
    not_a_directory.write_text("")
    monkeypatch.setenv("FASTPPL_CACHE_DIR", str(not_a_directory))
    monkeypatch.delenv("FASTPPL_DATA_DIR", raising=False)
    rc, err = _main(capsys, ["eval", "--model", TINY, "--data", "tinyshakespeare", "--split", "val", "--tokenizer",
                             str(tokenizer_dir), "--device", "cpu", "--quiet", "--ctx", "16"])
    assert rc == 2 and err.count("\n") == 1, err
    assert f"fastppl's cache is {not_a_directory}; point FASTPPL_CACHE_DIR at a writable directory" in err, err

