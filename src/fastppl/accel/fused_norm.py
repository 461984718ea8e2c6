"""GPT-2's residual adds fused with the LayerNorm that follows each of them (Triton, CUDA), applied to a built
model by swapping its forward. Every `x = x + f(...)` is followed by a LayerNorm (the next sublayer's, or
ln_f), so one kernel reads x and f's output once and writes both the new residual stream and its
normalisation; eager PyTorch runs an add kernel and then a LayerNorm kernel that reads the sum back.
The residual sum is rounded to the model dtype exactly as the eager add rounds it; the normalisation is
computed in fp32 from that rounded sum, as torch's LayerNorm does. The plain forward is the reference
(tests/test_gpu.py); KV-cache forwards (cache_step) keep the plain path."""
from __future__ import annotations

import os
import types
from typing import Optional

import torch
import torch.nn as nn

from ..models.gpt2 import GPT2

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

ROWS_PER_PROGRAM = 4


if triton is not None:

    @triton.jit
    def layer_norm_rows(x, ok, weight_ptr, bias_ptr, cols, col_ok, C, eps):
        """LayerNorm of rows held in registers: x (R, BLOCK_C) fp32, 0 where not ok; mean, then the
        variance of the centred row (as torch computes it), fp32; weight and bias at cols."""
        mean = tl.sum(x, axis=1) / C
        centred = tl.where(ok, x - mean[:, None], 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(centred * centred, axis=1) / C + eps)
        weight = tl.load(weight_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        bias = tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        return centred * rstd[:, None] * weight[None, :] + bias[None, :]

    @triton.jit
    def _add_layer_norm_kernel(x_ptr, delta_ptr, sum_ptr, out_ptr, weight_ptr, bias_ptr, n_rows, delta_rows, C,
                               eps, ROWS: tl.constexpr, BLOCK_C: tl.constexpr):
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, BLOCK_C)
        row_ok = rows < n_rows
        col_ok = cols < C
        ok = row_ok[:, None] & col_ok[None, :]
        offsets = rows[:, None] * C + cols[None, :]
        # delta_rows < n_rows: delta repeats every delta_rows rows (position embeddings (T, C) under (B, T, C))
        delta_offsets = (rows % delta_rows)[:, None] * C + cols[None, :]
        x = tl.load(x_ptr + offsets, mask=ok, other=0.0).to(tl.float32)
        delta = tl.load(delta_ptr + delta_offsets, mask=ok, other=0.0).to(tl.float32)
        total = (x + delta).to(sum_ptr.dtype.element_ty)          # rounded as the eager add rounds
        tl.store(sum_ptr + offsets, total, mask=ok)
        normed = layer_norm_rows(total.to(tl.float32), ok, weight_ptr, bias_ptr, cols, col_ok, C, eps)
        tl.store(out_ptr + offsets, normed.to(out_ptr.dtype.element_ty), mask=ok)


def add_layer_norm(x: torch.Tensor, delta: torch.Tensor, norm: nn.LayerNorm) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, norm(x + delta)). x (..., C); delta the same shape, or (T, C) repeated over x's leading dims."""
    assert triton is not None and (x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")   # interpreter: CPU check
    C = x.shape[-1]
    x = x.contiguous()
    delta = delta.contiguous()
    total = torch.empty_like(x)
    out = torch.empty_like(x)
    n_rows = x.numel() // C
    delta_rows = delta.numel() // C
    assert n_rows % delta_rows == 0
    grid = (triton.cdiv(n_rows, ROWS_PER_PROGRAM),)
    _add_layer_norm_kernel[grid](x, delta, total, out, norm.weight, norm.bias, n_rows, delta_rows, C, norm.eps,
                                 ROWS=ROWS_PER_PROGRAM, BLOCK_C=triton.next_power_of_2(C), num_warps=4)
    return total, out


def _fused_forward(
    self: GPT2, input_ids: torch.Tensor, position_ids: Optional[torch.Tensor] = None,
    document_ids: Optional[torch.Tensor] = None, cache_step=None,
) -> torch.Tensor:
    if cache_step is not None:
        return GPT2.forward(self, input_ids, position_ids, document_ids, cache_step)
    if position_ids is None:
        position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)
    blocks = self.blocks
    # x: the residual stream; h: its normalisation by the LayerNorm that reads it next
    x, h = add_layer_norm(self.wte(input_ids), self.wpe(position_ids), blocks[0].ln_1)
    for i, block in enumerate(blocks):
        x, h = add_layer_norm(x, block.attn(h, document_ids), block.ln_2)
        next_norm = blocks[i + 1].ln_1 if i + 1 < len(blocks) else self.ln_f
        x, h = add_layer_norm(x, block.mlp(h), next_norm)
    return h


def fuse_residual_norms(model: nn.Module) -> bool:
    """Swap a GPT-2's forward for the fused one; False (nothing done) for other models or without Triton."""
    if triton is None or not isinstance(model, GPT2):
        return False
    model.forward = types.MethodType(_fused_forward, model)
    return True


def unfuse_residual_norms(model: nn.Module) -> None:
    if "forward" in model.__dict__ and isinstance(model, GPT2):
        del model.forward
