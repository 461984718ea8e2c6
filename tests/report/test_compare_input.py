"""Inputs of `fastppl compare` that it must refuse in one line naming the file (and the line or field), never
with a traceback: devices and oversized files, fields of the wrong type, and JSON that Python's parser refuses
(integers of more than 4,300 digits, nesting deeper than its recursion limit)."""
import json
import math
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from fastppl.cli import main

ROOT = Path(__file__).resolve().parents[2]
DEEP = "[" * 100_000 + "]" * 100_000


def report(nll=3.0, **fields):
    units = {"kind": "document", "index": [0, 1, 2], "nll_sum": [300.0, 610.0, 150.0], "tokens": [100, 200, 50],
             "bytes": [400, 800, 200]}
    result = {"nll": nll, "ppl": math.exp(nll), "tokens_scored": 350, "nll_sum": 1060.0, "bits_per_byte": 1.2,
              "corpus_sha256": "ab" * 32, "config": {"model": "gpt2", "data": ["c.jsonl"], "split": "all"},
              "bootstrap": {"level": 0.95, "replicates": 200, "seed": 0, "resampled": units}}
    result.update(fields)
    return result


def write(path, text):
    path.write_text(text if isinstance(text, str) else json.dumps(text, indent=1))
    return str(path)


def one_line_error(capsys, args) -> str:
    assert main(["compare", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fastppl: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


def test_two_well_formed_reports_give_their_paired_difference(tmp_path, capsys):
    """The reports the refusals below alter compare as they are."""
    a, b = write(tmp_path / "a.json", report()), write(tmp_path / "b.json", report(nll=2.9))
    assert main(["compare", a, b]) == 0
    assert "paired differences against a" in capsys.readouterr().out


def _limited_memory():
    resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))   # a read without end fails fast, not the machine


def test_a_device_is_refused_before_it_is_read(tmp_path):
    """/dev/zero never ends: it was read until memory ran out."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")])))
    good = write(tmp_path / "a.json", report())
    proc = subprocess.run([sys.executable, "-m", "fastppl", "compare", good, "/dev/zero"], capture_output=True,
                          text=True, env=env, timeout=120, preexec_fn=_limited_memory)
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    assert proc.stderr == ("fastppl: error: /dev/zero: is a device, not a regular file; pass the JSON report "
                           "written by fastppl eval --json\n")


def test_a_file_larger_than_any_report_is_refused(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("fastppl.report.inputs.MAX_INPUT_BYTES", 1000)
    a, large = write(tmp_path / "a.json", report()), write(tmp_path / "large.json", report(padding="x" * 1000))
    assert "large.json: is larger than" in one_line_error(capsys, [a, large])
    per_doc = write(tmp_path / "docs.jsonl", "x" * 1001)
    assert "docs.jsonl: is larger than" in one_line_error(capsys, ["--per-doc", per_doc])


def _altered(change):
    result = report(nll=2.9)
    change(result)
    return result


@pytest.mark.parametrize("change, field", [
    (lambda r: r["bootstrap"]["resampled"].update(nll_sum=[[1.0, 2.0]] * 3), "bootstrap.resampled.nll_sum"),
    (lambda r: r["bootstrap"]["resampled"].update(tokens=[[1, 2]] * 3), "bootstrap.resampled.tokens"),
    (lambda r: r["bootstrap"]["resampled"].update(index=[0, 1e308, 2]), "bootstrap.resampled.index"),
    (lambda r: r["bootstrap"]["resampled"].update(nll_sum=[1.0, 10**400, 2.0]), "bootstrap.resampled.nll_sum"),
    (lambda r: r["bootstrap"].update(replicates=0), "bootstrap.replicates"),
    (lambda r: r["bootstrap"].update(replicates=10**400), "bootstrap.replicates"),
    (lambda r: r.update(bootstrap=[1]), "bootstrap"),
    (lambda r: r.update(nll_stderr="small"), "nll_stderr"),
    (lambda r: r.update(nll_stderr=[[1, 2]]), "nll_stderr"),
    (lambda r: r.update(nll=10**400), "nll"),
    (lambda r: r.update(tokens_per_second=10**400), "tokens_per_second"),
], ids=lambda value: value if isinstance(value, str) else "")
def test_a_field_of_the_wrong_type_is_named(tmp_path, capsys, change, field):
    a, b = write(tmp_path / "a.json", report()), write(tmp_path / "b.json", _altered(change))
    assert f"b.json: not a fastppl eval report ({field!r} has the wrong type)" in one_line_error(capsys, [a, b])


@pytest.mark.parametrize("field, value", [("tokens", 10**400), ("nll_sum", 10**400), ("bytes", 2**64)],
                         ids=["tokens", "nll_sum", "bytes"])
def test_a_per_doc_number_beyond_float64_or_int64_is_named(tmp_path, capsys, field, value):
    record = {"id": "d", "tokens": 3, "nll_sum": 6.0, "bytes": 12, field: value}
    docs = write(tmp_path / "docs.jsonl", json.dumps(record) + "\n")
    assert f"docs.jsonl:1: {field!r} must be" in one_line_error(capsys, ["--per-doc", docs])


def test_json_python_does_not_read_is_named_with_its_line(tmp_path, capsys):
    good = json.dumps(report(), indent=1)
    long_integer = write(tmp_path / "long.json", good.replace('"tokens_scored": 350', '"tokens_scored": ' + "7" * 5000))
    line = good.splitlines().index(' "tokens_scored": 350,') + 1
    a = write(tmp_path / "a.json", report())
    assert (f"long.json:{line}: an integer of more than 4,300 digits, more than Python reads; pass a fastppl eval "
            "--json report") in one_line_error(capsys, [a, long_integer])
    deep = write(tmp_path / "deep.json", '{\n "nll": 3.0,\n "x": ' + DEEP + "\n}")
    assert "deep.json:3: JSON nested more than 500 levels deep" in one_line_error(capsys, [a, deep])
    # the digits inside a string are text, not an integer: the line of the integer is named
    per_doc = write(tmp_path / "docs.jsonl", '{"id": "a", "tokens": 3, "nll_sum": 6.0}\n'
                                             '{"id": "' + "1" * 5000 + '", "tokens": 3, "nll_sum": 6.0}\n'
                                             '{"id": "c", "tokens": 3, "nll_sum": 6.0, "n": ' + "1" * 5000 + "}\n")
    assert "docs.jsonl:3: an integer of more than 4,300 digits" in one_line_error(capsys, ["--per-doc", per_doc])
    per_doc = write(tmp_path / "docs.jsonl", '{"id": "a", "tokens": 3, "nll_sum": 6.0, "n": ' + DEEP + "}\n")
    assert "docs.jsonl:1: JSON nested more than 500 levels deep" in one_line_error(capsys, ["--per-doc", per_doc])
