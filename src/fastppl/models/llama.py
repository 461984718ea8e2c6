"""The Llama family (Llama 2/3/3.1, Qwen2, Mistral): token ids -> final hidden states, its Hugging Face name map
and its ModelSpecs (Qwen2 and Mistral are specs of this module with options; Qwen3 adds per-head q/k norms in
fastppl.models.qwen3).

RoPE (with the llama3 and linear frequency scalings), grouped-query attention, RMSNorm, SwiGLU, tied or
untied embeddings, optional q/k/v, o and MLP biases. The output projection is applied by the loss
(fastppl.engine.loss), in chunks, so that the (B, T, V) logits never exist. q/k/v and gate/up are each one fused
matrix (fewer, larger matmuls); checkpoint_pieces concatenates the checkpoint's separate matrices into them."""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..errors import FastpplError
from .attention import causal_attention, masked_attention
from .initialization import init_gpt_style_
from .kv_cache import CacheStep
from .rotary import ROPE_TYPES, apply_rotary, rope_frequencies
from .llama_trunk import forward_with_fused_trunk, fused_trunk_split
from .spec import HFSizeKeys, ModelShape, ModelSpec, NotNative
from .weights import Piece, StoredTensor, check_stored, refuse_dropped_weights

@dataclass
class LlamaConfig:
    vocab_size: int = 128256
    max_positions: int = 131072           # HF max_position_embeddings (capped at Mistral's sliding window)
    hidden_size: int = 2048
    intermediate_size: int = 8192         # SwiGLU inner width
    n_layer: int = 16
    n_head: int = 32
    n_kv_head: int = 8                    # < n_head: grouped-query attention
    head_dim: Optional[int] = None        # None = hidden_size // n_head
    rms_norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_type: str = "default"            # default | linear | llama3
    rope_factor: float = 1.0              # linear and llama3: how much the low frequencies are slowed
    rope_low_freq_factor: float = 1.0     # llama3 only: wavelengths above original/low are divided by factor,
    rope_high_freq_factor: float = 4.0    #   below original/high kept, smoothly interpolated in between
    rope_original_max_positions: int = 8192
    tie_word_embeddings: bool = True
    qkv_bias: bool = False                # Qwen2 (and Llama's attention_bias)
    o_bias: bool = False                  # Llama's attention_bias
    mlp_bias: bool = False
    attention_window: Optional[int] = None   # Mistral/Qwen2 sliding attention: caps max_positions (full causal
                                             # attention equals it only on windows no longer than this)

    def __post_init__(self) -> None:
        assert min(self.vocab_size, self.max_positions, self.hidden_size, self.intermediate_size, self.n_layer,
                   self.n_head, self.n_kv_head) >= 1, "every size must be at least 1"
        assert self.rms_norm_eps > 0 and self.rope_theta > 0, "rms_norm_eps and rope_theta must be positive"
        if self.head_dim is None:
            assert self.hidden_size % self.n_head == 0, "hidden_size must be a multiple of n_head"
            self.head_dim = self.hidden_size // self.n_head
        assert self.n_head % self.n_kv_head == 0, "n_head must be a multiple of n_kv_head"
        assert self.head_dim % 2 == 0, "RoPE rotates pairs of dimensions"
        assert self.rope_type in ROPE_TYPES, f"rope_type {self.rope_type!r} is not one of {ROPE_TYPES}"


