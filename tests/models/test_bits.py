"""Bits per weight of a model's file (fastppl.models.bits): a GGUF's tensor bytes over its values as the gguf
package's own reader counts them, a compressed-tensors checkpoint's stored bytes over the weights they decode to,
a safetensors checkpoint's dtypes; random:PRESET has none."""
import pytest
import torch

from fastppl.models.bits import bits_per_weight

gguf = pytest.importorskip("gguf")
from test_gguf import LLAMA_SHAPE, _hf_random, _write_llama_family  # noqa: E402


def test_a_ggufs_bits_per_weight_are_its_tensor_bytes_over_its_values(tmp_path, tiny_tokenizer):
    """A tiny Llama of Q8_0, F16, Q4_0 and F32 matrices (test_gguf's mix) against GGUFReader's byte counts."""
    path = tmp_path / "mixed.gguf"
    _write_llama_family(path, _hf_random("llama", tie_word_embeddings=False, **LLAMA_SHAPE), "llama", tiny_tokenizer)
    tensors = gguf.GGUFReader(str(path)).tensors
    assert len({t.tensor_type for t in tensors}) >= 4
    expected = 8 * sum(int(t.n_bytes) for t in tensors) / sum(int(t.n_elements) for t in tensors)
    assert bits_per_weight(str(path)) == pytest.approx(expected, rel=1e-12)


@pytest.fixture(scope="module")
def tiny_tokenizer(shakespeare):
    from test_gguf import _tiny_bpe
    return _tiny_bpe(shakespeare)


def test_a_safetensors_checkpoints_bits_per_weight_are_its_dtypes(tmp_path):
    from fastppl.models import load_model
    from fastppl.models.loading import native_to_hf
    model = native_to_hf(load_model("random:gpt2-tiny", "native", torch.float32))
    for dtype, bits in ((torch.float32, 32.0), (torch.bfloat16, 16.0)):
        model.to(dtype).save_pretrained(tmp_path / str(dtype))
        assert bits_per_weight(str(tmp_path / str(dtype))) == bits
    assert bits_per_weight("random:gpt2-tiny") is None


def test_a_compressed_tensors_checkpoints_bits_count_its_scales_over_the_weights_they_decode_to(tmp_path):
    """int4 in groups of 32 with fp32 scales and packed zero points: every stored tensor's bytes over the
    decompressed model's weights (counted from the package's own decompression)."""
    pytest.importorskip("compressed_tensors")
    from test_compressed import SCHEMES, _write
    from fastppl.models.weights import safetensors_index
    weights, form = SCHEMES["int4-group-asymmetric"]
    decompressed = _write(tmp_path, weights, form)
    stored = safetensors_index(tmp_path / "model.safetensors")
    n_bytes = sum(t.n_bytes for t in stored.values())
    quantized = {name.rsplit(".", 1)[0] for name in stored if name.endswith(".weight_packed")}
    others = [t for name, t in stored.items() if name.rsplit(".", 1)[0] not in quantized]
    n_weights = sum(decompressed[f"{m}.weight"].numel() for m in quantized) + sum(
        torch.Size(t.shape).numel() for t in others)
    assert bits_per_weight(str(tmp_path)) == pytest.approx(8 * n_bytes / n_weights, rel=1e-12)
    assert bits_per_weight(str(tmp_path)) < 20   # fp32 embeddings of 400 ids beside 4-bit matrices
