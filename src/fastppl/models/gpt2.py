"""GPT-2: token ids -> final hidden states, its fused-norm forward, its Hugging Face name map and its ModelSpec.
The output projection is applied by the loss (fastppl.engine.loss), in chunks, so that the (B, T, V) logits never
exist."""
from __future__ import annotations

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
from .spec import HFSizeKeys, ModelShape, ModelSpec, NotNative, ResidualNormKernels
from .weights import Piece, StoredTensor, check_stored, refuse_dropped_weights


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
    family = "gpt2"   # its ModelSpec in fastppl.models.registry

    def __init__(self, config: GPT2Config):
        super().__init__()
        self.config = config
        # forward_with_fused_norms bound to its kernels, once fastppl.accel.fused_norm fused this model; else None
        self.fused_norms: Optional[Callable] = None
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
        if self.fused_norms is not None and cache_step is None:
            return self.fused_norms(self, input_ids, position_ids, document_ids)
        x, block_inputs = self.residual_stream(input_ids, position_ids)
        for block in self.blocks:
            x = block(x, *block_inputs, document_ids, cache_step)
        return self.final_norm(x)

    def residual_stream(self, input_ids: torch.Tensor,
                        position_ids: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, tuple]:
        """The forward's first part (ModelSpec's layer-major split): (B, T) ids -> the residual stream (B, T, C) and
        what each block takes beside it (nothing, for GPT-2)."""
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)
        return self.wte(input_ids) + self.wpe(position_ids), ()

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        return self.ln_f(x)


# ---- the fused-norm forward: offered through the spec, run with the kernels fastppl.accel.fused_norm passes ----

def _projection_bias_sums(model: GPT2) -> torch.Tensor:
    """(2L, 1, C) fp32: entry j is the sum of the first j + 1 output-projection biases (attention, MLP, attention,
    ...)."""
    biases = [b for block in model.blocks for b in (block.attn.proj.bias, block.mlp.proj.bias)]
    return torch.stack(biases).float().cumsum(0)[:, None, :]


def forward_with_fused_norms(model: GPT2, input_ids: torch.Tensor, position_ids: Optional[torch.Tensor] = None,
                             document_ids: Optional[torch.Tensor] = None, *,
                             kernels: ResidualNormKernels) -> torch.Tensor:
    """GPT2.forward with every `x = x + proj(y)`, and the LayerNorm that follows it, in two kernels: the product
    added into x in place, then one kernel per LayerNorm that reads x once (fastppl.accel.fused_norm). The plain
    forward is the reference (tests/accel/test_fused_norm.py)."""
    B, T = input_ids.shape
    C = model.config.n_embd
    if position_ids is None:
        position_ids = torch.arange(T, device=input_ids.device)
    blocks = model.blocks
    # x: the residual stream, kept less the output projections' biases added so far. A bias is the same vector
    # for every row, so the LayerNorm that reads x adds their sum back (bias_sums), and each projection can add
    # its product into x in place inside cuBLAS (beta = 1, x read once in the product's epilogue) rather than
    # write it for a separate add to read. h: x's normalisation by the LayerNorm that reads it next.
    bias_sums = _projection_bias_sums(model)
    x, h = kernels.add_layer_norm(model.wte(input_ids), model.wpe(position_ids), blocks[0].ln_1)
    x, h = x.view(B * T, C), h.view(B * T, C)
    for i, block in enumerate(blocks):
        heads = block.attn.attend(h.view(B, T, C), document_ids).view(B * T, C)
        kernels.linear(heads, block.attn.proj.weight, accumulate_into=x)
        _, h = kernels.add_layer_norm(x, bias_sums[2 * i], block.ln_2, store_sum=False)
        kernels.linear(block.mlp.activation(h), block.mlp.proj.weight, accumulate_into=x)
        next_norm = blocks[i + 1].ln_1 if i + 1 < len(blocks) else model.ln_f
        _, h = kernels.add_layer_norm(x, bias_sums[2 * i + 1], next_norm, store_sum=False)
    return h.view(B, T, C)


# ---- Hugging Face checkpoints <-> GPT2 ------------------------------------------------------------------------

