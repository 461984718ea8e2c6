"""Every refusal of a bad option or combination of options, in one table: one line "fastppl: error: ...", exit
code 2, no output file, and neither a model built nor the tokenizer or the corpus read (their loaders raise
here): options are checked in the one pass that builds the run's EvalConfig, before anything is loaded. What
only the model or the corpus can tell (a context past the model's maximum, a text shorter than a block, ...) is
tested beside the table, once each."""

import pytest

from cli_errors import TINY, _args, _assert_user_error, _main
from fastppl.cli import main
from fastppl.config import CHOICES, EvalConfig
from fastppl.errors import FastpplError

# a model that takes many seconds to build: a refusal that built it would show in the table's time too
SLOW_MODEL = "random:gpt2-xl"

# (extra arguments, the message or a fragment of it); {tmp} is the test's directory, {text} a text file, {model}
# TINY (for --reference-model)
REFUSALS = [
    # values outside an option's choices (argparse; EvalConfig refuses them too: test_unknown_values_of_the_api)
    (["--window", "rolling"], "argument --window: invalid choice: 'rolling'"),
    (["--dtype", "fp8"], "argument --dtype: invalid choice"),
    (["--backend", "onnx"], "argument --backend: invalid choice"),
    (["--split", "test"], "argument --split: invalid choice"),
    (["--errors", "ignore"], "argument --errors: invalid choice"),
    (["--compile", "maybe"], "argument --compile: invalid choice"),
    (["--tune-products", "auto"], "argument --tune-products: invalid choice"),
    (["--kv-cache", "yes"], "argument --kv-cache: invalid choice"),
    (["--loss", "exact"], "argument --loss: invalid choice"),
    (["--batching", "sorted"], "argument --batching: invalid choice"),
    (["--protocol", "lm-eval"], "argument --protocol: invalid choice"),
    (["--batch-size", "many"], "argument --batch-size: expected a positive integer or auto, got 'many'"),
    (["--bootstrap-seed", "-1"], "argument --bootstrap-seed: must be at least 0, got -1"),
    (["--seed", str(10**23)], "argument --seed: must be below 2**64"),
    # numbers below their minimum
    (["--batch-size", "0"], "--batch-size must be at least 1, got 0"),
    (["--ctx", "1"], "--ctx must be at least 2, got 1"),
    (["--loss-chunk-rows", "0"], "--loss-chunk-rows must be at least 1, got 0"),
    (["--resume", "{tmp}/ckpt", "--checkpoint-batches", "0"], "--checkpoint-batches must be at least 1, got 0"),
    (["--resume", "{tmp}/ckpt", "--checkpoint-seconds", "nan"], "--checkpoint-seconds must be a number >= 0, got nan"),
    (["--resume", "{tmp}/ckpt", "--checkpoint-seconds", "-1"], "--checkpoint-seconds must be a number >= 0, got -1"),
    (["--bootstrap", "50"], "--bootstrap must be 0 (off) or at least 100, got 50"),
    (["--bootstrap", str(10**9)], "--bootstrap must be at most 1,000,000, got 1,000,000,000"),
    (["--bootstrap", str(2**62)], "--bootstrap must be at most 1,000,000, got 4,611,686,018,427,387,904"),
    (["--nproc", "0"], "--nproc must be at least 1, got 0"),
    (["--nproc", str(2**62)], "--nproc 4,611,686,018,427,387,904 is more processes than the"),
    # windows
    (["--stride", "4"], "--stride applies to --window sliding only"),
    (["--kv-cache", "on"], "--kv-cache on applies to --window sliding only (chunked windows share no tokens)"),
    (["--bos"], "--bos applies to --window sliding only (chunked windows always start with BOS)"),
    (["--window", "sliding", "--stride", "0"], "--stride must be at least 1, got 0"),
    (["--window", "sliding", "--ctx", "16", "--stride", "17"], "--stride must be between 1 and --ctx (16), got 17"),
    (["--window", "sliding", "--kv-cache", "on", "--batching", "packed"],
     "--batching packed does not apply with --kv-cache on, which scores a row per document; drop one of them"),
    (["--window", "sliding", "--kv-cache", "on", "--resume", "{tmp}/ckpt"],
     "--resume does not work with --kv-cache on; drop one of them"),
    # protocols
    (["--protocol", "gptq", "--window", "sliding"],
     "--window sliding does not go with --protocol gptq, which fixes its windows; drop --window"),
    (["--protocol", "gptq", "--bos"], "--bos does not go with --protocol gptq"),
    (["--protocol", "gptq", "--kv-cache", "on"], "--kv-cache on does not go with --protocol gptq"),
    (["--protocol", "gptq", "--stride", "4"], "--stride does not go with --protocol gptq"),
    (["--protocol", "lm-eval-rolling", "--id-field", "id"], "--id-field and --group-by apply without --protocol"),
    (["--protocol", "llama.cpp", "--ctx", "2"],
     "--protocol llama.cpp scores positions from ctx/2 to ctx-2, none with --ctx 2; use --ctx 3 or more"),
    (["--data", "c4"], "--data c4 is a corpus of --protocol gptq; add --protocol gptq"),
    (["--data", "wikitext2", "--protocol", "lm-eval-rolling"],
     "--data wikitext2 is a corpus of --protocol gptq or hf-guide, read alone; use that protocol and no other --data"),
    (["--data", "c4", "--protocol", "gptq", "--split", "val"],
     "--split val applies to a single text; use --split all with --data c4"),
    # fields of records, given for a plain text
    (["--text-field", "body"], "--text-field applies to .jsonl files and hf: datasets, and no --data is one"),
    (["--id-field", "name"], "--id-field applies to .jsonl files and hf: datasets"),
    (["--group-by", "source"], "--group-by applies to .jsonl files and hf: datasets"),
    # names
    (["--model", ""], "--model is empty; give a checkpoint directory, a hub id or random:<preset>"),
    (["--model", " "], "--model is empty"),
    (["--tokenizer", ""], "--tokenizer is empty; give a tokenizer directory or hub id, or leave it out"),
    (["--model", "random:gpt3"], "unknown model random:gpt3"),
    (["--model", "{tmp}/no/such/dir"], "no/such/dir: no such model directory; check --model"),
    (["--model", "{text}"], "is a file; --model takes a checkpoint directory"),
    (["--reference-model", ""], "--reference-model is empty; give a checkpoint directory, a hub id or random:<preset>"),
    (["--reference-model", "{tmp}/no/such/dir"], "no/such/dir: no such model directory; check --reference-model"),
    (["--reference-model", "{text}"], "is a file; --reference-model takes a checkpoint directory"),
    (["--resume", ""], "--resume: empty path; give a directory for the checkpoint or leave --resume out"),
    (["--resume", " "], "--resume: empty path"),
    # options of another option
    (["--checkpoint-seconds", "5"], "--checkpoint-seconds and --checkpoint-batches apply with --resume only"),
    (["--checkpoint-batches", "3"], "--checkpoint-seconds and --checkpoint-batches apply with --resume only"),
    (["--reference-seed", "2"],
     "--reference-seed applies with --reference-model only; add --reference-model or drop it"),
    (["--reference-device", "cpu"], "--reference-device applies with --reference-model only"),
    (["--reference-model", "{model}", "--loss", "fused"],
     "--loss fused does not work with --reference-model (both models' divergence runs its own kernel); drop "
     "--loss fused"),
    (["--reference-model", "{model}", "--window", "sliding", "--kv-cache", "on"],
     "--kv-cache on does not work with --reference-model"),
    # devices (resolved before anything is read)
    (["--device", "tpu"], "unknown --device 'tpu'; use auto, cpu, cuda or cuda:N"),
    (["--device", "cpu:5"], "--device cpu:5: the CPU takes no index; use --device cpu"),
    (["--reference-model", "{model}", "--reference-device", "tpu"], "unknown --reference-device 'tpu'"),
    # one process only
    (["--nproc", "2", "--resume", "{tmp}/ckpt"], "--resume runs in one process only; drop it or run without --nproc"),
    (["--nproc", "2", "--window", "sliding", "--kv-cache", "on"], "--kv-cache on runs in one process only"),
    (["--nproc", "2", "--reference-model", "{model}", "--reference-device", "cpu"],
     "--reference-device runs in one process only"),
    (["--nproc", "2", "--data", "{tmp}/missing.txt"], "missing.txt: no such file; check the --data path"),
]


