"""Hugging Face GPT-2 checkpoint <-> native GPT2: a name map, with asserted key and shape checks."""
from __future__ import annotations

import re

import torch

from ..errors import FastpplError
from .gpt2 import GPT2, GPT2Config

# native name pattern -> HF name pattern ({} is the layer index)
GPT2_NAME_MAP = {
    "wte.weight": "transformer.wte.weight",
    "wpe.weight": "transformer.wpe.weight",
    "ln_f.weight": "transformer.ln_f.weight",
    "ln_f.bias": "transformer.ln_f.bias",
    "blocks.{}.ln_1.weight": "transformer.h.{}.ln_1.weight",
    "blocks.{}.ln_1.bias": "transformer.h.{}.ln_1.bias",
    "blocks.{}.attn.qkv.weight": "transformer.h.{}.attn.c_attn.weight",
    "blocks.{}.attn.qkv.bias": "transformer.h.{}.attn.c_attn.bias",
    "blocks.{}.attn.proj.weight": "transformer.h.{}.attn.c_proj.weight",
    "blocks.{}.attn.proj.bias": "transformer.h.{}.attn.c_proj.bias",
    "blocks.{}.ln_2.weight": "transformer.h.{}.ln_2.weight",
    "blocks.{}.ln_2.bias": "transformer.h.{}.ln_2.bias",
    "blocks.{}.mlp.fc.weight": "transformer.h.{}.mlp.c_fc.weight",
    "blocks.{}.mlp.fc.bias": "transformer.h.{}.mlp.c_fc.bias",
    "blocks.{}.mlp.proj.weight": "transformer.h.{}.mlp.c_proj.weight",
    "blocks.{}.mlp.proj.bias": "transformer.h.{}.mlp.c_proj.bias",
}
# HF GPT-2 stores these as Conv1D, i.e. (in, out): transposed relative to nn.Linear
_CONV1D = re.compile(r"\.(c_attn|c_proj|c_fc)\.weight$")


def gpt2_config_from_hf(hf_config: dict) -> GPT2Config:
    return GPT2Config(
        vocab_size=hf_config["vocab_size"],
        n_positions=hf_config.get("n_positions", hf_config.get("n_ctx", 1024)),
        n_embd=hf_config["n_embd"],
        n_layer=hf_config["n_layer"],
        n_head=hf_config["n_head"],
        layer_norm_epsilon=hf_config.get("layer_norm_epsilon", 1e-5),
    )


def gpt2_native_gaps(hf_config: dict) -> list[str]:
    """Settings of a GPT-2 config.json that the native GPT2 does not implement (empty: it is exact).
    Such a checkpoint must run through transformers, or it would load and score wrongly."""
    n_inner = hf_config.get("n_inner")
    checks = {
        "activation_function": hf_config.get("activation_function", "gelu_new") in ("gelu_new", "gelu_pytorch_tanh"),
        "n_inner": n_inner is None or n_inner == 4 * hf_config.get("n_embd", 0),
        "scale_attn_weights": hf_config.get("scale_attn_weights", True) is True,
        "scale_attn_by_inverse_layer_idx": not hf_config.get("scale_attn_by_inverse_layer_idx", False),
        "reorder_and_upcast_attn": not hf_config.get("reorder_and_upcast_attn", False),
        "tie_word_embeddings": hf_config.get("tie_word_embeddings", True) is not False,
    }
    return [f"{name}={hf_config.get(name)!r}" for name, supported in checks.items() if not supported]


def gpt2_config_to_hf(config: GPT2Config) -> dict:
    return dict(
        model_type="gpt2", architectures=["GPT2LMHeadModel"], vocab_size=config.vocab_size,
        n_positions=config.n_positions, n_ctx=config.n_positions, n_embd=config.n_embd,
        n_layer=config.n_layer, n_head=config.n_head, layer_norm_epsilon=config.layer_norm_epsilon,
        activation_function="gelu_new", bos_token_id=50256, eos_token_id=50256, tie_word_embeddings=True,
    )


def _expand(config: GPT2Config) -> dict[str, str]:
    names = {}
    for native, hf in GPT2_NAME_MAP.items():
        if "{}" in native:
            for i in range(config.n_layer):
                names[native.format(i)] = hf.format(i)
        else:
            names[native] = hf
    return names


def load_hf_gpt2_state_dict(model: GPT2, hf_state: dict[str, torch.Tensor], source: str) -> None:
    """Copy an HF GPT-2 state dict into model (checks every key and shape)."""
    # some checkpoints drop the "transformer." prefix; attention mask buffers are not weights
    hf_state = {(k if k.startswith(("transformer.", "lm_head.")) else "transformer." + k): v
                for k, v in hf_state.items() if not k.endswith((".attn.bias", ".attn.masked_bias"))}
    names = _expand(model.config)
    missing = [hf for hf in names.values() if hf not in hf_state]
    if missing:
        raise FastpplError(
            f"{source}: checkpoint lacks {len(missing)} GPT-2 weights (first: {missing[0]}); "
            "the file is incomplete or not a GPT-2 checkpoint"
        )
    native_params = dict(model.named_parameters())
    with torch.no_grad():
        for native, hf in names.items():
            tensor = hf_state[hf]
            if _CONV1D.search(hf):
                tensor = tensor.t()
            target = native_params[native]
            if tuple(tensor.shape) != tuple(target.shape):
                raise FastpplError(
                    f"{source}: {hf} has shape {tuple(tensor.shape)}, config.json implies "
                    f"{tuple(target.shape)}; the checkpoint does not match its config"
                )
            target.copy_(tensor)


def gpt2_state_dict_to_hf(model: GPT2) -> dict[str, torch.Tensor]:
    """Native weights as an HF GPT2LMHeadModel state dict (for tests and for saving tiny models)."""
    params = dict(model.named_parameters())
    out = {}
    for native, hf in _expand(model.config).items():
        tensor = params[native].detach()
        out[hf] = (tensor.t() if _CONV1D.search(hf) else tensor).contiguous().clone()
    out["lm_head.weight"] = out["transformer.wte.weight"]
    return out
