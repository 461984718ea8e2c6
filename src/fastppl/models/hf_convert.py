"""Hugging Face checkpoints <-> native models (GPT-2, the Llama family): name maps, with asserted key
and shape checks."""
from __future__ import annotations

import re
from typing import Optional

import torch

from ..errors import FastpplError
from .gpt2 import GPT2, GPT2Config
from .llama import Llama, LlamaConfig
from .weights import Piece, StoredTensor, read_tensor

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


def gpt2_pieces(model: GPT2, index: dict[str, StoredTensor], source: str) -> list[tuple[StoredTensor, Piece]]:
    """Where each tensor of an HF GPT-2 checkpoint goes in model (checks every key, shape and dtype)."""
    # some checkpoints drop the "transformer." prefix; attention mask buffers are not weights
    index = {(k if k.startswith(("transformer.", "lm_head.")) else "transformer." + k): v
             for k, v in index.items() if not k.endswith((".attn.bias", ".attn.masked_bias"))}
    names = _expand(model.config)
    missing = [hf for hf in names.values() if hf not in index]
    if missing:
        raise FastpplError(
            f"{source}: checkpoint lacks {len(missing)} GPT-2 weights (first: {missing[0]}); "
            "the file is incomplete or not a GPT-2 checkpoint"
        )
    # the native GPT-2 ties lm_head to wte: a checkpoint's own lm_head must be that same matrix
    _refuse_dropped_weights(index, "transformer.h.", model.config.n_layer, "lm_head.weight",
                            "transformer.wte.weight", source)
    native_params = dict(model.named_parameters())
    pieces = []
    for native, hf in names.items():
        shape, transpose = tuple(native_params[native].shape), bool(_CONV1D.search(hf))
        _check_stored(index[hf], shape[::-1] if transpose else shape, source, hf)
        pieces.append((index[hf], Piece(native, 0, shape[0], transpose)))
    return pieces


def _refuse_dropped_weights(index: dict[str, StoredTensor], layer_prefix: str, n_layer: int, tied_head: Optional[str],
                            embedding: str, source: str) -> None:
    """Refuse a checkpoint whose weights the model would drop and so silently be another model: layers past
    the config's n_layer (a config with fewer layers than the file), or, for a tied model, a file's own output
    matrix that is not the embedding. Other extra tensors (a value head, a second copy of the weights under
    other names, as Mistral's consolidated.safetensors) are ignored, as transformers ignores them."""
    layer = re.compile(re.escape(layer_prefix) + r"(\d+)\.")
    extra = sorted((int(m.group(1)), k) for k in index if (m := layer.match(k)) and int(m.group(1)) >= n_layer)
    if extra:
        raise FastpplError(
            f"{source}: checkpoint holds layer {extra[0][0]} ({extra[0][1]}), but config.json has {n_layer} layers; "
            "the config does not match the file")
    if tied_head is not None and tied_head in index and embedding in index:
        head, table = index[tied_head], index[embedding]
        if head.shape != table.shape or not torch.equal(read_tensor(head), read_tensor(table)):
            raise FastpplError(
                f"{source}: {tied_head} differs from {embedding}, but config.json ties them (tie_word_embeddings); "
                "the config does not match the file")


def _check_stored(stored: StoredTensor, shape: tuple, source: str, hf_name: str) -> None:
    """A checkpoint tensor holds weights of the shape the config implies."""
    if not stored.dtype.is_floating_point:   # a conversion would turn integers into weights silently
        raise FastpplError(f"{source}: {hf_name} holds {stored.dtype} values, not weights; the checkpoint is corrupt")
    if tuple(stored.shape) != tuple(shape):
        raise FastpplError(
            f"{source}: {hf_name} has shape {tuple(stored.shape)}, config.json implies "
            f"{tuple(shape)}; the checkpoint does not match its config"
        )


def gpt2_state_dict_to_hf(model: GPT2) -> dict[str, torch.Tensor]:
    """Native weights as an HF GPT2LMHeadModel state dict (for tests and for saving tiny models)."""
    params = dict(model.named_parameters())
    out = {}
    for native, hf in _expand(model.config).items():
        tensor = params[native].detach()
        out[hf] = (tensor.t() if _CONV1D.search(hf) else tensor).contiguous().clone()
    out["lm_head.weight"] = out["transformer.wte.weight"]
    return out


# ---------------------------------------------------------------------------------------------------
# Llama family (Llama 2/3, Qwen2, Mistral): one name map; q/k/v and gate/up are concatenated (dim 0)
# into the native fused matrices, in the order listed.

LLAMA_MODEL_TYPES = ("llama", "qwen2", "mistral")

