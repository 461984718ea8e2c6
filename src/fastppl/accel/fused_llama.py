"""The kernels of the Llama family's fused trunk (fastppl.models.llama_trunk.forward_with_fused_trunk), for an
eager CUDA scorer. Per block, eager PyTorch writes and reads back: the two residual sums, the RMSNorm's fp32 copy,
RoPE's halves, concatenation and products (for q and k), SiLU's output and the gate product. Here:

  x  += o_proj(attention)            cuBLAS adds the product into the residual stream in place (beta = 1)
  h   = rms_norm(x)                  one Triton kernel: x read once, h written
  qkv = h @ Wqkv^T                   q, k rotated in place in the product's output by one kernel (RoPE),
                                     attention reads q, k, v as views of it
  a   = silu(gate) * up              one kernel over the fused gate-up product's output

The residual stream is rounded to the model dtype once per product (cuBLAS adds in fp32; eager rounds the product
and the sum); RoPE rotates with fp32 cos/sin (eager rounds them to the model dtype first); the RMSNorm and SiLU
round where the eager modules do. The plain forward is the reference (tests/accel/test_fused_llama.py: fp32 within
1e-5 relative through Triton's interpreter, bf16 on a GPU). KV-cache forwards (cache_step) keep the plain path.
fuse_llama_trunk hands these kernels to a model whose family's spec offers the fused-trunk forward."""
from __future__ import annotations

import functools
import os
from typing import Optional

import torch
import torch.nn as nn

from ..models.registry import spec_of
from ..models.spec import LayerSplit, LlamaTrunkKernels
from .linear import linear

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

NORM_ROWS_PER_PROGRAM = 4
SWIGLU_BLOCK = 1024


if triton is not None:

    @triton.jit
    def _rms_norm_kernel(x_ptr, out_ptr, weight_ptr, n_rows, C, eps, ROWS: tl.constexpr, BLOCK_C: tl.constexpr):
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, BLOCK_C)
        ok = (rows < n_rows)[:, None] & (cols < C)[None, :]
        offsets = rows[:, None].to(tl.int64) * C + cols[None, :]
        x = tl.load(x_ptr + offsets, mask=ok, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / C + eps)
        # rounded to the model dtype before the weight multiplies it, as the eager module does
        normed = (x * rstd[:, None]).to(out_ptr.dtype.element_ty).to(tl.float32)
        weight = tl.load(weight_ptr + cols, mask=cols < C, other=0.0).to(tl.float32)
        tl.store(out_ptr + offsets, (weight[None, :] * normed).to(out_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _rope_kernel(qkv_ptr, cos_ptr, sin_ptr, row_stride, cos_rows, n_heads, half,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
        """One token: its n_heads (q then k) heads of qkv rotated in place, pairs (j, j + half)."""
        row = tl.program_id(0).to(tl.int64)
        heads = tl.arange(0, BLOCK_H)
        dims = tl.arange(0, BLOCK_D)
        ok = (heads < n_heads)[:, None] & (dims < half)[None, :]
        first = qkv_ptr + row * row_stride + heads[:, None] * (2 * half) + dims[None, :]
        x1 = tl.load(first, mask=ok, other=0.0).to(tl.float32)
        x2 = tl.load(first + half, mask=ok, other=0.0).to(tl.float32)
        angle_row = (row % cos_rows) * (2 * half)
        cos = tl.load(cos_ptr + angle_row + dims, mask=dims < half, other=0.0)[None, :]
        sin = tl.load(sin_ptr + angle_row + dims, mask=dims < half, other=0.0)[None, :]
        tl.store(first, (x1 * cos - x2 * sin).to(qkv_ptr.dtype.element_ty), mask=ok)
        tl.store(first + half, (x2 * cos + x1 * sin).to(qkv_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _swiglu_kernel(gate_up_ptr, out_ptr, inner, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < inner
        gate = tl.load(gate_up_ptr + row * 2 * inner + cols, mask=ok, other=0.0).to(tl.float32)
        up = tl.load(gate_up_ptr + row * 2 * inner + inner + cols, mask=ok, other=0.0).to(tl.float32)
        # SiLU rounded to the model dtype before the product, as F.silu(gate) * up rounds it
        silu = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
        tl.store(out_ptr + row * inner + cols, (silu * up).to(out_ptr.dtype.element_ty), mask=ok)


def _check_device(x: torch.Tensor) -> None:
    assert triton is not None and (x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")   # interpreter: CPU


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of the rows of a contiguous x (M, C), as models.llama.RMSNorm computes it."""
    _check_device(x)
    n_rows, C = x.shape
    out = torch.empty_like(x)
    block_c = triton.next_power_of_2(C)
    # about 2,048 values a program (fewer rows for wider models), and warps to hold a wide row without spilling
    rows = max(1, min(NORM_ROWS_PER_PROGRAM, 2048 // block_c))
    _rms_norm_kernel[(triton.cdiv(n_rows, rows),)](x, out, weight, n_rows, C, eps, ROWS=rows, BLOCK_C=block_c,
                                                   num_warps=4 if block_c <= 1024 else 8 if block_c <= 4096 else 16)
    return out


def rotate_queries_and_keys_(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_heads: int,
                             head_dim: int) -> None:
    """RoPE in place on the first n_heads heads (q, then k) of each row of qkv (M, H * head_dim); cos, sin
    (R, head_dim) fp32 with M a multiple of R (row m takes angle row m % R)."""
    _check_device(qkv)
    assert qkv.is_contiguous() and cos.is_contiguous() and sin.is_contiguous() and cos.dtype == torch.float32
    half = head_dim // 2
    _rope_kernel[(qkv.shape[0],)](qkv, cos, sin, qkv.stride(0), cos.shape[0], n_heads, half,
                                  BLOCK_H=triton.next_power_of_2(n_heads), BLOCK_D=triton.next_power_of_2(half),
                                  num_warps=4)


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of a contiguous fused (M, 2 * inner) gate-up product: (M, inner)."""
    _check_device(gate_up)
    n_rows, inner = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(n_rows, inner, dtype=gate_up.dtype, device=gate_up.device)
    _swiglu_kernel[(n_rows, triton.cdiv(inner, SWIGLU_BLOCK))](gate_up, out, inner, BLOCK=SWIGLU_BLOCK)
    return out


TRUNK_KERNELS = LlamaTrunkKernels(rms_norm, rotate_queries_and_keys_, swiglu, linear)


def fuse_llama_trunk(model: nn.Module) -> bool:
    """Run the model through the fused-trunk forward its family offers (ModelSpec.fused_trunk_forward), bound to
    these kernels; False (nothing done) where none is offered or without Triton."""
    spec = spec_of(model)
    if triton is None or spec is None or spec.fused_trunk_forward is None:
        return False
    model.fused_trunk = functools.partial(spec.fused_trunk_forward, kernels=TRUNK_KERNELS)
    return True


def fused_trunk_split(model: nn.Module) -> Optional[LayerSplit]:
    """The fused-trunk forward of the model's family as a LayerSplit (for the layer-major path), bound to these
    kernels; None where the family offers none or without Triton."""
    spec = spec_of(model)
    if triton is None or spec is None or spec.fused_trunk_split is None:
        return None
    return spec.fused_trunk_split(TRUNK_KERNELS)


def unfuse_llama_trunk(model: nn.Module) -> None:
    if getattr(model, "fused_trunk", None) is not None:
        model.fused_trunk = None
