"""GPT-2's fused residual forward (accel/fused_norm.py: products added into the residual stream in place, projection
biases added back by the LayerNorm kernel) against the model's own forward, on the CPU through Triton's
interpreter (conftest.py) and on a GPU where there is one. Tolerances: hidden states within 1e-5 relative in fp32
(summation order only), 5e-3 in fp16 (measured 4.9e-4; leaving the bias sums out gives 1.4)."""
import os

import pytest
import torch
from fused_forward import plain_and_fused, relative_difference

fused_norm = pytest.importorskip("fastppl.accel.fused_norm")
if fused_norm.triton is None or (not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"):
    pytest.skip("needs triton, and a GPU or TRITON_INTERPRET=1", allow_module_level=True)
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = [pytest.mark.gpu] if torch.cuda.is_available() else []


def _model_with_biases(dtype=torch.float32):
    from fastppl.models.loading import random_gpt2
    model = random_gpt2("gpt2-tiny", 0, DEVICE).eval()
    g = torch.Generator(device=DEVICE).manual_seed(3)
    with torch.no_grad():   # GPT-2's initialisation zeroes the biases; a trained model's are not zero
        for block in model.blocks:
            for linear in (block.attn.proj, block.mlp.proj, block.attn.qkv, block.mlp.fc):
                linear.bias.normal_(0, 0.5, generator=g)
    return model.to(dtype)


_rel = relative_difference


@pytest.mark.slow   # Triton's interpreter on the CPU
@pytest.mark.parametrize("packed", [False, True])
def test_fused_forward_equals_the_plain_forward(packed):
    plain, fused = plain_and_fused(_model_with_biases(), fused_norm.fuse_residual_norms,
                                   fused_norm.unfuse_residual_norms, DEVICE, packed)
    assert _rel(fused, plain) <= 1e-5


def test_fused_forward_reads_the_biases_as_they_are_now():
    """The bias sums are taken at each forward, so weights loaded or changed after fusing are used."""
    model = _model_with_biases()
    ids = torch.randint(0, 50257, (2, 16), device=DEVICE, generator=torch.Generator(device=DEVICE).manual_seed(2))
    assert fused_norm.fuse_residual_norms(model)
    with torch.inference_mode():
        before = model(ids)
        bias = model.blocks[0].mlp.proj.bias
        bias.add_(torch.randn(bias.shape, device=DEVICE, generator=torch.Generator(device=DEVICE).manual_seed(4)))
        after = model(ids)
        fused_norm.unfuse_residual_norms(model)
        plain = model(ids)
    assert _rel(before, plain) > 1e-2
    assert _rel(after, plain) <= 1e-5


@pytest.mark.slow   # Triton's interpreter on the CPU
def test_fused_forward_in_half_precision_with_biases_equals_the_plain_forward():
    """16-bit weights with non-zero projection biases: the bias sums are fp32 and added back before each
    LayerNorm, so the stream kept less them must give the plain model's hidden states."""
    model = _model_with_biases(torch.float16)   # fp16: Triton's interpreter has no bf16 arithmetic
    ids = torch.randint(0, 50257, (2, 64), device=DEVICE, generator=torch.Generator(device=DEVICE).manual_seed(6))
    with torch.inference_mode():
        plain = model(ids)
        assert fused_norm.fuse_residual_norms(model)
        fused = model(ids)
        fused_norm.unfuse_residual_norms(model)
    assert _rel(fused, plain) <= 5e-3
