"""A model transformers runs (a family with no native spec, or --backend hf) whose weights do not fit the GPU:
loaded through accelerate's device_map, its layers on the GPU in order up to the limit and the rest in host
memory, which accelerate's hooks copy to the GPU for every forward (slow: every batch moves them, where the
native families' layer-major path moves them once a wave). The embeddings and the output projection stay on the
GPU, where fastppl's loss reads the projection's weight."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch
import torch.nn as nn

from ..errors import FastpplError


def meta_model(directory: Path) -> nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    from ..quiet import quiet_transformers
    with quiet_transformers(), torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(directory)))


def hf_weights_bytes(directory: Path, dtype: torch.dtype) -> Optional[int]:
    """The bytes of a transformers model's parameters in dtype, from its config alone (None where transformers
    cannot build it: loading says why)."""
    try:
        model = meta_model(directory)
    except Exception:   # noqa: BLE001 -- any failure is the loader's to report, in its own words
        return None
    if getattr(model.config, "quantization_config", None):   # stored smaller than its dtype: loaded as it is
        return None
    return parameter_bytes(model, dtype)


def parameter_bytes(module: nn.Module, dtype: torch.dtype) -> int:
    """The bytes of a module's parameters (a tied one once) in dtype, real or on the meta device."""
    return sum(p.numel() for p in module.parameters()) * dtype.itemsize


def _layers(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """The model's list of decoder layers (the longest ModuleList of one of its no-split classes), by name."""
    kinds = set(model._no_split_modules or ())
    lists = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m)
             and type(m[0]).__name__ in kinds]
    if not lists:
        raise FastpplError(f"{type(model).__name__}: no list of decoder layers found to keep part of it in host "
                           "memory; give more --max-gpu-memory, or a smaller model")
    return max(lists, key=lambda item: len(item[1]))


def offload_device_map(model: nn.Module, gpu_bytes: int, dtype: torch.dtype,
                       gpu: int | str) -> dict[str, int | str]:
    """accelerate's device_map of a (meta) transformers model: everything but its decoder layers on GPU `gpu`
    (the embeddings and output projection among it), then the layers in order while they fit gpu_bytes beside it
    and one layer's copy, the rest "cpu" (their weights copied to the GPU for each forward)."""
    layers_name, layers = _layers(model)
    device_map: dict[str, int | str] = {}
    path = layers_name.split(".")
    for depth in range(len(path)):   # the siblings of each module on the way to the layers, whole, on the GPU
        parent = model.get_submodule(".".join(path[:depth])) if depth else model
        prefix = ".".join(path[:depth]) + "." if depth else ""
        for name, _ in parent.named_children():
            if name != path[depth]:
                device_map[prefix + name] = gpu
    layer_bytes = [parameter_bytes(layer, dtype) for layer in layers]
    room = gpu_bytes - (parameter_bytes(model, dtype) - sum(layer_bytes)) - max(layer_bytes)
    if room < 0:
        needed = gpu_bytes - room
        raise FastpplError(f"the model's embeddings, output projection and other weights beside its layers, with one "
                           f"layer's copy, take {needed / 2**20:,.1f} MiB, more than the {gpu_bytes / 2**20:,.1f} MiB "
                           "the GPU may hold; give more --max-gpu-memory, or a smaller model")
    on_gpu = True   # a prefix of the layers: once one goes to host memory, those after it go too
    for i, size in enumerate(layer_bytes):
        on_gpu = on_gpu and room >= size
        device_map[f"{layers_name}.{i}"] = gpu if on_gpu else "cpu"
        room -= size if on_gpu else 0
    return device_map


def offload_note(device_map: dict[str, int | str]) -> str:
    in_host = sum(1 for place in device_map.values() if place == "cpu")
    return (f"through accelerate's device_map: {in_host} of {len(device_map)} modules in host memory, copied to the "
            "GPU at every batch (slow)")


def require_accelerate() -> None:
    try:
        import accelerate  # noqa: F401
    except ImportError:
        raise FastpplError("the model's weights do not fit the GPU and transformers runs it, which needs accelerate "
                           "to keep part of it in host memory: pip install accelerate (or give more "
                           "--max-gpu-memory, or a smaller model)") from None
