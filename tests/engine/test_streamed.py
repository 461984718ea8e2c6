"""The streamed placement (fastppl.runner, fastppl.engine.streamed): the windows scored layer-major, in waves under a
--max-gpu-memory limit, give the resident path's per-token NLL and sums bit for bit at the same batch shapes, for
each native family, for packed documents, for a GGUF file, a compressed-tensors checkpoint and a divergence run,
whatever the wave size (quantized blocks kept in their stored form and decoded a block at a time); auto streams
where the weights do not fit; bad limits are one line."""
import json
import re

import numpy as np
import pytest

from fastppl import evaluate
from fastppl.config import EvalConfig, memory_size
from fastppl.engine.streamed import plan_waves
from fastppl.errors import FastpplError

TEXT_CHARS = 6000


@pytest.fixture(scope="module")
def text(tmp_path_factory, shakespeare):
    path = tmp_path_factory.mktemp("streamed") / "text.txt"
    path.write_text(shakespeare.read_text()[:TEXT_CHARS])
    return path


def run(**settings):
    return evaluate(EvalConfig(quiet=True, device="cpu", **settings))


def smallest_limit(**settings) -> int:
    """The least --max-gpu-memory that holds one wave, read from the refusal of a 1-byte limit."""
    with pytest.raises(FastpplError, match="cannot hold one wave") as refused:
        run(placement="streamed", max_gpu_memory=1, **settings)
    return memory_size(re.search(r"at least (\S+?)(,|$)", str(refused.value)).group(1), "limit") + 2**14


def assert_streamed_equals_resident(**settings) -> dict:
    """Resident once, streamed at wave limits from the smallest to one wave: equal per-token values and sums,
    bit for bit. Returns the last streamed run's report."""
    resident = run(**settings)
    assert resident["placement"] == "resident" and resident["streaming"] is None
    least = smallest_limit(**settings)
    hidden_bytes = 64 * 4 * settings["ctx"] * settings["batch_size"]   # one batch's residual streams (width 64, fp32)
    waves = []
    for limit in (least, least + 3 * hidden_bytes, 2**40):
        streamed = run(placement="streamed", max_gpu_memory=limit, **settings)
        assert streamed["placement"] == "streamed" and streamed["placement_reason"] == "--placement streamed"
        assert streamed["nll_sum"] == resident["nll_sum"]
        assert np.array_equal(streamed.per_token, resident.per_token, equal_nan=True)
        assert streamed["nll_by_position"] == resident["nll_by_position"]
        waves.append(streamed["streaming"]["waves"])
        n_layer = 2
        assert streamed["streaming"]["bytes_streamed"] > 0
        assert streamed["streaming"]["bytes_streamed"] % (waves[-1] * n_layer) == 0   # every block once a wave
    assert waves[0] > waves[1] > waves[2] == 1, waves
    return streamed


@pytest.mark.parametrize("model", ["random:gpt2-tiny", "random:llama-tiny", "random:qwen3-tiny"])
def test_each_native_family_streamed_equals_resident_bit_for_bit(model, text, tokenizer_dir, tmp_path):
    assert_streamed_equals_resident(model=model, data=[str(text)], tokenizer=str(tokenizer_dir), ctx=48,
                                    batch_size=3, per_token=str(tmp_path / "t.npy"))


def test_packed_documents_and_sliding_windows_streamed_equal_resident(text, tokenizer_dir, tmp_path):
    documents = tmp_path / "docs.jsonl"
    chunks = text.read_text().split("\n\n")
    documents.write_text("".join(json.dumps({"text": chunk}) + "\n" for chunk in chunks if chunk.strip()))
    common = dict(model="random:llama-tiny", tokenizer=str(tokenizer_dir), batch_size=2,
                  per_token=str(tmp_path / "t.npy"))
    assert_streamed_equals_resident(data=[str(documents)], ctx=64, batching="packed", **common)
    assert_streamed_equals_resident(data=[str(text)], ctx=32, window="sliding", stride=16, **common)


def test_a_divergence_run_streamed_equals_resident(text, tokenizer_dir, tmp_path):
    settings = dict(model="random:llama-tiny", reference_model="random:llama-tiny", reference_seed=1,
                    data=[str(text)], tokenizer=str(tokenizer_dir), ctx=48, batch_size=3,
                    per_token=str(tmp_path / "t.npy"))
    resident = run(**settings)
    streamed = run(placement="streamed", max_gpu_memory=smallest_limit(**settings), **settings)
    assert streamed["streaming"]["waves"] > 1
    assert streamed["divergence"]["kld_mean"] == resident["divergence"]["kld_mean"]
    assert np.array_equal(streamed.per_token, resident.per_token, equal_nan=True)   # every column of every token


