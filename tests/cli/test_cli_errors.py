"""Bad inputs through the CLI: one line "fastppl: error: ..." on stderr, exit code 2,
no traceback, and neither the --json nor the --per-token file is created.

A few cases run `python -m fastppl` as a subprocess (the real entry point, real stderr); the rest
call fastppl.cli.main in-process."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from fastppl.cli import main
from fastppl.report.files import write_json, write_jsonl

ROOT = Path(__file__).resolve().parents[2]
TINY = "random:gpt2-tiny"


@pytest.fixture
def outputs(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    return out / "report.json", out / "tokens.npy"


@pytest.fixture
def text(tmp_path):
    path = tmp_path / "text.txt"
    path.write_text("It is a tale told by an idiot, full of sound and fury, signifying nothing.\n")
    return path


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny HF GPT-2 directory (vocabulary of 1,000 ids: smaller than GPT-2's tokenizer)."""
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=1000, n_positions=64, n_embd=32, n_layer=2, n_head=4,
                                       bos_token_id=999, eos_token_id=999))
    directory = tmp_path_factory.mktemp("small-vocab")
    model.save_pretrained(directory)
    return directory


def _copy_checkpoint(source: Path, dest: Path) -> Path:
    dest.mkdir()
    for f in source.iterdir():
        (dest / f.name).write_bytes(f.read_bytes())
    return dest


def _args(model, data, outputs, tokenizer_dir, *extra):
    json_path, npy_path = outputs
    return ["eval", "--model", str(model), "--data", str(data), "--tokenizer", str(tokenizer_dir), "--device", "cpu",
            "--quiet", "--json", str(json_path), "--per-token", str(npy_path), *map(str, extra)]


def _assert_user_error(rc, err, outputs, *fragments):
    assert rc == 2, err
    assert err.startswith("fastppl: error: ") and err.count("\n") == 1, err   # exactly one line
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in err, err
    for path in outputs:
        assert not path.exists(), f"{path} was created"
    leftovers = list(outputs[0].parent.iterdir()) if outputs[0].parent.is_dir() else []
    assert leftovers == [], f"partial files left: {leftovers}"


def _main(capsys, args):
    rc = main(args)
    return rc, capsys.readouterr().err


# ---------------------------------------------------------------------- the real entry point
def _subprocess(args):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "fastppl", *args], capture_output=True, text=True, env=env,
                          timeout=120)


@pytest.mark.slow   # a process of its own
def test_subprocess_missing_file(tmp_path, outputs, tokenizer_dir):
    proc = _subprocess(_args(TINY, tmp_path / "nope.txt", outputs, tokenizer_dir))
    _assert_user_error(proc.returncode, proc.stderr, outputs, "nope.txt: no such file")
    assert proc.stdout == ""


@pytest.mark.slow   # a process of its own
def test_subprocess_transformers_warnings_stay_off_stderr(tmp_path, checkpoint, text, outputs):
    """A config whose special ids lie outside its vocabulary made transformers log two warnings while the
    tokenizer was looked for, above fastppl's one error line (capsys does not see transformers' logger)."""
    model = _copy_checkpoint(checkpoint, tmp_path / "ids-outside")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(dict(config, bos_token_id=50256, eos_token_id=50256)))
    proc = _subprocess(["eval", "--model", str(model), "--data", str(text), "--device", "cpu", "--quiet",
                        "--json", str(outputs[0])])
    _assert_user_error(proc.returncode, proc.stderr, outputs, "holds no tokenizer vocabulary")


@pytest.mark.slow   # a process of its own
def test_subprocess_truncated_checkpoint(tmp_path, checkpoint, text, outputs, tokenizer_dir):
    broken = _copy_checkpoint(checkpoint, tmp_path / "truncated")
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    proc = _subprocess(_args(broken, text, outputs, tokenizer_dir))
    _assert_user_error(proc.returncode, proc.stderr, outputs, "model.safetensors", "corrupt or truncated")


