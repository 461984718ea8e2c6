"""Rotary position embeddings of the rotary families (fastppl.models.llama, fastppl.models.qwen3): the inverse
frequencies, with the linear and llama3 scalings, and the rotation itself."""
from __future__ import annotations

import math
from typing import Optional

import torch

ROPE_TYPES = ("default", "linear", "llama3")


def rope_frequencies(config, device: Optional[torch.device] = None) -> torch.Tensor:
    """(head_dim / 2,) fp32 inverse frequencies, computed as transformers computes them.

    Recomputed in each forward rather than kept as a buffer: a buffer would be rounded to bf16 by
    model.to(torch.bfloat16), which moves the angle of position 100,000 by hundreds of radians."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float, device=device) / dim))
    if config.rope_type == "linear":
        return inv_freq / config.rope_factor
    if config.rope_type == "llama3":
        factor = config.rope_factor
        low, high = config.rope_low_freq_factor, config.rope_high_freq_factor
        original = config.rope_original_max_positions
        wavelength = 2 * math.pi / inv_freq
        # long wavelengths slowed by `factor`, short ones kept, the band between interpolated
        scaled = torch.where(wavelength > original / low, inv_freq / factor, inv_freq)
        smooth = (original / wavelength - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        in_band = ~(wavelength < original / high) & ~(wavelength > original / low)
        return torch.where(in_band, smoothed, scaled)
    return inv_freq


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (i, i + hs/2) of x (B, nh, T, hs) by the angles whose cos/sin are (T, hs) or (B, T, hs).
    The half-split pairing (not interleaved) is the one Hugging Face checkpoints are stored for."""
    cos, sin = cos.unsqueeze(-3), sin.unsqueeze(-3)             # broadcast over heads
    x1, x2 = x.chunk(2, dim=-1)
    rotated_half = torch.cat((-x2, x1), dim=-1)
    return x * cos + rotated_half * sin
