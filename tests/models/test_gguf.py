"""GGUF files as models: tiny random Llama, Qwen2, Qwen3 and GPT-2 checkpoints written with gguf's own writer
(llama.cpp's layout: q and k rows permuted for Llama only, GPT-2's matrices as (out, in), Qwen3's head_dim as
attention.key_length) load natively to the weights transformers' GGUF loader gives and score as transformers does in
fp32; the tokenizer's ids are transformers'; bad files are one line."""
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

gguf = pytest.importorskip("gguf")
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from fastppl.engine.score import make_score_fn  # noqa: E402
from fastppl.errors import FastpplError  # noqa: E402
from fastppl.models import load_model  # noqa: E402
from fastppl.models.gguf import unpermute_rope_rows  # noqa: E402
from fastppl.models.llama import state_dict_to_hf as llama_state_dict_to_hf  # noqa: E402
from fastppl.models.registry import spec_of  # noqa: E402

FP32_RTOL = 1e-5
Q = gguf.GGMLQuantizationType
TEXT = ("First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n\n"
        "First Citizen:\nYou are all resolved rather to die than to famish?\n")


def _tiny_bpe(shakespeare):
    """A byte-level BPE of 400 tokens trained on TinyShakespeare, with <|endoftext|> as its special token."""
    return _tiny_bpe_of(shakespeare.read_text()[:100_000])


def _tiny_bpe_of(text: str):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator([text], trainer)
    return tokenizer


