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
_QUANTIZATION_PARTS = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx")
_PARAMETERS = (*_QUANTIZATION_PARTS, "weight")


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
        if not _dequantizable(weights, form):
            raise FastpplError(f"{source}: compressed-tensors {name} ({form}, {weights.get('strategy')} strategy, "
                               f"{weights.get('num_bits')}-bit {weights.get('type')}) is not a scheme fastppl "
                               f"dequantizes ({', '.join(_WEIGHT_ONLY_FORMATS)}; {', '.join(_STRATEGIES)}; int of 1, "
                               "2, 4 or 8 bits, fp8); run it with --backend hf")
        groups.append(dict(group, format=form, weights=weights))
    return groups


def _dequantizable(weights: dict, form) -> bool:
    """Int of bits dividing 32 (packed word by word) or fp8, static, of a strategy fastppl decodes."""
    kind, bits, group_size = weights.get("type", "int"), weights.get("num_bits", 8), weights.get("group_size")
    strategy = weights.get("strategy", "tensor")
    sized = strategy != "group" or (type(group_size) is int and group_size > 0)
    values = type(bits) is int and ((kind == "int" and bits in (1, 2, 4, 8)) or
                                    (kind == "float" and bits == 8 and form != "pack-quantized"))
    return form in _WEIGHT_ONLY_FORMATS and strategy in _STRATEGIES and not weights.get("dynamic") and sized and values


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
    modules = sorted({name.rsplit(".", 1)[0] for name in index if name.rsplit(".", 1)[-1] in _QUANTIZATION_PARTS})
    out = dict(index)
    for module in modules:
        parts = {p: out.pop(f"{module}.{p}") for p in _PARAMETERS if f"{module}.{p}" in out}
        if "weight_g_idx" in parts:
            raise FastpplError(f"{source}: {module} has activation-ordered groups (weight_g_idx), which fastppl "
                               "does not dequantize; run it with --backend hf")
        out[f"{module}.weight"] = _dequantized(module, parts, _group_of(module, groups, source), source)
    return out


def _dequantized(module: str, parts: dict, group: dict, source: str) -> StoredTensor:
    weights, form = group["weights"], group["format"]
    shape = check_module(module, parts, weights, form, source)
    scale, zero_point = parts["weight_scale"], parts.get("weight_zero_point")
    stored = parts["weight_packed" if form == "pack-quantized" else "weight"]
    decode = functools.partial(_decode, form, stored.dtype, tuple(stored.shape), shape, weights, scale, zero_point)
    return StoredTensor(scale.dtype, shape, stored.file, stored.offset, decode=decode, stored_bytes=stored.n_bytes)


def _scheme(weights: dict, form: str) -> str:
    strategy = weights.get("strategy", "tensor")
    return (f"{form}, {weights.get('num_bits', 8)}-bit {weights.get('type', 'int')}, {strategy} strategy"
            f"{' of ' + str(weights['group_size']) if strategy == 'group' else ''}, "
            f"{'symmetric' if weights.get('symmetric', True) else 'asymmetric'}")


def check_module(module: str, parts: dict[str, StoredTensor], weights: dict, form: str, source: str) -> tuple:
    """The (rows, columns) of a quantized module, with every tensor it holds checked against them and its scheme
    as compressed-tensors writes it (pack_to_int32: 32 // bits values a word, zero points packed along the rows),
    none missing, none extra: any other would dequantize to another model's weights without a word."""
    def lie(tensor: str, what: str, needs: str) -> FastpplError:
        return FastpplError(f"{source}: {tensor} {what}, but its compressed-tensors scheme ({_scheme(weights, form)}) "
                            f"{needs}; the checkpoint is corrupt or its config.json lies about it")
    packed = form == "pack-quantized"
    stored = parts.get("weight_packed" if packed else "weight")
    if stored is None or (packed and "weight_shape" not in parts):
        missing = next(p for p in ("weight_packed", "weight_shape") if p not in parts) if packed else "weight"
        raise lie(f"{module}.{missing}", "is missing", "needs it")
    shape = _weight_shape(module, parts, source) if packed else tuple(stored.shape)
    if len(shape) != 2:
        raise lie(f"{module}.weight", f"has shape {shape}", "quantizes matrices")
    expected = _layout(weights, form, *shape)
    for part in sorted(set(parts) | set(expected)):
        tensor = f"{module}.{part}"
        if part not in parts:
            raise lie(tensor, "is missing", "needs it")
        if part not in expected:
            raise lie(tensor, "is present", "has none")
        dtypes, shapes = expected[part]
        if parts[part].dtype not in dtypes or tuple(parts[part].shape) not in shapes:
            raise lie(tensor, f"is {str(parts[part].dtype)[6:]} {tuple(parts[part].shape)} for a {shape[0]} x "
                      f"{shape[1]} weight", f"needs {str(dtypes[0])[6:]} {shapes[0]}")
    if weights.get("strategy") == "group" and shape[1] % weights["group_size"]:
        raise FastpplError(f"{source}: {module} has {shape[1]} columns, which its group size "
                           f"{weights['group_size']} does not divide; fastppl does not dequantize a partial group: "
                           "run it with --backend hf")
    return shape


def _weight_shape(module: str, parts: dict, source: str) -> tuple:
    stored = parts["weight_shape"]
    if stored.dtype.is_floating_point or stored.dtype == torch.bool or tuple(stored.shape) != (2,):
        raise FastpplError(f"{source}: {module}.weight_shape is {stored.dtype} {tuple(stored.shape)}, not the two "
                           "sizes of a matrix; the checkpoint is corrupt")
    shape = tuple(int(s) for s in read_tensor(stored).tolist())
    if min(shape) <= 0:
        raise FastpplError(f"{source}: {module}.weight_shape is {shape}; the checkpoint is corrupt")
    return shape


_SCALE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)   # initialize_qparams' choices
_INTEGERS = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def _layout(weights: dict, form: str, rows: int, columns: int) -> dict[str, tuple[tuple, tuple]]:
    """{part: (the dtypes it may have, the shapes it may have)} of a module of rows x columns in this scheme."""
    bits, strategy = weights.get("num_bits", 8), weights.get("strategy", "tensor")
    quantized = (torch.int8,) if weights.get("type", "int") == "int" else (torch.float8_e4m3fn,)
    if strategy == "group":
        scale = [(rows, -(-columns // weights["group_size"]))]
    else:
        scale = [(rows, 1)] if strategy == "channel" else [(1,), ()]
    layout = {"weight_scale": (_SCALE_DTYPES, scale)}
    if form == "pack-quantized":
        layout.update(weight_packed=((torch.int32,), [(rows, -(-columns * bits // 32))]),
                      weight_shape=(_INTEGERS, [(2,)]))
    else:
        layout["weight"] = (quantized, [(rows, columns)])
    if not weights.get("symmetric", True):
        packed = form == "pack-quantized" and strategy != "tensor"   # the package packs these along dim 0
        layout["weight_zero_point"] = ((torch.int32,), [(-(-rows * bits // 32), scale[0][-1])]) if packed else \
            (quantized, scale)
    return layout


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
