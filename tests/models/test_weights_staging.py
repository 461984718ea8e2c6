"""Checkpoints streamed through a ring of staging buffers (the GPU's loading path) give the weights of the tensor at a
time path, bit for bit: the ring, tensors split over several buffers, and the conversions are exercised on the CPU
with a CPU staging target; a gpu-marked test loads onto CUDA through pinned buffers."""
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from fastppl.models import weights
from fastppl.errors import FastpplError
from fastppl.models import load_model
from fastppl.models.gpt2 import GPT2, GPT2Config
from fastppl.models.llama import config_to_hf as llama_config_to_hf, state_dict_to_hf as llama_state_dict_to_hf
from fastppl.models.llama import Llama, LlamaConfig
from fastppl.models.loading import save_hf_gpt2
from fastppl.models.weights import Chunk, Staging, plan_fills

# buffers smaller than the embedding (300 x 32 values: 19,200 bytes in bf16), so that it spans several, and a ring
# of two, so that each buffer is read into again; reads smaller than a buffer, so that several threads share one
SMALL_RING = Staging(buffer_bytes=4096, n_buffers=2, n_threads=3, read_bytes=1000, pinned=False)


def _random(model: torch.nn.Module) -> torch.nn.Module:
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.3)
    return model


def _save_llama_in_shards(directory: Path, file_dtype: torch.dtype, n_shards: int = 3) -> Path:
    config = LlamaConfig(vocab_size=300, max_positions=64, hidden_size=32, intermediate_size=48, n_layer=2,
                         n_head=4, n_kv_head=2, rope_theta=10000.0, tie_word_embeddings=False, qkv_bias=True)
    state = {name: t.to(file_dtype) for name, t in llama_state_dict_to_hf(_random(Llama(config))).items()}
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(llama_config_to_hf(config)))
    names, weight_map = list(state), {}
    for shard in range(n_shards):
        file = f"model-{shard + 1:05d}-of-{n_shards:05d}.safetensors"
        held = names[shard::n_shards]   # every shard holds layers' tensors, one the embedding, one lm_head
        save_file({name: state[name] for name in held}, str(directory / file))
        weight_map.update({name: file for name in held})
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return directory


def _save_gpt2(directory: Path, file_dtype: torch.dtype) -> Path:
    """GPT-2's checkpoint stores its matrices as (in, out): the staged path transposes them on the device."""
    save_hf_gpt2(_random(GPT2(GPT2Config(vocab_size=300, n_positions=32, n_embd=32, n_layer=2, n_head=4))), directory)
    file = directory / "model.safetensors"
    from safetensors.torch import load_file
    save_file({name: t.to(file_dtype) for name, t in load_file(str(file)).items()}, str(file))
    return directory


def _same_bits(got: torch.nn.Module, expected: torch.nn.Module) -> None:
    expected_params = dict(expected.named_parameters())
    for name, p in got.named_parameters():
        e = expected_params[name]
        assert p.dtype == e.dtype and p.shape == e.shape, name
        bits = {2: torch.int16, 4: torch.int32}[p.dtype.itemsize]
        assert torch.equal(p.detach().cpu().view(bits), e.detach().cpu().view(bits)), name


def _staged(monkeypatch, staging: Staging) -> list:
    """Make every load stream through `staging` (on the CPU too); returns the list of staged loads' sizes."""
    calls, real = [], weights._fill_staged

    def spy(items, destinations, used):
        calls.append(sum(stored.n_bytes for stored, _ in items))
        return real(items, destinations, used)
    monkeypatch.setattr(weights, "default_staging", lambda device, pieces: staging)
    monkeypatch.setattr(weights, "_fill_staged", spy)
    return calls


def test_a_buffers_fills_hold_every_byte_once_in_order():
    assert plan_fills([5, 2, 9], 4) == [
        [Chunk(0, 0, 4, 0)], [Chunk(0, 4, 5, 0), Chunk(1, 0, 2, 1), Chunk(2, 0, 1, 3)],
        [Chunk(2, 1, 5, 0)], [Chunk(2, 5, 9, 0)]]
    assert plan_fills([0, 3, 0], 4) == [[Chunk(0, 0, 0, 0), Chunk(1, 0, 3, 0), Chunk(2, 0, 0, 3)]]
    assert plan_fills([], 4) == []
    sizes = [7, 1, 0, 64, 3, 12, 5]
    fills = plan_fills(sizes, 8)
    assert all(sum(c.stop - c.start for c in fill) == 8 for fill in fills[:-1])
    read = [(c.item, byte) for fill in fills for c in fill for byte in range(c.start, c.stop)]
    assert read == [(item, byte) for item, size in enumerate(sizes) for byte in range(size)]
    for fill in fills:   # chunks lie side by side in their buffer
        offsets = [c.buffer_offset for c in fill]
        assert offsets == [sum(c.stop - c.start for c in fill[:i]) for i in range(len(fill))]