def _add_tokenizer(writer, tokenizer) -> None:
    state = json.loads(tokenizer.to_str())["model"]
    tokens = sorted(state["vocab"], key=state["vocab"].get)
    merges = [m if isinstance(m, str) else " ".join(m) for m in state["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_merges(merges)
    writer.add_token_types([3 if t == "<|endoftext|>" else 1 for t in tokens])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(0)
    writer.add_add_bos_token(False)


def _tensor(writer, name: str, values: torch.Tensor, qtype) -> None:
    array = values.detach().float().numpy()
    if qtype in (Q.F32, Q.F16):
        writer.add_tensor(name, array.astype(np.float32 if qtype == Q.F32 else np.float16))
    else:
        writer.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)


def _permute(weights: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's convert_hf_to_gguf permute of Llama's q and k rows."""
    return weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:]).swapaxes(1, 2).reshape(
        weights.shape)


LLAMA_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
               "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
               "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
               "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}   # the last two: Qwen3's


def _matrix_type(name: str, layer: int):
    """A mix of stored types, so that each model holds quantized, half and full precision matrices."""
    return [Q.Q8_0, Q.F16, Q.Q4_0, Q.F32][(layer + len(name)) % 4]


def _write_llama_family(path, hf_model, architecture: str, tokenizer, matrix_type=None, rope_freqs=None,
                        metadata=None) -> None:
    config = hf_model.config
    writer = gguf.GGUFWriter(str(path), architecture)
    for key, value in (metadata or {}).items():
        (writer.add_string if isinstance(value, str) else writer.add_float32)(key, value)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if architecture == "qwen3":   # llama.cpp's converter: config.json's head_dim as the key and value length
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    else:
        writer.add_rope_dimension_count(head_dim)
    _add_tokenizer(writer, tokenizer)
    state = hf_model.state_dict()
    matrix_type = matrix_type or _matrix_type
    if rope_freqs is not None:
        _tensor(writer, "rope_freqs.weight", rope_freqs, Q.F32)
    _tensor(writer, "token_embd.weight", state["model.embed_tokens.weight"], matrix_type("token_embd", 0))
    _tensor(writer, "output_norm.weight", state["model.norm.weight"], Q.F32)
    if not config.tie_word_embeddings:
        _tensor(writer, "output.weight", state["lm_head.weight"], Q.F16)
    for layer in range(config.num_hidden_layers):
        for hf_part, gguf_part in LLAMA_NAMES.items():
            for kind in ("weight", "bias"):
                values = state.get(f"model.layers.{layer}.{hf_part}.{kind}")
                if values is None:
                    continue
                if architecture == "llama" and gguf_part in ("attn_q", "attn_k"):
                    heads = config.num_attention_heads if gguf_part == "attn_q" else config.num_key_value_heads
                    values = _permute(values, heads)
                qtype = matrix_type(gguf_part, layer) if values.dim() == 2 else Q.F32
                _tensor(writer, f"blk.{layer}.{gguf_part}.{kind}", values, qtype)
    _finish(writer)


def _finish(writer) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _perturbed(hf_model):
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in hf_model.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.05)
    return hf_model.eval()


def _hf_random(model_type: str, **settings):
    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, vocab_size=400, **settings)
    return _perturbed(AutoModelForCausalLM.from_config(config))


LLAMA_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5)


@pytest.fixture(scope="module")
def tiny_tokenizer(shakespeare):
    return _tiny_bpe(shakespeare)


@pytest.fixture(scope="module")
def llama_gguf(tmp_path_factory, tiny_tokenizer):
    original = _hf_random("llama", tie_word_embeddings=False, **LLAMA_SHAPE)
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf"
    _write_llama_family(path, original, "llama", tiny_tokenizer)
    return path, original


@pytest.fixture(scope="module")
def qwen2_gguf(tmp_path_factory, tiny_tokenizer):
    original = _hf_random("qwen2", tie_word_embeddings=True, **LLAMA_SHAPE)
    path = tmp_path_factory.mktemp("gguf") / "tiny-qwen2.gguf"
    _write_llama_family(path, original, "qwen2", tiny_tokenizer)
    return path, original


# transformers' GGUF loader reads no attention.key_length for qwen3 and builds Qwen3Config's default head_dim,
# 128 (every Qwen3 release's): the files it is the reference for have that head_dim, unlike hidden / heads (16)
QWEN3_SHAPE = dict(LLAMA_SHAPE, head_dim=128, rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0})


def _qwen3_gguf(path, tokenizer, tied: bool, matrix_type=None, **shape):
    original = _hf_random("qwen3", tie_word_embeddings=tied, **{**QWEN3_SHAPE, **shape})
    _write_llama_family(path, original, "qwen3", tokenizer, matrix_type)
    return path, original


@pytest.fixture(scope="module")
def qwen3_gguf(tmp_path_factory, tiny_tokenizer):
    return _qwen3_gguf(tmp_path_factory.mktemp("gguf") / "tiny-qwen3.gguf", tiny_tokenizer, tied=False)


def _write_gpt2(path, hf_model, tokenizer) -> None:
    config = hf_model.config
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_block_count(config.n_layer)
    writer.add_context_length(config.n_positions)
    writer.add_embedding_length(config.n_embd)
    writer.add_feed_forward_length(4 * config.n_embd)
    writer.add_head_count(config.n_head)
    writer.add_layer_norm_eps(config.layer_norm_epsilon)
    _add_tokenizer(writer, tokenizer)
    state = hf_model.state_dict()
    names = {"ln_1": "attn_norm", "attn.c_attn": "attn_qkv", "attn.c_proj": "attn_output", "ln_2": "ffn_norm",
             "mlp.c_fc": "ffn_up", "mlp.c_proj": "ffn_down"}
    _tensor(writer, "token_embd.weight", state["transformer.wte.weight"], Q.Q8_0)
    _tensor(writer, "position_embd.weight", state["transformer.wpe.weight"], Q.F32)
    _tensor(writer, "output_norm.weight", state["transformer.ln_f.weight"], Q.F32)
    _tensor(writer, "output_norm.bias", state["transformer.ln_f.bias"], Q.F32)
    for layer in range(config.n_layer):
        for hf_part, gguf_part in names.items():
            for kind in ("weight", "bias"):
                values = state[f"transformer.h.{layer}.{hf_part}.{kind}"]
                if values.dim() == 2:   # Conv1D (in, out) -> llama.cpp's (out, in)
                    _tensor(writer, f"blk.{layer}.{gguf_part}.{kind}", values.t(), _matrix_type(gguf_part, layer))
                else:
                    _tensor(writer, f"blk.{layer}.{gguf_part}.{kind}", values, Q.F32)
    _finish(writer)


@pytest.fixture(scope="module")
def gpt2_gguf(tmp_path_factory, tiny_tokenizer):
    # 1024 positions: transformers reads GGUF context_length as n_ctx only, so n_positions keeps its default
    original = _hf_random("gpt2", n_embd=64, n_layer=2, n_head=4, n_positions=1024)
    path = tmp_path_factory.mktemp("gguf") / "tiny-gpt2.gguf"
    _write_gpt2(path, original, tiny_tokenizer)
    return path, original


def _transformers_gguf(path):
    from fastppl.quiet import quiet_transformers
    with quiet_transformers():
        return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=str(path), dtype=torch.float32).eval()


def _hf_token_nll(hf, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        # normalised in float64: torch's fp32 log_softmax over a 50k vocabulary reads about 1e-5 nats low (its sum of
        # exponentials rounds down), a bias the model's fp32 forward does not have
        logits = hf(ids).logits.double()
    return -F.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None])[..., 0].float()


def _native_token_nll(model, ids: torch.Tensor) -> torch.Tensor:
    score = make_score_fn(model, chunk_rows=13)
    with torch.no_grad():
        return score(ids[:, :-1], ids[:, 1:], torch.ones_like(ids[:, :-1], dtype=torch.bool))


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "gpt2"])
def test_a_gguf_loads_to_transformers_weights_and_scores_as_transformers(family, request):
    path, _ = request.getfixturevalue(f"{family}_gguf")
    native = load_model(str(path), "native", torch.float32)
    reference = _transformers_gguf(path)
    ours = spec_of(native).state_dict_to_hf(native)
    theirs = {k: v for k, v in reference.state_dict().items() if not k.endswith((".attn.bias", ".attn.masked_bias"))}
    assert ours.keys() == theirs.keys()
    unequal = [k for k in ours if not torch.equal(ours[k], theirs[k])]
    assert not unequal, unequal[:3]
    ids = torch.randint(0, 400, (2, 48), generator=torch.Generator().manual_seed(2))
    ours_nll, theirs_nll = _native_token_nll(native, ids), _hf_token_nll(reference, ids)
    assert ((ours_nll - theirs_nll).abs() / theirs_nll.abs()).max().item() <= FP32_RTOL


def test_llamas_q_and_k_rows_come_back_in_their_original_order(llama_gguf):
    """Independently of transformers: the F32/F16 q and k of the file, unpermuted, are the model's own."""
    path, original = llama_gguf
    native = load_model(str(path), "native", torch.float32)
    ours = llama_state_dict_to_hf(native)
    for layer in range(2):
        for part in ("q", "k"):
            name = f"model.layers.{layer}.self_attn.{part}_proj.weight"
            qtype = _matrix_type(f"attn_{part}", layer)
            if qtype in (Q.F32, Q.F16):
                expected = original.state_dict()[name]
                assert torch.equal(ours[name], expected.half().float() if qtype == Q.F16 else expected), name
    weights = torch.randn(8 * 6, 5)
    assert torch.equal(unpermute_rope_rows(_permute(weights, 8), 8), weights)


@pytest.mark.parametrize("stored, tied", [("F32", True), ("Q8_0", False)])
def test_a_qwen3_gguf_runs_natively_and_scores_as_transformers(stored, tied, tmp_path, tiny_tokenizer):
    path, _ = _qwen3_gguf(tmp_path / "qwen3.gguf", tiny_tokenizer, tied, lambda *_: Q[stored])
    model = load_model(str(path), "auto", torch.float32)
    assert spec_of(model).name == "qwen3", type(model).__name__   # auto took the native model, not transformers'
    config = model.config
    assert (config.head_dim, config.rms_norm_eps, config.rope_theta, config.tie_word_embeddings) == (
        128, float(np.float32(1e-5)), 1_000_000.0, tied)   # GGUF stores the epsilon as a float32
    ids = torch.randint(0, 400, (2, 48), generator=torch.Generator().manual_seed(2))
    ours, theirs = _native_token_nll(model, ids), _hf_token_nll(_transformers_gguf(path), ids)
    assert ((ours - theirs).abs() / theirs.abs()).max().item() <= FP32_RTOL


def test_a_qwen3_ggufs_head_dim_is_its_attention_key_length(tmp_path, tiny_tokenizer):
    """A head_dim neither hidden / heads (16) nor the 128 transformers' GGUF loader assumes for every qwen3 file:
    the native model reads the file's key length and scores as the checkpoint the file was written from."""
    path, original = _qwen3_gguf(tmp_path / "qwen3.gguf", tiny_tokenizer, True, lambda *_: Q.F32, head_dim=32)
    native = load_model(str(path), "native", torch.float32)
    assert native.config.head_dim == 32
    ids = torch.randint(0, 400, (2, 48), generator=torch.Generator().manual_seed(2))
    ours, theirs = _native_token_nll(native, ids), _hf_token_nll(original, ids)
    assert ((ours - theirs).abs() / theirs.abs()).max().item() <= FP32_RTOL


def _llama3_rope_freqs(theta: float, head_dim: int, rope: dict) -> torch.Tensor:
    """llama.cpp's convert_hf_to_gguf: Llama 3's RoPE scaling as one divisor per frequency (rope_freqs)."""
    import math
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    original = rope["original_max_position_embeddings"]
    low, high = original / rope["low_freq_factor"], original / rope["high_freq_factor"]
    divisors = []
    for freq in freqs.tolist():
        wavelength = 2 * math.pi / freq
        if wavelength < high:
            divisors.append(1.0)
        elif wavelength > low:
            divisors.append(rope["factor"])
        else:
            low, high = rope["low_freq_factor"], rope["high_freq_factor"]
            smooth = (original / wavelength - low) / (high - low)
            divisors.append(1 / ((1 - smooth) / rope["factor"] + smooth))
    return torch.tensor(divisors, dtype=torch.float32)


def test_llama3_rope_factors_become_its_rope_scaling(tmp_path, tiny_tokenizer):
    rope = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192, "rope_theta": 500000.0}
    original = _hf_random("llama", tie_word_embeddings=True, rope_parameters=rope, **LLAMA_SHAPE)
    divisors = _llama3_rope_freqs(500000.0, 16, rope)
    assert divisors.min() == 1.0 and divisors.max() == 32.0 and len(set(divisors.tolist())) > 2   # all three regimes
    path = tmp_path / "llama3.gguf"
    _write_llama_family(path, original, "llama", tiny_tokenizer, lambda *_: Q.F32, divisors)
    native = load_model(str(path), "native", torch.float32)
    assert native.config.rope_type == "llama3" and native.config.rope_factor == 32.0
    ids = torch.randint(0, 400, (2, 48), generator=torch.Generator().manual_seed(2))
    ours, theirs = _native_token_nll(native, ids), _hf_token_nll(original, ids)
    assert ((ours - theirs).abs() / theirs.abs()).max().item() <= FP32_RTOL
    _write_llama_family(tmp_path / "odd.gguf", original, "llama", tiny_tokenizer, lambda *_: Q.F32, divisors * 1.5)
    with pytest.raises(FastpplError, match="RoPE frequency factors"):
        load_model(str(tmp_path / "odd.gguf"), "native", torch.float32)
    # transformers' GGUF loader reads no RoPE scaling: it would score the unscaled model
    with pytest.raises(FastpplError, match=r"RoPE scaling \(llama3\) would be dropped by transformers' GGUF loader"):
        load_model(str(path), "hf", torch.float32)


def test_a_gguf_whose_rope_scaling_is_not_native_is_refused_not_run_unscaled(tmp_path, tiny_tokenizer):
    original = _hf_random("qwen3", tie_word_embeddings=True, **LLAMA_SHAPE)
    path = tmp_path / "yarn.gguf"
    _write_llama_family(path, original, "qwen3", tiny_tokenizer, lambda *_: Q.F32,
                        metadata={"qwen3.rope.scaling.type": "yarn", "qwen3.rope.scaling.factor": 4.0})
    for backend in ("auto", "hf"):
        with pytest.raises(FastpplError, match=r"RoPE scaling \(yarn\) would be dropped"):
            load_model(str(path), backend, torch.float32)


def test_the_run_dtype_is_the_dequantized_fp32_values_rounded(llama_gguf):
    path, _ = llama_gguf
    full = llama_state_dict_to_hf(load_model(str(path), "native", torch.float32))
    half = llama_state_dict_to_hf(load_model(str(path), "native", torch.bfloat16))
    assert all(half[k].dtype == torch.bfloat16 and torch.equal(half[k], full[k].bfloat16()) for k in full)


def test_backend_hf_runs_transformers_gguf_loader(qwen2_gguf):
    path, _ = qwen2_gguf
    model = load_model(str(path), "hf", torch.float32)
    assert type(model).__name__ == "HFCausalLM" and model.why == "--backend hf"


def test_the_tokenizer_is_transformers_and_equals_the_original(llama_gguf, tiny_tokenizer):
    from fastppl.data.tokenize import load_tokenizer
    path, _ = llama_gguf
    ours = load_tokenizer(str(path))
    theirs = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=str(path))
    text = TEXT + " <|endoftext|> 123 ümlaut"
    ids = ours.encode(text).tolist()
    assert ids == theirs(text, add_special_tokens=False)["input_ids"] == tiny_tokenizer.encode(text).ids
    assert (ours.bos_id, ours.eos_id, ours.vocab_size, ours.default_prefix()) == (0, 0, 400, None)


