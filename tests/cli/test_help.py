"""The command line's own description: `fastppl --version`, and --help lines that state each option's default and
name what the code accepts."""
import argparse
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import fastppl
from fastppl.cli import build_parser, main
from fastppl.cli.args import Parser, RANDOM_PRESETS

ROOT = Path(__file__).resolve().parents[2]
COMMANDS = ("eval", "bench", "generate", "compare")


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    [sub] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def _help_text(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    """The action's help line as --help prints it (%(default)s and friends expanded), on one line."""
    expanded = parser._get_formatter()._expand_help(action) if action.help else ""
    return " ".join(expanded.split())


def _shown(default) -> str:
    return "off" if default is False else str(default)


def help_problems(parser: argparse.ArgumentParser) -> list[str]:
    """'COMMAND ARGUMENT: what is wrong' for each argument of each subcommand whose help does not state its
    default: "default: VALUE" for a default other than None (off for a flag), the word "default" (the value in
    words) for None, "required" for a required one."""
    problems = []
    for command, sub in _subparsers(parser).items():
        for action in sub._actions:
            if action.default == argparse.SUPPRESS:   # --help
                continue
            name = f"{command} {'/'.join(action.option_strings) or action.metavar or action.dest}"
            text = _help_text(sub, action)
            if action.required and action.nargs != argparse.ZERO_OR_MORE:   # argparse marks RUN.json* required
                expected = "required"
            elif action.default is None:
                expected = "default"
            else:
                expected = f"default: {_shown(action.default)}"
            if expected not in text:
                problems.append(f"{name}: help {text!r} lacks {expected!r}")
    return problems


def test_every_help_line_states_its_default():
    parser = build_parser()
    assert set(_subparsers(parser)) == set(COMMANDS)
    assert help_problems(parser) == []


def test_the_check_finds_a_missing_or_wrong_default():
    """help_problems is what the test above relies on: it must flag each kind of omission, and only those."""
    parser = Parser(prog="fastppl")
    sub = parser.add_subparsers(dest="command").add_parser("x")
    sub.add_argument("--no-word", default=3, help="a number")
    sub.add_argument("--wrong-value", default=3, help="a number (default: 4)")
    sub.add_argument("--flag", action="store_true", help="a switch")
    sub.add_argument("--none", help="a path")
    sub.add_argument("--needed", required=True, help="a name")
    sub.add_argument("--empty", default="auto")
    sub.add_argument("--good", default=8192, help="rows (default: %(default)s)")
    sub.add_argument("--good-flag", action="store_true", help="a switch (default: off)")
    sub.add_argument("--good-none", help="a path (default: not written)")
    sub.add_argument("--good-needed", required=True, help="a name; required")
    flagged = [p.split(":")[0] for p in help_problems(parser)]
    assert flagged == ["x --no-word", "x --wrong-value", "x --flag", "x --none", "x --needed", "x --empty"]


def test_the_walk_reaches_every_subcommands_options():
    parser = build_parser()
    seen = {(command, option) for command, sub in _subparsers(parser).items()
            for action in sub._actions for option in action.option_strings}
    for expected in [("eval", "--model"), ("eval", "--checkpoint-batches"), ("bench", "--tokens"),
                     ("bench", "--prompt-tokens"), ("generate", "--temperature"), ("compare", "--min-doc-tokens")]:
        assert expected in seen


def _option_help(command: str, option: str) -> str:
    sub = _subparsers(build_parser())[command]
    [action] = [a for a in sub._actions if option in a.option_strings]
    return _help_text(sub, action)


def test_model_help_names_every_random_preset():
    from fastppl.models.registry import presets
    # the CLI's own list (it may not import torch to read the tables) is the families' presets
    assert RANDOM_PRESETS == tuple(presets())
    for command in ("eval", "bench", "generate"):
        named = set(re.findall(r"[\w.-]+", _option_help(command, "--model")))
        missing = [p for p in presets() if p not in named]
        assert not missing, f"{command} --model help lacks {missing}"


def test_model_help_names_checkpoints_and_hub_ids_where_they_are_taken():
    for command in ("eval", "generate"):
        text = _option_help(command, "--model")
        assert "checkpoint directory" in text and "hub id" in text, text


def test_backend_help_names_every_native_architecture():
    from fastppl.models.loading import NATIVE_MODEL_TYPES
    text = _option_help("eval", "--backend").lower()
    assert all(t.replace("gpt2", "gpt-2") in text for t in NATIVE_MODEL_TYPES), text


def test_the_stated_defaults_are_the_configs_defaults():
    """The parser's defaults, which the help states, are the ones the configs and runs would take anyway."""
    from fastppl.bench.dense import DEFAULTS
    from fastppl.bench.documents import run_docs_bench
    from fastppl.bench.generate import run_bench_generate
    from fastppl.config import EvalConfig
    from fastppl.generate import GenerateConfig
    from fastppl.report.compare import compare
    parser = build_parser()
    evaluated = vars(parser.parse_args(["eval", "--model", "m", "--data", "d"]))
    config = EvalConfig(model="m", data=["d"])
    for field in ("split", "errors", "window", "batch_size", "batching", "device", "dtype", "backend", "compile",
                  "tune_products", "loss", "loss_chunk_rows", "kv_cache", "seed", "bos", "quiet", "bootstrap",
                  "bootstrap_seed", "group_by", "id_field"):
        assert evaluated[field] == getattr(config, field), field
    assert "(default: 60)" in _option_help("eval", "--checkpoint-seconds") and config.checkpoint_seconds == 60
    generated = vars(parser.parse_args(["generate", "--model", "m"]))
    generate_config = GenerateConfig(model="m", prompts=["p"])
    for field in ("max_new_tokens", "device", "dtype", "backend", "compile"):
        assert generated[field] == getattr(generate_config, field), field
    assert generated["temperature"] == generate_config.sampling.temperature
    compared = vars(parser.parse_args(["compare"]))
    signature = inspect.signature(compare).parameters
    assert (compared["worst"], compared["min_doc_tokens"]) == (signature["worst"].default,
                                                               signature["min_doc_tokens"].default)
    benched = vars(parser.parse_args(["bench"]))
    assert benched["documents"] == inspect.signature(run_docs_bench).parameters["n_documents"].default
    bench_generate = inspect.signature(run_bench_generate).parameters
    assert benched["batch_sizes"] == ",".join(map(str, bench_generate["batch_sizes"].default))
    assert benched["new_tokens"] == bench_generate["new_tokens"].default
    assert benched["prompt_tokens"] == bench_generate["prompt_tokens"].default
    for option, index in (("--seq", 0), ("--batch-size", 1)):
        text = _option_help("bench", option)
        assert f"{DEFAULTS['gpt2'][index]} for GPT-2" in text and f"{DEFAULTS['llama'][index]} for Llama" in text


# ---------------------------------------------------------------------------------------------- --version
def test_version_prints_the_package_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    out, err = capsys.readouterr()
    assert exit_info.value.code == 0 and out == f"fastppl {fastppl.__version__}\n" and err == ""


def test_version_and_help_do_not_import_torch():
    """The CLI imports torch late: --version and every --help answer without it."""
    code = ("import sys\nfrom fastppl.cli import main\n"
            f"for argv in [['--version'], *[[c, '--help'] for c in {COMMANDS!r}]]:\n"
            "    try:\n        main(argv)\n    except SystemExit as e:\n        assert e.code == 0, (argv, e.code)\n"
            "print('torch' in sys.modules, file=sys.stderr)\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0 and proc.stderr == "False\n", proc.stderr
    assert proc.stdout.startswith(f"fastppl {fastppl.__version__}\n")


def test_version_through_the_real_entry_point():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-m", "fastppl", "--version"], capture_output=True, text=True, env=env,
                          timeout=60)
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, f"fastppl {fastppl.__version__}\n", "")
