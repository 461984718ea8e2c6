"""Checkpoints read a tensor at a time into a model built on the meta device, on the run's device and in its dtype:
the same weights, bit for bit, as reading in fp32 and converting (the route checked against transformers in
test_vs_hf.py and test_llama.py), one file open at a time, and the model held once in host memory."""
import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import fastppl
import fastppl.models.weights as weights
from fastppl.errors import FastpplError
from fastppl.models import load_model
from fastppl.models.gpt2 import GPT2, GPT2Config
from fastppl.models.llama import Llama, LlamaConfig
from fastppl.models.loading import save_hf_gpt2
from fastppl.models.llama import config_to_hf as llama_config_to_hf, state_dict_to_hf as llama_state_dict_to_hf

ROOT = Path(__file__).resolve().parents[2]
# in an fp64 file: above 1 + 2**-8 (halfway between two bf16 numbers) by less than fp32 resolves, so that a cast
# straight to bf16 would round it up, and the fp32 route (the one checked against transformers) rounds it down
ROUNDS_TWICE = 1 + 2 ** -8 + 2 ** -30


def _random(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.3)
    return model.eval()


def _save_gpt2(directory: Path, file_dtype: torch.dtype) -> Path:
    save_hf_gpt2(_random(GPT2(GPT2Config(vocab_size=300, n_positions=32, n_embd=32, n_layer=2, n_head=4))), directory)
    state = load_file(str(directory / "model.safetensors"))
    state["transformer.ln_f.weight"][0] = ROUNDS_TWICE
    save_file({name: t.to(file_dtype) for name, t in state.items()}, str(directory / "model.safetensors"))
    return directory


def _save_llama(directory: Path, file_dtype: torch.dtype, tied: bool, max_shard_bytes: int = 0) -> Path:
    config = LlamaConfig(vocab_size=300, max_positions=64, hidden_size=32, intermediate_size=48, n_layer=2,
                         n_head=4, n_kv_head=2, rope_theta=10000.0, tie_word_embeddings=tied, qkv_bias=True)
    state = llama_state_dict_to_hf(_random(Llama(config)))
    if tied:
        del state["lm_head.weight"]
    state["model.norm.weight"][0] = ROUNDS_TWICE
    state = {name: t.to(file_dtype) for name, t in state.items()}
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(llama_config_to_hf(config)))
    if not max_shard_bytes:
        save_file(state, str(directory / "model.safetensors"))
        return directory
    shards, weight_map = [{}], {}
    for name, tensor in state.items():   # consecutive tensors, a shard of at most max_shard_bytes
        if shards[-1] and sum(t.nbytes for t in shards[-1].values()) + tensor.nbytes > max_shard_bytes:
            shards.append({})
        shards[-1][name] = tensor
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(directory / file))
        weight_map.update({name: file for name in shard})
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return directory


def _assert_same_weights(got: torch.nn.Module, expected: torch.nn.Module, dtype: torch.dtype) -> None:
    got_params, expected_params = dict(got.named_parameters()), dict(expected.named_parameters())
    assert got_params.keys() == expected_params.keys()
    bits = {2: torch.int16, 4: torch.int32}[dtype.itemsize]
    for name, p in got_params.items():
        assert p.dtype == dtype, name
        assert torch.equal(p.detach().view(bits), expected_params[name].detach().view(bits)), name


CHECKPOINTS = {"gpt2": lambda d, dtype: _save_gpt2(d, dtype),
               "llama-tied": lambda d, dtype: _save_llama(d, dtype, tied=True),
               "llama-untied-sharded": lambda d, dtype: _save_llama(d, dtype, tied=False, max_shard_bytes=12_000)}