def _eval(model, text, report, *extra) -> dict:
    from fastppl.cli import main
    assert main(["eval", "--model", str(model), "--data", str(text), "--device", "cpu", "--ctx", "32", "--quiet",
                 "--json", str(report), *extra]) == 0
    return json.loads(report.read_text())


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_eval_of_a_gguf_from_the_command_line_equals_transformers(family, request, tmp_path):
    path, _ = request.getfixturevalue(f"{family}_gguf")
    (tmp_path / "text.txt").write_text(TEXT * 3)
    native = _eval(path, tmp_path / "text.txt", tmp_path / "native.json")
    hf = _eval(path, tmp_path / "text.txt", tmp_path / "hf.json", "--backend", "hf")
    assert native["backend"] == "native" and hf["backend"].startswith("transformers")
    assert native["tokens_scored"] == hf["tokens_scored"] == 258
    assert abs(native["nll_sum"] - hf["nll_sum"]) <= FP32_RTOL * hf["nll_sum"]


def _patched(source, destination, offset: int, data: bytes):
    content = bytearray(source.read_bytes())
    content[offset:offset + len(data)] = data
    destination.write_bytes(bytes(content))
    return destination


def _type_id_offset(content: bytes, tensor: bytes) -> int:
    """Where the type id of a 2-d tensor lies in the tensor table: after its name, n_dims and two dims."""
    return content.index(len(tensor).to_bytes(8, "little") + tensor) + 8 + len(tensor) + 4 + 16