# native name pattern -> HF name pattern ({} is the layer index)
HF_NAME_MAP = {
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


def native_gaps(hf_config: dict) -> list[str]:
    """Settings of a GPT-2 config.json that the native GPT2 does not implement (empty: it is exact)."""
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


def config_from_hf(hf_config: dict) -> GPT2Config:
    """GPT2Config of a config.json; NotNative for a variant the native GPT2 would score wrongly."""
    gaps = native_gaps(hf_config)
    if gaps:
        raise NotNative(", ".join(gaps))
    return GPT2Config(
        vocab_size=hf_config["vocab_size"],
        n_positions=hf_config.get("n_positions", hf_config.get("n_ctx", 1024)),
        n_embd=hf_config["n_embd"],
        n_layer=hf_config["n_layer"],
        n_head=hf_config["n_head"],
        layer_norm_epsilon=hf_config.get("layer_norm_epsilon", 1e-5),
    )


def config_to_hf(config: GPT2Config) -> dict:
    return dict(
        model_type="gpt2", architectures=["GPT2LMHeadModel"], vocab_size=config.vocab_size,
        n_positions=config.n_positions, n_ctx=config.n_positions, n_embd=config.n_embd,
        n_layer=config.n_layer, n_head=config.n_head, layer_norm_epsilon=config.layer_norm_epsilon,
        activation_function="gelu_new", bos_token_id=50256, eos_token_id=50256, tie_word_embeddings=True,
    )


def _expand(config: GPT2Config) -> dict[str, str]:
    names = {}
    for native, hf in HF_NAME_MAP.items():
        if "{}" in native:
            for i in range(config.n_layer):
                names[native.format(i)] = hf.format(i)
        else:
            names[native] = hf
    return names


def checkpoint_pieces(model: GPT2, index: dict[str, StoredTensor], source: str) -> list[tuple[StoredTensor, Piece]]:
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
    refuse_dropped_weights(index, "transformer.h.", model.config.n_layer, "lm_head.weight",
                           "transformer.wte.weight", source)
    native_params = dict(model.named_parameters())
    pieces = []
    for native, hf in names.items():
        shape, transpose = tuple(native_params[native].shape), bool(_CONV1D.search(hf))
        check_stored(index[hf], shape[::-1] if transpose else shape, source, hf)
        pieces.append((index[hf], Piece(native, 0, shape[0], transpose)))
    return pieces


def state_dict_to_hf(model: GPT2) -> dict[str, torch.Tensor]:
    """Native weights as an HF GPT2LMHeadModel state dict (for tests and for saving tiny models)."""
    params = dict(model.named_parameters())
    out = {}
    for native, hf in _expand(model.config).items():
        tensor = params[native].detach()
        out[hf] = (tensor.t() if _CONV1D.search(hf) else tensor).contiguous().clone()
    out["lm_head.weight"] = out["transformer.wte.weight"]
    return out


def shape(config: GPT2Config) -> ModelShape:
    return ModelShape(n_layer=config.n_layer, width=config.n_embd, q_width=config.n_embd, kv_width=config.n_embd,
                      mlp_inner=4 * config.n_embd, mlp_matrices=2, n_head=config.n_head, vocab_size=config.vocab_size)


SPEC = ModelSpec(
    name="gpt2", model_class=GPT2, config_class=GPT2Config, model_types=("gpt2",), config_from_hf=config_from_hf,
    config_to_hf=config_to_hf, checkpoint_pieces=checkpoint_pieces, state_dict_to_hf=state_dict_to_hf,
    hf_size_keys=HFSizeKeys("n_layer", "vocab_size", "n_embd", "wte.weight"), shape=shape, presets=PRESETS,
    hf_sizes=("vocab_size", "n_positions", "n_ctx", "n_embd", "n_layer", "n_head"), hf_factors=("layer_norm_epsilon",),
    # Measured on the H200 with an eager scorer slower than the current one, so these are, if anything, low: with
    # the fused loss, compiling moves the scorer only from 1.62 to 1.70 M tokens/s, so it repays ~8 s after ~250 M
    # tokens; with the chunked loss 0.64 -> 1.62 M tokens/s, repaid after ~8 M tokens.
    compile_family="gpt2", compile_min_tokens={"fused": 250_000_000, "chunked": 8_000_000},
    rotary=False, fused_norm_forward=forward_with_fused_norms, gelu_mlp_class=MLP, fused_decode=True,
)
