"""Llama-family decoder (Llama 2/3, Qwen2, Mistral), architecture only: token ids -> final hidden states.

RoPE (with the llama3 and linear frequency scalings), grouped-query attention, RMSNorm, SwiGLU, tied or
untied embeddings, optional q/k/v bias (Qwen2). The output projection is applied by the loss
(fastppl.engine.loss), in chunks, so that the (B, T, V) logits never exist.

q/k/v and gate/up are each one fused matrix (fewer, larger matmuls); hf_convert concatenates the
checkpoint's separate matrices into them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from .attention import causal_attention, masked_attention
from .initialization import init_gpt_style_
from .kv_cache import CacheStep

ROPE_TYPES = ("default", "linear", "llama3")


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
    # tiny shape for tests: GQA, untied, and llama3 scaling that bites at short wavelengths (original
    # context 64), with a vocabulary that holds the GPT-2 tokenizer's 50,257 ids
    "llama-tiny": LlamaConfig(
        vocab_size=50304, max_positions=512, hidden_size=64, intermediate_size=176, n_layer=2,
        n_head=4, n_kv_head=2, rope_theta=10000.0, rope_type="llama3", rope_factor=8.0,
        rope_low_freq_factor=1.0, rope_high_freq_factor=4.0, rope_original_max_positions=64,
        tie_word_embeddings=False),
}


def rope_frequencies(config: LlamaConfig, device: Optional[torch.device] = None) -> torch.Tensor:
    """(head_dim / 2,) fp32 inverse frequencies, computed as transformers computes them.

    Recomputed in each forward rather than kept as a buffer: a buffer would be rounded to bf16 by
    model.to(torch.bfloat16), which moves the angle of position 100,000 by hundreds of radians."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float, device=device) / dim))
    if config.rope_type == "linear":
        return inv_freq / config.rope_factor
    if config.rope_type == "llama3":
        factor = config.rope_factor
        low, high = config.rope_low_freq_factor, config.rope_high_freq_factor
        original = config.rope_original_max_positions
        wavelength = 2 * math.pi / inv_freq
        # long wavelengths slowed by `factor`, short ones kept, the band between interpolated
        scaled = torch.where(wavelength > original / low, inv_freq / factor, inv_freq)
        smooth = (original / wavelength - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        in_band = ~(wavelength < original / high) & ~(wavelength > original / low)
        return torch.where(in_band, smoothed, scaled)
    return inv_freq


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (i, i + hs/2) of x (B, nh, T, hs) by the angles whose cos/sin are (T, hs) or (B, T, hs).
    The half-split pairing (not interleaved) is the one Hugging Face checkpoints are stored for."""
    cos, sin = cos.unsqueeze(-3), sin.unsqueeze(-3)             # broadcast over heads
    x1, x2 = x.chunk(2, dim=-1)
    rotated_half = torch.cat((-x2, x1), dim=-1)
    return x * cos + rotated_half * sin


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # normalised in fp32, scaled in the input's dtype (as the reference implementation does)
        x32 = x.float()
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
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = Attention(config)
        self.mlp_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, rope, document_ids=None, cache_step=None) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), rope, document_ids, cache_step)
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight

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
        B, T = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(T, device=input_ids.device)
        x = self.embed(input_ids)
        rope = self.rope_cos_sin(position_ids, x.dtype)                    # (T or B x T, hs) each
        for block in self.blocks:
            x = block(x, rope, document_ids, cache_step)
        return self.norm(x)
