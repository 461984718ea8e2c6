"""Corpora that `fastppl eval` must refuse in one line naming the file and line (or the --data arguments), exit 2,
nothing written: JSON lines that Python's parser refuses, texts that are not valid Unicode, and one corpus given
twice (its documents' ids twice in the per-document results, which compare then refuses)."""
import json

import pytest

from fastppl.cli import main
from fastppl.data.corpus import Fields, jsonl_documents

DEEP = "[" * 100_000 + "]" * 100_000


def jsonl(path, *lines):
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def refused(capsys, tmp_path, tokenizer_dir, *data) -> str:
    report = tmp_path / "out" / "r.json"
    report.parent.mkdir(exist_ok=True)
    args = ["eval", "--model", "random:gpt2-tiny", "--tokenizer", str(tokenizer_dir), "--ctx", "16", "--device", "cpu",
            "--quiet", "--json", str(report), "--per-doc", str(report.parent / "docs.jsonl")]
    for source in data:
        args += ["--data", str(source)]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("fastppl: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    assert list(report.parent.iterdir()) == []
    return err


GOOD = json.dumps({"id": "a", "text": "It is a tale told by an idiot, full of sound and fury."})


@pytest.mark.parametrize("line, message", [
    ('{"id": "b", "text": "x", "n": ' + "7" * 5000 + "}",
     "an integer of more than 4,300 digits, more than Python reads"),
    ('{"id": "b", "text": "x", "n": ' + DEEP + "}",
     "JSON nested more than 500 levels deep, deeper than Python reads"),
    ('{"id": "b", "text": "bad \\ud800 text"}',
     "field 'text' holds a lone surrogate (\\ud800 at character 4), which is not valid Unicode"),
    ('{"id": "b", "text": "bad \\udfff"}', "field 'text' holds a lone surrogate (\\udfff at character 4), which is "
                                          "not valid Unicode"),
], ids=["long integer", "deep nesting", "lone high surrogate", "lone low surrogate"])
def test_a_line_python_cannot_read_or_encode_is_named(tmp_path, tokenizer_dir, capsys, line, message):
    corpus = jsonl(tmp_path / "c.jsonl", GOOD, line)
    assert f"c.jsonl:2: {message}; fix the line" in refused(capsys, tmp_path, tokenizer_dir, corpus)


def test_an_escaped_surrogate_pair_is_one_character(tmp_path):
    corpus = jsonl(tmp_path / "c.jsonl", '{"text": "smile \\ud83d\\ude00"}')
    [document] = jsonl_documents(corpus.read_text(), corpus, Fields())
    assert document.text == "smile \U0001F600"


def test_a_corpus_given_twice_is_refused(tmp_path, tokenizer_dir, capsys, monkeypatch):
    corpus = jsonl(tmp_path / "c.jsonl", GOOD)
    assert f"--data {corpus} is given twice; give each corpus once" in refused(
        capsys, tmp_path, tokenizer_dir, corpus, corpus)
    monkeypatch.chdir(tmp_path)
    assert "--data ./c.jsonl is given twice (as c.jsonl and ./c.jsonl)" in refused(
        capsys, tmp_path, tokenizer_dir, "c.jsonl", "./c.jsonl")


def test_two_corpora_sharing_an_id_are_refused(tmp_path, tokenizer_dir, capsys):
    first, second = jsonl(tmp_path / "c.jsonl", GOOD), jsonl(tmp_path / "d.jsonl", GOOD)
    assert (f"--data {first} and --data {second} both hold a document with the id 'a'; per-document results are "
            "keyed by id: pass --id-field naming a field unique across them, or give each document once") in refused(
        capsys, tmp_path, tokenizer_dir, first, second)