def _bad_files(llama_path, directory):
    content = llama_path.read_bytes()
    type_at = _type_id_offset(content, b"token_embd.weight")
    mamba = directory / "mamba.gguf"
    writer = gguf.GGUFWriter(str(mamba), "mamba")
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    _finish(writer)
    (directory / "header-cut.gguf").write_bytes(content[:2000])
    (directory / "data-cut.gguf").write_bytes(content[:-100])
    return {
        "header-cut.gguf": "ends inside its GGUF header; the file is truncated",
        "data-cut.gguf": "runs past the end of the file",
        "magic.gguf": ("not a GGUF file", _patched(llama_path, directory / "magic.gguf", 0, b"GGUX")),
        "type99.gguf": ("GGML type id 99",
                        _patched(llama_path, directory / "type99.gguf", type_at, bytes([99, 0, 0, 0]))),
        "iq2.gguf": ("GGML type IQ2_XXS", _patched(llama_path, directory / "iq2.gguf", type_at, bytes([16, 0, 0, 0]))),
        "mamba.gguf": "GGUF architecture 'mamba' is not one fastppl runs",
    }


def test_bad_gguf_files_are_one_line_and_exit_2(llama_gguf, tmp_path, capsys):
    from fastppl.cli import main
    path, _ = llama_gguf
    (tmp_path / "text.txt").write_text(TEXT)
    for name, expected in _bad_files(path, tmp_path).items():
        message = expected[0] if isinstance(expected, tuple) else expected
        code = main(["eval", "--model", str(tmp_path / name), "--data", str(tmp_path / "text.txt"), "--device", "cpu",
                     "--quiet", "--json", str(tmp_path / "report.json")])
        err = capsys.readouterr().err
        assert code == 2 and err.startswith("fastppl: error: ") and err.count("\n") == 1, (name, err)
        assert message in err, (name, err)
        assert not (tmp_path / "report.json").exists()