def test_a_gguf_file_streamed_equals_resident(tmp_path, shakespeare):
    gguf_tests = pytest.importorskip("models.test_gguf")
    original = gguf_tests._hf_random("llama", tie_word_embeddings=False, **gguf_tests.LLAMA_SHAPE)
    path = tmp_path / "tiny.gguf"   # its matrices stored as Q8_0, F16, Q4_0 and F32, unlike from block to block
    gguf_tests._write_llama_family(path, original, "llama", gguf_tests._tiny_bpe(shakespeare))
    (tmp_path / "text.txt").write_text(shakespeare.read_text()[:3000])
    streamed = assert_streamed_equals_resident(model=str(path), data=[str(tmp_path / "text.txt")], ctx=32,
                                               batch_size=2, per_token=str(tmp_path / "t.npy"))
    assert streamed["streaming"]["blocks_rest_in"] == "the cpu device in their stored (quantized) form, decoded a " \
        "block at a time"


def test_a_compressed_tensors_checkpoint_streamed_equals_resident(tmp_path, shakespeare):
    compressed_tests = pytest.importorskip("models.test_compressed")
    gguf_tests = pytest.importorskip("models.test_gguf")
    checkpoint = tmp_path / "int4"
    compressed_tests._write(checkpoint, *compressed_tests.SCHEMES["int4-group-symmetric"])
    gguf_tests._tiny_bpe(shakespeare).save(str(checkpoint / "tokenizer.json"))   # its 400 ids fit the model's
    (tmp_path / "text.txt").write_text(shakespeare.read_text()[:3000])
    streamed = assert_streamed_equals_resident(model=str(checkpoint), data=[str(tmp_path / "text.txt")], ctx=32,
                                               batch_size=2, per_token=str(tmp_path / "t.npy"))
    assert streamed["streaming"]["blocks_rest_in"] == "the cpu device in their stored (quantized) form, decoded a " \
        "block at a time"


@pytest.fixture(scope="module")
def deep_llama(tmp_path_factory, shakespeare):
    """A Llama checkpoint whose 16 blocks hold most of its weights (a 400-id vocabulary, its tokenizer's), as a big
    model's do."""
    import torch
    from fastppl.models.llama import Llama, LlamaConfig
    from fastppl.models.loading import save_hf_checkpoint
    gguf_tests = pytest.importorskip("models.test_gguf")
    model = Llama(LlamaConfig(vocab_size=400, max_positions=64, hidden_size=64, intermediate_size=128, n_layer=16,
                              n_head=4, n_kv_head=2, rope_theta=10000.0, tie_word_embeddings=False))
    model.init_weights(torch.Generator().manual_seed(0))
    directory = tmp_path_factory.mktemp("deep") / "llama"
    save_hf_checkpoint(model, directory)
    gguf_tests._tiny_bpe(shakespeare).save(str(directory / "tokenizer.json"))
    (directory.parent / "text.txt").write_text(shakespeare.read_text()[:3000])
    return directory


def test_blocks_stay_in_the_checkpoints_files_where_host_memory_is_short(deep_llama, tmp_path, monkeypatch,
                                                                         capsys):
    import fastppl.models.loading as loading
    monkeypatch.setattr(loading, "available_host_memory", lambda: 2**20)   # less than the blocks take
    streamed = assert_streamed_equals_resident(model=str(deep_llama), data=[str(deep_llama.parent / "text.txt")],
                                               ctx=32, batch_size=2, per_token=str(tmp_path / "t.npy"))
    assert streamed["streaming"]["blocks_rest_in"] == ("the checkpoint's files (host memory is short of the blocks: "
                                                       "read a block at a time)")
    warning = capsys.readouterr().err.splitlines()[-1]
    assert warning.startswith("fastppl: warning: the blocks take ") and "host memory available (0.00 GiB)" in warning
    from fastppl.models.loading import load_model
    from fastppl.resume import weights_digest   # a resumed or distributed run's check reads the files' blocks
    assert len({weights_digest(load_model(str(deep_llama), streamed=True)) for _ in range(2)}) == 1


