"""GGML block formats dequantized with torch ops on the tensor's own device, to fp32 values equal bit for bit to
gguf.quants.dequantize (the reference implementation of llama.cpp's Python package): the same products and sums
in the same order, each rounded once (no fused multiply-add).

A tensor of a block type is stored as blocks of `type_size` bytes, each holding `block_size` values; the
functions here take the raw bytes as a (n_blocks, type_size) uint8 tensor and return (n_blocks, block_size) fp32.
The layouts are llama.cpp's (ggml-common.h); QK_K = 256 values per super-block of the K and IQ4_XS types."""
from __future__ import annotations

from typing import Callable

import torch

from ..errors import FastpplError

QK_K = 256
# the 16 values an IQ4 nibble selects (llama.cpp's kvalues_iq4nl)
IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


def _f16(raw: torch.Tensor, start: int) -> torch.Tensor:
    """The little-endian fp16 at bytes [start, start + 2) of each block, as (n_blocks, 1) fp32."""
    return raw[:, start:start + 2].contiguous().view(torch.float16).float()


def _bits(raw: torch.Tensor, shifts: tuple[int, ...], mask: int) -> torch.Tensor:
    """(n, ..., bytes) -> (n, ..., len(shifts), bytes): each byte shifted right by each shift, masked; uint8."""
    shift = torch.tensor(shifts, dtype=torch.uint8, device=raw.device).view(len(shifts), 1)
    return (raw.unsqueeze(-2) >> shift) & mask


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """(n, 16) packed bytes -> (n, 32) uint8: the low nibbles of the 16 bytes, then their high nibbles."""
    return _bits(qs, (0, 4), 0x0F).reshape(qs.shape[0], -1)


def _high_bits_32(qh: torch.Tensor) -> torch.Tensor:
    """4 bytes of a little-endian uint32 -> its 32 bits, bit i at column i."""
    return _bits(qh, tuple(range(8)), 1).transpose(-1, -2).reshape(qh.shape[0], 32)


def q4_0(raw):
    return _f16(raw, 0) * (_nibbles(raw[:, 2:]).float() - 8)


def q4_1(raw):
    return _f16(raw, 0) * _nibbles(raw[:, 4:]).float() + _f16(raw, 2)


def q5_0(raw):
    q = _nibbles(raw[:, 6:]) | (_high_bits_32(raw[:, 2:6]) << 4)
    return _f16(raw, 0) * (q.float() - 16)


def q5_1(raw):
    q = _nibbles(raw[:, 8:]) | (_high_bits_32(raw[:, 4:8]) << 4)
    return _f16(raw, 0) * q.float() + _f16(raw, 2)


def q8_0(raw):
    return raw[:, 2:].contiguous().view(torch.int8).float() * _f16(raw, 0)


def q2_k(raw):
    n = raw.shape[0]
    scales, qs = raw[:, :16].to(torch.int32), raw[:, 16:80]
    d, dmin = _f16(raw, 80), _f16(raw, 82)
    scale = (d * (scales & 0xF).float()).view(n, 16, 1)
    offset = (dmin * (scales >> 4).float()).view(n, 16, 1)
    q = _bits(qs.reshape(n, 2, 32), (0, 2, 4, 6), 3).reshape(n, 16, 16).float()
    return (scale * q - offset).reshape(n, QK_K)


def q3_k(raw):
    n = raw.shape[0]
    hmask, qs, packed = raw[:, :32], raw[:, 32:96], raw[:, 96:108]
    d = _f16(raw, 108)
    # sixteen 6-bit scales: low 4 bits in bytes 0-7 (low nibbles, then high), high 2 bits in bytes 8-11
    low = _bits(packed[:, :8], (0, 4), 0x0F).reshape(n, 16)
    high = _bits(packed[:, 8:], (0, 2, 4, 6), 0x03).reshape(n, 16)
    scales = (low | (high << 4)).float() - 32
    scale = (d * scales).view(n, 16, 1)
    low_q = _bits(qs.reshape(n, 2, 32), (0, 2, 4, 6), 3).reshape(n, 16, 16)
    high_q = _bits(hmask.reshape(n, 1, 32), tuple(range(8)), 1).reshape(n, 16, 16)
    q = low_q.float() - ((high_q ^ 1) << 2).float()   # a clear mask bit subtracts 4
    return (scale * q).reshape(n, QK_K)


