"""Bad models and tokenizers through the CLI: unknown, missing, corrupt or mismatched checkpoints are one line
"fastppl: error: ...", exit code 2, no traceback, and no output file."""
import json
import os
import time

import pytest
import torch
from cli_errors import (
    TINY,
    _args,
    _assert_user_error,
    _copy_checkpoint,
    _main,
)


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
    # offline in the tests: the hub is unreachable, which is not "unknown"
    ("no-such-model-anywhere", "model 'no-such-model-anywhere': not a local directory, and the hub is unreachable"),
    ("no-such-org/no-such-model", "model 'no-such-org/no-such-model': not a local directory, and the hub is "
                                  "unreachable"),
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
    from fastppl import pipeline
    real_load_model = pipeline.load_model

    def corrupt_model(*args, **kwargs):   # a checkpoint whose weights hold a NaN
        model = real_load_model(*args, **kwargs)
        with torch.no_grad():
            model.blocks[0].mlp.fc.weight[0, 0] = float("nan")
        return model
    monkeypatch.setattr(pipeline, "load_model", corrupt_model)
    _assert_user_error(*_main(capsys, _args(TINY, text, outputs, tokenizer_dir)), outputs,
                       "the model produced a non-finite loss in fp32; check its weights for NaN or inf")


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


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible")
def test_cuda_without_a_gpu(text, outputs, tokenizer_dir, capsys):
    args = _args(TINY, text, outputs, tokenizer_dir)
    args[args.index("--device") + 1] = "cuda"
    _assert_user_error(*_main(capsys, args), outputs, "no CUDA GPU is visible")


def test_tokenizer_names_a_path_or_a_hub_id(tmp_path, text, outputs, capsys, monkeypatch):
    """a/b/c is a path (no hub); org/name is a hub id, tried once, and its failure is one line at once."""
    import huggingface_hub
    asked = []

    def unreachable(name, **kwargs):
        asked.append(name)
        raise ConnectionError("no network")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", unreachable)
    _assert_user_error(*_main(capsys, _args(TINY, text, outputs, "models/org/tok")), outputs,
                       "no such tokenizer directory")
    assert asked == []
    _assert_user_error(*_main(capsys, _args(TINY, text, outputs, "org/tok")), outputs,
                       "tokenizer 'org/tok': not a local directory, and the hub is unreachable (no network)")
    assert asked == ["org/tok"]


@pytest.mark.parametrize("device", ["mps", "meta", "xpu"])
def test_devices_torch_knows_but_fastppl_does_not_run_on(device, text, outputs, tokenizer_dir, capsys):
    _assert_user_error(*_main(capsys, _args(TINY, text, outputs, tokenizer_dir, "--device", device)), outputs,
                       f"--device {device}: not supported")

