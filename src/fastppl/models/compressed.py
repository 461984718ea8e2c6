"""compressed-tensors checkpoints (what llm-compressor writes; config.json's quantization_config.quant_method is
"compressed-tensors"): weight-only schemes dequantized on the run's device as each weight is read, by the
package's own formula, (q - zero_point) * scale in the scale's dtype, then converted to the run's dtype.

Formats: pack-quantized (int4/int8 packed into int32, group, channel or tensor scales, symmetric or with zero
points), naive-quantized (int8), float-quantized (FP8 weights). Schemes that quantize activations (W8A8, FP8
dynamic) or the KV cache compute with their own kernels: they run with --backend hf."""
from __future__ import annotations

import functools
import re
from typing import Optional

import torch

from ..errors import FastpplError
from .weights import StoredTensor, read_tensor

_WEIGHT_ONLY_FORMATS = ("pack-quantized", "naive-quantized", "float-quantized", "dense")
_STRATEGIES = ("group", "channel", "tensor")
_PARAMETERS = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx", "weight")


def is_compressed_tensors(hf_config: dict) -> bool:
    quantization = hf_config.get("quantization_config")
    return isinstance(quantization, dict) and quantization.get("quant_method") == "compressed-tensors"


def _not_weight_only(source: str, what: str) -> FastpplError:
    return FastpplError(f"{source}: its compressed-tensors scheme {what}, so it is not weight-only: fastppl's native "
                        "models would compute something else; run it with --backend hf, which uses its kernels")


def _groups(quantization: dict, source: str) -> list[dict]:
    """The config groups, each checked to be a weight-only scheme fastppl dequantizes."""
    if quantization.get("kv_cache_scheme"):
        raise _not_weight_only(source, "quantizes the KV cache")
    if quantization.get("sparsity_config") or quantization.get("transform_config"):
        raise FastpplError(f"{source}: a sparse or transformed compressed-tensors checkpoint; run it with --backend hf")
    groups = []
    for name, group in (quantization.get("config_groups") or {}).items():
        if group.get("input_activations") or group.get("output_activations"):
            raise _not_weight_only(source, f"{name} quantizes activations")
        weights, form = group.get("weights") or {}, group.get("format") or quantization.get("format")
        if form not in _WEIGHT_ONLY_FORMATS or weights.get("strategy", "tensor") not in _STRATEGIES or weights.get(
                "dynamic") or (weights.get("type") == "int" and 32 % weights.get("num_bits", 8)):
            raise FastpplError(f"{source}: compressed-tensors {name} ({form}, {weights.get('strategy')} strategy, "
                               f"{weights.get('num_bits')}-bit {weights.get('type')}) is not a scheme fastppl "
                               f"dequantizes ({', '.join(_WEIGHT_ONLY_FORMATS)}; {', '.join(_STRATEGIES)}); run it "
                               "with --backend hf")
        groups.append(dict(group, format=form, weights=weights))
    return groups


def _group_of(module: str, groups: list[dict], source: str) -> dict:
    """The first config group whose targets name the module ("re:" patterns, or a class name such as Linear: every
    quantized module here is a linear layer)."""
    for group in groups:
        for target in group.get("targets", []):
            if not target.startswith("re:") or re.match(target[3:], module):
                return group
    raise FastpplError(f"{source}: {module} holds quantized weights no compressed-tensors config group targets; "
                       "the checkpoint is corrupt")


def compressed_index(index: dict[str, StoredTensor], hf_config: dict, source: str) -> dict[str, StoredTensor]:
    """The checkpoint's index with each quantized module's tensors (weight_packed, weight_scale, ...) replaced by one
    <module>.weight, dequantized when it is read."""
    groups = _groups(hf_config["quantization_config"], source)
    modules = sorted({name.rsplit(".", 1)[0] for name in index if name.endswith(".weight_scale")})
    out = dict(index)
    for module in modules:
        parts = {p: out.pop(f"{module}.{p}") for p in _PARAMETERS if f"{module}.{p}" in out}
        if "weight_g_idx" in parts:
            raise FastpplError(f"{source}: {module} has activation-ordered groups (weight_g_idx), which fastppl "
                               "does not dequantize; run it with --backend hf")
        out[f"{module}.weight"] = _dequantized(module, parts, _group_of(module, groups, source), source)
    return out


def _dequantized(module: str, parts: dict, group: dict, source: str) -> StoredTensor:
    weights, form, scale = group["weights"], group["format"], parts["weight_scale"]
    zero_point = None if weights.get("symmetric", True) else parts.get("weight_zero_point")
    if form == "pack-quantized":
        if "weight_packed" not in parts or "weight_shape" not in parts:
            raise FastpplError(f"{source}: {module} lacks weight_packed or weight_shape; the checkpoint is corrupt")
        stored, shape = parts["weight_packed"], tuple(int(s) for s in read_tensor(parts["weight_shape"]).tolist())
    else:
        expected = torch.int8 if weights.get("type", "int") == "int" else torch.float8_e4m3fn
        if "weight" not in parts or parts["weight"].dtype != expected:
            raise FastpplError(f"{source}: {module}.weight is not stored as {expected} as its scheme says; the "
                               "checkpoint is corrupt")
        stored, shape = parts["weight"], parts["weight"].shape
    decode = functools.partial(_decode, form, stored.dtype, tuple(stored.shape), shape, weights, scale, zero_point)
    return StoredTensor(scale.dtype, shape, stored.file, stored.offset, decode=decode, stored_bytes=stored.n_bytes)


def unpack_int32(packed: torch.Tensor, bits: int, columns: int) -> torch.Tensor:
    """(rows, words) int32 -> (rows, columns) signed values: 32 // bits per word, low bits first, stored with an
    offset of 2 ** (bits - 1) (compressed-tensors' pack_to_int32, for bits dividing 32)."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)
    values = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)   # & drops the sign an arithmetic shift brings
    return values.reshape(packed.shape[0], -1)[:, :columns] - (1 << (bits - 1))


def _decode(form: str, stored_dtype, stored_shape, shape, weights: dict, scale_stored: StoredTensor,
            zero_stored: Optional[StoredTensor], raw: torch.Tensor) -> torch.Tensor:
    device, bits = raw.device, weights.get("num_bits", 8)
    stored = raw.view(stored_dtype).reshape(stored_shape)
    quantized = unpack_int32(stored, bits, shape[-1]) if form == "pack-quantized" else stored
    scale = read_tensor(scale_stored).to(device)
    zero_point = None
    if zero_stored is not None:
        zero_point = read_tensor(zero_stored).to(device)
        if form == "pack-quantized" and weights.get("strategy") in ("group", "channel"):   # packed along dim 0
            zero_point = unpack_int32(zero_point.t().contiguous(), bits, shape[0]).t()
    if weights.get("strategy") == "group":   # (rows, columns) -> (rows, groups, group_size)
        quantized = quantized.unflatten(-1, (-1, weights["group_size"]))
        scale = scale.unsqueeze(-1)
        zero_point = zero_point.unsqueeze(-1) if zero_point is not None else None
    values = quantized.to(scale.dtype)
    if zero_point is not None:
        values = values - zero_point.to(scale.dtype)
    return (values * scale).reshape(shape)