@pytest.fixture
def nothing_is_loaded(monkeypatch):
    """Loading a model, the tokenizer or the corpus, or starting torchrun, fails the test."""
    import fastppl.cli.eval as eval_command
    import fastppl.pipeline as pipeline
    import fastppl.reference as reference

    def loaded(what):
        def fail(*args, **kwargs):
            raise AssertionError(f"{what} before the refusal")
        return fail
    monkeypatch.setattr(pipeline, "load_model", loaded("a model was built"))
    monkeypatch.setattr(reference, "load_model", loaded("a reference model was built"))
    monkeypatch.setattr(pipeline, "load_tokenizer", loaded("the tokenizer was loaded"))
    monkeypatch.setattr(pipeline, "read_corpus", loaded("the corpus was read"))
    monkeypatch.setattr(eval_command, "_relaunch", loaded("torchrun was started"))


def _run(args, capsys) -> tuple[int, str]:
    try:
        rc = main(args)
    except SystemExit as done:   # argparse's refusals
        rc = done.code
    return rc, capsys.readouterr().err


@pytest.mark.parametrize("extra, message", REFUSALS, ids=[" ".join(extra)[:60] for extra, _ in REFUSALS])
def test_every_refusal_is_one_line_before_anything_is_loaded(extra, message, tmp_path, tokenizer_dir, capsys,
                                                             monkeypatch, nothing_is_loaded):
    monkeypatch.chdir(tmp_path)
    text = tmp_path / "text.txt"
    text.write_text("Is this a dagger which I see before me, the handle toward my hand?\n")
    out = tmp_path / "out"
    out.mkdir()
    outputs = (out / "r.json", out / "docs.jsonl", out / "tokens.npy")
    extra = [a.format(tmp=tmp_path, text=text, model=TINY) for a in extra]
    args = ["eval", "--model", SLOW_MODEL, "--data", str(text), "--tokenizer", str(tokenizer_dir), "--device",
            "cpu", "--quiet", "--json", str(outputs[0]), "--per-doc", str(outputs[1]), "--per-token",
            str(outputs[2])]
    for flag in ("--model", "--data", "--tokenizer", "--device"):   # given in the row: in place of the base's
        if flag in extra:
            at = extra.index(flag)
            args[args.index(flag) + 1] = extra[at + 1]
            extra = extra[:at] + extra[at + 2:]
    rc, err = _run([*args, *extra], capsys)
    _assert_user_error(rc, err, outputs, message)
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize("flag, name", [(flag, name) for flag, name, _ in CHOICES])
def test_unknown_values_of_the_api(flag, name):
    """The Python API's EvalConfig refuses what argparse's choices refuse on the command line, naming its field."""
    with pytest.raises(FastpplError, match=f"^unknown {name} 'nope'; use one of "):
        EvalConfig(model="m", data=["d.txt"], **{name: "nope"})
    with pytest.raises(FastpplError, match="^unknown protocol 'nope'; use one of lm-eval-rolling"):
        EvalConfig(model="m", data=["d.txt"], protocol="nope")


