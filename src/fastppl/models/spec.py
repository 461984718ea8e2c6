"""What fastppl knows of a model family, as data: the ModelSpec each family file defines next to its architecture
and fastppl.models.registry collects. Loading, accel/, engine/ and bench/ ask a family's spec, never its class."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, NamedTuple, Optional

import torch
import torch.nn as nn


class NotNative(ValueError):
    """A checkpoint setting the family's native model does not implement (an unknown RoPE scaling, another
    activation, ...). Its message says what, in a few words; the loader then runs transformers (--backend auto) or
    refuses (--backend native). Never a native model that would score wrongly."""


class ResidualNormKernels(NamedTuple):
    """add_layer_norm(x, delta, norm, store_sum) -> (x + delta or None, norm(x + delta)) (one Triton kernel), and
    linear(x, weight, accumulate_into=out), which adds x @ weight.T into out in place (cuBLAS, beta = 1)."""
    add_layer_norm: Callable
    linear: Callable


class LlamaTrunkKernels(NamedTuple):
    """rms_norm(x (M, C), weight, eps) -> its RMSNorm; rotate_queries_and_keys_(qkv, cos, sin, n_heads, head_dim)
    rotates the first n_heads heads of each qkv row in place; swiglu(gate_up (M, 2I)) -> silu(gate) * up (M, I);
    linear as ResidualNormKernels'."""
    rms_norm: Callable
    rotate_queries_and_keys_: Callable
    swiglu: Callable
    linear: Callable


class LayerSplit(NamedTuple):
    """A forward in the three parts that the layer-major path (fastppl.engine.streamed) runs apart:
    residual_stream(model, input_ids, position_ids) -> (x (B, T, C), block_inputs), then for each block
    block(block, x, *block_inputs, document_ids) -> x, then final_norm(model, x) -> (B, T, C)."""
    residual_stream: Callable
    block: Callable
    final_norm: Callable


# every native model's own forward, split: model.residual_stream, its blocks, model.final_norm
PLAIN_SPLIT = LayerSplit(lambda model, input_ids, position_ids: model.residual_stream(input_ids, position_ids),
                         lambda block, x, *inputs: block(x, *inputs), lambda model, x: model.final_norm(x))


@dataclass(frozen=True)
class ModelShape:
    """The sizes that the memory bound (accel.batch_size) and the FLOP count (bench.dense) need."""
    n_layer: int
    width: int              # the residual stream
    q_width: int            # heads x head dim
    kv_width: int           # KV heads x head dim
    mlp_inner: int          # the MLP's inner width
    mlp_matrices: int       # 2 (fc, proj) or 3 (SwiGLU's gate, up, down)
    n_head: int
    vocab_size: int


@dataclass(frozen=True)
class HFSizeKeys:
    """config.json's keys for the layers, vocabulary and width, and the embedding's tensor name (its suffix), read
    against the weights' shapes before anything is built (fastppl.models.loading.check_config_fits_weights)."""
    layers: str
    vocab: str
    width: str
    embedding: str


@dataclass(frozen=True)
class ModelSpec:
    """One native model family. Pattern: torchtitan's ModelSpec, gpt-fast's transformer_configs.

    Every family's model splits the same way, which the layer-major path (fastppl.engine.streamed) runs a block at
    a time over many batches: `x, block_inputs = model.residual_stream(input_ids, position_ids)`, then
    `x = block(x, *block_inputs, document_ids)` for each of `model.blocks` (alike in their parameters' shapes),
    then `model.final_norm(x)`; model.forward is that composition, so both paths compute the same."""
    name: str                                        # the family, e.g. "llama"
    model_class: type                                # config -> nn.Module with the engine's interface
    config_class: type                               # the native config dataclass
    model_types: tuple[str, ...]                     # the config.json model_types it takes
    # config.json dict -> native config; raises NotNative(reason) for a setting it does not implement, KeyError or
    # ValueError for a config that is incomplete or invalid (a corrupt checkpoint)
    config_from_hf: Callable[[dict], Any]
    config_to_hf: Callable[[Any], dict]              # native config -> config.json dict (native_to_hf, saving)
    # (model built on the meta device, checkpoint index, source) -> [(stored tensor, where it goes)], every key,
    # shape and dtype checked (fastppl.models.weights)
    checkpoint_pieces: Callable[[nn.Module, dict, str], list]
    state_dict_to_hf: Callable[[nn.Module], dict[str, torch.Tensor]]   # native weights under the HF names
    hf_size_keys: HFSizeKeys
    shape: Callable[[Any], ModelShape]               # native config -> its sizes (memory bound, FLOPs)
    # config.json's keys (one in an object as "rope_scaling.factor") that must hold a positive whole number, and a
    # positive finite number, where present: checked before anything is built (fastppl.models.settings)
    hf_sizes: tuple[str, ...] = ()
    hf_factors: tuple[str, ...] = ()
    presets: Mapping[str, Any] = field(default_factory=dict)   # random:<name> -> native config
    # the compile profile (accel.compile): the scored tokens from which a cold compile repays itself, by loss
    compile_family: str = "gpt2"
    compile_min_tokens: Mapping[str, int] = field(default_factory=dict)
    rotary: bool = False                             # RoPE: a cached sliding window can move keys to new positions
    kv_cache: bool = True                            # attention layers take a KV cache (fastppl.models.kv_cache)
    packing: bool = True                             # forward takes document_ids: packed rows stay apart
    tuned_products: bool = True                      # its products may run through the cuBLASLt tuner
    # fusions the family offers, applied by fastppl.accel.apply on CUDA with an eager scorer
    # forward(model, input_ids, position_ids, document_ids, kernels=ResidualNormKernels): the fused-norm forward
    fused_norm_forward: Optional[Callable] = None
    # forward(model, input_ids, position_ids, document_ids, kernels=LlamaTrunkKernels): the fused-trunk forward
    fused_trunk_forward: Optional[Callable] = None
    # kernels=LlamaTrunkKernels -> the fused-trunk forward as a LayerSplit, for the layer-major path
    fused_trunk_split: Optional[Callable] = None
    gelu_mlp_class: Optional[type] = None            # MLP modules whose fc + tanh GELU a cuBLASLt epilogue can run
    fused_decode: bool = False                       # fastppl.accel.fused_decode's Triton decode step applies

    def build(self, preset: str, device: torch.device | str = "cpu") -> nn.Module:
        with torch.device(device):
            return self.model_class(self.presets[preset])