# native name pattern -> HF name patterns ({} is the layer index)
LLAMA_NAME_MAP = {
    "embed.weight": ["model.embed_tokens.weight"],
    "norm.weight": ["model.norm.weight"],
    "lm_head.weight": ["lm_head.weight"],                      # untied checkpoints only
    "blocks.{}.attn_norm.weight": ["model.layers.{}.input_layernorm.weight"],
    "blocks.{}.attn.qkv.weight": ["model.layers.{}.self_attn.%s_proj.weight" % p for p in "qkv"],
    "blocks.{}.attn.qkv.bias": ["model.layers.{}.self_attn.%s_proj.bias" % p for p in "qkv"],
    "blocks.{}.attn.o_proj.weight": ["model.layers.{}.self_attn.o_proj.weight"],
    "blocks.{}.attn.o_proj.bias": ["model.layers.{}.self_attn.o_proj.bias"],
    "blocks.{}.mlp_norm.weight": ["model.layers.{}.post_attention_layernorm.weight"],
    "blocks.{}.mlp.gate_up.weight": ["model.layers.{}.mlp.gate_proj.weight", "model.layers.{}.mlp.up_proj.weight"],
    "blocks.{}.mlp.gate_up.bias": ["model.layers.{}.mlp.gate_proj.bias", "model.layers.{}.mlp.up_proj.bias"],
    "blocks.{}.mlp.down_proj.weight": ["model.layers.{}.mlp.down_proj.weight"],
    "blocks.{}.mlp.down_proj.bias": ["model.layers.{}.mlp.down_proj.bias"],
}
_LAYER = re.compile(r"^blocks\.(\d+)\.")


def _llama_rope(hf_config: dict) -> dict:
    """The RoPE settings from either spelling: transformers 5's rope_parameters, or the older
    rope_theta + rope_scaling (whose type key was once "type")."""
    for key in ("rope_parameters", "rope_scaling"):
        if not isinstance(hf_config.get(key) or {}, dict):
            raise FastpplError(f"config.json: {key} is not an object of settings; the checkpoint is corrupt")
    rope = dict(hf_config.get("rope_parameters") or {})
    if not rope:
        rope = dict(hf_config.get("rope_scaling") or {})
        rope.setdefault("rope_theta", hf_config.get("rope_theta", 10000.0))
    rope.setdefault("rope_type", rope.pop("type", "default"))
    return rope


def llama_unsupported(hf_config: dict) -> Optional[str]:
    """Why the native Llama cannot run this config (the HF backend then does), or None."""
    from .llama import ROPE_TYPES
    rope = _llama_rope(hf_config)
    if rope["rope_type"] not in ROPE_TYPES:
        return f"RoPE type {rope['rope_type']!r} (native: {', '.join(ROPE_TYPES)})"
    if hf_config.get("hidden_act", "silu") != "silu":
        return f"activation {hf_config['hidden_act']!r} (native: silu)"
    if rope.get("partial_rotary_factor", hf_config.get("partial_rotary_factor", 1.0)) != 1.0:
        return "partial rotary embeddings"
    return None