# ----------------------------------------------------------- what only the model or the corpus can tell, once each
@pytest.mark.parametrize("extra, message", [
    (["--ctx", "257"], "--ctx 257 exceeds the model's maximum of 256 positions; lower --ctx"),
    (["--window", "sliding", "--stride", "300"], "--stride must be between 1 and --ctx (256), got 300"),
    (["--window", "sliding", "--kv-cache", "on"], "--kv-cache on needs a native rotary model (Llama, Qwen2, "
                                                  "Qwen3, Mistral), not GPT2"),
])
def test_what_the_model_tells_is_refused_once_it_is_built(extra, message, text, outputs, tokenizer_dir, capsys):
    _assert_user_error(*_main(capsys, _args(TINY, text, outputs, tokenizer_dir, *extra)), outputs, message)


@pytest.mark.slow
def test_a_text_shorter_than_a_block_names_ctx_and_both_numbers(tmp_path, outputs, tokenizer_dir, capsys):
    """It said "needs at least one block tokens, and the text has 6"."""
    text = tmp_path / "short.txt"
    text.write_text("Double, double toil and trouble")   # 7 GPT-2 tokens
    _assert_user_error(*_main(capsys, _args(TINY, text, outputs, tokenizer_dir, "--protocol", "gptq")), outputs,
                       "--protocol gptq needs at least one block of --ctx = 256 tokens, and the text has 7; lower "
                       "--ctx to 7 or less, or pass a longer text\n")
    _assert_user_error(*_main(capsys, _args(TINY, text, outputs, tokenizer_dir, "--protocol", "llama.cpp",
                                            "--ctx", "8")), outputs,
                       "--protocol llama.cpp needs at least 2 x --ctx = 16 tokens, and the text has 7; lower --ctx "
                       "to 3 or less, or pass a longer text\n")
    _assert_user_error(*_main(capsys, _args(TINY, text, outputs, tokenizer_dir, "--protocol", "gptq",
                                            "--ctx", "8")), outputs,
                       "; lower --ctx to 7 or less, or pass a longer text\n")


