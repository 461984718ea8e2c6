"""An error names an option as its caller spells it: the CLI's flag (--kv-cache on) on the command line, the
EvalConfig field (kv_cache="on") through the Python API, for the same check."""
import pytest

import fastppl
from fastppl.cli import main
from fastppl.config import python_spelling
from fastppl.errors import FastpplError, Unreachable


@pytest.mark.parametrize("message, python", [
    ("--ctx must be at least 2, got 1", "ctx must be at least 2, got 1"),
    ("--stride must be between 1 and --ctx (64), got 0", "stride must be between 1 and ctx (64), got 0"),
    ("--kv-cache on does not work with --reference-model", 'kv_cache="on" does not work with reference_model'),
    ("add --resume DIR", "add resume=DIR"),
    ("--ctx 4096 exceeds the model's maximum; lower --ctx", "ctx=4096 exceeds the model's maximum; lower ctx"),
    ("--per-doc and --bootstrap 100", "per_doc and bootstrap=100"),
    ("--protocol gptq fixes it", 'protocol="gptq" fixes it'),
    ("--json and --nproc are the CLI's", "--json and --nproc are the CLI's"),   # no EvalConfig field
])
def test_python_spelling_names_the_field(message, python):
    assert python_spelling(message) == python


def test_the_same_check_reads_in_each_callers_spelling(tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text("Some text.")
    assert main(["eval", "--model", "random:gpt2-tiny", "--data", str(text), "--window", "sliding", "--ctx", "8",
                 "--stride", "9"]) == 2
    assert capsys.readouterr().err == "fastppl: error: --stride must be between 1 and --ctx (8), got 9\n"
    with pytest.raises(FastpplError) as error:
        fastppl.EvalConfig(model="random:gpt2-tiny", data=[str(text)], window="sliding", ctx=8, stride=9)
    assert str(error.value) == "stride must be between 1 and ctx (8), got 9"


def test_an_error_of_evaluate_names_the_field(tmp_path, tokenizer_dir):
    text = tmp_path / "t.txt"
    text.write_text("Some text to score.")
    config = fastppl.EvalConfig(model="random:gpt2-tiny", data=[str(text)], tokenizer=str(tokenizer_dir),
                                device="cpu", ctx=4096, quiet=True)
    with pytest.raises(FastpplError, match="^ctx=4096 exceeds the model's maximum of 256 positions; lower ctx"):
        fastppl.evaluate(config)


def test_the_error_keeps_its_class(monkeypatch):
    import fastppl.pipeline

    def unreachable(config):
        raise Unreachable("--model org/m: the hub is unreachable; pass --model PATH")
    monkeypatch.setattr(fastppl.pipeline, "evaluate", unreachable)
    with pytest.raises(Unreachable, match="^model org/m: the hub is unreachable; pass model=PATH$"):
        fastppl.evaluate(fastppl.EvalConfig(model="m", data=["d.txt"]))
