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
    (lambda c: {**c, "n_embd": "abc"}, "n_embd is 'abc', not a positive whole number"),
    (lambda c: {**c, "n_positions": -5}, "n_positions is -5, not a positive whole number"),
    (lambda c: {**c, "n_head": 3}, "does not describe a valid model"),        # 32 is not a multiple of 3
    (lambda c: {**c, "n_head": -2}, "n_head is -2, not a positive whole number"),           # -2 divides 64
    (lambda c: {**c, "n_layer": 0}, "n_layer is 0, not a positive whole number"),
    (lambda c: {**c, "layer_norm_epsilon": -1}, "layer_norm_epsilon is -1, not a positive finite number"),
    (lambda c: {**c, "layer_norm_epsilon": float("nan")}, "layer_norm_epsilon is nan, not a positive finite"),
    (lambda c: {**c, "n_embd": 32.0}, "n_embd is 32.0, not a positive whole number"),
    (lambda c: {**c, "n_positions": True}, "n_positions is True, not a positive whole number"),
    (lambda c: {**c, "n_layer": 1}, "checkpoint holds layer 1 (transformer.h.1."),   # layer 1 was dropped
])
def test_config_of_the_wrong_types_or_sizes(tmp_path, checkpoint, text, outputs, tokenizer_dir, capsys, change,
                                            fragment):
    broken = _copy_checkpoint(checkpoint, tmp_path / "bad-config")
    config = json.loads((checkpoint / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps(change(config)))
    _assert_user_error(*_main(capsys, _args(broken, text, outputs, tokenizer_dir, "--backend", "native")), outputs,
                       "config.json", fragment)


@pytest.fixture(scope="module")
def llama_checkpoint(tmp_path_factory):
    """A random llama-tiny checkpoint directory (config.json as transformers writes a Llama's)."""
    from fastppl.models.loading import random_native, save_hf_checkpoint
    directory = tmp_path_factory.mktemp("llama-tiny")
    save_hf_checkpoint(random_native("llama-tiny"), directory)
    return directory


def _rope(config: dict, **change) -> dict:
    """config with its RoPE object's settings changed (rope_scaling, or transformers 5's rope_parameters)."""
    key = "rope_parameters" if "rope_parameters" in config else "rope_scaling"
    return {**config, key: {**config[key], **change}}


@pytest.mark.parametrize("backend", ["native", "hf"])
@pytest.mark.parametrize("change, fragment", [
    (lambda c: {**c, "rope_theta": float("inf")}, "rope_theta is inf, not a positive finite number"),
    (lambda c: {**c, "rope_theta": float("nan")}, "rope_theta is nan, not a positive finite number"),
    (lambda c: {**c, "rope_theta": 0}, "rope_theta is 0, not a positive finite number"),
    (lambda c: {**c, "rope_theta": -10000.0}, "rope_theta is -10000.0, not a positive finite number"),
    (lambda c: _rope(c, factor=float("inf")), ".factor is inf, not a positive finite number"),
    (lambda c: _rope(c, original_max_position_embeddings=0), ".original_max_position_embeddings is 0, not a"),
    (lambda c: {**c, "head_dim": 0}, "head_dim is 0, not a positive whole number"),   # was read as the default
    (lambda c: {**c, "num_key_value_heads": 0}, "num_key_value_heads is 0, not a positive whole number"),
    (lambda c: {**c, "hidden_size": 64.5}, "hidden_size is 64.5, not a positive whole number"),
    (lambda c: {**c, "num_attention_heads": "4"}, "num_attention_heads is '4', not a positive whole number"),
    (lambda c: {**c, "intermediate_size": -176}, "intermediate_size is -176, not a positive whole number"),
    (lambda c: {**c, "rms_norm_eps": 0}, "rms_norm_eps is 0, not a positive finite number"),
    (lambda c: {**c, "rms_norm_eps": float("-inf")}, "rms_norm_eps is -inf, not a positive finite number"),
])
def test_a_llama_config_of_sizes_or_factors_no_model_has_is_one_line(tmp_path, llama_checkpoint, text, outputs,
                                                                     tokenizer_dir, capsys, change, fragment, backend):
    broken = _copy_checkpoint(llama_checkpoint, tmp_path / "bad-config")
    config = json.loads((llama_checkpoint / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps(change(config)))   # inf and nan as JSON's Infinity and NaN
    _assert_user_error(*_main(capsys, _args(broken, text, outputs, tokenizer_dir, "--backend", backend)), outputs,
                       f"{broken}/config.json: ", fragment, "the checkpoint is corrupt")


def test_the_llama_checkpoint_of_those_checks_is_scored(llama_checkpoint, text, outputs, tokenizer_dir, capsys):
    """The checks refuse only what they name: the checkpoint they change is itself scored."""
    assert _main(capsys, _args(llama_checkpoint, text, outputs, tokenizer_dir))[0] == 0
    assert json.loads(outputs[0].read_text())["nll"] > 0


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