PRESETS = {
    # the Llama-3.2-1B shape
    "llama-1b": LlamaConfig(
        vocab_size=128256, max_positions=131072, hidden_size=2048, intermediate_size=8192, n_layer=16,
        n_head=32, n_kv_head=8, head_dim=64, rope_theta=500000.0, rope_type="llama3", rope_factor=32.0,
        rope_low_freq_factor=1.0, rope_high_freq_factor=4.0, rope_original_max_positions=8192,
        tie_word_embeddings=True),
    # the Llama-3.1-8B shape (16 GB of bf16 weights: for a GPU)
    "llama-8b": LlamaConfig(
        vocab_size=128256, max_positions=131072, hidden_size=4096, intermediate_size=14336, n_layer=32,
        n_head=32, n_kv_head=8, head_dim=128, rope_theta=500000.0, rope_type="llama3", rope_factor=8.0,
        rope_low_freq_factor=1.0, rope_high_freq_factor=4.0, rope_original_max_positions=8192,
        tie_word_embeddings=False),
    # tiny shape for tests: GQA, untied, and llama3 scaling that bites at short wavelengths (original
    # context 64), with a vocabulary that holds the GPT-2 tokenizer's 50,257 ids
    "llama-tiny": LlamaConfig(
        vocab_size=50304, max_positions=512, hidden_size=64, intermediate_size=176, n_layer=2,
        n_head=4, n_kv_head=2, rope_theta=10000.0, rope_type="llama3", rope_factor=8.0,
        rope_low_freq_factor=1.0, rope_high_freq_factor=4.0, rope_original_max_positions=64,
        tie_word_embeddings=False),
}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # normalised in fp32 (float64 in a float64 model), scaled in the input's dtype (as the reference
        # implementation does)
        x32 = x.to(torch.promote_types(x.dtype, torch.float32))
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = config.n_head, config.n_kv_head, config.head_dim
        q_dim, kv_dim = config.n_head * config.head_dim, config.n_kv_head * config.head_dim
        self.split = (q_dim, kv_dim, kv_dim)
        self.qkv = nn.Linear(config.hidden_size, q_dim + 2 * kv_dim, bias=config.qkv_bias)   # fused q, k, v
        self.o_proj = nn.Linear(q_dim, config.hidden_size, bias=config.o_bias)
        self.kv_cache = None      # a KVCache once fastppl.models.kv_cache.setup_kv_cache attached one;
                                  # used only by forwards given a cache_step

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
        document_ids: Optional[torch.Tensor] = None, cache_step: Optional[CacheStep] = None,
    ) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = self.qkv(x).split(self.split, dim=-1)
        q = q.view(B, T, self.n_head, self.head_dim).transpose(1, 2)       # (B, nh, T, hs)
        k = k.view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)    # (B, nkv, T, hs)
        v = v.view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)    # (B, nkv, T, hs)
        q, k = self.normalize_heads(q, k)
        q = apply_rotary(q, *rope)
        if cache_step is None:
            y = causal_attention(q, apply_rotary(k, *rope), v, document_ids)
        else:
            if cache_step.key_rope is None:
                k = apply_rotary(k, *rope)           # cached as rotated at their own positions
            k, v = self.kv_cache.update(cache_step.slots, k, v)            # (B, nkv, L, hs)
            if cache_step.key_rope is not None:
                k = apply_rotary(k, *cache_step.key_rope)   # cached unrotated: rotated here at the step's positions
            y = masked_attention(q, k, v, cache_step.mask)
        y = y.transpose(1, 2).contiguous().view(B, T, -1)                  # (B, nh, T, hs) -> (B, T, nh * hs)
        return self.o_proj(y)

    def normalize_heads(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Before RoPE: nothing in Llama; Qwen3's attention normalises each head (fastppl.models.qwen3)."""
        return q, k


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.inner = config.intermediate_size
        self.gate_up = nn.Linear(config.hidden_size, 2 * self.inner, bias=config.mlp_bias)   # fused gate, up
        self.down_proj = nn.Linear(self.inner, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).split(self.inner, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, config: LlamaConfig, attention_class: type = Attention):
        super().__init__()
        self.attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = attention_class(config)
        self.mlp_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, rope, document_ids=None, cache_step=None) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), rope, document_ids, cache_step)
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    family = "llama"              # its ModelSpec in fastppl.models.registry
    attention_class = Attention   # a family built on this module may bring its own (fastppl.models.qwen3)

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.blocks = nn.ModuleList(Block(config, self.attention_class) for _ in range(config.n_layer))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight
        self.fused_trunk: Optional[Callable] = None   # forward_with_fused_trunk, set by fastppl.accel.fused_llama

    @property
    def max_positions(self) -> int:
        return self.config.max_positions

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def init_weights(self, generator: Optional[torch.Generator] = None) -> None:
        """Normal(0, 0.02) matrices, residual projections scaled by 1/sqrt(2 * n_layer), unit norms, zero biases."""
        init_gpt_style_(self, self.config.n_layer, "norm", ("o_proj.weight", "down_proj.weight"), generator)

    def rope_cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (..., hs) of the rotary angles at integer positions (...), computed in fp32."""
        inv_freq = rope_frequencies(self.config, positions.device)        # (hs/2,)
        angles = positions[..., None].float() * inv_freq                   # (..., hs/2)
        angles = torch.cat((angles, angles), dim=-1)                       # (..., hs): both halves of each pair
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def forward(
        self, input_ids: torch.Tensor, position_ids: Optional[torch.Tensor] = None,
        document_ids: Optional[torch.Tensor] = None, cache_step: Optional[CacheStep] = None,
    ) -> torch.Tensor:
        """(B, T) token ids -> (B, T, C) final hidden states (after the final norm). position_ids (T,) or
        (B, T) and document_ids (B, T) serve packed rows; cache_step is set when a KV cache is attached
        (fastppl.models.kv_cache)."""
        if self.fused_trunk is not None and cache_step is None:
            return self.fused_trunk(self, input_ids, position_ids, document_ids)
        x, block_inputs = self.residual_stream(input_ids, position_ids)
        for block in self.blocks:
            x = block(x, *block_inputs, document_ids, cache_step)
        return self.final_norm(x)

    def residual_stream(self, input_ids: torch.Tensor,
                        position_ids: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, tuple]:
        """The forward's first part (ModelSpec's layer-major split): (B, T) ids -> the residual stream (B, T, C) and
        what each block takes beside it (RoPE's cos and sin)."""
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.embed(input_ids)
        return x, (self.rope_cos_sin(position_ids, x.dtype),)              # (T or B x T, hs) each

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x)


