"""Every native family against transformers in fp32, through the loader a user's `--model DIR` takes: tiny random
checkpoints written by save_pretrained, per-token NLL within 1e-5 relative. And what is not native: an unknown
model_type and a setting a family does not implement run on transformers with the reason in the report, or are
one line under --backend native."""
import json

import pytest
import torch
import torch.nn.functional as F
import transformers

from fastppl.engine.score import make_score_fn
from fastppl.errors import FastpplError
from fastppl.models import load_model
from fastppl.models.hf_backend import HFCausalLM
from fastppl.models.loading import native_to_hf, random_native, weights_bytes
from fastppl.models.registry import SPECS, native_model_types, presets, spec_for_model_type, spec_of

FP32_RTOL = 1e-5   # per-token NLL, max relative error

SIZES = dict(vocab_size=1000, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6)
LLAMA31_ROPE = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=32)
# case -> (HF config class, model class, config fields, the family that must load it)
CASES = {
    "gpt2": ("GPT2Config", "GPT2LMHeadModel",
             dict(vocab_size=1000, n_positions=128, n_embd=64, n_layer=2, n_head=4), "gpt2"),
    "llama-untied": ("LlamaConfig", "LlamaForCausalLM", dict(SIZES, tie_word_embeddings=False), "llama"),
    "llama-3.1-rope-scaling": ("LlamaConfig", "LlamaForCausalLM",
                               dict(SIZES, rope_theta=500000.0, rope_scaling=LLAMA31_ROPE), "llama"),
    "llama-biases-tied": ("LlamaConfig", "LlamaForCausalLM",
                          dict(SIZES, attention_bias=True, mlp_bias=True, tie_word_embeddings=True), "llama"),
    "qwen2-tied": ("Qwen2Config", "Qwen2ForCausalLM", dict(SIZES, tie_word_embeddings=True), "qwen2"),
    "qwen2-untied": ("Qwen2Config", "Qwen2ForCausalLM", dict(SIZES, tie_word_embeddings=False), "qwen2"),
    "qwen3-head-dim-untied": ("Qwen3Config", "Qwen3ForCausalLM",
                              dict(SIZES, head_dim=24, tie_word_embeddings=False), "qwen3"),
    "qwen3-attention-bias-tied": ("Qwen3Config", "Qwen3ForCausalLM",
                                  dict(SIZES, attention_bias=True, tie_word_embeddings=True), "qwen3"),
    "mistral-window-untied": ("MistralConfig", "MistralForCausalLM",
                              dict(SIZES, sliding_window=128, tie_word_embeddings=False), "mistral"),
}


def _tiny_hf(config_class: str, model_class: str, fields: dict):
    torch.manual_seed(0)
    hf = getattr(transformers, model_class)(getattr(transformers, config_class)(**fields)).eval()
    # larger than the 0.02 init, and no unit norms or zero biases for a wrong name to hide behind
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.add_(torch.randn_like(p) * (0.05 if "norm" in name or "ln" in name else 0.1))
    return hf


def _hf_nll(hf, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        logits = hf(ids).logits[:, :-1].float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none")


def _native_nll(model, ids: torch.Tensor) -> torch.Tensor:
    inputs, targets = ids[:, :-1], ids[:, 1:]
    with torch.no_grad():
        score = make_score_fn(model, chunk_rows=37)
        return score(inputs, targets, torch.ones_like(inputs, dtype=torch.bool)).reshape(-1)


def _max_rel(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got - expected).abs() / expected.abs()).max().item()


@pytest.mark.parametrize("case", CASES)
def test_each_family_loads_natively_and_matches_transformers(case, tmp_path):
    config_class, model_class, fields, family = CASES[case]
    hf = _tiny_hf(config_class, model_class, fields)
    hf.save_pretrained(tmp_path)
    model = load_model(str(tmp_path))
    assert spec_for_model_type(json.loads((tmp_path / "config.json").read_text())["model_type"]).name == family
    assert spec_of(model) is not None and not isinstance(model, HFCausalLM)
    if family != "gpt2":
        tied = model.lm_head.weight is model.embed.weight
        assert tied == bool(hf.config.tie_word_embeddings)
    ids = torch.randint(0, 1000, (3, 100), generator=torch.Generator().manual_seed(1))
    expected = _hf_nll(hf, ids)
    assert expected.std() > 0.1   # the weights are not so small that every token looks alike
    assert _max_rel(_native_nll(model, ids), expected) <= FP32_RTOL


