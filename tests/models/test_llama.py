"""Native Llama-family model vs transformers (fp32, same weights), name maps and loading."""
import json

import pytest
import torch
import torch.nn.functional as F

from fastppl.engine.score import make_score_fn
from fastppl.errors import FastpplError
from fastppl.models import load_model
from fastppl.models.hf_backend import HFCausalLM
from fastppl.models.llama import config_from_hf as llama_config_from_hf
from fastppl.models.llama import PRESETS, Llama, rope_frequencies
from fastppl.models.loading import native_to_hf, random_native

FP32_MAX_RELATIVE_ERROR = 1e-5   # per-token NLL, native vs transformers


def _tiny_hf(model_type: str, **overrides):
    import transformers
    config_class = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
                    "mistral": transformers.MistralConfig}[model_type]
    fields = dict(vocab_size=1000, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6)
    fields.update(overrides)
    model_class = {"llama": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM,
                   "mistral": transformers.MistralForCausalLM}[model_type]
    torch.manual_seed(0)
    hf = model_class(config_class(**fields)).eval()
    with torch.no_grad():   # larger than the 0.02 init, so that attention and RoPE matter to the result
        for name, p in hf.named_parameters():
            p.add_(torch.randn_like(p) * (0.05 if "norm" in name else 0.1))
    return hf


def _hf_nll(hf, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        logits = hf(ids).logits[:, :-1]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none")


def _native_nll(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        targets = torch.cat([ids[:, 1:], ids[:, :1]], dim=1)
        mask = torch.ones_like(ids, dtype=torch.bool)
        return make_score_fn(model, chunk_rows=37)(ids, targets, mask)[:, :-1].reshape(-1)


def _assert_matches_hf(model, hf, T: int = 100):
    T = min(T, model.max_positions)
    ids = torch.randint(0, hf.config.vocab_size, (3, T), generator=torch.Generator().manual_seed(1))
    expected, got = _hf_nll(hf, ids), _native_nll(model, ids)
    relative = ((got - expected).abs() / expected.abs()).max().item()
    assert relative <= FP32_MAX_RELATIVE_ERROR, relative
    assert expected.std() > 0.1     # the weights are not so small that every token looks alike


CASES = {
    "llama3-rope-gqa-untied": ("llama", dict(
        rope_theta=10000.0, tie_word_embeddings=False,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=32))),
    "llama-attention-bias-tied": ("llama", dict(attention_bias=True, mlp_bias=True, tie_word_embeddings=True)),
    "llama-linear-rope-mha": ("llama", dict(num_key_value_heads=4, rope_scaling=dict(rope_type="linear", factor=2.0))),
    "qwen2-qkv-bias-tied": ("qwen2", dict(tie_word_embeddings=True, rope_theta=1e6)),
    "mistral-head-dim": ("mistral", dict(head_dim=32, sliding_window=64)),
}


@pytest.mark.parametrize("case", CASES)
def test_checkpoint_dir_loads_natively_and_matches_transformers(case, tmp_path):
    model_type, overrides = CASES[case]
    hf = _tiny_hf(model_type, **overrides)
    hf.save_pretrained(tmp_path)
    model = load_model(str(tmp_path))
    assert isinstance(model, Llama)
    assert model.config.tie_word_embeddings == hf.config.tie_word_embeddings
    assert (model.lm_head.weight is model.embed.weight) == hf.config.tie_word_embeddings
    _assert_matches_hf(model, hf)


def test_mistral_context_capped_at_its_sliding_window(tmp_path, tokenizer_dir, capsys):
    # full attention equals sliding-window attention only on windows no longer than the window
    hf = _tiny_hf("mistral", sliding_window=48, vocab_size=50257)   # the GPT-2 tokenizer's, for the CLI below
    hf.save_pretrained(tmp_path / "model")
    capsys.readouterr()
    assert load_model(str(tmp_path / "model")).max_positions == 48
    # a --ctx beyond it says why the limit is below the checkpoint's 128 positions, and what goes further
    (tmp_path / "t.txt").write_text("To be, or not to be, that is the question. " * 20)
    from fastppl.cli import main
    assert main(["eval", "--model", str(tmp_path / "model"), "--tokenizer", str(tokenizer_dir), "--device", "cpu",
                 "--data", str(tmp_path / "t.txt"), "--ctx", "64", "--quiet"]) == 2
    error = capsys.readouterr().err
    assert "maximum of 48 positions (the checkpoint's sliding attention window" in error and "--backend hf" in error


@pytest.mark.slow
def test_random_llama_tiny_matches_its_transformers_twin():
    native = random_native("llama-tiny").eval()
    assert native.config.rope_type == "llama3"
    with torch.no_grad():
        for name, p in native.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.1)
    _assert_matches_hf(native, native_to_hf(native).eval(), T=200)   # beyond the original 64 positions


