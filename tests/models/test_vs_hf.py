"""Native GPT-2 and the whole pipeline against Hugging Face transformers in fp32.

The reference is always GPT2LMHeadModel's own logits: log-softmax of the last position of exactly
the context the windowing contract names, one forward pass per scored token."""
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoTokenizer, GPT2Config as HFGPT2Config, GPT2LMHeadModel

from fastppl.config import EvalConfig
from fastppl.engine.score import make_score_fn
from fastppl.models import load_model
from fastppl.models.gpt2 import GPT2, GPT2Config
from fastppl.models.gpt2 import config_to_hf as gpt2_config_to_hf, state_dict_to_hf as gpt2_state_dict_to_hf
from fastppl.pipeline import evaluate
from fixtures.window_references import hf_guide_pairs, lm_eval_rolling_pairs

FP32_RTOL = 1e-5   # fp32: the bound on per-token NLL, max relative error

TEXT = ("First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n\n"
        "First Citizen:\nYou are all resolved rather to die than to famish?\n")


def _perturb(model: torch.nn.Module, seed: int) -> None:
    """Noise on every parameter (biases and layer norms too), so that a wrong name in the map or a
    missed transpose cannot hide behind zero biases and unit norms."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)


def _hf_tiny(vocab_size=50257, n_positions=64, seed=0) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    config = HFGPT2Config(vocab_size=vocab_size, n_positions=n_positions, n_embd=32, n_layer=2, n_head=4)
    model = GPT2LMHeadModel(config).eval()
    _perturb(model, seed)
    return model


def _hf_from_native(native: GPT2) -> GPT2LMHeadModel:
    hf = GPT2LMHeadModel(HFGPT2Config(**gpt2_config_to_hf(native.config), attn_implementation="eager")).eval()
    missing, unexpected = hf.load_state_dict(gpt2_state_dict_to_hf(native), strict=False)
    assert not unexpected and all(k.endswith((".attn.bias", ".attn.masked_bias")) for k in missing)
    return hf


def _hf_token_nll(hf: GPT2LMHeadModel, ids: torch.Tensor) -> torch.Tensor:
    """(B, T-1) NLL of ids[:, 1:] from HF's full logits."""
    with torch.no_grad():
        # normalised in float64: torch's fp32 log_softmax over a 50k vocabulary reads about 1e-5 nats low (its sum of
        # exponentials rounds down), a bias the model's fp32 forward does not have
        logits = hf(ids).logits.double()
    return -F.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None])[..., 0].float()


def _native_token_nll(model, ids: torch.Tensor) -> torch.Tensor:
    score = make_score_fn(model, chunk_rows=13)   # chunks that do not divide B*T
    inputs, targets = ids[:, :-1], ids[:, 1:]
    with torch.no_grad():
        return score(inputs, targets, torch.ones_like(inputs, dtype=torch.bool))


def _max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs() / b.abs()).max().item()


# ------------------------------------------------------------------------------ model vs model
def test_native_gpt2_matches_hf_on_same_random_weights():
    native = GPT2(GPT2Config(vocab_size=211, n_positions=40, n_embd=48, n_layer=3, n_head=4)).eval()
    native.init_weights(torch.Generator().manual_seed(3))
    _perturb(native, 4)
    hf = _hf_from_native(native)
    ids = torch.randint(0, 211, (3, 40), generator=torch.Generator().manual_seed(5))
    assert _max_rel(_native_token_nll(native, ids), _hf_token_nll(hf, ids)) <= FP32_RTOL


def test_random_preset_matches_hf():
    native = load_model("random:gpt2-tiny", "native", torch.float32, seed=7)
    hf = _hf_from_native(native)
    ids = torch.randint(0, 50257, (2, 64), generator=torch.Generator().manual_seed(0))
    assert _max_rel(_native_token_nll(native, ids), _hf_token_nll(hf, ids)) <= FP32_RTOL
    # --backend hf on a random preset wraps the same weights
    wrapped = load_model("random:gpt2-tiny", "hf", torch.float32, seed=7)
    assert _max_rel(_native_token_nll(wrapped, ids), _hf_token_nll(hf, ids)) <= FP32_RTOL


