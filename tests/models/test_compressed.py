"""compressed-tensors checkpoints written by the package's own compressors load natively to the weights its own
decompression gives, bit for bit; schemes that quantize activations are one line pointing at --backend hf."""
import copy
import json

import pytest
import torch

ct = pytest.importorskip("compressed_tensors")
from compressed_tensors.compressors import ModelCompressor  # noqa: E402
from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,  # noqa: E402
                                             apply_quantization_config)
from compressed_tensors.quantization.utils import calculate_qparams  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

from fastppl.errors import FastpplError  # noqa: E402
from fastppl.models import load_model  # noqa: E402
from fastppl.models.compressed import unpack_int32  # noqa: E402
from fastppl.models.llama import state_dict_to_hf as llama_state_dict_to_hf  # noqa: E402
from fastppl.quiet import quiet_transformers  # noqa: E402

# scheme -> (weight arguments, the format the checkpoint is saved in: None for the package's choice)
SCHEMES = {
    "int4-group-asymmetric": (dict(num_bits=4, type="int", symmetric=False, strategy="group", group_size=32), None),
    "int4-group-symmetric": (dict(num_bits=4, type="int", symmetric=True, strategy="group", group_size=16), None),
    "int8-channel": (dict(num_bits=8, type="int", symmetric=True, strategy="channel"), None),
    "int8-channel-naive": (dict(num_bits=8, type="int", symmetric=True, strategy="channel"), "naive-quantized"),
    "fp8-channel": (dict(num_bits=8, type="float", symmetric=True, strategy="channel"), None),
    "fp8-tensor-float": (dict(num_bits=8, type="float", symmetric=True, strategy="tensor"), "float-quantized"),
}


def _observe(model, weights: QuantizationArgs) -> None:
    """Scales and zero points from each weight's min and max (what llm-compressor's default observer computes)."""
    for module in model.modules():
        if not hasattr(module, "weight_scale"):
            continue
        weight = module.weight.data
        if weights.strategy == "group":   # (rows, groups, group_size); channel: one group of every column
            weight = weight.unflatten(-1, (-1, weights.group_size))
        elif weights.strategy == "tensor":
            weight = weight.reshape(1, -1)
        scale, zero_point = calculate_qparams(weight.amin(-1), weight.amax(-1), weights)
        module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
        if getattr(module, "weight_zero_point", None) is not None:
            module.weight_zero_point.data.copy_(zero_point.reshape(module.weight_zero_point.shape))