def test_random_llama_hf_backend_holds_the_same_weights():
    native = load_model("random:llama-tiny", "native")
    hf = load_model("random:llama-tiny", "hf")
    assert isinstance(hf, HFCausalLM)
    ids = torch.randint(0, 50257, (2, 50))
    with torch.no_grad():
        torch.testing.assert_close(native(ids), hf(ids), rtol=1e-5, atol=1e-5)


def test_llama_1b_preset_has_the_llama_3_2_1b_shape():
    config = PRESETS["llama-1b"]
    with torch.device("meta"):
        model = Llama(config)
    n_params = sum(p.numel() for p in model.parameters())   # tied: the embedding counts once
    assert n_params == 1_235_814_400
    assert (config.n_layer, config.hidden_size, config.n_head, config.n_kv_head, config.intermediate_size,
            config.vocab_size, config.max_positions) == (16, 2048, 32, 8, 8192, 128256, 131072)
    assert config.tie_word_embeddings and config.rope_type == "llama3" and config.rope_theta == 500000.0


def test_rope_frequencies_equal_transformers_llama3():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    hf_dict = dict(hidden_size=2048, num_attention_heads=32, head_dim=64, rope_theta=500000.0,
                   rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                     original_max_position_embeddings=8192))
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](LlamaConfig(**hf_dict))
    torch.testing.assert_close(rope_frequencies(PRESETS["llama-1b"]), expected, rtol=0, atol=0)


def test_config_reads_both_rope_spellings():
    old = dict(model_type="llama", vocab_size=10, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
               num_attention_heads=4, rope_theta=5e5,
               rope_scaling=dict(type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                 original_max_position_embeddings=8192))
    new = {k: v for k, v in old.items() if k not in ("rope_theta", "rope_scaling")}
    new["rope_parameters"] = dict(old["rope_scaling"], rope_theta=5e5, rope_type="llama3")
    del new["rope_parameters"]["type"]
    assert llama_config_from_hf(old) == llama_config_from_hf(new)
    assert llama_config_from_hf(old).rope_type == "llama3" and llama_config_from_hf(old).n_kv_head == 4


@pytest.mark.parametrize("rope, missing", [
    (dict(rope_type="llama3", rope_theta=1e4), "factor, low_freq_factor, high_freq_factor, original_max_position"),
    (dict(rope_type="llama3", rope_theta=1e4, factor=8.0, low_freq_factor=1.0, original_max_position_embeddings=64),
     "needs high_freq_factor"),
    (dict(rope_type="linear", rope_theta=1e4), "needs factor"),
])
def test_a_rope_config_missing_its_keys_is_a_corrupt_checkpoint_not_defaults(tmp_path, rope, missing):
    """transformers refuses these configs; the native loader filled in factor 1.0 and ran."""
    _tiny_hf("llama").save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config.pop("rope_scaling", None)
    config["rope_parameters"] = rope
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(FastpplError, match=f"{missing}.*the checkpoint is corrupt"):
        load_model(str(tmp_path), backend="native")


