"""GGML block formats dequantized with torch equal gguf.quants.dequantize (llama.cpp's reference) bit for bit."""
import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf.quants import dequantize as reference_dequantize, quantize  # noqa: E402

from fastppl.errors import FastpplError  # noqa: E402
from fastppl.models.gguf_quants import BLOCK_TYPES, TYPE_NAMES, dequantize, stored_bytes, supported_type  # noqa: E402

# byte offsets of the fp16 scales in the blocks of the types gguf cannot quantize (llama.cpp's ggml-common.h):
# random bytes there would be NaN or infinite now and then, and NaN payloads need not survive arithmetic
F16_FIELDS = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_NL": (0,),
              "IQ4_XS": (0,)}


def _random_blocks(type_name: str, n_blocks: int, rng: np.random.Generator) -> np.ndarray:
    """(n_blocks, type_size) random bytes with finite fp16 scales."""
    _, type_size, _ = BLOCK_TYPES[type_name]
    blocks = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
    for offset in F16_FIELDS[type_name]:
        scales = (rng.standard_normal(n_blocks) * 0.01).astype(np.float16)
        blocks[:, offset:offset + 2] = scales.view(np.uint8).reshape(n_blocks, 2)
    return blocks


def _stored(type_name: str, rows: int, columns: int, seed: int) -> np.ndarray:
    """A (rows, bytes per row) tensor of the type: gguf's quantization of random values where it has one, else
    random valid blocks."""
    rng = np.random.default_rng(seed)
    qtype = gguf.GGMLQuantizationType[type_name]
    if type_name not in F16_FIELDS:
        values = (rng.standard_normal((rows, columns)) * rng.uniform(0.01, 3, (rows, 1))).astype(np.float32)
        values[0, :8] = 0.0   # an all-zero start: quantizers special-case a zero scale
        return np.ascontiguousarray(quantize(values, qtype)).view(np.uint8).reshape(rows, -1)
    block_size, _, _ = BLOCK_TYPES[type_name]
    return _random_blocks(type_name, rows * columns // block_size, rng).reshape(rows, -1)


@pytest.mark.parametrize("type_name", list(BLOCK_TYPES))
def test_dequantized_values_equal_ggufs_reference_bit_for_bit(type_name):
    block_size = BLOCK_TYPES[type_name][0]
    columns = max(block_size, 32) * 3
    stored = _stored(type_name, 5, columns, seed=len(type_name))
    expected = reference_dequantize(stored, gguf.GGMLQuantizationType[type_name])
    assert expected.shape == (5, columns) and np.isfinite(expected).all()
    got = dequantize(torch.from_numpy(stored.copy()), type_name, (5, columns))
    assert got.dtype == torch.float32
    assert np.array_equal(got.numpy().view(np.uint32), expected.view(np.uint32)), type_name
    assert stored_bytes(type_name, (5, columns)) == stored.nbytes


def test_the_type_tables_agree_with_ggufs():
    for type_id, name in TYPE_NAMES.items():
        assert gguf.GGMLQuantizationType(type_id).name == name
    for name, (block_size, type_size, _) in BLOCK_TYPES.items():
        assert gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]] == (block_size, type_size)


def test_a_type_fastppl_does_not_dequantize_is_one_line_naming_it():
    with pytest.raises(FastpplError, match=r"blk\.0\.ffn_up\.weight is stored as GGML type IQ2_XXS"):
        supported_type(16, "blk.0.ffn_up.weight", "model.gguf")
    with pytest.raises(FastpplError, match="GGML type id 99"):
        supported_type(99, "token_embd.weight", "model.gguf")
    with pytest.raises(ValueError, match="no whole number of Q4_K blocks"):
        stored_bytes("Q4_K", (4, 100))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("type_name", list(BLOCK_TYPES))
def test_dequantizing_on_the_gpu_equals_the_reference_bit_for_bit(type_name):
    columns = max(BLOCK_TYPES[type_name][0], 32) * 64
    stored = _stored(type_name, 64, columns, seed=3)
    expected = reference_dequantize(stored, gguf.GGMLQuantizationType[type_name])
    got = dequantize(torch.from_numpy(stored.copy()).cuda(), type_name, (64, columns)).cpu()
    assert np.array_equal(got.numpy().view(np.uint32), expected.view(np.uint32)), type_name