def test_a_pre_tokenizer_fastppl_does_not_reproduce_is_refused_and_the_users_tokenizer_used(llama_gguf, tmp_path,
                                                                                              tiny_tokenizer, capsys):
    """tokenizer.ggml.pre 'afmoe' (llama.cpp's digits grouped by a rule of its own): one line naming it, else with
    --tokenizer the run reads that tokenizer."""
    from fastppl.cli import main
    path, _ = llama_gguf
    afmoe = _patched(path, tmp_path / "afmoe.gguf", path.read_bytes().index(b"gpt-2"), b"afmoe")
    (tmp_path / "text.txt").write_text(TEXT * 3)
    code = main(["eval", "--model", str(afmoe), "--data", str(tmp_path / "text.txt"), "--device", "cpu", "--quiet",
                 "--json", str(tmp_path / "report.json")])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("fastppl: error: ") and err.count("\n") == 1, err
    assert "tokenizer.ggml.pre 'afmoe'" in err and "--tokenizer" in err and not (tmp_path / "report.json").exists()
    (tmp_path / "tokenizer").mkdir()
    tiny_tokenizer.save(str(tmp_path / "tokenizer" / "tokenizer.json"))
    report = _eval(afmoe, tmp_path / "text.txt", tmp_path / "report.json", "--tokenizer", str(tmp_path / "tokenizer"))
    assert report["tokens_scored"] == 258