@pytest.mark.slow   # a process of its own
def test_a_reader_that_leaves_early_gets_no_traceback(tmp_path, text, tokenizer_dir):
    """`fastppl eval ... | head -1`: stdout's reader is gone before the summary is printed. Before, a
    BrokenPipeError traceback and exit 1; now the report is written, nothing is said, exit 141 (128 + SIGPIPE)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    report = tmp_path / "r.json"
    proc = subprocess.Popen([sys.executable, "-m", "fastppl", "eval", "--model", TINY, "--data", str(text), "--tokenizer",
                             str(tokenizer_dir), "--device", "cpu", "--quiet", "--ctx", "16", "--json", str(report)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    proc.stdout.close()   # long before the summary: the process is still importing torch
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141 and err == "", err
    assert json.loads(report.read_text())["tokens_scored"] > 0


def test_subprocess_help_and_usage():
    proc = _subprocess(["eval", "--help"])
    assert proc.returncode == 0 and proc.stderr == ""
    for flag in ("--model", "--data", "--window", "--ctx", "--stride", "--bos", "--json", "--per-token"):
        assert flag in proc.stdout
    proc = _subprocess([])
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "see fastppl --help" in proc.stderr


# ----------------------------------------------------------------------------------- the data
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
        (_args(TINY, loop, outputs, tokenizer_dir), f"{loop}: is a loop of symbolic links, not a file; check the --data"),
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


@pytest.mark.parametrize("raised, size", [
    (lambda: torch.empty(500_000_000_000_000, dtype=torch.uint8), "465,661.29 GiB"),   # the CPU allocator's
    (lambda: torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.50 GiB. GPU 0 has a total capacity "
                                    "of 79.19 GiB of which 1.06 GiB is free."), "2.50 GiB"),
    (lambda: MemoryError("Unable to allocate 3.00 TiB for an array with shape (1, 2) and data type float64"),
     "3,072.00 GiB"),
], ids=["cpu", "cuda", "numpy"])
def test_out_of_memory_gives_the_size_in_gib_and_what_to_lower(monkeypatch, text, outputs, tokenizer_dir, capsys,
                                                              raised, size):
    """The message was torch's first line cut at 120 characters: "... you tried to allocate 51200000"."""
    def evaluate(config):
        error = raised()
        raise error
    monkeypatch.setattr("fastppl.pipeline.evaluate", evaluate)
    _assert_user_error(*_main(capsys, _args(TINY, text, outputs, tokenizer_dir)), outputs,
                       f"fastppl: error: out of memory (could not allocate {size}); lower --batch-size or --ctx, or "
                       "use a smaller model\n")


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


# -------------------------------------------------------------------------------- the model
def test_ctx_beyond_the_model(text, outputs, tokenizer_dir, capsys):
    _assert_user_error(*_main(capsys, _args(TINY, text, outputs, tokenizer_dir, "--ctx", 257)), outputs,
                       "--ctx 257 exceeds the model's maximum of 256")


@pytest.mark.parametrize("backend", ["auto", "hf"])
def test_tokenizer_ids_beyond_the_model_vocabulary(checkpoint, text, outputs, tokenizer_dir, capsys, backend):
    _assert_user_error(*_main(capsys, _args(checkpoint, text, outputs, tokenizer_dir, "--backend", backend)), outputs,
                       "has 50,257 ids but the model's vocabulary has 1,000")


def test_model_directory_without_a_tokenizer(checkpoint, text, outputs, capsys):
    json_path, npy_path = outputs
    args = ["eval", "--model", str(checkpoint), "--data", str(text), "--device", "cpu", "--quiet",
            "--json", str(json_path), "--per-token", str(npy_path)]
    _assert_user_error(*_main(capsys, args), outputs, "no tokenizer", "--tokenizer")


@pytest.mark.parametrize("model, fragment", [
    ("random:gpt3", "unknown model random:gpt3"),
    ("no-such-model-anywhere", "unknown model 'no-such-model-anywhere'"),
    ("no-such-org/no-such-model", "unknown model 'no-such-org/no-such-model'"),
    ("./no/such/dir", "no such model directory"),
])
def test_unknown_model(model, fragment, text, outputs, tokenizer_dir, capsys):
    _assert_user_error(*_main(capsys, _args(model, text, outputs, tokenizer_dir)), outputs, fragment)


@pytest.mark.parametrize("command", ["eval", "generate"])
@pytest.mark.parametrize("model, fragment", [
    ("random:nope", "unknown model random:nope; use one of random:gpt2"),   # not a hub failure for 'gpt2'
    ("./typo-dir", "./typo-dir: no such model directory; check --model"),  # not "no such tokenizer directory"
])
def test_a_bad_model_without_tokenizer_is_reported_as_the_model(command, model, fragment, text, outputs, capsys):
    # the tokenizer is found from the model's name: the model's error must come first
    args = (["eval", "--data", str(text), "--json", str(outputs[0]), "--quiet"] if command == "eval"
            else ["generate", "--prompt", "Hello"])
    args += ["--model", model, "--device", "cpu"]
    _assert_user_error(*_main(capsys, args), outputs, fragment)