# ---- Hugging Face checkpoints <-> Llama ----------------------------------------------------------------------
# One name map, native name pattern -> HF name patterns ({} is the layer index); q/k/v and gate/up are
# concatenated (dim 0) into the native fused matrices, in the order listed.
HF_NAME_MAP = {
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
# what transformers requires of each RoPE type: a config without them is incomplete, not one to fill with defaults
ROPE_REQUIRED_KEYS = {"linear": ("factor",),
                      "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}


def hf_rope(hf_config: dict) -> dict:
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


def _refuse_what_is_not_native(hf_config: dict, rope: dict) -> None:
    if rope["rope_type"] not in ROPE_TYPES:
        raise NotNative(f"RoPE type {rope['rope_type']!r} (native: {', '.join(ROPE_TYPES)})")
    if hf_config.get("hidden_act", "silu") != "silu":
        raise NotNative(f"activation {hf_config['hidden_act']!r} (native: silu)")
    if rope.get("partial_rotary_factor", hf_config.get("partial_rotary_factor", 1.0)) != 1.0:
        raise NotNative("partial rotary embeddings")


def sliding_window(hf_config: dict) -> Optional[int]:
    """The attention window of the checkpoint's sliding layers, as transformers reads config.json, or None when
    every layer attends to the whole context. Mistral slides every layer (4096 unless set; null: none); Qwen2 and
    Qwen3 only with use_sliding_window, and only the layers that layer_types (or max_window_layers) names."""
    if hf_config["model_type"] == "mistral":
        return hf_config.get("sliding_window", 4096)
    if not hf_config.get("use_sliding_window", False):
        return None
    window = hf_config.get("sliding_window", 4096)
    layer_types = hf_config.get("layer_types")
    if layer_types is not None:
        return window if "sliding_attention" in layer_types else None
    return window if hf_config.get("max_window_layers", 28) < hf_config["num_hidden_layers"] else None


def config_from_hf(hf_config: dict, qkv_bias: Optional[bool] = None, o_bias: Optional[bool] = None,
                   default_head_dim: Optional[int] = None, config_class: type = LlamaConfig) -> LlamaConfig:
    """LlamaConfig of a llama, qwen2 or mistral config.json (qwen3: fastppl.models.qwen3); NotNative for what
    the native model does not implement. qkv_bias, o_bias: None reads attention_bias."""
    rope = hf_rope(hf_config)
    _refuse_what_is_not_native(hf_config, rope)
    missing = [key for key in ROPE_REQUIRED_KEYS.get(rope["rope_type"], ()) if key not in rope]
    if missing:
        raise ValueError(f"RoPE type {rope['rope_type']!r} needs {', '.join(missing)}")
    max_positions = hf_config.get("max_position_embeddings", 2048)
    # sliding-window attention equals full causal attention on windows no longer than the window,
    # so capping the context at it keeps the native (full-attention) model exact
    window = sliding_window(hf_config)
    if window:
        max_positions = min(max_positions, window)
    attention_bias = bool(hf_config.get("attention_bias", False))
    return config_class(
        vocab_size=hf_config["vocab_size"],
        max_positions=max_positions,
        hidden_size=hf_config["hidden_size"],
        intermediate_size=hf_config["intermediate_size"],
        n_layer=hf_config["num_hidden_layers"],
        n_head=hf_config["num_attention_heads"],
        n_kv_head=hf_config.get("num_key_value_heads") or hf_config["num_attention_heads"],
        head_dim=hf_config.get("head_dim") or default_head_dim,
        rms_norm_eps=hf_config.get("rms_norm_eps", 1e-6),
        rope_theta=rope["rope_theta"],
        rope_type=rope["rope_type"],
        rope_factor=rope.get("factor", 1.0),                 # the defaults serve the types that do not use them
        rope_low_freq_factor=rope.get("low_freq_factor", 1.0),
        rope_high_freq_factor=rope.get("high_freq_factor", 4.0),
        rope_original_max_positions=rope.get("original_max_position_embeddings", max_positions),
        tie_word_embeddings=hf_config.get("tie_word_embeddings", False),
        qkv_bias=attention_bias if qkv_bias is None else qkv_bias,
        o_bias=attention_bias if o_bias is None else o_bias,
        mlp_bias=bool(hf_config.get("mlp_bias", False)),
        attention_window=window or None,
    )


def qwen2_config_from_hf(hf_config: dict) -> LlamaConfig:
    return config_from_hf(hf_config, qkv_bias=True, o_bias=False)   # Qwen2 always biases q, k, v (not o)


def config_to_hf(config: LlamaConfig) -> dict:
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
        rope_theta=config.rope_theta,
    )   # no special ids: the native config does not know them (the tokenizer holds them)
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


def _hf_names(native: str, name_map: dict) -> list[str]:
    match = _LAYER.match(native)
    pattern = _LAYER.sub("blocks.{}.", native) if match else native
    assert pattern in name_map, f"no HF name for native parameter {native}"
    return [hf.format(match.group(1)) if match else hf for hf in name_map[pattern]]


def _rows(config: LlamaConfig, native: str, n_rows: int, n_pieces: int) -> list[int]:
    """The rows each HF tensor holds of a native parameter: q, k, v of their heads; gate and up halves."""
    if native.endswith(("qkv.weight", "qkv.bias")):
        return [config.n_head * config.head_dim, config.n_kv_head * config.head_dim, config.n_kv_head * config.head_dim]
    return [n_rows // n_pieces] * n_pieces


def checkpoint_pieces(model: Llama, index: dict[str, StoredTensor], source: str,
                      name_map: dict = HF_NAME_MAP) -> list[tuple[StoredTensor, Piece]]:
    """Where each tensor of an HF Llama/Qwen2/Mistral checkpoint goes in model (checks every key, shape, dtype)."""
    # some checkpoints drop the "model." prefix
    index = {(k if k.startswith(("model.", "lm_head.")) else "model." + k): v for k, v in index.items()}
    native_params = dict(model.named_parameters())        # a tied lm_head appears once, as embed.weight
    names = {native: _hf_names(native, name_map) for native in native_params}
    missing = [hf for hf_names in names.values() for hf in hf_names if hf not in index]
    if missing:
        raise FastpplError(f"{source}: checkpoint lacks {len(missing)} weights that config.json implies (first: "
                           f"{missing[0]}); the file is incomplete or its config does not match it")
    refuse_dropped_weights(index, "model.layers.", model.config.n_layer,
                           "lm_head.weight" if model.config.tie_word_embeddings else None,
                           "model.embed_tokens.weight", source)
    pieces = []
    for native, hf_names in names.items():
        shape, start = tuple(native_params[native].shape), 0
        for hf, rows in zip(hf_names, _rows(model.config, native, shape[0], len(hf_names))):
            check_stored(index[hf], (rows, *shape[1:]), source, hf)
            pieces.append((index[hf], Piece(native, start, start + rows)))
            start += rows
    return pieces


def state_dict_to_hf(model: Llama, name_map: dict = HF_NAME_MAP) -> dict[str, torch.Tensor]:
    """Native weights as an HF LlamaForCausalLM / Qwen2ForCausalLM state dict (fused matrices split)."""
    out = {}
    for native, param in model.named_parameters():
        hf_names = _hf_names(native, name_map)
        tensor = param.detach()
        for hf, piece in zip(hf_names, tensor.split(_rows(model.config, native, tensor.shape[0], len(hf_names)))):
            out[hf] = piece.contiguous().clone()
    if model.config.tie_word_embeddings:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


def shape(config: LlamaConfig) -> ModelShape:
    return ModelShape(n_layer=config.n_layer, width=config.hidden_size, q_width=config.n_head * config.head_dim,
                      kv_width=config.n_kv_head * config.head_dim, mlp_inner=config.intermediate_size, mlp_matrices=3,
                      n_head=config.n_head, vocab_size=config.vocab_size)


# Measured on the H200 (the Llama-3.2-1B shape, where RMSNorm, RoPE and SwiGLU run as many small eager kernels):
# fused 158 k -> 212 k tokens/s for 9 s, chunked 146 k -> 216 k for 11 s: repaid after ~5.6 M tokens.
COMPILE_MIN_TOKENS = {"fused": 6_000_000, "chunked": 6_000_000}
SIZE_KEYS = HFSizeKeys("num_hidden_layers", "vocab_size", "hidden_size", "embed_tokens.weight")
_IN_ROPE = [f"{rope}.{key}" for rope in ("rope_parameters", "rope_scaling") for key in (
    "original_max_position_embeddings", "rope_theta", "factor", "low_freq_factor", "high_freq_factor")]
HF_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "max_position_embeddings", *_IN_ROPE[::5])
HF_FACTORS = ("rms_norm_eps", "rope_theta", *(key for key in _IN_ROPE if not key.endswith("_embeddings")))
SPEC = ModelSpec(
    name="llama", model_class=Llama, config_class=LlamaConfig, model_types=("llama",),
    config_from_hf=config_from_hf, config_to_hf=config_to_hf, checkpoint_pieces=checkpoint_pieces,
    state_dict_to_hf=state_dict_to_hf, hf_sizes=HF_SIZES, hf_factors=HF_FACTORS,
    hf_size_keys=SIZE_KEYS, shape=shape, presets=PRESETS, compile_family="llama",
    compile_min_tokens=COMPILE_MIN_TOKENS, rotary=True, fused_trunk_forward=forward_with_fused_trunk,
    fused_trunk_split=fused_trunk_split,
)
# Qwen2 and Mistral are this module with options: q/k/v biases; a sliding window (exact up to its length)
QWEN2_SPEC = dataclasses.replace(SPEC, name="qwen2", model_types=("qwen2",), config_from_hf=qwen2_config_from_hf,
                                 presets={})
MISTRAL_SPEC = dataclasses.replace(SPEC, name="mistral", model_types=("mistral",), presets={})