def test_a_missing_gguf_file_is_one_line(tmp_path):
    with pytest.raises(FastpplError, match="no such file"):
        load_model(str(tmp_path / "absent.gguf"), "auto", torch.float32)


def test_a_hub_gguf_is_named_owner_repo_colon_file(monkeypatch):
    import huggingface_hub

    from fastppl.config import gguf_spec
    assert gguf_spec("owner/repo:model-Q4_K_M.gguf") == ("owner/repo", "model-Q4_K_M.gguf")
    assert gguf_spec("models/x.gguf") == (None, "models/x.gguf")
    assert gguf_spec("owner/repo") is None and gguf_spec("checkpoints/llama") is None
    def unreachable(repo, filename):
        raise OSError(f"cannot reach the hub for {repo}/{filename}\nsecond line")
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", unreachable)
    with pytest.raises(FastpplError, match="the hub did not serve model.gguf of owner/repo"):
        load_model("owner/repo:model.gguf", "auto", torch.float32)


def test_a_gguf_reference_of_another_tokenizer_is_refused(llama_gguf, tmp_path, shakespeare):
    """A GGUF's own tokenizer is in its metadata: as --reference-model it must be the run's, token for token (the
    same vocabulary size is not enough)."""
    from fastppl.config import EvalConfig
    from fastppl.pipeline import evaluate
    path, original = llama_gguf
    text = tmp_path / "text.txt"
    text.write_text(shakespeare.read_text()[:600])
    other_tokenizer = _tiny_bpe_of(shakespeare.read_text()[200_000:300_000])   # 400 tokens too, other merges
    other = tmp_path / "other-tokenizer.gguf"
    _write_llama_family(other, original, "llama", other_tokenizer)
    same = tmp_path / "same.gguf"
    same.write_bytes(path.read_bytes())

    def run(reference):
        return evaluate(EvalConfig(model=str(path), reference_model=str(reference), data=[str(text)], ctx=32,
                                   device="cpu", quiet=True))
    assert run(same).divergence["kld_mean"] == pytest.approx(0, abs=1e-9)
    with pytest.raises(FastpplError, match="has a tokenizer of its own that differs from the run's"):
        run(other)