def _save_bin(hf: GPT2LMHeadModel, directory) -> None:
    """The pre-safetensors layout: config.json + pytorch_model.bin (a pickled state dict)."""
    directory.mkdir()
    hf.config.save_pretrained(directory)
    torch.save(hf.state_dict(), directory / "pytorch_model.bin")


@pytest.fixture(scope="module")
def hf_checkpoints(tmp_path_factory):
    """One tiny random HF GPT-2, saved both ways."""
    hf = _hf_tiny()
    root = tmp_path_factory.mktemp("ckpt")
    hf.save_pretrained(root / "safetensors")
    assert (root / "safetensors" / "model.safetensors").exists()
    _save_bin(hf, root / "bin")
    return hf, root


@pytest.mark.parametrize("layout", ["safetensors", "bin"])
@pytest.mark.parametrize("backend", ["auto", "native", "hf"])
def test_load_hf_checkpoint_directory(hf_checkpoints, layout, backend):
    hf, root = hf_checkpoints
    model = load_model(str(root / layout), backend, torch.float32)
    assert type(model).__name__ == ("HFCausalLM" if backend == "hf" else "GPT2")
    assert model.max_positions == 64 and model.vocab_size == 50257
    ids = torch.randint(0, 50257, (2, 64), generator=torch.Generator().manual_seed(1))
    assert _max_rel(_native_token_nll(model, ids), _hf_token_nll(hf, ids)) <= FP32_RTOL


def test_a_checkpoints_layer_norm_epsilon_is_used(tmp_path):
    """config.json's layer_norm_epsilon reaches every LayerNorm: 0.5 against the default 1e-5 moves every
    NLL far past the fp32 tolerance."""
    torch.manual_seed(0)
    hf = GPT2LMHeadModel(HFGPT2Config(vocab_size=50257, n_positions=64, n_embd=32, n_layer=2, n_head=4,
                                      layer_norm_epsilon=0.5)).eval()
    _perturb(hf, 0)
    hf.save_pretrained(tmp_path)
    model = load_model(str(tmp_path), "native", torch.float32)
    assert model.config.layer_norm_epsilon == 0.5
    ids = torch.randint(0, 50257, (2, 64), generator=torch.Generator().manual_seed(1))
    assert _max_rel(_native_token_nll(model, ids), _hf_token_nll(hf, ids)) <= FP32_RTOL


@pytest.mark.parametrize("change", [{"activation_function": "relu"}, {"n_inner": 80},
                                    {"scale_attn_by_inverse_layer_idx": True}, {"tie_word_embeddings": False}])
def test_gpt2_variants_the_native_model_lacks_run_through_hf(tmp_path, change):
    """A GPT-2 checkpoint whose config asks for something the native file does not implement is
    run by transformers under --backend auto (not silently mis-scored), and refused by --backend native."""
    torch.manual_seed(0)
    config = HFGPT2Config(vocab_size=97, n_positions=32, n_embd=32, n_layer=2, n_head=4, bos_token_id=96,
                          eos_token_id=96, **change)
    hf = GPT2LMHeadModel(config).eval()
    _perturb(hf, 1)
    hf.save_pretrained(tmp_path)
    model = load_model(str(tmp_path), "auto", torch.float32)
    assert type(model).__name__ == "HFCausalLM"
    ids = torch.randint(0, 97, (2, 32), generator=torch.Generator().manual_seed(2))
    assert _max_rel(_native_token_nll(model, ids), _hf_token_nll(hf, ids)) <= FP32_RTOL
    from fastppl.errors import FastpplError
    with pytest.raises(FastpplError, match="--backend hf"):
        load_model(str(tmp_path), "native", torch.float32)


# ------------------------------------------------------------------------- pipeline vs brute force
def _evaluate(model, tokenizer_dir, text_path, **kwargs):
    config = EvalConfig(model=str(model), data=[str(text_path)], tokenizer=str(tokenizer_dir), device="cpu",
                        dtype="fp32", quiet=True, per_token="unused.npy", **kwargs)
    result = evaluate(config)
    return result, result.per_token