def test_a_model_with_a_nan_weight_is_an_error_with_no_output(monkeypatch, text, outputs, tokenizer_dir, capsys):
    import fastppl.pipeline as pipeline
    real_load_model = pipeline.load_model

    def corrupt_model(*args, **kwargs):   # a checkpoint whose weights hold a NaN
        model = real_load_model(*args, **kwargs)
        with torch.no_grad():
            model.blocks[0].mlp.fc.weight[0, 0] = float("nan")
        return model
    monkeypatch.setattr(pipeline, "load_model", corrupt_model)
    _assert_user_error(*_main(capsys, _args(TINY, text, outputs, tokenizer_dir)), outputs,
                       "the model produced a non-finite loss in fp32; check its weights for NaN or inf")


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


def test_model_path_is_a_file(text, outputs, tokenizer_dir, capsys):
    _assert_user_error(*_main(capsys, _args(text, text, outputs, tokenizer_dir)), outputs, "is a file")


@pytest.mark.parametrize("backend", ["auto", "hf"])
def test_truncated_safetensors(tmp_path, checkpoint, text, outputs, tokenizer_dir, capsys, backend):
    broken = _copy_checkpoint(checkpoint, tmp_path / "truncated")
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    _assert_user_error(*_main(capsys, _args(broken, text, outputs, tokenizer_dir, "--backend", backend)), outputs,
                       "corrupt")


@pytest.mark.parametrize("backend", ["auto", "hf"])
def test_garbage_pytorch_model_bin(tmp_path, checkpoint, text, outputs, tokenizer_dir, capsys, backend):
    broken = _copy_checkpoint(checkpoint, tmp_path / "garbage")
    (broken / "model.safetensors").unlink()
    (broken / "pytorch_model.bin").write_bytes(os.urandom(4096))
    _assert_user_error(*_main(capsys, _args(broken, text, outputs, tokenizer_dir, "--backend", backend)), outputs,
                       "corrupt")


@pytest.mark.parametrize("backend", ["auto", "hf"])
def test_checkpoint_missing_a_weight(tmp_path, checkpoint, text, outputs, tokenizer_dir, capsys, backend):
    """transformers would fill the gap with random weights and only warn: that must be an error."""
    from safetensors.torch import load_file, save_file
    broken = _copy_checkpoint(checkpoint, tmp_path / "incomplete")
    state = load_file(broken / "model.safetensors")
    del state["transformer.h.1.mlp.c_fc.weight"]
    save_file(state, broken / "model.safetensors")
    _assert_user_error(*_main(capsys, _args(broken, text, outputs, tokenizer_dir, "--backend", backend)), outputs,
                       "transformer.h.1.mlp.c_fc.weight")


@pytest.mark.parametrize("backend, fragment", [("auto", "config.json implies"),
                                               ("hf", "holds weights of other shapes than its config.json implies")])
def test_checkpoint_with_a_weight_of_another_shape(tmp_path, checkpoint, text, outputs, tokenizer_dir, capsys,
                                                   backend, fragment):
    """transformers' own message pointed at a report above it that is not shown."""
    from safetensors.torch import load_file, save_file
    broken = _copy_checkpoint(checkpoint, tmp_path / "reshaped")
    state = load_file(broken / "model.safetensors")
    state["transformer.h.1.mlp.c_fc.weight"] = state["transformer.h.1.mlp.c_fc.weight"][:, :8].clone()
    save_file(state, broken / "model.safetensors")
    _assert_user_error(*_main(capsys, _args(broken, text, outputs, tokenizer_dir, "--backend", backend)), outputs,
                       fragment)


def test_corrupt_config_and_missing_weights(tmp_path, checkpoint, text, outputs, tokenizer_dir, capsys):
    broken = _copy_checkpoint(checkpoint, tmp_path / "bad-config")
    (broken / "config.json").write_text("{not json")
    _assert_user_error(*_main(capsys, _args(broken, text, outputs, tokenizer_dir)), outputs, "config.json")
    (broken / "config.json").write_bytes((checkpoint / "config.json").read_bytes())
    (broken / "model.safetensors").unlink()
    _assert_user_error(*_main(capsys, _args(broken, text, outputs, tokenizer_dir)), outputs,
                       "no model.safetensors or pytorch_model.bin")


