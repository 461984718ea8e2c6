"""A model transformers runs (no native family) whose weights exceed the GPU: auto offloads it (its weights counted
from its config alone), and the device_map keeps everything but the decoder layers on the GPU and the layers in
order while they fit; the map covers the whole model (transformers loads it), and the run scores as the resident
one. The offloaded run itself needs a GPU (the gpu test at the end)."""
import json

import pytest
import torch
import transformers

from fastppl.config import EvalConfig
from fastppl.errors import FastpplError
from fastppl.models.hf_offload import hf_weights_bytes, meta_model, offload_device_map
from fastppl.models.loading import _load_hf
from fastppl.pipeline import evaluate
from fastppl.runner import RESIDENT_SHARE, choose_placement

N_LAYER = 4


@pytest.fixture(scope="module")
def neox(tmp_path_factory):
    """A tiny GPT-NeoX checkpoint (a family fastppl runs through transformers)."""
    torch.manual_seed(0)
    hf = transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(
        vocab_size=50257, hidden_size=32, intermediate_size=64, num_hidden_layers=N_LAYER, num_attention_heads=4,
        max_position_embeddings=64)).eval()
    directory = tmp_path_factory.mktemp("neox") / "model"
    hf.save_pretrained(directory)
    return directory, hf


def test_a_transformers_models_weights_are_counted_from_its_config(neox):
    directory, hf = neox
    assert hf_weights_bytes(directory, torch.bfloat16) == sum(p.numel() for p in hf.parameters()) * 2
    assert hf_weights_bytes(directory.parent / "nothing", torch.bfloat16) is None


def test_auto_offloads_a_transformers_model_past_the_limit_and_says_why(neox):
    directory, hf = neox
    needed = sum(p.numel() for p in hf.parameters()) * 2
    config = EvalConfig(model=str(directory), data=["x"], max_gpu_memory=needed)   # 90 % of it is too little
    placement = choose_placement(config, torch.device("cuda"), torch.bfloat16)
    assert placement.name == "offloaded" and placement.offload_bytes == int(RESIDENT_SHARE * needed)
    assert "and transformers runs the model: part of it in host memory" in placement.reason
    roomy = EvalConfig(model=str(directory), data=["x"], max_gpu_memory=2 * needed)
    assert choose_placement(roomy, torch.device("cuda"), torch.bfloat16).name == "resident"
    on_cpu = EvalConfig(model=str(directory), data=["x"], max_gpu_memory=needed, device="cpu")
    assert choose_placement(on_cpu, torch.device("cpu"), torch.float32).name == "resident"


def test_the_device_map_keeps_the_rest_on_the_gpu_and_the_layers_in_order(neox):
    directory, hf = neox
    model = meta_model(directory)
    layer = sum(p.numel() for p in hf.gpt_neox.layers[0].parameters()) * 4
    rest = sum(p.numel() for p in hf.parameters()) * 4 - N_LAYER * layer
    for fitting in range(N_LAYER + 1):   # room for `fitting` layers beside the rest and one layer's copy
        device_map = offload_device_map(model, rest + layer + fitting * layer + layer // 2, torch.float32, 0)
        layers = [device_map.pop(f"gpt_neox.layers.{i}") for i in range(N_LAYER)]
        assert layers == [0] * fitting + ["cpu"] * (N_LAYER - fitting)
        assert device_map == {"lm_head": 0, "gpt_neox.embed_in": 0, "gpt_neox.emb_dropout": 0,
                              "gpt_neox.final_layer_norm": 0, "gpt_neox.rotary_emb": 0}
    with pytest.raises(FastpplError, match=r"layer's copy, take [\d.,]+ MiB, more than the [\d.,]+ MiB the GPU"):
        offload_device_map(model, rest + layer - 1, torch.float32, 0)


def test_a_quantized_transformers_checkpoint_is_not_offloaded_by_its_unquantized_size(neox, tmp_path):
    directory, _ = neox
    quantized = tmp_path / "quantized"
    quantized.mkdir()
    config = json.loads((directory / "config.json").read_text())
    (quantized / "config.json").write_text(json.dumps(config | {"quantization_config": {"quant_method": "gptq"}}))
    assert hf_weights_bytes(quantized, torch.bfloat16) is None


def test_a_model_loaded_by_the_map_scores_as_the_model_loaded_whole(neox, tokenizer_dir, tmp_path):
    directory, _ = neox
    device_map = offload_device_map(meta_model(directory), 2**40, torch.float32, "cpu")   # the map's keys, on the CPU
    mapped = _load_hf(directory, torch.float32, "test", device_map)
    whole = _load_hf(directory, torch.float32, "test")
    ids = torch.randint(0, 50257, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(mapped(ids), whole(ids))
    assert mapped.offloaded and not whole.offloaded


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_on_cuda_an_offloaded_run_equals_the_resident_one(neox, tokenizer_dir, tmp_path):
    directory, hf = neox
    (tmp_path / "t.txt").write_text("To be, or not to be, that is the question. " * 20)
    settings = dict(model=str(directory), data=[str(tmp_path / "t.txt")], tokenizer=str(tokenizer_dir), ctx=32,
                    batch_size=2, device="cuda", dtype="fp32", quiet=True)
    resident = evaluate(EvalConfig(**settings))
    needed = sum(p.numel() for p in hf.parameters()) * 4
    offloaded = evaluate(EvalConfig(max_gpu_memory=needed, **settings))
    assert offloaded["placement"] == "offloaded" and "device_map" in offloaded["backend"]
    assert offloaded["nll_sum"] == pytest.approx(resident["nll_sum"], rel=1e-6)
    json.dumps(offloaded.to_dict())