def _write(directory, weights: dict, form=None, dtype=torch.float32, input_activations=None):
    """A tiny random Llama quantized and saved by compressed-tensors; returns its decompressed state dict."""
    torch.manual_seed(0)
    config = AutoConfig.for_model("llama", vocab_size=400, hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                  max_position_embeddings=64, tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(config).to(dtype).eval()
    args = QuantizationArgs(**weights)
    scheme = QuantizationScheme(targets=["Linear"], weights=args,
                                input_activations=QuantizationArgs(**input_activations) if input_activations else None)
    with quiet_transformers():
        apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"]))
        _observe(model, args)
        compressor = ModelCompressor.from_pretrained_model(model, form)
        compressor.compress_model(model)
        reference = copy.deepcopy(model)
        compressor.decompress_model(reference)
        model.save_pretrained(directory)
    compressor.update_config(str(directory))
    return {k: v for k, v in reference.state_dict().items() if k.endswith(".weight")}


@pytest.mark.parametrize("name", list(SCHEMES))
def test_a_weight_only_checkpoint_loads_to_the_packages_own_decompression(name, tmp_path):
    expected = _write(tmp_path, *SCHEMES[name])
    form = json.loads((tmp_path / "config.json").read_text())["quantization_config"]["format"]
    assert form == SCHEMES[name][1] or (SCHEMES[name][1] is None and form in ("pack-quantized", "naive-quantized"))
    native = load_model(str(tmp_path), "native", torch.float32)
    ours = llama_state_dict_to_hf(native)
    assert ours.keys() == expected.keys()
    unequal = [k for k in ours if not torch.equal(ours[k], expected[k].float())]
    assert not unequal, unequal[:3]


def test_bf16_scales_dequantize_in_bf16_as_the_package_does(tmp_path):
    expected = _write(tmp_path, *SCHEMES["int4-group-asymmetric"], dtype=torch.bfloat16)
    ours = llama_state_dict_to_hf(load_model(str(tmp_path), "native", torch.bfloat16))
    assert all(torch.equal(ours[k], expected[k]) for k in ours)


def test_a_scheme_that_quantizes_activations_is_one_line(tmp_path):
    _write(tmp_path, *SCHEMES["int8-channel"],
           input_activations=dict(num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True))
    with pytest.raises(FastpplError, match="quantizes activations, so it is not weight-only.*--backend hf"):
        load_model(str(tmp_path), "native", torch.float32)


def test_unpacking_equals_the_packages_packing():
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    for bits in (2, 4, 8):
        values = torch.randint(-(1 << (bits - 1)), 1 << (bits - 1), (6, 80), dtype=torch.int8)
        assert torch.equal(unpack_int32(pack_to_int32(values, bits), bits, 80), values.int())


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """One checkpoint of each scheme, written once; copy_of(scheme) gives a copy to damage."""
    import shutil
    originals = {}

    def copy_of(scheme: str, into):
        if scheme not in originals:
            originals[scheme] = tmp_path_factory.mktemp(scheme)
            _write(originals[scheme], *SCHEMES[scheme])
        shutil.copytree(originals[scheme], into, dirs_exist_ok=True)
        return into
    return copy_of


def _lie(directory, weights=None, tensors=None) -> None:
    """Edit a checkpoint: weights(group weights dict) edits its config group in place; tensors(state dict) its
    tensors."""
    from safetensors.torch import load_file, save_file
    if weights is not None:
        config = json.loads((directory / "config.json").read_text())
        weights(config["quantization_config"]["config_groups"]["group_0"]["weights"])
        (directory / "config.json").write_text(json.dumps(config))
    if tensors is not None:
        state = load_file(str(directory / "model.safetensors"))
        tensors(state)
        save_file({k: v.contiguous() for k, v in state.items()}, str(directory / "model.safetensors"))


DOWN = "model.layers.0.mlp.down_proj"


def _set(key, value):
    return lambda weights: weights.__setitem__(key, value)


def _replace(name, change):
    def edit(state):
        state[name] = change(state[name])
    return edit


def _drop(suffix):
    def edit(state):
        for name in [n for n in state if n.endswith(suffix)]:
            del state[name]
    return edit


# (scheme, config edit, tensor edit, the tensor the error must name): each scored as another model before
LIES = {
    "2 bits on 4-bit words": ("int4-group-symmetric", _set("num_bits", 2), None, "weight_packed"),
    "1 bit on 4-bit words": ("int4-group-symmetric", _set("num_bits", 1), None, "weight_packed"),
    "4 bits on 8-bit words": ("int8-channel", _set("num_bits", 4), None, "weight_packed"),
    "symmetric, with zero points": ("int4-group-asymmetric", _set("symmetric", True), None, "weight_zero_point"),
    "one zero point deleted": ("int4-group-asymmetric", None, _drop(f"{DOWN}.weight_zero_point"),
                               "weight_zero_point"),
    "every zero point deleted": ("int4-group-asymmetric", None, _drop(".weight_zero_point"), "weight_zero_point"),
    "half the packed words": ("int4-group-symmetric", None, _replace(f"{DOWN}.weight_packed", lambda t: t[:, :8]),
                              "weight_packed"),
    "a group too few in the scale": ("int4-group-symmetric", None,
                                     _replace(f"{DOWN}.weight_scale", lambda t: t[:, :-1]), "weight_scale"),
    "a scalar scale for groups": ("int4-group-symmetric", None, _replace(f"{DOWN}.weight_scale", lambda t: t[0, 0]),
                                  "weight_scale"),
    "a (1, 1) scale for channels": ("int8-channel", None, _replace(f"{DOWN}.weight_scale", lambda t: t[:1]),
                                    "weight_scale"),
    "another group size": ("int4-group-symmetric", _set("group_size", 32), None, "weight_scale"),
    "channels called groups": ("int8-channel", lambda w: w.update(strategy="group", group_size=64), None,
                               "weight_scale"),
    "zero points unpacked": ("int4-group-asymmetric", None,
                             _replace(f"{DOWN}.weight_zero_point", lambda t: torch.zeros(64, 4, dtype=torch.int8)),
                             "weight_zero_point"),
    "a float weight_shape": ("int4-group-symmetric", None, _replace(f"{DOWN}.weight_shape", lambda t: t.float()),
                             "weight_shape"),
    "a naive weight of int16": ("int8-channel-naive", None, _replace(f"{DOWN}.weight", lambda t: t.to(torch.int16)),
                                f"{DOWN}.weight"),
    "fp8 scales per tensor, said per channel": ("fp8-tensor-float", _set("strategy", "channel"), None,
                                                "weight_scale"),
}


@pytest.mark.parametrize("lie", list(LIES))
def test_a_checkpoint_whose_tensors_and_config_disagree_is_one_line_naming_the_tensor(lie, written, tmp_path):
    scheme, weights, tensors, named = LIES[lie]
    _lie(written(scheme, tmp_path), weights, tensors)
    with pytest.raises(FastpplError, match=rf"\.{named}|{named} .*scheme") as raised:
        load_model(str(tmp_path), "native", torch.float32)
    assert "\n" not in str(raised.value) and "corrupt" in str(raised.value)