def test_unsupported_rope_falls_back_to_transformers(tmp_path):
    hf = _tiny_hf("llama", rope_scaling=dict(rope_type="yarn", factor=2.0, original_max_position_embeddings=64))
    hf.save_pretrained(tmp_path)
    model = load_model(str(tmp_path))
    assert isinstance(model, HFCausalLM) and model.why.startswith("auto: the native model does not implement RoPE")
    with pytest.raises(FastpplError, match="yarn"):
        load_model(str(tmp_path), backend="native")


def test_generate_says_an_architecture_without_a_native_model_cannot_generate(tmp_path, tokenizer_dir):
    """It advised --backend native, which then advised --backend hf, which generate does not take."""
    from fastppl.generate import GenerateConfig, run_generate
    hf = _tiny_hf("llama", rope_scaling=dict(rope_type="yarn", factor=2.0, original_max_position_embeddings=64))
    hf.save_pretrained(tmp_path)
    for backend in ("auto", "native"):
        with pytest.raises(FastpplError, match="generate runs native models only") as error:
            run_generate(GenerateConfig(model=str(tmp_path), prompts=["hi"], max_new_tokens=2, device="cpu",
                                        tokenizer=str(tokenizer_dir), backend=backend))
        assert "--backend hf" not in str(error.value)


def test_checkpoint_holding_more_layers_than_its_config_is_refused(tmp_path):
    hf = _tiny_hf("qwen2")
    hf.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["num_hidden_layers"] -= 1                   # layer 1's weights would be dropped silently
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(FastpplError, match="holds layer 1 .model.layers.1.*config.json has 1 layers"):
        load_model(str(tmp_path))


def test_extra_tensors_outside_the_model_are_ignored_as_transformers_ignores_them(tmp_path):
    """A value head, or Mistral's consolidated.safetensors beside the HF shards (the same weights, other names)."""
    from safetensors.torch import load_file, save_file
    hf = _tiny_hf("llama")
    hf.save_pretrained(tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    extra = {"v_head.summary.weight": torch.ones(1, 8), "layers.0.attention.wq.weight": torch.ones(4, 4)}
    save_file({**state, **extra}, str(tmp_path / "model.safetensors"))
    model = load_model(str(tmp_path), backend="native")
    assert torch.equal(model.embed.weight, state["model.embed_tokens.weight"])
    # beside the HF file, a second copy under other names is not even read (it would double the memory)
    (tmp_path / "consolidated.safetensors").write_bytes(b"not safetensors")
    assert torch.equal(load_model(str(tmp_path), backend="native").embed.weight, state["model.embed_tokens.weight"])


def test_sharded_checkpoints_read_the_files_their_index_names(tmp_path):
    hf = _tiny_hf("qwen2")
    hf.save_pretrained(tmp_path, max_shard_size="20KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1
    (tmp_path / "consolidated.safetensors").write_bytes(b"junk")   # not in the index: not read
    reference = load_model(str(tmp_path), backend="native")
    assert torch.equal(reference.embed.weight, hf.model.embed_tokens.weight)
    (tmp_path / shards[-1]).unlink()
    with pytest.raises(FastpplError, match=f"names {shards[-1]}, which is missing"):
        load_model(str(tmp_path), backend="native")


def test_checkpoint_missing_a_weight_is_a_user_error(tmp_path):
    from safetensors.torch import load_file, save_file
    hf = _tiny_hf("qwen2")
    hf.save_pretrained(tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    del state["model.layers.1.self_attn.k_proj.bias"]
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(FastpplError, match="k_proj.bias"):
        load_model(str(tmp_path))


def test_bf16_model_keeps_fp32_rope_angles():
    # rope frequencies are not a buffer, so casting the weights cannot round them
    model = random_native("llama-tiny").to(torch.bfloat16)
    assert not any("freq" in name for name, _ in model.named_buffers())
    cos, _ = model.rope_cos_sin(torch.tensor([100_000]), torch.float32)
    inv_freq = rope_frequencies(model.config)
    torch.testing.assert_close(cos[0, 0], torch.cos(torch.tensor(100_000.0) * inv_freq[0]))
    assert json.dumps(model.config.__dict__)   # plain fields, serialisable
