"""GPU checks (pytest -m gpu on the H200); skipped where there is no CUDA device.
Tolerances: fused loss vs float64 reference on the same inputs <= 1e-5 relative for fp32 inputs and
<= 2e-3 for bf16 (the reference sees the same bf16-rounded inputs, so this is arithmetic error only);
bf16 scoring vs fp32 scoring of the same model: mean NLL within 0.5 %."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-3), (torch.float16, 2e-3)])
@pytest.mark.parametrize("n,c,v,bias", [(1000, 768, 50257, False), (333, 64, 1000, True), (4097, 128, 50304, False)])
def test_fused_loss_matches_float64_reference(dtype, tolerance, n, c, v, bias):
    from fastppl.engine.fused_loss import fused_token_nll
    g = torch.Generator(device="cuda").manual_seed(n + v)
    h = torch.randn(n, c, device="cuda", generator=g).to(dtype)
    w = (0.05 * torch.randn(v, c, device="cuda", generator=g)).to(dtype)
    b = torch.randn(v, device="cuda", generator=g).to(dtype) if bias else None
    t = torch.randint(0, v, (n,), device="cuda", generator=g)
    ref = F.cross_entropy(F.linear(h.double(), w.double(), None if b is None else b.double()), t, reduction="none")
    out = fused_token_nll(h, w, t, b)
    assert not torch.isnan(out).any()
    assert _rel(out, ref) <= tolerance


def _eval(tmp_path, tokenizer_dir, shakespeare, **overrides):
    from fastppl.config import EvalConfig
    from fastppl.pipeline import evaluate
    options = dict(model="random:gpt2", data=[str(shakespeare)], tokenizer=str(tokenizer_dir), split="val",
                   device="cuda", quiet=True, batch_size=16)
    options.update(overrides)
    return evaluate(EvalConfig(**options))


def test_fast_path_equals_plain_path(tmp_path, tokenizer_dir, shakespeare):
    plain = _eval(tmp_path, tokenizer_dir, shakespeare, dtype="fp32", loss="chunked", compile="off")
    fused = _eval(tmp_path, tokenizer_dir, shakespeare, dtype="fp32", loss="fused", compile="off")
    compiled = _eval(tmp_path, tokenizer_dir, shakespeare, dtype="fp32", loss="fused", compile="on", batch_size=8)
    assert plain["tokens_scored"] == fused["tokens_scored"] == 36059
    assert fused["nll_sum"] == pytest.approx(plain["nll_sum"], rel=1e-6)
    assert compiled["nll_sum"] == pytest.approx(plain["nll_sum"], rel=1e-6)


def test_auto_batch_size_matches_fixed(tmp_path, tokenizer_dir, shakespeare):
    fixed = _eval(tmp_path, tokenizer_dir, shakespeare, dtype="bf16")
    auto = _eval(tmp_path, tokenizer_dir, shakespeare, dtype="bf16", batch_size="auto")
    assert auto["batch_size"] >= 8
    assert auto["nll_sum"] == pytest.approx(fixed["nll_sum"], rel=1e-5)