def _rewritten(source, destination, metadata: dict):
    """A copy of a GGUF with metadata {key: (value, GGUFValueType)} set in place of (or beside) its own."""
    reader = gguf.GGUFReader(str(source))
    writer = gguf.GGUFWriter(str(destination), reader.fields["general.architecture"].contents())
    for key, field in reader.fields.items():
        if not key.startswith("GGUF.") and key != "general.architecture" and key not in metadata:
            writer.add_key_value(key, field.contents(), *field.types[:2])
    for key, (value, value_type) in metadata.items():
        writer.add_key_value(key, value, value_type)
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, np.array(tensor.data), raw_dtype=tensor.tensor_type)
    _finish(writer)
    return destination


def _tensor_field(content: bytes, tensor: bytes, at: int, value: int, size: int) -> bytes:
    """content with a field of a tensor's table entry (at bytes after its name: n_dims 0, dims 4, ...) set."""
    start = content.index(len(tensor).to_bytes(8, "little") + tensor) + 8 + len(tensor) + at
    return content[:start] + value.to_bytes(size, "little") + content[start + size:]


U32, F32_VALUE = gguf.GGUFValueType.UINT32, gguf.GGUFValueType.FLOAT32
# metadata that lies about the tensors, each built into a model (a hang, a traceback or another model's score) before
METADATA_LIES = {
    "a billion blocks": ({"llama.block_count": (10**9, U32)}, "block_count is 1,000,000,000, but the file holds"),
    "2.5 blocks": ({"llama.block_count": (2.5, F32_VALUE)}, "block_count is 2.5, not a positive whole number"),
    "no heads": ({"llama.attention.head_count": (0, U32)}, "head_count is 0, not a positive whole number"),
    "an infinite RoPE base": ({"llama.rope.freq_base": (float("inf"), F32_VALUE)},
                              "freq_base is inf, not a positive finite number"),
    "a RoPE scaling of 0": ({"llama.rope.scaling.type": ("linear", gguf.GGUFValueType.STRING),
                             "llama.rope.scaling.factor": (0.0, F32_VALUE)}, "scaling.factor is 0.0"),
    "an alignment of 7": ({"general.alignment": (7, U32)}, "general.alignment 7 is no power of two"),
}


@pytest.mark.parametrize("lie", list(METADATA_LIES))
def test_gguf_metadata_is_checked_against_the_tensors_before_a_model_is_built(lie, llama_gguf, tmp_path):
    metadata, message = METADATA_LIES[lie]
    path = _rewritten(llama_gguf[0], tmp_path / "lie.gguf", metadata)
    with pytest.raises(FastpplError, match=message):
        load_model(str(path), "native", torch.float32)


@pytest.mark.parametrize("at, value, size", [(12, 1, 4), (16, 0, 8), (16, 4, 8)],
                         ids=["F16 over F32 data", "over the first tensor's data", "unaligned"])
def test_tensor_data_where_the_table_says_no_tensor_lies_is_one_line(at, value, size, llama_gguf, tmp_path):
    """Tensors' data lie one after the other in the table's order, as llama.cpp requires: another type or offset
    makes a tensor overlap or skip data (once scored as another model)."""
    path = tmp_path / "lie.gguf"
    # output_norm: F32, one dimension (its type id 12 bytes after its name, its offset 16), not the first tensor
    path.write_bytes(_tensor_field(llama_gguf[0].read_bytes(), b"output_norm.weight", at, value, size))
    with pytest.raises(FastpplError, match=r"the data of tensor \S+ starts at byte .* where the tensors before"):
        load_model(str(path), "native", torch.float32)