@pytest.mark.parametrize("change, fragment", [
    (lambda c: [1, 2], "holds a JSON list, not an object of settings"),
    (lambda c: {**c, "n_embd": "abc"}, "does not describe a valid model"),
    (lambda c: {**c, "n_positions": -5}, "does not describe a valid model"),
    (lambda c: {**c, "n_head": 3}, "does not describe a valid model"),        # 32 is not a multiple of 3
    (lambda c: {**c, "n_head": -2}, "every size must be at least 1"),           # -2 divides 64
    (lambda c: {**c, "n_layer": 0}, "every size must be at least 1"),
    (lambda c: {**c, "layer_norm_epsilon": -1}, "layer_norm_epsilon must be positive"),   # NaN NLL, exit 0 before
    (lambda c: {**c, "n_layer": 1}, "checkpoint holds layer 1 (transformer.h.1."),   # layer 1 was dropped
])
def test_config_of_the_wrong_types_or_sizes(tmp_path, checkpoint, text, outputs, tokenizer_dir, capsys, change,
                                            fragment):
    import json
    broken = _copy_checkpoint(checkpoint, tmp_path / "bad-config")
    config = json.loads((checkpoint / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps(change(config)))
    _assert_user_error(*_main(capsys, _args(broken, text, outputs, tokenizer_dir, "--backend", "native")), outputs,
                       "config.json", fragment)


@pytest.mark.parametrize("backend", ["native", "hf"])
@pytest.mark.parametrize("change, fragment", [
    ({"n_layer": 10**9}, "has 1,000,000,000 layers but the weights hold 2"),      # hung building layers
    ({"n_layer": 20_000}, "has 20,000 layers but the weights hold 2"),           # 40 s and 1.5 GB before
    ({"vocab_size": 30_000_000}, "an embedding of 30,000,000 x 32 but transformer.wte.weight is 1,000 x 32"),
    ({"n_embd": 64, "n_head": 4}, "an embedding of 1,000 x 64 but transformer.wte.weight is 1,000 x 32"),
])
def test_a_config_is_checked_against_the_weights_shapes_before_building(tmp_path, checkpoint, text, outputs,
                                                                         tokenizer_dir, capsys, change, fragment,
                                                                         backend):
    import json
    import time
    broken = _copy_checkpoint(checkpoint, tmp_path / "other-config")
    config = json.loads((checkpoint / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**config, **change}))
    started = time.monotonic()
    _assert_user_error(*_main(capsys, _args(broken, text, outputs, tokenizer_dir, "--backend", backend)), outputs,
                       "config.json", fragment, "belongs to another model")
    assert time.monotonic() - started < 10


def test_a_tied_model_whose_file_has_its_own_output_matrix_is_refused(tmp_path, checkpoint, text, outputs,
                                                                       tokenizer_dir, capsys):
    """The native GPT-2 ties lm_head to wte: a different lm_head.weight in the file would be dropped silently."""
    from safetensors.torch import load_file, save_file
    broken = _copy_checkpoint(checkpoint, tmp_path / "own-head")
    state = load_file(str(checkpoint / "model.safetensors"))
    state["lm_head.weight"] = state["transformer.wte.weight"] + 1.0
    save_file(state, str(broken / "model.safetensors"))
    _assert_user_error(*_main(capsys, _args(broken, text, outputs, tokenizer_dir, "--backend", "native")), outputs,
                       "lm_head.weight differs from transformer.wte.weight")
    state["lm_head.weight"] = state["transformer.wte.weight"].clone()   # the tied matrix saved twice: fine
    save_file(state, str(broken / "model.safetensors"))
    from fastppl.models.loading import load_model
    assert load_model(str(broken), backend="native").config.n_layer >= 1


def test_integer_weights_are_refused(tmp_path, checkpoint, text, outputs, tokenizer_dir, capsys):
    from safetensors.torch import load_file, save_file
    broken = _copy_checkpoint(checkpoint, tmp_path / "int-weights")
    state = load_file(str(checkpoint / "model.safetensors"))
    save_file({k: v.to(torch.int32) for k, v in state.items()}, str(broken / "model.safetensors"))
    _assert_user_error(*_main(capsys, _args(broken, text, outputs, tokenizer_dir, "--backend", "native")), outputs,
                       "holds torch.int32 values, not weights")


