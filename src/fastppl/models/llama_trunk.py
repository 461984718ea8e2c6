"""The Llama family's fused-trunk forward (offered through its ModelSpec, run with fastppl.accel.fused_llama's
kernels on CUDA): Llama.forward with each output product added into the residual stream in place, and RMSNorm,
RoPE and SwiGLU as kernels. Split as the plain forward is (fastppl.models.spec.LayerSplit), so that the
layer-major path runs it a block at a time."""
from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn as nn

from .attention import causal_attention
from .spec import LayerSplit, LlamaTrunkKernels


def forward_with_fused_trunk(model: nn.Module, input_ids: torch.Tensor, position_ids: Optional[torch.Tensor] = None,
                             document_ids=None, *, kernels: LlamaTrunkKernels) -> torch.Tensor:
    """Llama.forward with each output product added into the residual stream x in place, RMSNorm, RoPE (q, k rotated
    in place in the qkv product) and SiLU(gate) * up as kernels. Equal to the plain forward up to rounding. Split
    as the plain forward is (ModelSpec): fused_residual_stream, fused_block per block, fused_final_norm."""
    x, block_inputs = fused_residual_stream(model, input_ids, position_ids)
    for block in model.blocks:
        x = fused_block(block, x, *block_inputs, document_ids, kernels=kernels)
    return fused_final_norm(model, x, kernels=kernels)


def fused_residual_stream(model: nn.Module, input_ids: torch.Tensor,
                          position_ids: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, tuple]:
    """The residual stream (B, T, C) and each block's other inputs: RoPE's fp32 cos, sin (B*T or T, hs)."""
    T, head_dim = input_ids.shape[1], model.config.head_dim
    positions = torch.arange(T, device=input_ids.device) if position_ids is None else position_ids
    cos, sin = (a.reshape(-1, head_dim).contiguous() for a in model.rope_cos_sin(positions, torch.float32))
    return model.embed(input_ids), (cos, sin)


def fused_block(block: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, document_ids=None, *,
                kernels: LlamaTrunkKernels) -> torch.Tensor:
    """One block of the fused trunk: x (B, T, C) updated in place, and returned."""
    B, T, C = x.shape
    attn, mlp, linear = block.attn, block.mlp, kernels.linear
    n_head, n_kv_head, head_dim = attn.n_head, attn.n_kv_head, attn.head_dim
    stream = x.view(B * T, C)                                              # the residual stream (B*T, C)
    h = kernels.rms_norm(stream, block.attn_norm.weight, block.attn_norm.eps)
    qkv = linear(h, attn.qkv.weight, attn.qkv.bias)                         # (B*T, (nh + 2 nkv) hs)
    kernels.rotate_queries_and_keys_(qkv, cos, sin, n_head + n_kv_head, head_dim)
    q, k, v = qkv.view(B, T, -1, head_dim).transpose(1, 2).split((n_head, n_kv_head, n_kv_head), dim=1)
    y = causal_attention(q, k, v, document_ids)                            # (B, nh, T, hs)
    linear(y.transpose(1, 2).reshape(B * T, -1), attn.o_proj.weight, accumulate_into=stream)
    if attn.o_proj.bias is not None:
        stream.add_(attn.o_proj.bias)
    h = kernels.rms_norm(stream, block.mlp_norm.weight, block.mlp_norm.eps)
    linear(kernels.swiglu(linear(h, mlp.gate_up.weight, mlp.gate_up.bias)), mlp.down_proj.weight,
           accumulate_into=stream)
    if mlp.down_proj.bias is not None:
        stream.add_(mlp.down_proj.bias)
    return x


def fused_final_norm(model: nn.Module, x: torch.Tensor, *, kernels: LlamaTrunkKernels) -> torch.Tensor:
    return kernels.rms_norm(x.view(-1, x.shape[-1]), model.norm.weight, model.norm.eps).view_as(x)


def fused_trunk_split(kernels: LlamaTrunkKernels) -> LayerSplit:
    return LayerSplit(fused_residual_stream, functools.partial(fused_block, kernels=kernels),
                      functools.partial(fused_final_norm, kernels=kernels))