def _k_scales(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 bytes -> eight 6-bit scales and eight 6-bit mins, (n, 8) int32 each."""
    n = packed.shape[0]
    d, m, m_d = packed.to(torch.int32).view(n, 3, 4).unbind(1)
    scales = torch.cat([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mins = torch.cat([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return scales, mins


def q4_k(raw):
    n = raw.shape[0]
    scales, mins = _k_scales(raw[:, 4:16])
    scale = (_f16(raw, 0) * scales.float()).view(n, 8, 1)
    offset = (_f16(raw, 2) * mins.float()).view(n, 8, 1)
    q = _bits(raw[:, 16:].reshape(n, 4, 32), (0, 4), 0x0F).reshape(n, 8, 32).float()
    return (scale * q - offset).reshape(n, QK_K)


def q5_k(raw):
    n = raw.shape[0]
    scales, mins = _k_scales(raw[:, 4:16])
    scale = (_f16(raw, 0) * scales.float()).view(n, 8, 1)
    offset = (_f16(raw, 2) * mins.float()).view(n, 8, 1)
    low = _bits(raw[:, 48:].reshape(n, 4, 32), (0, 4), 0x0F).reshape(n, 8, 32)
    high = _bits(raw[:, 16:48].reshape(n, 1, 32), tuple(range(8)), 1).reshape(n, 8, 32)
    return (scale * (low | (high << 4)).float() - offset).reshape(n, QK_K)


def q6_k(raw):
    n = raw.shape[0]
    ql, qh, scales = raw[:, :128], raw[:, 128:192], raw[:, 192:208]
    scale = (_f16(raw, 208) * scales.contiguous().view(torch.int8).float()).view(n, 16, 1)
    low = _bits(ql.reshape(n, 2, 64), (0, 4), 0x0F).reshape(n, 8, 32)
    high = _bits(qh.reshape(n, 2, 32), (0, 2, 4, 6), 0x03).reshape(n, 8, 32)
    q = (low | (high << 4)).reshape(n, 16, 16).float() - 32
    return (scale * q).reshape(n, QK_K)


def _iq4_values(nibbles: torch.Tensor) -> torch.Tensor:
    return torch.tensor(IQ4_VALUES, dtype=torch.float32, device=nibbles.device)[nibbles.long()]


def iq4_nl(raw):
    return _f16(raw, 0) * _iq4_values(_nibbles(raw[:, 2:]))


def iq4_xs(raw):
    n = raw.shape[0]
    high_word = raw[:, 2].to(torch.int32) | (raw[:, 3].to(torch.int32) << 8)
    high = (high_word.view(n, 1) >> torch.arange(0, 16, 2, dtype=torch.int32, device=raw.device)) & 0x03
    low = _bits(raw[:, 4:8], (0, 4), 0x0F).transpose(-1, -2).reshape(n, 8)
    scale = (_f16(raw, 0) * ((low | (high << 4)).float() - 32)).view(n, 8, 1)
    q = _bits(raw[:, 8:].reshape(n, 8, 16), (0, 4), 0x0F).reshape(n, 8, 32)
    return (scale * _iq4_values(q)).reshape(n, QK_K)


def bf16(raw):
    return raw.contiguous().view(torch.bfloat16).float()


def f16(raw):
    return raw.contiguous().view(torch.float16).float()


def f32(raw):
    return raw.contiguous().view(torch.float32)


# GGML type name -> (values per block, bytes per block, dequantizer)
BLOCK_TYPES: dict[str, tuple[int, int, Callable[[torch.Tensor], torch.Tensor]]] = {
    "F32": (1, 4, f32), "F16": (1, 2, f16), "BF16": (1, 2, bf16),
    "Q4_0": (32, 18, q4_0), "Q4_1": (32, 20, q4_1), "Q5_0": (32, 22, q5_0), "Q5_1": (32, 24, q5_1),
    "Q8_0": (32, 34, q8_0), "Q2_K": (QK_K, 84, q2_k), "Q3_K": (QK_K, 110, q3_k), "Q4_K": (QK_K, 144, q4_k),
    "Q5_K": (QK_K, 176, q5_k), "Q6_K": (QK_K, 210, q6_k), "IQ4_NL": (32, 18, iq4_nl), "IQ4_XS": (QK_K, 136, iq4_xs),
}


# GGML's type ids (ggml.h), the unsupported ones named for the error
TYPE_NAMES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1", 10: "Q2_K",
              11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K", 16: "IQ2_XXS", 17: "IQ2_XS", 18: "IQ3_XXS",
              19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S", 23: "IQ4_XS", 24: "I8", 25: "I16", 26: "I32",
              27: "I64", 28: "F64", 29: "IQ1_M", 30: "BF16", 34: "TQ1_0", 35: "TQ2_0", 39: "MXFP4", 40: "NVFP4"}


def supported_type(type_id: int, tensor_name: str, source: str) -> str:
    """The name of a tensor's GGML type, which fastppl dequantizes; another is a one-line error."""
    name = TYPE_NAMES.get(type_id, f"id {type_id}")
    if name not in BLOCK_TYPES:
        raise FastpplError(f"{source}: tensor {tensor_name} is stored as GGML type {name}, which fastppl does not "
                           f"dequantize ({', '.join(BLOCK_TYPES)}); use a GGUF of one of these types")
    return name


def stored_bytes(type_name: str, shape: tuple[int, ...]) -> int:
    """The bytes a tensor of this type and shape occupies; a row that is no whole number of blocks is an error."""
    block_size, type_size, _ = BLOCK_TYPES[type_name]
    if shape and shape[-1] % block_size:
        raise ValueError(f"rows of {shape[-1]} values are no whole number of {type_name} blocks of {block_size}")
    return _numel(shape) // block_size * type_size


def dequantize(raw: torch.Tensor, type_name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """The fp32 values of a tensor of `shape` (torch's order: the last dimension is contiguous) from its raw bytes
    (a uint8 tensor on any device), computed on that device."""
    block_size, type_size, function = BLOCK_TYPES[type_name]
    blocks = raw.reshape(-1, type_size)
    assert blocks.shape[0] * block_size == _numel(shape), "the byte count does not fit the shape"
    return function(blocks).reshape(shape)


def _numel(shape) -> int:
    count = 1
    for size in shape:
        count *= size
    return count