# what transformers requires of each RoPE type: a config without them is incomplete, not one to fill with defaults
ROPE_REQUIRED_KEYS = {"linear": ("factor",),
                      "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}


def llama_config_from_hf(hf_config: dict) -> LlamaConfig:
    model_type = hf_config["model_type"]
    rope = _llama_rope(hf_config)
    missing = [key for key in ROPE_REQUIRED_KEYS.get(rope["rope_type"], ()) if key not in rope]
    if missing:
        raise ValueError(f"RoPE type {rope['rope_type']!r} needs {', '.join(missing)}")
    max_positions = hf_config.get("max_position_embeddings", 2048)
    # sliding-window attention equals full causal attention on windows no longer than the window,
    # so capping the context at it keeps the native (full-attention) model exact
    uses_window = model_type == "mistral" or hf_config.get("use_sliding_window", False)
    attention_window = hf_config.get("sliding_window") if uses_window else None
    if attention_window:
        max_positions = min(max_positions, attention_window)
    if model_type == "qwen2":
        qkv_bias, o_bias = True, False                      # Qwen2 always biases q, k, v (not o)
    else:
        qkv_bias = o_bias = bool(hf_config.get("attention_bias", False))
    return LlamaConfig(
        vocab_size=hf_config["vocab_size"],
        max_positions=max_positions,
        hidden_size=hf_config["hidden_size"],
        intermediate_size=hf_config["intermediate_size"],
        n_layer=hf_config["num_hidden_layers"],
        n_head=hf_config["num_attention_heads"],
        n_kv_head=hf_config.get("num_key_value_heads") or hf_config["num_attention_heads"],
        head_dim=hf_config.get("head_dim"),
        rms_norm_eps=hf_config.get("rms_norm_eps", 1e-6),
        rope_theta=rope["rope_theta"],
        rope_type=rope["rope_type"],
        rope_factor=rope.get("factor", 1.0),                 # the defaults serve the types that do not use them
        rope_low_freq_factor=rope.get("low_freq_factor", 1.0),
        rope_high_freq_factor=rope.get("high_freq_factor", 4.0),
        rope_original_max_positions=rope.get("original_max_position_embeddings", max_positions),
        tie_word_embeddings=hf_config.get("tie_word_embeddings", False),
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        mlp_bias=bool(hf_config.get("mlp_bias", False)),
        attention_window=attention_window or None,
    )


def llama_config_to_hf(config: LlamaConfig) -> dict:
    """An HF config.json for the native config: Qwen2 when only q/k/v are biased, else Llama."""
    assert not (config.o_bias and not config.qkv_bias), "no HF architecture biases o but not q/k/v"
    model_type = "qwen2" if config.qkv_bias and not config.o_bias else "llama"
    hf = dict(
        model_type=model_type, architectures=["Qwen2ForCausalLM" if model_type == "qwen2" else "LlamaForCausalLM"],
        vocab_size=config.vocab_size, max_position_embeddings=config.max_positions,
        hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.n_layer, num_attention_heads=config.n_head,
        num_key_value_heads=config.n_kv_head, head_dim=config.head_dim, rms_norm_eps=config.rms_norm_eps,
        hidden_act="silu", tie_word_embeddings=config.tie_word_embeddings, mlp_bias=config.mlp_bias,
        rope_theta=config.rope_theta, bos_token_id=50256, eos_token_id=50256,
    )
    if model_type == "llama":
        hf["attention_bias"] = config.qkv_bias
    if config.rope_type == "linear":
        hf["rope_scaling"] = dict(rope_type="linear", factor=config.rope_factor)
    elif config.rope_type == "llama3":
        hf["rope_scaling"] = dict(
            rope_type="llama3", factor=config.rope_factor, low_freq_factor=config.rope_low_freq_factor,
            high_freq_factor=config.rope_high_freq_factor,
            original_max_position_embeddings=config.rope_original_max_positions)
    return hf


def _llama_hf_names(native: str) -> list[str]:
    match = _LAYER.match(native)
    pattern = _LAYER.sub("blocks.{}.", native) if match else native
    assert pattern in LLAMA_NAME_MAP, f"no HF name for native parameter {native}"
    return [hf.format(match.group(1)) if match else hf for hf in LLAMA_NAME_MAP[pattern]]


def _llama_rows(config: LlamaConfig, native: str, n_rows: int, n_pieces: int) -> list[int]:
    """The rows each HF tensor holds of a native parameter: q, k, v of their heads; gate and up halves."""
    if native.endswith(("qkv.weight", "qkv.bias")):
        return [config.n_head * config.head_dim, config.n_kv_head * config.head_dim, config.n_kv_head * config.head_dim]
    return [n_rows // n_pieces] * n_pieces


def llama_pieces(model: Llama, index: dict[str, StoredTensor], source: str) -> list[tuple[StoredTensor, Piece]]:
    """Where each tensor of an HF Llama/Qwen2/Mistral checkpoint goes in model (checks every key, shape, dtype)."""
    # some checkpoints drop the "model." prefix
    index = {(k if k.startswith(("model.", "lm_head.")) else "model." + k): v for k, v in index.items()}
    native_params = dict(model.named_parameters())        # a tied lm_head appears once, as embed.weight
    names = {native: _llama_hf_names(native) for native in native_params}
    missing = [hf for hf_names in names.values() for hf in hf_names if hf not in index]
    if missing:
        raise FastpplError(
            f"{source}: checkpoint lacks {len(missing)} weights that config.json implies (first: {missing[0]}); "
            "the file is incomplete or its config does not match it"
        )
    _refuse_dropped_weights(index, "model.layers.", model.config.n_layer,
                            "lm_head.weight" if model.config.tie_word_embeddings else None,
                            "model.embed_tokens.weight", source)
    pieces = []
    for native, hf_names in names.items():
        shape, start = tuple(native_params[native].shape), 0
        for hf, rows in zip(hf_names, _llama_rows(model.config, native, shape[0], len(hf_names))):
            _check_stored(index[hf], (rows, *shape[1:]), source, hf)
            pieces.append((index[hf], Piece(native, start, start + rows)))
            start += rows
    return pieces


def llama_state_dict_to_hf(model: Llama) -> dict[str, torch.Tensor]:
    """Native weights as an HF LlamaForCausalLM / Qwen2ForCausalLM state dict (fused matrices split)."""
    out = {}
    for native, param in model.named_parameters():
        hf_names = _llama_hf_names(native)
        tensor = param.detach()
        pieces = tensor.split(_llama_rows(model.config, native, tensor.shape[0], len(hf_names)))
        for hf, piece in zip(hf_names, pieces):
            out[hf] = piece.contiguous().clone()
    if model.config.tie_word_embeddings:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out
