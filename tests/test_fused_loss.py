"""The fused linear + cross-entropy kernel (engine/fused_loss.py) against a float64 reference, on the CPU in
Triton's interpreter (conftest.py sets TRITON_INTERPRET=1), through both of its load paths: tensor descriptors
(TMA on Hopper) and pointer loads. Tolerances: fp32 inputs <= 1e-5 relative, fp16 <= 2e-3 (the reference sees the
same bf16-rounded inputs, so this is the kernel's arithmetic alone); tests/test_gpu.py repeats this on the GPU."""
import os

import pytest
import torch
import torch.nn.functional as F

fused_loss = pytest.importorskip("fastppl.engine.fused_loss")
if fused_loss.triton is None or (not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"):
    pytest.skip("needs triton, and a GPU or TRITON_INTERPRET=1", allow_module_level=True)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _reference(h, w, t, b):
    return F.cross_entropy(F.linear(h.double(), w.double(), None if b is None else b.double()), t, reduction="none")


@pytest.mark.parametrize("tma", [True, False])
# 16-bit as fp16: the interpreter has no bf16 arithmetic (numpy), and the kernel's 16-bit path is one path
@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.float16, 2e-3)])
@pytest.mark.parametrize("n,c,v,bias", [(130, 64, 300, False), (70, 40, 257, True), (5, 72, 512, False)])
def test_fused_loss_matches_float64_reference(tma, dtype, tolerance, n, c, v, bias):
    g = torch.Generator().manual_seed(n * v + c)
    h = torch.randn(n, c, generator=g).to(dtype).to(DEVICE)
    w = (0.3 * torch.randn(v, c, generator=g)).to(dtype).to(DEVICE)
    b = torch.randn(v, generator=g).to(dtype).to(DEVICE) if bias else None
    t = torch.randint(0, v, (n,), generator=g).to(DEVICE)
    out = fused_loss.fused_token_nll(h, w, t, b, block_m=32, block_n=64, block_k=32, tma=tma)
    ref = _reference(h, w, t, b)
    assert out.dtype == torch.float32 and out.shape == (n,)
    assert ((out.double() - ref).norm() / ref.norm()).item() <= tolerance


def test_descriptors_only_where_they_pay_and_the_alignment_allows():
    """Bulk copies need 16-byte row strides: 12 fp16 columns (24 bytes) take the pointer path, and still
    give the right answer; 16 columns take descriptors; fp32 inputs never do (20x slower on the H200)."""
    h = torch.randn(40, 12, device=DEVICE).half()
    w = torch.randn(100, 12, device=DEVICE).half()
    assert not fused_loss._tma_fits(h, w)
    assert not fused_loss._tma_fits(torch.randn(40, 16, device=DEVICE), torch.randn(100, 16, device=DEVICE))
    assert fused_loss._tma_fits(torch.randn(40, 16, device=DEVICE).half(), torch.randn(100, 16, device=DEVICE).half()) == (
        fused_loss.TensorDescriptor is not None and fused_loss._has_tma(torch.device(DEVICE)))
    t = torch.randint(0, 100, (40,), device=DEVICE)
    out = fused_loss.fused_token_nll(h, w, t, block_m=32, block_n=64, block_k=32)
    ref = _reference(h, w, t, None)
    assert ((out.double() - ref).norm() / ref.norm()).item() <= 2e-3
