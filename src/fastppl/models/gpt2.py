"""GPT-2, architecture only: token ids -> final hidden states. The output projection is applied by
the loss (fastppl.engine.loss), in chunks, so that the (B, T, V) logits never exist."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from .initialization import init_gpt_style_
from .attention import causal_attention, masked_attention
from .kv_cache import CacheStep


@dataclass
class GPT2Config:
    vocab_size: int = 50257
    n_positions: int = 1024       # the largest ctx the model allows
    n_embd: int = 768
    n_layer: int = 12
    n_head: int = 12
    layer_norm_epsilon: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    def __post_init__(self) -> None:
        assert min(self.vocab_size, self.n_positions, self.n_embd, self.n_layer, self.n_head) >= 1, \
            "every size must be at least 1"
        assert self.layer_norm_epsilon > 0, "layer_norm_epsilon must be positive"
        assert self.n_embd % self.n_head == 0, "n_embd must be a multiple of n_head"


PRESETS = {
    "gpt2": GPT2Config(n_layer=12, n_head=12, n_embd=768),
    "gpt2-medium": GPT2Config(n_layer=24, n_head=16, n_embd=1024),
    "gpt2-large": GPT2Config(n_layer=36, n_head=20, n_embd=1280),
    "gpt2-xl": GPT2Config(n_layer=48, n_head=25, n_embd=1600),
    # tiny shapes for tests; the vocabulary stays GPT-2's so that the real tokenizer fits
    "gpt2-tiny": GPT2Config(n_layer=2, n_head=2, n_embd=64, n_positions=256),
}


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPT2Config):
        super().__init__()
        self.n_head = config.n_head
        self.n_kv_head, self.head_dim = config.n_head, config.head_dim   # the shape a KV cache needs
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd)   # fused q, k, v
        self.proj = nn.Linear(config.n_embd, config.n_embd)
        self.kv_cache = None      # a KVCache once fastppl.models.kv_cache.setup_kv_cache attached one;
                                  # used only by forwards given a cache_step

    def forward(self, x: torch.Tensor, document_ids: Optional[torch.Tensor] = None,
                cache_step: Optional[CacheStep] = None) -> torch.Tensor:
        return self.proj(self.attend(x, document_ids, cache_step))

    def attend(self, x: torch.Tensor, document_ids: Optional[torch.Tensor] = None,
               cache_step: Optional[CacheStep] = None) -> torch.Tensor:
        """(B, T, C) -> (B, T, C): the heads' outputs side by side, before the output projection."""
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        # (B, T, C) -> (B, nh, T, hs)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        if cache_step is None:
            y = causal_attention(q, k, v, document_ids)
        else:
            k, v = self.kv_cache.update(cache_step.slots, k, v)            # (B, nh, L, hs)
            y = masked_attention(q, k, v, cache_step.mask)
        return y.transpose(1, 2).contiguous().view(B, T, C)      # (B, nh, T, hs) -> (B, T, C)


class MLP(nn.Module):
    def __init__(self, config: GPT2Config):
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.proj = nn.Linear(4 * config.n_embd, config.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.activation(x))

    def activation(self, x: torch.Tensor) -> torch.Tensor:
        """(..., C) -> (..., 4C), before the output projection."""
        return F.gelu(self.fc(x), approximate="tanh")   # GPT-2's "gelu_new"


class Block(nn.Module):
    def __init__(self, config: GPT2Config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, document_ids: Optional[torch.Tensor] = None,
                cache_step: Optional[CacheStep] = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), document_ids, cache_step)
        return x + self.mlp(self.ln_2(x))


class GPT2(nn.Module):
    def __init__(self, config: GPT2Config):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.n_positions, config.n_embd)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight                     # tied, as in GPT-2

    @property
    def max_positions(self) -> int:
        return self.config.n_positions

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def init_weights(self, generator: Optional[torch.Generator] = None) -> None:
        """GPT-2's initialisation (normal 0.02, residual projections scaled by 1/sqrt(2 * n_layer))."""
        init_gpt_style_(self, self.config.n_layer, "ln", ("proj.weight",), generator)

    def forward(
        self, input_ids: torch.Tensor, position_ids: Optional[torch.Tensor] = None,
        document_ids: Optional[torch.Tensor] = None, cache_step: Optional[CacheStep] = None,
    ) -> torch.Tensor:
        """(B, T) token ids -> (B, T, C) final hidden states (after ln_f). position_ids (T,) or (B, T)
        and document_ids (B, T) serve packed rows: positions restart and attention stops at each document.
        cache_step is set when a KV cache is attached (fastppl.models.kv_cache)."""
        B, T = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(T, device=input_ids.device)
        x = self.wte(input_ids) + self.wpe(position_ids)
        for block in self.blocks:
            x = block(x, document_ids, cache_step)
        return self.ln_f(x)
