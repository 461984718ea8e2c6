"""GPT-2's MLP with bias + GELU fused into the first matmul's epilogue (cuBLASLt), applied to a built
model by swapping the activation (fc, then tanh GELU) of the MLP modules its family's spec names (gelu_mlp_class):
the (B, T, 4C) pre-activation is never written and read back.
CUDA only; the plain model is the reference (tests/test_gpu.py)."""
from __future__ import annotations

import types

import torch
import torch.nn as nn

from ..models.registry import spec_of
from .linear import linear


def _fused_activation(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    shape = x.shape
    # cuBLASLt's GELU epilogue is the tanh approximation, GPT-2's "gelu_new"
    h = linear(x.reshape(-1, shape[-1]), self.fc.weight, self.fc.bias, gelu=True)
    return h.view(*shape[:-1], self.fc.weight.shape[0])   # not -1: no size to infer from 0 rows


def fuse_mlp_epilogue(model: nn.Module) -> int:
    """Swap the activation of every MLP module the model's spec names for the fused one; returns how many."""
    spec = spec_of(model)
    if spec is None or spec.gelu_mlp_class is None:
        return 0
    swapped = 0
    for module in model.modules():
        if isinstance(module, spec.gelu_mlp_class):
            module.activation = types.MethodType(_fused_activation, module)
            swapped += 1
    return swapped


def unfuse_mlp_epilogue(model: nn.Module) -> None:
    """Undo fuse_mlp_epilogue: the class's own activation again."""
    for module in model.modules():
        if "activation" in module.__dict__:
            del module.activation
