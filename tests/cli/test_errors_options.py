"""Bad options through the CLI (eval, generate, bench): one line "fastppl: error: ...", exit code 2, no traceback,
and no output file."""

import pytest
from cli_errors import TINY, _args, _assert_user_error, _main

from fastppl.cli import main


def test_an_empty_resume_path_is_an_error_not_no_resume(text, outputs, tokenizer_dir, capsys):
    _assert_user_error(*_main(capsys, _args(TINY, text, outputs, tokenizer_dir, "--resume", "")), outputs,
                       "--resume: empty path")


def test_batching_with_kv_cache_on_is_an_error_not_ignored(text, outputs, tokenizer_dir, capsys):
    args = _args("random:llama-tiny", text, outputs, tokenizer_dir, "--window", "sliding", "--kv-cache", "on",
                 "--batching", "packed")
    _assert_user_error(*_main(capsys, args), outputs, "--batching packed does not apply with --kv-cache on")


@pytest.mark.parametrize("args, fragment", [
    (["--tokenizer", ""], "--tokenizer is empty"),                 # not to be taken as no --tokenizer
    (["--device", "cpu:5"], "the CPU takes no index"),             # torch reads it as the one CPU
])
def test_values_that_were_silently_read_as_others(args, fragment, text, outputs, capsys):
    _assert_user_error(*_main(capsys, ["eval", "--model", TINY, "--data", str(text), "--quiet",
                                       "--json", str(outputs[0]), "--device", "cpu", *args]), outputs, fragment)


@pytest.mark.parametrize("extra, fragment", [
    (["--batch-size", 0], "--batch-size must be at least 1"),
    (["--ctx", 1], "--ctx must be at least 2"),
    (["--stride", 4], "--stride applies to --window sliding only"),
    (["--bos"], "--bos applies to --window sliding only"),
    (["--window", "sliding", "--stride", 0], "--stride must be at least 1, got 0"),
    (["--window", "sliding", "--ctx", 16, "--stride", 17], "--stride must be between 1 and --ctx (16)"),
    (["--device", "tpu"], "unknown --device 'tpu'"),
    (["--loss-chunk-rows", 0], "--loss-chunk-rows must be at least 1"),
    (["--checkpoint-batches", 3], "apply with --resume only"),     # would be silently ignored
    (["--checkpoint-seconds", 5], "apply with --resume only"),
    (["--text-field", "body"], "--text-field applies to .jsonl files and hf: datasets"),   # not ignored
    (["--placement", "streamed", "--compile", "on"], "--compile on does not work with --placement streamed"),
    (["--placement", "streamed", "--max-gpu-memory", "1MiB", "--ctx", 64],
     "cannot hold one wave of 1 x 64 positions"),                  # no wave holds a batch: refused before scoring
    (["--placement", "resident", "--max-gpu-memory", "1MiB"], "use --placement streamed"),
])
def test_bad_options(extra, fragment, text, outputs, tokenizer_dir, capsys):
    _assert_user_error(*_main(capsys, _args(TINY, text, outputs, tokenizer_dir, *extra)), outputs, fragment)


def test_checkpoint_seconds_nan_is_refused():
    from fastppl.config import EvalConfig
    from fastppl.errors import FastpplError
    with pytest.raises(FastpplError, match="checkpoint_seconds must be a number >= 0, got nan"):
        EvalConfig(model="random:gpt2-tiny", data=["x.txt"], checkpoint_seconds=float("nan"))


@pytest.mark.parametrize("extra", [["--window", "rolling"], ["--split", "test"], ["--batch-size", "many"],
                                   ["--max-gpu-memory", "lots"], ["--placement", "host"]])