@pytest.mark.parametrize("file_dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_three_shards_through_a_small_ring_give_the_direct_reads_weights(tmp_path, monkeypatch, file_dtype):
    directory = _save_llama_in_shards(tmp_path / "model", file_dtype)
    direct = {dtype: load_model(str(directory), "native", dtype) for dtype in (torch.bfloat16, torch.float32)}
    calls = _staged(monkeypatch, SMALL_RING)
    for dtype, expected in direct.items():
        _same_bits(load_model(str(directory), "native", dtype), expected)
    largest = max(p.numel() for p in direct[torch.bfloat16].parameters()) * file_dtype.itemsize
    assert len(calls) == 2 and largest > 4 * SMALL_RING.buffer_bytes   # staged, and a tensor spans several fills


@pytest.mark.parametrize("file_dtype", [torch.bfloat16, torch.float32])
def test_transposed_matrices_through_a_small_ring_give_the_direct_reads_weights(tmp_path, monkeypatch, file_dtype):
    directory = _save_gpt2(tmp_path / "gpt2", file_dtype)
    direct = {dtype: load_model(str(directory), "native", dtype) for dtype in (torch.bfloat16, torch.float32)}
    calls = _staged(monkeypatch, SMALL_RING)
    for dtype, expected in direct.items():
        _same_bits(load_model(str(directory), "native", dtype), expected)
    assert len(calls) == 2


def test_one_buffer_larger_than_the_checkpoint_is_the_checkpoints_size(tmp_path, monkeypatch):
    directory = _save_llama_in_shards(tmp_path / "model", torch.bfloat16)
    expected = load_model(str(directory), "native", torch.bfloat16)
    sizes = []
    real_empty = torch.empty

    def recording_empty(*shape, **kwargs):
        tensor = real_empty(*shape, **kwargs)
        if kwargs.get("dtype") is torch.uint8 and "pin_memory" in kwargs:
            sizes.append(tensor.numel())
        return tensor
    calls = _staged(monkeypatch, Staging(buffer_bytes=1 << 30, n_buffers=4, n_threads=2, pinned=False))
    monkeypatch.setattr(weights.torch, "empty", recording_empty)
    _same_bits(load_model(str(directory), "native", torch.bfloat16), expected)
    assert sizes == [calls[0]]   # one buffer, of the checkpoint's bytes: not 1 GiB for a tiny model


def test_a_file_that_ends_inside_a_tensor_is_one_line_when_staged(tmp_path, monkeypatch):
    """A file cut short after its header was read (the header check catches one cut before) fails the read."""
    from fastppl.models import loading
    directory = _save_llama_in_shards(tmp_path / "model", torch.float32)
    last = sorted(directory.glob("*.safetensors"))[-1]
    real_index = loading.checkpoint_index

    def index_then_cut(checkpoint: Path):
        index = real_index(checkpoint)
        last.write_bytes(last.read_bytes()[:-100])
        return index
    monkeypatch.setattr(loading, "checkpoint_index", index_then_cut)
    _staged(monkeypatch, SMALL_RING)
    with pytest.raises(FastpplError, match=f"{last.name}: cannot be read as a checkpoint .*it ends inside a tensor"):
        load_model(str(directory), "native", torch.float32)


def test_staging_is_for_a_gpu_and_safetensors_only(tmp_path, monkeypatch):
    monkeypatch.delenv("FASTPPL_STAGED_LOAD", raising=False)   # on by default
    directory = _save_llama_in_shards(tmp_path / "model", torch.bfloat16)
    index = weights.index_checkpoint(sorted(directory.glob("*.safetensors")))
    pieces = [(stored, weights.Piece(name, 0, 1)) for name, stored in index.items()]
    assert weights.default_staging(torch.device("cpu"), pieces) is None
    staging = weights.default_staging(torch.device("cuda"), pieces)
    assert staging is not None and staging.pinned and staging.n_buffers * staging.buffer_bytes <= 1 << 30
    in_memory = weights.StoredTensor(torch.float32, (1,), directory, tensor=torch.zeros(1))
    assert weights.default_staging(torch.device("cuda"), pieces + [(in_memory, weights.Piece("x", 0, 1))]) is None
    monkeypatch.setenv("FASTPPL_STAGED_LOAD", "0")   # the switch that turns it off
    assert weights.default_staging(torch.device("cuda"), pieces) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("file_dtype", [torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("buffer_bytes", [4096, 256 << 20])
def test_a_load_onto_the_gpu_through_pinned_buffers_has_the_cpus_weights(tmp_path, monkeypatch, file_dtype,
                                                                         buffer_bytes):
    directory = _save_llama_in_shards(tmp_path / "model", file_dtype)
    gpt2 = _save_gpt2(tmp_path / "gpt2", file_dtype if file_dtype != torch.float64 else torch.float16)
    on_cpu = {(d, dtype): load_model(str(d), "native", dtype) for d in (directory, gpt2)
              for dtype in (torch.bfloat16, torch.float32)}
    calls = _staged(monkeypatch, Staging(buffer_bytes=buffer_bytes, n_buffers=2, n_threads=4, read_bytes=1000))
    for (d, dtype), expected in on_cpu.items():
        on_gpu = load_model(str(d), "native", dtype, device="cuda")
        assert all(p.device.type == "cuda" for p in on_gpu.parameters())
        _same_bits(on_gpu, expected)
    assert len(calls) == len(on_cpu)
