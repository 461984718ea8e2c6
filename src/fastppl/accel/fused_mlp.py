"""GPT-2's MLP with bias + GELU fused into the first matmul's epilogue (cuBLASLt), applied to a built
model by swapping the MLP modules' activation (fc, then GELU): the (B, T, 4C) pre-activation is never written
and read back.
CUDA only; the plain model is the reference (tests/test_gpu.py)."""
from __future__ import annotations

import types

import torch
import torch.nn as nn

from ..models.gpt2 import MLP
from .linear import linear


def _fused_activation(self: MLP, x: torch.Tensor) -> torch.Tensor:
    shape = x.shape
    # cuBLASLt's GELU epilogue is the tanh approximation, GPT-2's "gelu_new"
    h = linear(x.reshape(-1, shape[-1]), self.fc.weight, self.fc.bias, gelu=True)
    return h.view(*shape[:-1], self.fc.weight.shape[0])   # not -1: no size to infer from 0 rows


def fuse_mlp_epilogue(model: nn.Module) -> int:
    """Swap every GPT-2 MLP's activation for the fused one; returns how many were swapped."""
    swapped = 0
    for module in model.modules():
        if isinstance(module, MLP):
            module.activation = types.MethodType(_fused_activation, module)
            swapped += 1
    return swapped


def unfuse_mlp_epilogue(model: nn.Module) -> None:
    """Undo fuse_mlp_epilogue: the class's own activation again."""
    for module in model.modules():
        if isinstance(module, MLP) and "activation" in module.__dict__:
            del module.activation