def test_a_checkpoint_that_goes_during_a_run_from_its_files_is_one_line(deep_llama, tmp_path, monkeypatch):
    import shutil

    import fastppl.models.loading as loading
    from fastppl.models.weights import FileBlock
    monkeypatch.setattr(loading, "available_host_memory", lambda: 2**20)
    moved = shutil.copytree(deep_llama, tmp_path / "llama")
    real_fill = FileBlock.fill

    def fill_then_remove(self, parameters):   # the file goes once the first block is read
        real_fill(self, parameters)
        (moved / "model.safetensors").unlink(missing_ok=True)
    monkeypatch.setattr(FileBlock, "fill", fill_then_remove)
    with pytest.raises(FastpplError, match=r"model.safetensors: could not be read during the run .*keep it in place"):
        run(model=str(moved), data=[str(deep_llama.parent / "text.txt")], ctx=32, batch_size=2, placement="streamed")


def test_auto_streams_where_the_weights_exceed_the_limit_and_says_why(deep_llama, tmp_path):
    settings = dict(model=str(deep_llama), data=[str(deep_llama.parent / "text.txt")], ctx=32, batch_size=2,
                    per_token=str(tmp_path / "t.npy"))
    resident = run(max_gpu_memory="64MiB", **settings)   # the weights: 2.85 MiB in fp32
    assert resident["placement"] == "resident" and resident["placement_reason"].startswith("auto: the weights")
    streamed = run(max_gpu_memory="2MiB", **settings)
    assert streamed["placement"] == "streamed" and "exceed 90% of --max-gpu-memory" in streamed["placement_reason"]
    assert streamed["streaming"]["waves"] > 1 and streamed["nll_sum"] == resident["nll_sum"]
    assert np.array_equal(streamed.per_token, resident.per_token, equal_nan=True)


def test_a_wave_that_cannot_hold_one_batch_names_the_ctx_and_the_limit_that_would(text, tokenizer_dir):
    settings = dict(model="random:gpt2-tiny", data=[str(text)], tokenizer=str(tokenizer_dir), ctx=64, batch_size=1)
    least = smallest_limit(**settings)
    with pytest.raises(FastpplError) as refused:
        run(placement="streamed", max_gpu_memory=least - 2**16, **settings)
    message = str(refused.value)
    assert "\n" not in message and "raise max_gpu_memory to at least" in message
    ctx = int(re.search(r"lower ctx to (\d+)", message).group(1))
    assert 2 <= ctx < 64
    run(placement="streamed", max_gpu_memory=least - 2**16, **{**settings, "ctx": ctx})   # that --ctx runs


def test_placement_resident_of_weights_that_do_not_fit_says_what_they_need(text, tokenizer_dir):
    import torch
    from fastppl.models.loading import weights_bytes
    from fastppl.runner import gib
    needed = gib(weights_bytes("random:gpt2-tiny", "auto", torch.float32))   # its parameters, counted
    with pytest.raises(FastpplError, match=rf"the weights need {re.escape(needed)}, .*use placement=\"streamed\""):
        run(model="random:gpt2-tiny", data=[str(text)], tokenizer=str(tokenizer_dir), placement="resident",
            max_gpu_memory="8MiB")


@pytest.mark.parametrize("option", [dict(compile="on"), dict(kv_cache="on", window="sliding"),
                                    dict(backend="hf"), dict(reference_model="random:gpt2-tiny",
                                                             reference_device="cpu")])
def test_what_the_streamed_path_cannot_run_is_refused_in_one_line(option, text):
    with pytest.raises(FastpplError, match='does not work with placement="streamed"') as refused:
        EvalConfig(model="random:gpt2-tiny", data=[str(text)], placement="streamed", **option)
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize("given, expected", [("8GiB", 8 * 2**30), ("8GB", 8 * 10**9), ("512MiB", 512 * 2**20),
                                             ("1.5G", 3 * 2**29), ("1000", 1000)])
def test_memory_sizes_read_as_bytes(given, expected):
    assert memory_size(given, "--max-gpu-memory") == expected


@pytest.mark.parametrize("given", ["8 lots", "GiB", "-1GiB", ""])
def test_a_size_that_is_none_is_one_line(given):
    with pytest.raises(FastpplError, match="max_gpu_memory must be a size such as 8GiB"):
        EvalConfig(model="random:gpt2-tiny", data=["x"], max_gpu_memory=given)