BENCH_REFUSALS = [
    (["--peers", "fastppl,nope"], "unknown --peers nope; use a subset of naive,autocast,hf-bf16,hf-compiled,fastppl"),
    (["--peers", ""], "--peers is empty"),
    (["--peers", "fastppl,fastppl"], "has an empty or repeated name"),
    (["--generate", "--peers", "nope"], "unknown --peers nope for --generate"),
    (["--generate", "--new-tokens", "1"], "--new-tokens must be at least 2"),
    (["--generate", "--batch-sizes", "1,,2"], "--batch-sizes takes comma-separated integers"),
    (["--generate", "--seq", "64"], "--batch-size and --seq are for scoring"),
    (["--new-tokens", "8"], "--new-tokens apply to bench --generate only"),
    (["--corpus", "docs", "--rounds", "3"], "--rounds do not apply to --corpus docs"),
    (["--model", "gpt2"], "bench takes a random:<preset> model, got 'gpt2'"),
    (["--corpus", "docs", "--model", "gpt2"], "bench --corpus docs takes a random:<preset> model, got 'gpt2'"),
    (["--device", "tpu"], "unknown --device 'tpu'"),
]
if not __import__("torch").cuda.is_available():
    BENCH_REFUSALS.append((["--loss", "fused", "--peers", "fastppl"], "--loss fused needs a CUDA device"))


@pytest.mark.parametrize("extra, message", BENCH_REFUSALS, ids=[" ".join(e)[:50] for e, _ in BENCH_REFUSALS])
def test_bench_refuses_before_drawing_weights(extra, message, tmp_path, capsys, monkeypatch):
    import fastppl.models.loading as loading

    def drawn(*args, **kwargs):
        raise AssertionError("weights were drawn before the refusal")
    monkeypatch.setattr(loading, "random_native", drawn)
    args = ["bench", "--model", SLOW_MODEL, "--device", "cpu", "--json", str(tmp_path / "b.json"), "--quiet"]
    for flag in ("--model", "--device"):
        if flag in extra:
            at = extra.index(flag)
            args[args.index(flag) + 1] = extra[at + 1]
            extra = extra[:at] + extra[at + 2:]
    rc, err = _run([*args, *extra], capsys)
    assert rc == 2 and err.startswith("fastppl: error: ") and err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "b.json").exists()


GENERATE_REFUSALS = [
    (["--top-k", "5"], "--top-k applies to sampling, and --temperature 0 decodes greedily"),
    (["--top-p", "0.5", "--seed", "3"], "--top-p, --seed apply to sampling"),
    (["--temperature", "nan"], "--temperature must be a finite number"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be at least 1, got 0"),
    (["--prompts", ""], "--prompts: empty path"),
    (["--prompts", "{tmp}/missing.txt"], "{tmp}/missing.txt: no such file; check --prompts"),
    (["--model", ""], "--model is empty"),
    (["--tokenizer", ""], "--tokenizer is empty"),
    (["--model", "{tmp}/no/such/dir"], "no such model directory; check --model"),
    (["--device", "tpu"], "unknown --device 'tpu'"),
]


@pytest.mark.parametrize("extra, message", GENERATE_REFUSALS, ids=[" ".join(e)[:50] for e, _ in GENERATE_REFUSALS])
def test_generate_refuses_before_loading(extra, message, tmp_path, tokenizer_dir, capsys, monkeypatch):
    import fastppl.data.tokenize as tokenize
    import fastppl.models as models

    def loaded(*args, **kwargs):
        raise AssertionError("a model or tokenizer was loaded before the refusal")
    monkeypatch.setattr(models, "load_model", loaded)
    monkeypatch.setattr(tokenize, "load_tokenizer", loaded)
    args = ["generate", "--model", SLOW_MODEL, "--tokenizer", str(tokenizer_dir), "--device", "cpu", "--prompt", "hi",
            "--json", str(tmp_path / "g.json")]
    extra = [a.format(tmp=tmp_path) for a in extra]
    for flag in ("--model", "--tokenizer", "--device"):
        if flag in extra:
            at = extra.index(flag)
            args[args.index(flag) + 1] = extra[at + 1]
            extra = extra[:at] + extra[at + 2:]
    rc, err = _run([*args, *extra], capsys)
    message = message.format(tmp=tmp_path)
    assert rc == 2 and err.startswith("fastppl: error: ") and err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "g.json").exists()