def _brute_force(hf, stream: list[int], pairs, token_of_target) -> np.ndarray:
    """Per-token NLL (NaN where unscored): for each (start, j), HF on stream[start:j], last position."""
    n_tokens = max(token_of_target(len(stream) - 1), 0) + 1
    out = np.full(n_tokens, np.nan)
    for start, j in pairs:
        with torch.no_grad():
            logits = hf(torch.tensor([stream[start:j]])).logits[0, -1].double()
        assert np.isnan(out[token_of_target(j)])
        out[token_of_target(j)] = -torch.log_softmax(logits, -1)[stream[j]].item()
    return out


@pytest.fixture(scope="module")
def short_text(tmp_path_factory, tokenizer_dir):
    path = tmp_path_factory.mktemp("text") / "short.txt"
    path.write_text(TEXT)
    ids = AutoTokenizer.from_pretrained(str(tokenizer_dir))(TEXT, add_special_tokens=False)["input_ids"]
    assert 40 < len(ids) < 60
    return path, ids


def _assert_matches(per_token: np.ndarray, reference: np.ndarray) -> None:
    assert per_token.shape == reference.shape
    assert np.array_equal(np.isnan(per_token), np.isnan(reference)), "scored positions differ"
    scored = ~np.isnan(reference)
    assert np.max(np.abs(per_token[scored] - reference[scored]) / np.abs(reference[scored])) <= FP32_RTOL


@pytest.mark.parametrize("ctx", [8, 13])
def test_chunked_equals_brute_force_hf(hf_checkpoints, tokenizer_dir, short_text, ctx):
    hf, root = hf_checkpoints
    path, ids = short_text
    bos = hf.config.eos_token_id                                # GPT-2's <|endoftext|>
    result, per_token = _evaluate(root / "safetensors", tokenizer_dir, path, ctx=ctx, batch_size=3)
    reference = _brute_force(hf, [bos] + ids, lm_eval_rolling_pairs(len(ids), ctx), lambda j: j - 1)
    assert result["tokens_scored"] == len(ids) and not np.isnan(per_token).any()
    _assert_matches(per_token, reference)
    assert result["nll_sum"] == pytest.approx(reference.sum(), rel=FP32_RTOL)


@pytest.mark.parametrize("ctx, stride, bos", [(8, 3, False), (8, 8, False), (10, 1, False), (8, 4, True),
                                              (9, None, False)])   # None: the default, ctx // 2
def test_sliding_equals_brute_force_hf(hf_checkpoints, tokenizer_dir, short_text, ctx, stride, bos):
    hf, root = hf_checkpoints
    path, ids = short_text
    stream = [hf.config.eos_token_id] + ids if bos else ids
    result, per_token = _evaluate(root / "bin", tokenizer_dir, path, ctx=ctx, window="sliding", stride=stride,
                                  bos=bos, batch_size=2)
    assert result["stride"] == (stride or ctx // 2)
    reference = _brute_force(hf, stream, hf_guide_pairs(len(stream), ctx, stride or ctx // 2),
                             (lambda j: j - 1) if bos else (lambda j: j))
    _assert_matches(per_token, reference)
    assert result["tokens_scored"] == int((~np.isnan(reference)).sum())
    assert result["nll_sum"] == pytest.approx(np.nansum(reference), rel=FP32_RTOL)


@pytest.mark.parametrize("window", ["chunked", "sliding"])
def test_backend_hf_gives_the_native_result(hf_checkpoints, tokenizer_dir, short_text, window):
    _, root = hf_checkpoints
    path, _ = short_text
    kwargs = dict(ctx=16, window=window, stride=5 if window == "sliding" else None)
    native, native_tokens = _evaluate(root / "safetensors", tokenizer_dir, path, backend="native", **kwargs)
    via_hf, hf_tokens = _evaluate(root / "safetensors", tokenizer_dir, path, backend="hf", **kwargs)
    assert native["tokens_scored"] == via_hf["tokens_scored"]
    assert via_hf["nll_sum"] == pytest.approx(native["nll_sum"], rel=FP32_RTOL)
    np.testing.assert_allclose(hf_tokens, native_tokens, rtol=FP32_RTOL)
    assert json.loads(json.dumps(via_hf["config"]))["backend"] == "hf"
    assert via_hf["backend"] == "transformers (--backend hf)" and native["backend"] == "native"   # what ran
