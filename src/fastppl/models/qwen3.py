"""Qwen3: the Llama module (fastppl.models.llama) with each query and key head RMS-normalised before RoPE, its
Hugging Face name map and its ModelSpec. head_dim is the config's own (128 by default), not hidden / heads;
attention_bias biases q, k, v and o together; a sliding window, where config.json turns one on, caps the context
as for Qwen2."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import partial

import torch

from . import llama
from .llama import Attention, Llama, LlamaConfig, RMSNorm


@dataclass
class Qwen3Config(LlamaConfig):
    """LlamaConfig; the per-head norms share rms_norm_eps."""


PRESETS = {
    # tiny shape for tests: GQA, a head_dim unlike hidden / heads (64 / 4 = 16), tied, with a vocabulary that holds
    # the GPT-2 tokenizer's 50,257 ids
    "qwen3-tiny": Qwen3Config(
        vocab_size=50304, max_positions=512, hidden_size=64, intermediate_size=176, n_layer=2, n_head=4,
        n_kv_head=2, head_dim=32, rope_theta=1_000_000.0, tie_word_embeddings=True, rms_norm_eps=1e-6),
}


class QKNormAttention(Attention):
    def __init__(self, config: LlamaConfig):
        super().__init__(config)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)   # over each head's hs, shared by the heads
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)

    def normalize_heads(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.q_norm(q), self.k_norm(k)                          # (B, nh or nkv, T, hs) each


class Qwen3(Llama):
    family = "qwen3"   # its ModelSpec in fastppl.models.registry
    attention_class = QKNormAttention


# ---- Hugging Face checkpoints <-> Qwen3 ----------------------------------------------------------------------

HF_NAME_MAP = {**llama.HF_NAME_MAP,
               "blocks.{}.attn.q_norm.weight": ["model.layers.{}.self_attn.q_norm.weight"],
               "blocks.{}.attn.k_norm.weight": ["model.layers.{}.self_attn.k_norm.weight"]}


def config_from_hf(hf_config: dict) -> Qwen3Config:
    # transformers' Qwen3Config: head_dim 128 where config.json has none
    return llama.config_from_hf(hf_config, default_head_dim=128, config_class=Qwen3Config)


def config_to_hf(config: Qwen3Config) -> dict:
    assert config.qkv_bias == config.o_bias, "Qwen3's attention_bias biases q, k, v and o together"
    hf = llama.config_to_hf(dataclasses.replace(config, qkv_bias=False, o_bias=False))
    hf.update(model_type="qwen3", architectures=["Qwen3ForCausalLM"], attention_bias=config.qkv_bias)
    return hf


SPEC = dataclasses.replace(
    llama.SPEC, name="qwen3", model_class=Qwen3, config_class=Qwen3Config, model_types=("qwen3",),
    config_from_hf=config_from_hf,
    config_to_hf=config_to_hf, checkpoint_pieces=partial(llama.checkpoint_pieces, name_map=HF_NAME_MAP),
    state_dict_to_hf=partial(llama.state_dict_to_hf, name_map=HF_NAME_MAP), presets=PRESETS,
    fused_trunk_forward=None, fused_trunk_split=None,   # the fused trunk has no kernel for the per-head q/k norms
)
