"""Device and dtype resolution."""
from __future__ import annotations

import torch

from ..errors import FastpplError

DTYPE_BY_NAME = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise FastpplError(f"unknown --device {name!r}; use auto, cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda"):   # mps, xpu, meta: torch knows them, fastppl was never run on them
        raise FastpplError(f"--device {name}: not supported; use auto, cpu, cuda or cuda:N")
    if device.type == "cpu" and device.index is not None:   # torch takes cpu:5 as the one CPU device
        raise FastpplError(f"--device {name}: the CPU takes no index; use --device cpu")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise FastpplError("--device cuda, but no CUDA GPU is visible; use --device cpu")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """auto = bf16 on CUDA (the loss stays fp32), fp32 on the CPU."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPE_BY_NAME[name]