# ------------------------------------------------------------------------------ the outputs
def test_json_in_a_missing_directory(tmp_path, text, tokenizer_dir, capsys):
    outputs = (tmp_path / "no-such-dir" / "r.json", tmp_path / "t.npy")
    _assert_user_error(*_main(capsys, _args(TINY, text, outputs, tokenizer_dir)), outputs, "does not exist")
    assert not (tmp_path / "no-such-dir").exists()


def _can_create_in(directory: Path) -> bool:
    try:
        (directory / ".fastppl-probe").touch()
    except OSError:
        return False
    (directory / ".fastppl-probe").unlink()
    return True


@pytest.fixture
def unwritable_dir(tmp_path):
    """A directory this process cannot create files in: a chmod 555 one, or for root (who writes
    through permission bits) a pseudo filesystem that refuses everyone."""
    read_only = tmp_path / "read-only"
    read_only.mkdir()
    read_only.chmod(0o555)
    try:
        if not _can_create_in(read_only):
            yield read_only
            return
        for candidate in (Path("/sys"), Path("/proc")):
            if candidate.is_dir() and not _can_create_in(candidate):
                yield candidate
                return
        pytest.skip("no directory here refuses this user's writes")
    finally:
        read_only.chmod(0o755)


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


# ------------------------------------------------------------------------------ the options
@pytest.mark.parametrize("extra, fragment", [
    (["--batch-size", 0], "--batch-size must be at least 1"),
    (["--ctx", 1], "--ctx must be at least 2"),
    (["--stride", 4], "--stride applies to --window sliding only"),
    (["--bos"], "--bos applies to --window sliding only"),
    (["--window", "sliding", "--stride", 0], "--stride must be between 1 and --ctx"),
    (["--window", "sliding", "--ctx", 16, "--stride", 17], "--stride must be between 1 and --ctx (16)"),
    (["--device", "tpu"], "unknown --device 'tpu'"),
    (["--loss-chunk-rows", 0], "--loss-chunk-rows must be at least 1"),
    (["--checkpoint-batches", 3], "apply with --resume only"),     # would be silently ignored
    (["--checkpoint-seconds", 5], "apply with --resume only"),
    (["--text-field", "body"], "--text-field applies to .jsonl files and hf: datasets"),   # not ignored
])
def test_bad_options(extra, fragment, text, outputs, tokenizer_dir, capsys):
    _assert_user_error(*_main(capsys, _args(TINY, text, outputs, tokenizer_dir, *extra)), outputs, fragment)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible")
def test_cuda_without_a_gpu(text, outputs, tokenizer_dir, capsys):
    args = _args(TINY, text, outputs, tokenizer_dir)
    args[args.index("--device") + 1] = "cuda"
    _assert_user_error(*_main(capsys, args), outputs, "no CUDA GPU is visible")


def test_checkpoint_seconds_nan_is_refused():
    from fastppl.config import EvalConfig
    from fastppl.errors import FastpplError
    with pytest.raises(FastpplError, match="checkpoint-seconds"):
        EvalConfig(model="random:gpt2-tiny", data=["x.txt"], checkpoint_seconds=float("nan"))


