"""The GPT-2-style initialisation that the native architectures share: normal(0, 0.02) matrices,
residual output projections scaled by 1/sqrt(2 * n_layer), unit norm weights, zero biases."""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn as nn


def init_gpt_style_(
    model: nn.Module, n_layer: int, norm_marker: str, residual_suffixes: tuple[str, ...],
    generator: Optional[torch.Generator] = None,
) -> None:
    """norm_marker: the substring that names norm parameters ("ln" for GPT-2, "norm" for Llama);
    residual_suffixes: names of the projections that write into the residual stream."""
    residual_std = 0.02 / math.sqrt(2 * n_layer)
    for name, p in model.named_parameters():
        if name.endswith("bias"):
            nn.init.zeros_(p)
        elif norm_marker in name:
            nn.init.ones_(p)
        else:
            std = residual_std if name.endswith(residual_suffixes) else 0.02
            nn.init.normal_(p, 0.0, std, generator=generator)