def test_waves_keep_the_batches_order_and_fit_the_capacity():
    sizes = [3, 3, 2, 5, 1, 4]
    waves = plan_waves(sizes, lambda size: size, capacity=6)
    assert waves == [[3, 3], [2], [5, 1], [4]]
    assert plan_waves(sizes, lambda size: size, capacity=100) == [sizes]
    assert plan_waves([], lambda size: size, capacity=1) == []


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("model", ["random:llama-tiny", "random:qwen3-tiny", "random:gpt2-tiny"])
def test_on_cuda_streamed_from_pinned_memory_equals_resident(model, text, tokenizer_dir, tmp_path):
    """bf16 on a GPU: the copies run on a side stream from pinned memory; Llama's fused trunk and every family's
    fused loss run in both placements, bit for bit. GPT-2's fused norms carry bias sums across blocks, so its
    blocks stream plain: within bf16's rounding of the resident fused forward."""
    settings = dict(model=model, data=[str(text)], tokenizer=str(tokenizer_dir), ctx=48, batch_size=3,
                    per_token=str(tmp_path / "t.npy"), device="cuda", dtype="bf16", quiet=True)
    resident = evaluate(EvalConfig(**settings))
    with pytest.raises(FastpplError, match="cannot hold one wave") as refused:
        evaluate(EvalConfig(**settings, placement="streamed", max_gpu_memory=1))
    least = memory_size(re.search(r"at least (\S+?)(,|$)", str(refused.value)).group(1), "limit") + 2**16
    streamed = evaluate(EvalConfig(**settings, placement="streamed", max_gpu_memory=least))
    assert streamed["streaming"]["waves"] > 1 and streamed["streaming"]["blocks_rest_in"] == "pinned host memory"
    assert 0 <= streamed["streaming"]["copy_seconds_hidden"] <= streamed["streaming"]["copy_seconds"]
    if model == "random:gpt2-tiny":
        assert abs(streamed["nll_sum"] / resident["nll_sum"] - 1) < 1e-3
    else:
        assert streamed["residual_norms"] == resident["residual_norms"]
        assert streamed["nll_sum"] == resident["nll_sum"]
        assert np.array_equal(streamed.per_token, resident.per_token, equal_nan=True)


def test_a_model_transformers_runs_is_not_streamed(text, tokenizer_dir, tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM
    config = AutoConfig.for_model("opt", vocab_size=50304, hidden_size=16, num_hidden_layers=1, ffn_dim=32,
                                  num_attention_heads=2, word_embed_proj_dim=16, max_position_embeddings=64)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "opt")
    with pytest.raises(FastpplError, match='model runs through transformers: use placement="resident"') as refused:
        run(model=str(tmp_path / "opt"), data=[str(text)], tokenizer=str(tokenizer_dir), ctx=32,
            placement="streamed")
    assert "\n" not in str(refused.value)


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="no CUDA device")
def test_on_cuda_blocks_that_cannot_be_pinned_stream_from_pageable_memory_with_one_warning(text, tokenizer_dir,
                                                                                          monkeypatch, capsys):
    import fastppl.runner as runner

    def refused(tensor):
        raise RuntimeError("cannot pin: out of host memory")
    settings = dict(model="random:llama-tiny", data=[str(text)], tokenizer=str(tokenizer_dir), ctx=48, batch_size=3,
                    device="cuda", dtype="bf16", quiet=True)
    resident = evaluate(EvalConfig(**settings))
    monkeypatch.setattr(runner, "pinned", refused)
    streamed = evaluate(EvalConfig(**settings, placement="streamed"))
    assert streamed["streaming"]["blocks_rest_in"].startswith("pageable host memory (pinning failed: cannot pin")
    assert streamed["nll_sum"] == resident["nll_sum"]
    warnings = [line for line in capsys.readouterr().err.splitlines() if "pinning the weights" in line]
    assert len(warnings) == 1 and warnings[0].startswith("fastppl: warning: ")


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="no CUDA device")
def test_on_cuda_a_gguf_streamed_from_its_quantized_blocks_on_the_gpu_equals_resident(tmp_path, shakespeare):
    gguf_tests = pytest.importorskip("models.test_gguf")
    original = gguf_tests._hf_random("llama", tie_word_embeddings=False, **gguf_tests.LLAMA_SHAPE)
    path = tmp_path / "tiny.gguf"
    gguf_tests._write_llama_family(path, original, "llama", gguf_tests._tiny_bpe(shakespeare))
    (tmp_path / "text.txt").write_text(shakespeare.read_text()[:3000])
    settings = dict(model=str(path), data=[str(tmp_path / "text.txt")], ctx=32, batch_size=2, device="cuda",
                    dtype="bf16", quiet=True, per_token=str(tmp_path / "t.npy"))
    resident = evaluate(EvalConfig(**settings))
    streamed = evaluate(EvalConfig(**settings, placement="streamed", max_gpu_memory="64MiB"))
    assert streamed["streaming"]["blocks_rest_in"].startswith("the cuda device in their stored (quantized) form")
    assert streamed["nll_sum"] == resident["nll_sum"]
    assert np.array_equal(streamed.per_token, resident.per_token, equal_nan=True)