@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
@pytest.mark.parametrize("file_dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_each_run_dtype_gets_the_fp32_routes_weights_bit_for_bit(tmp_path, checkpoint, file_dtype):
    """Read straight into bf16/fp16, the weights equal those read into fp32 and then converted (an fp64 file goes
    through fp32 too: straight to bf16, ROUNDS_TWICE would round the other way)."""
    directory = CHECKPOINTS[checkpoint](tmp_path / "model", file_dtype)
    in_fp32 = load_model(str(directory), "native", torch.float32)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        model = load_model(str(directory), "native", dtype)
        _assert_same_weights(model, copy.deepcopy(in_fp32).to(dtype), dtype)
        assert (model.lm_head.weight is (model.wte if checkpoint == "gpt2" else model.embed).weight) == \
            (checkpoint != "llama-untied-sharded")


def test_the_fp32_route_is_the_files_values(tmp_path):
    """What the other dtypes are compared with: every native weight is the file's tensor, fused and transposed as
    the name maps say (in fp32, bit for bit)."""
    directory = _save_llama(tmp_path / "model", torch.bfloat16, tied=False, max_shard_bytes=12_000)
    state = {name: t for file in directory.glob("*.safetensors") for name, t in load_file(str(file)).items()}
    model = load_model(str(directory), "native", torch.float32)
    qkv = torch.cat([state[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"]).float()
    assert torch.equal(model.blocks[1].attn.qkv.weight, qkv)
    assert torch.equal(model.lm_head.weight, state["lm_head.weight"].float())
    gpt2_dir = _save_gpt2(tmp_path / "gpt2", torch.float16)
    state = load_file(str(gpt2_dir / "model.safetensors"))
    model = load_model(str(gpt2_dir), "native", torch.float32)
    assert torch.equal(model.blocks[0].mlp.fc.weight, state["transformer.h.0.mlp.c_fc.weight"].t().float())


def test_shards_are_read_one_open_file_at_a_time(tmp_path, monkeypatch):
    directory = _save_llama(tmp_path / "model", torch.bfloat16, tied=False, max_shard_bytes=12_000)
    assert len(list(directory.glob("*.safetensors"))) > 3
    open_now, most_open, real_open = set(), [0], open

    class Tracked:
        def __init__(self, file, *args, **kwargs):
            self.file, self.handle = file, real_open(file, *args, **kwargs)

        def __enter__(self):
            open_now.add(self.file)
            most_open[0] = max(most_open[0], len(open_now))
            return self.handle.__enter__()

        def __exit__(self, *exc):
            open_now.discard(self.file)
            return self.handle.__exit__(*exc)

    monkeypatch.setattr(weights, "open", Tracked, raising=False)
    load_model(str(directory), "native", torch.bfloat16)
    assert most_open[0] == 1


def test_a_file_that_ends_inside_a_tensor_is_one_line(tmp_path):
    directory = _save_gpt2(tmp_path / "model", torch.float32)
    file = directory / "model.safetensors"
    file.write_bytes(file.read_bytes()[:-100])
    with pytest.raises(FastpplError, match="model.safetensors: cannot be read as a checkpoint .*corrupt or truncated"):
        load_model(str(directory), "native", torch.float32)


_PEAK_SCRIPT = """
import re, sys, torch
from fastppl.models import load_model

def status_kib(field):
    return int(re.search(field + r":\\s+(\\d+) kB", open("/proc/self/status").read()).group(1))

load_model(sys.argv[1], "native", torch.bfloat16)   # a tiny one first: the modules a load imports, imported
open("/proc/self/clear_refs", "w").write("5")   # the peak (VmHWM) restarts from the resident memory now
before = status_kib("VmRSS")
model = load_model(sys.argv[2], "native", torch.bfloat16)
print(status_kib("VmHWM") - before)
"""


@pytest.mark.slow   # a process of its own
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="measures the peak through Linux's /proc")
@pytest.mark.parametrize("checkpoint", ["gpt2", "llama"])
def test_a_bf16_load_holds_the_model_once_in_host_memory(tmp_path, checkpoint):
    """The peak resident memory a bf16 load adds is about the file (the model itself), not the file plus an fp32
    copy plus the converted model (about 4x)."""
    directory = tmp_path / "model"
    if checkpoint == "gpt2":
        model = GPT2(GPT2Config(vocab_size=50257, n_positions=256, n_embd=512, n_layer=4, n_head=8))
        save_hf_gpt2(model.to(torch.bfloat16), directory)   # writes fp32
        state = load_file(str(directory / "model.safetensors"))
        save_file({k: v.to(torch.bfloat16) for k, v in state.items()}, str(directory / "model.safetensors"))
    else:
        config = LlamaConfig(vocab_size=32000, max_positions=256, hidden_size=512, intermediate_size=1536, n_layer=4,
                             n_head=8, n_kv_head=4, tie_word_embeddings=False)
        directory.mkdir()
        save_file({k: v.to(torch.bfloat16) for k, v in llama_state_dict_to_hf(Llama(config)).items()},
                  str(directory / "model.safetensors"))
        (directory / "config.json").write_text(json.dumps(llama_config_to_hf(config)))
    file_bytes = (directory / "model.safetensors").stat().st_size
    tiny = _save_gpt2(tmp_path / "tiny", torch.bfloat16)
    done = subprocess.run([sys.executable, "-c", _PEAK_SCRIPT, str(tiny), str(directory)], capture_output=True,
                          text=True, env=dict(os.environ, PYTHONPATH=str(ROOT / "src")), check=True)
    added_kib = int(done.stdout.split()[0])
    assert added_kib * 1024 <= 1.15 * file_bytes, (added_kib * 1024 / file_bytes, done.stdout)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
def test_a_checkpoint_loads_straight_to_the_gpu_with_the_cpus_weights(tmp_path, checkpoint):
    directory = CHECKPOINTS[checkpoint](tmp_path / "model", torch.float64)
    for dtype in (torch.bfloat16, torch.float32):
        on_gpu = fastppl.load_model(str(directory), "native", dtype, device="cuda")   # the public API's too
        assert all(p.device.type == "cuda" for p in on_gpu.parameters())
        _assert_same_weights(on_gpu.cpu(), load_model(str(directory), "native", dtype), dtype)


@pytest.mark.slow   # a process of its own
def test_building_on_the_meta_device_imports_no_compiler_machinery(tmp_path):
    """Initialising meta tensors (normal_) and Module.to_empty imported torch's decompositions and sympy, seconds
    of a first load; the native load skips both."""
    directory = _save_llama(tmp_path / "model", torch.bfloat16, tied=True)
    code = ("import sys, torch; from fastppl.models import load_model; "
            f"load_model({str(directory)!r}, 'native', torch.bfloat16); print('sympy' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          env=dict(os.environ, PYTHONPATH=str(ROOT / "src")))
    assert done.stdout.split() == ["False"]


@pytest.mark.parametrize("damage", ["no header", "header of another length", "offsets past the end", "not JSON"])
def test_a_damaged_safetensors_header_is_one_line(tmp_path, damage):
    import struct
    directory = _save_gpt2(tmp_path / "model", torch.float32)
    file = directory / "model.safetensors"
    data = file.read_bytes()
    length = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + length])
    if damage == "no header":
        data = data[:5]
    elif damage == "header of another length":
        data = struct.pack("<Q", 2 ** 40) + data[8:]
    elif damage == "offsets past the end":
        header["transformer.wpe.weight"]["data_offsets"][1] += 4
        text = json.dumps(header).encode()
        data = struct.pack("<Q", len(text)) + text + data[8 + length:]
    else:
        data = data[:8] + b"\xff" * length + data[8 + length:]
    file.write_bytes(data)
    with pytest.raises(FastpplError, match="model.safetensors: cannot be read as a checkpoint .*corrupt or truncated"):
        load_model(str(directory), "native", torch.float32)