def test_argparse_errors_are_one_line(extra, text, outputs, tokenizer_dir, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(_args(TINY, text, outputs, tokenizer_dir, *extra))
    _assert_user_error(exit_info.value.code, capsys.readouterr().err, outputs, "see fastppl eval --help")


def test_generate_nan_temperature_and_bench_zero_tokens(tokenizer_dir, capsys):
    rc, err = _main(capsys, ["generate", "--model", TINY, "--tokenizer", str(tokenizer_dir), "--device", "cpu",
                             "--prompt", "hi", "--max-new-tokens", "2", "--temperature", "nan"])
    assert rc == 2 and "--temperature must be a finite number" in err and err.count("\n") == 1
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--model", TINY, "--device", "cpu", "--tokens", "0"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "--tokens: must be at least 1, got 0" in err and err.count("\n") == 1
    rc, err = _main(capsys, ["bench", "--model", TINY, "--device", "cpu", "--json", " "])
    assert rc == 2 and "--json: empty path" in err


@pytest.mark.parametrize("extra, fragment", [
    (["--top-k", "5"], "--top-k applies to sampling"),                  # not a greedy run ignoring them
    (["--top-p", "0.5", "--seed", "3"], "--top-p, --seed apply to sampling"),
    (["--prompt", "caf\udce9"], "a --prompt is not valid UTF-8 text"),   # argv byte 0xe9: no TypeError
    (["--prompts", ""], "--prompts: empty path"),                       # not ignored beside --prompt
    (["--model", ""], "--model is empty"),                              # not about the tokenizer ''
])
def test_generate_options_that_would_be_ignored_or_crash(extra, fragment, tokenizer_dir, capsys):
    rc, err = _main(capsys, ["generate", "--model", TINY, "--tokenizer", str(tokenizer_dir), "--device", "cpu",
                             "--prompt", "hi", "--max-new-tokens", "2", *extra])
    assert rc == 2 and err.startswith("fastppl: error: ") and fragment in err and err.count("\n") == 1, err


@pytest.mark.parametrize("extra, fragment", [
    (["--generate", "--corpus", "docs"], "--corpus apply to scoring (bench without --generate) only"),
    (["--generate", "--loss", "fused", "--tokens", "100"], "--tokens, --loss apply to scoring"),
    (["--generate", "--compile", "on"], "--compile apply to scoring"),
    (["--new-tokens", "8"], "--new-tokens apply to bench --generate only"),
    (["--batch-sizes", "0"], "--batch-sizes apply to bench --generate only"),
    (["--generate", "--rounds", "3"], "--rounds apply to scoring"),
    (["--corpus", "docs", "--rounds", "3"],
     "--rounds do not apply to --corpus docs (--rounds: the peers' bench (--corpus dense)); drop them"),
    (["--nproc", "2", "--rounds", "3"], "--rounds do not apply to --nproc"),
    # each was silently ignored by the scoring kind it was given to
    (["--nproc", "2", "--compile", "on", "--peers", "naive", "--variants"],
     "--variants, --peers, --compile do not apply to --nproc (--variants, --peers: the peers' bench (--corpus "
     "dense); --compile: the peers' bench (--corpus dense) and --corpus docs)"),
    (["--nproc", "2", "--naive-tokens", "7", "--documents", "5"],
     "--naive-tokens, --documents do not apply to --nproc"),
    (["--tokenizer", "x", "--documents", "5"], "--documents, --tokenizer do not apply to the peers' bench"),
    (["--corpus", "docs", "--tokens", "100"], "--tokens do not apply to --corpus docs (--tokens: the peers' bench"),
])
def test_bench_options_of_the_other_kind_are_refused(extra, fragment, capsys):
    rc, err = _main(capsys, ["bench", "--model", TINY, "--device", "cpu", *extra])   # each was silently ignored
    assert rc == 2 and err.startswith("fastppl: error: ") and fragment in err and err.count("\n") == 1, err


@pytest.mark.parametrize("extra, fragment", [
    (["--batch-size", "0"], "--batch-size: must be at least 1, got 0"),
    (["--batch-size", "-1"], "--batch-size: must be at least 1, got -1"),
    (["--seq", "0"], "--seq/--ctx: must be at least 2, got 0"),
    (["--seq", "1"], "--seq/--ctx: must be at least 2, got 1"),
    (["--documents", "0", "--corpus", "docs"], "--documents: must be at least 1, got 0"),
])
def test_bench_sizes_below_their_minimum(extra, fragment, capsys):
    """0 is refused, neither read as "the default" (batch 64) nor reported as a --seq the user never gave."""
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--model", TINY, "--device", "cpu", *extra])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and fragment in err and err.count("\n") == 1, err


def test_bench_empty_peers_and_fused_loss_on_the_cpu(capsys):
    rc, err = _main(capsys, ["bench", "--model", TINY, "--device", "cpu", "--peers", ""])
    assert rc == 2 and "--peers is empty" in err and err.count("\n") == 1, err
    for peers in ("fastppl,fastppl", "hf-bf16,,fastppl"):   # each ran (the empty one dropped) before
        rc, err = _main(capsys, ["bench", "--model", TINY, "--device", "cpu", "--peers", peers])
        assert rc == 2 and "has an empty or repeated name" in err and err.count("\n") == 1, err
    rc, err = _main(capsys, ["bench", "--generate", "--model", TINY, "--device", "cpu", "--batch-sizes", "1,,2"])
    assert rc == 2 and "--batch-sizes takes comma-separated integers" in err and err.count("\n") == 1, err
    rc, err = _main(capsys, ["bench", "--model", TINY, "--device", "cpu", "--tokens", "512", "--seq", "64",
                             "--peers", "fastppl", "--loss", "fused"])
    assert rc == 2 and "--loss fused needs a CUDA device" in err and err.count("\n") == 1, err


@pytest.mark.parametrize("command", ["eval", "generate"])
def test_a_seed_beyond_64_bits(command, text, outputs, tokenizer_dir, capsys):
    args = (_args(TINY, text, outputs, tokenizer_dir) if command == "eval" else
            ["generate", "--model", TINY, "--tokenizer", str(tokenizer_dir), "--device", "cpu", "--prompt", "hi"])
    with pytest.raises(SystemExit) as exit_info:
        main([*args, "--seed", str(10**23)])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "--seed: must be below 2**64" in err and err.count("\n") == 1, err


def test_nproc_checks_data_and_outputs_before_starting_torchrun(tmp_path, text, tokenizer_dir, capsys, monkeypatch):
    from fastppl.cli import eval as eval_command
    monkeypatch.setattr(eval_command, "_relaunch", lambda args: pytest.fail("torchrun was started"))
    base = ["eval", "--nproc", "2", "--model", TINY, "--tokenizer", str(tokenizer_dir), "--device", "cpu"]
    rc, err = _main(capsys, [*base, "--data", str(tmp_path / "missing.txt")])
    assert rc == 2 and "missing.txt: no such file" in err and err.count("\n") == 1, err
    rc, err = _main(capsys, [*base, "--data", str(text), "--json", str(tmp_path / "no-dir" / "r.json")])
    assert rc == 2 and "does not exist" in err and err.count("\n") == 1, err