@pytest.mark.parametrize("extra", [["--window", "rolling"], ["--split", "test"], ["--batch-size", "many"]])
def test_argparse_errors_are_one_line(extra, text, outputs, tokenizer_dir, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(_args(TINY, text, outputs, tokenizer_dir, *extra))
    _assert_user_error(exit_info.value.code, capsys.readouterr().err, outputs, "see fastppl eval --help")


# ------------------------------------------------------------------------------ the outputs
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


def test_tokenizer_names_a_path_or_a_hub_id(tmp_path, text, outputs, capsys, monkeypatch):
    """a/b/c is a path (no hub); org/name is a hub id, tried once, and its failure is one line at once."""
    import fastppl.data.tokenize as tokenize
    asked = []
    monkeypatch.setattr(tokenize, "_hub_tokenizer_dir", lambda name: (asked.append(name), (None, "no network"))[1])
    _assert_user_error(*_main(capsys, _args(TINY, text, outputs, "models/org/tok")), outputs,
                       "no such tokenizer directory")
    assert asked == []
    _assert_user_error(*_main(capsys, _args(TINY, text, outputs, "org/tok")), outputs,
                       "not a local directory, and the hub did not serve it (no network)")
    assert asked == ["org/tok"]


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


@pytest.mark.parametrize("flag", ["--json", "--per-token", "--per-doc"])
def test_an_output_of_dash_is_refused_not_written_as_a_file_named_dash(tmp_path, text, tokenizer_dir, capsys,
                                                                       monkeypatch, flag):
    monkeypatch.chdir(tmp_path)
    rc, err = _main(capsys, ["eval", "--model", TINY, "--data", str(text), "--tokenizer", str(tokenizer_dir),
                             "--device", "cpu", "--quiet", "--ctx", "16", flag, "-"])
    assert rc == 2 and f"{flag} -: outputs go to files" in err and err.count("\n") == 1, err
    assert not (tmp_path / "-").exists()


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


def test_json_path_with_a_trailing_slash_and_out_of_memory(tmp_path, tokenizer_dir, capsys):
    rc, err = _main(capsys, ["generate", "--model", TINY, "--tokenizer", str(tokenizer_dir), "--device", "cpu",
                             "--prompt", "hi", "--max-new-tokens", "2", "--json", str(tmp_path / "sub") + "/"])
    assert rc == 2 and "is a directory; give a file path" in err and err.count("\n") == 1, err
    assert not (tmp_path / "sub").exists()     # not written as a file named sub
    rc, err = _main(capsys, ["bench", "--generate", "--model", TINY, "--device", "cpu",
                             "--batch-sizes", str(10**11), "--new-tokens", "2"])
    # after bench's header line (progress): the error, one line, no traceback
    assert rc == 2 and err.splitlines()[-1].startswith("fastppl: error: out of memory") and "Traceback" not in err, err


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
    (["--nproc", "2", "--naive-tokens", "7", "--documents", "5"], "--naive-tokens, --documents do not apply to --nproc"),
    (["--tokenizer", "x", "--documents", "5"], "--documents, --tokenizer do not apply to the peers' bench"),
    (["--corpus", "docs", "--tokens", "100"], "--tokens do not apply to --corpus docs (--tokens: the peers' bench"),
])
def test_bench_options_of_the_other_kind_are_refused(extra, fragment, capsys):
    rc, err = _main(capsys, ["bench", "--model", TINY, "--device", "cpu", *extra])   # each was silently ignored
    assert rc == 2 and err.startswith("fastppl: error: ") and fragment in err and err.count("\n") == 1, err


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
        (["--resume", str(corpus)], "--resume"),                                         # the checkpoint would join the corpus
        (["--resume", str(resume), "--json", str(resume / "checkpoint.npz")], "is or lies inside --resume"),
        (["--resume", str(resume), "--json", str(resume)], "is or lies inside --resume"),
    ]:
        rc, err = _main(capsys, [*base, *extra])
        assert rc == 2 and fragment in err and err.count("\n") == 1, err
        assert sorted(p.name for p in corpus.iterdir()) == ["a.txt"] and not resume.exists()


@pytest.mark.parametrize("device", ["mps", "meta", "xpu"])
def test_devices_torch_knows_but_fastppl_does_not_run_on(device, text, outputs, tokenizer_dir, capsys):
    _assert_user_error(*_main(capsys, _args(TINY, text, outputs, tokenizer_dir, "--device", device)), outputs,
                       f"--device {device}: not supported")


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


@pytest.mark.slow   # a process of its own
def test_a_hub_id_with_the_hub_unreachable_fails_at_once_in_one_line(text, tokenizer_dir, tmp_path):
    """Online but with no route to the hub (here a closed local port): one request, not a retry loop that printed
    five warnings over 23 s before the error."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")])),
               HF_ENDPOINT="http://127.0.0.1:9", HF_HOME=str(tmp_path / "hf"))
    for offline in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):   # either makes huggingface_hub offline
        env.pop(offline, None)
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "fastppl", "eval", "--model", "no-such-org/no-such-model",
                           "--tokenizer", str(tokenizer_dir), "--data", str(text), "--device", "cpu", "--quiet"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith("fastppl: error: unknown model 'no-such-org/no-such-model'")
    assert time.perf_counter() - started < 15