def test_qwen3_per_head_norms_are_read_and_used(tmp_path):
    """The q/k norms change every NLL: a loader that left them at one would miss the tolerance by far."""
    hf = _tiny_hf(*CASES["qwen3-head-dim-untied"][:3])
    hf.save_pretrained(tmp_path)
    model = load_model(str(tmp_path))
    assert model.config.head_dim == 24 != model.config.hidden_size // model.config.n_head
    torch.testing.assert_close(model.blocks[1].attn.k_norm.weight, hf.model.layers[1].self_attn.k_norm.weight)
    ids = torch.randint(0, 1000, (2, 50), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        for block in model.blocks:
            block.attn.q_norm.weight.fill_(1.0)
    assert _max_rel(_native_nll(model, ids), _hf_nll(hf, ids)) > 100 * FP32_RTOL


@pytest.mark.slow
def test_qwen3_through_eval_equals_transformers(tmp_path, tokenizer_dir):
    """`fastppl eval --model DIR`'s path (fastppl.pipeline.evaluate): the per-token NLLs of one chunked window,
    which starts with the tokenizer's <|endoftext|> as BOS."""
    from fastppl.config import EvalConfig
    from fastppl.pipeline import evaluate
    hf = _tiny_hf("Qwen3Config", "Qwen3ForCausalLM", dict(SIZES, vocab_size=50257, head_dim=24))
    hf.save_pretrained(tmp_path / "model")
    (tmp_path / "t.txt").write_text("To be, or not to be, that is the question. " * 3)
    result = evaluate(EvalConfig(model=str(tmp_path / "model"), data=[str(tmp_path / "t.txt")],
                                 tokenizer=str(tokenizer_dir), device="cpu", dtype="fp32", ctx=64, quiet=True,
                                 per_token="unused.npy"))
    per_token = torch.from_numpy(result.per_token)
    assert result["backend"] == "native"
    ids = transformers.AutoTokenizer.from_pretrained(str(tokenizer_dir))(
        "To be, or not to be, that is the question. " * 3)["input_ids"]
    expected = _hf_nll(hf, torch.tensor([[50256] + ids]))
    scored = ~torch.isnan(per_token)
    assert int(scored.sum()) == len(expected)
    assert _max_rel(per_token[scored].float(), expected) <= FP32_RTOL


def test_an_unknown_model_type_runs_on_transformers_and_the_report_says_why(tmp_path, tokenizer_dir):
    from fastppl.config import EvalConfig
    from fastppl.pipeline import evaluate
    hf = _tiny_hf("GPTNeoXConfig", "GPTNeoXForCausalLM",
                  dict(vocab_size=50257, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, max_position_embeddings=64))
    hf.save_pretrained(tmp_path / "model")
    assert "gpt_neox" not in native_model_types()
    (tmp_path / "t.txt").write_text("To be, or not to be, that is the question. " * 3)
    result = evaluate(EvalConfig(model=str(tmp_path / "model"), data=[str(tmp_path / "t.txt")],
                                 tokenizer=str(tokenizer_dir), device="cpu", dtype="fp32", ctx=32, quiet=True))
    assert result["backend"].startswith("transformers (auto: model_type 'gpt_neox' has no native implementation")
    with pytest.raises(FastpplError, match="gpt_neox.*no native implementation.*--backend hf"):
        load_model(str(tmp_path / "model"), backend="native")


@pytest.mark.parametrize("case", ["qwen3-head-dim-untied", "qwen2-tied", "mistral-window-untied"])
def test_an_unmappable_rope_falls_back_with_the_reason_or_is_one_line(case, tmp_path, capsys, tokenizer_dir):
    config_class, model_class, fields, family = CASES[case]
    yarn = dict(rope_type="yarn", factor=2.0, original_max_position_embeddings=64, rope_theta=10000.0)
    hf = _tiny_hf(config_class, model_class, dict(fields, vocab_size=50257, rope_parameters=yarn))
    hf.save_pretrained(tmp_path / "model")
    model = load_model(str(tmp_path / "model"))
    assert isinstance(model, HFCausalLM) and model.why == (
        "auto: the native model does not implement RoPE type 'yarn' (native: default, linear, llama3)")
    ids = torch.randint(0, 50257, (2, 40), generator=torch.Generator().manual_seed(3))
    assert _max_rel(_native_nll(model, ids), _hf_nll(hf, ids)) <= FP32_RTOL
    from fastppl.cli import main
    (tmp_path / "t.txt").write_text("To be, or not to be. " * 4)
    capsys.readouterr()
    assert main(["eval", "--model", str(tmp_path / "model"), "--tokenizer", str(tokenizer_dir), "--device", "cpu",
                 "--data", str(tmp_path / "t.txt"), "--ctx", "16", "--backend", "native", "--quiet"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1 and captured.err.startswith("fastppl: error: ")
    assert f"the native {family} model does not implement RoPE type 'yarn'" in captured.err
    assert "--backend hf" in captured.err


def _saved_config(tmp_path, case: str, **changes) -> None:
    """A saved tiny checkpoint of the case with config.json edited (None deletes a key)."""
    _tiny_hf(*CASES[case][:3]).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    for key, value in changes.items():
        config.pop(key, None) if value is None else config.update({key: value})
    (tmp_path / "config.json").write_text(json.dumps(config))


def test_a_mistral_config_without_a_window_gets_transformers_default_of_4096(tmp_path):
    """transformers slides Mistral's attention over 4096 positions where config.json names no window; full attention
    beyond them would be another model."""
    _saved_config(tmp_path, "mistral-window-untied", sliding_window=None, max_position_embeddings=32768)
    assert transformers.AutoConfig.from_pretrained(tmp_path).sliding_window == 4096
    assert load_model(str(tmp_path)).max_positions == 4096


@pytest.mark.parametrize("max_window_layers, layer_types, capped", [
    (1, None, True),                                       # layer 1 slides
    (2, None, False),                                      # no layer slides
    (0, ["full_attention", "full_attention"], False),      # layer_types decide over max_window_layers
    (2, ["full_attention", "sliding_attention"], True),
])
def test_qwen_sliding_window_caps_the_context_only_where_a_layer_slides(tmp_path, max_window_layers, layer_types,
                                                                        capped):
    _saved_config(tmp_path, "qwen2-tied", use_sliding_window=True, sliding_window=48,
                  max_window_layers=max_window_layers, layer_types=layer_types)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="sdpa").eval()
    assert ("sliding_attention" in hf.config.layer_types) == capped
    model = load_model(str(tmp_path))
    assert model.max_positions == (48 if capped else 128)
    ids = torch.randint(0, 1000, (2, model.max_positions), generator=torch.Generator().manual_seed(4))
    assert _max_rel(_native_nll(model, ids), _hf_nll(hf, ids)) <= FP32_RTOL


# ------------------------------------------------------------------------------------------ the registry
@pytest.mark.slow
def test_every_random_preset_is_built_by_its_family_and_has_a_transformers_twin():
    for preset in presets():
        if weights_bytes(f"random:{preset}", "native", torch.float32) > 2**28:
            continue   # full-size shapes (GPT-2 124M and up, Llama 1B and 8B): the tiny ones cover the same code
        native = random_native(preset).eval()
        assert spec_of(native).presets[preset] is native.config
        with torch.no_grad():
            for name, p in native.named_parameters():
                if "norm" not in name and "ln" not in name:
                    p.normal_(0.0, 0.1)
        ids = torch.randint(0, 50257, (2, 48), generator=torch.Generator().manual_seed(5))
        assert _max_rel(_native_nll(native, ids), _hf_nll(native_to_hf(native).eval(), ids)) <= FP32_RTOL, preset


def test_each_model_type_has_one_family_and_each_family_its_own_spec():
    model_types = [t for spec in SPECS for t in spec.model_types]
    assert len(model_types) == len(set(model_types))
    assert {spec.name for spec in SPECS} == {"gpt2", "llama", "qwen2", "mistral", "qwen3"}
    assert spec_for_model_type("gpt_neox") is None and spec_for_model_type(None) is None
    assert spec_of(torch.nn.Linear(2, 2)) is None
