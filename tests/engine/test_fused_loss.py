"""The fused linear + cross-entropy kernel (engine/fused_loss.py) against a float64 reference, on the CPU in
Triton's interpreter (conftest.py sets TRITON_INTERPRET=1), through both of its load paths: tensor descriptors
(TMA on Hopper) and pointer loads; on a GPU machine the same tests run on the GPU (`pytest -m gpu`). Tolerance:
every row's NLL within 2e-5 nats of the reference, in fp32 and fp16 alike: the reference sees the same rounded
inputs, so this is the kernel's fp32 arithmetic alone (measured ~1e-7 relative). A norm-relative bound of 2e-3 let
a kernel without its vocabulary-tail mask pass."""
import os

import pytest
import torch
import torch.nn.functional as F

fused_loss = pytest.importorskip("fastppl.engine.fused_loss")
if fused_loss.triton is None or (not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"):
    pytest.skip("needs triton, and a GPU or TRITON_INTERPRET=1", allow_module_level=True)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = [pytest.mark.gpu] if torch.cuda.is_available() else []
MAX_ABS_ERROR = 2e-5


def _reference(h, w, t, b):
    return F.cross_entropy(F.linear(h.double(), w.double(), None if b is None else b.double()), t, reduction="none")


@pytest.mark.parametrize("tma", [True, False])
# 16-bit as fp16: the interpreter has no bf16 arithmetic (numpy), and the kernel's 16-bit path is one path
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n,c,v,bias", [(130, 64, 300, False), (70, 40, 257, True), (5, 72, 512, False)])
def test_fused_loss_matches_float64_reference(tma, dtype, n, c, v, bias):
    g = torch.Generator().manual_seed(n * v + c)
    h = torch.randn(n, c, generator=g).to(dtype).to(DEVICE)
    w = (0.3 * torch.randn(v, c, generator=g)).to(dtype).to(DEVICE)
    b = torch.randn(v, generator=g).to(dtype).to(DEVICE) if bias else None
    t = torch.randint(0, v, (n,), generator=g).to(DEVICE)
    out = fused_loss.fused_token_nll(h, w, t, b, block_m=32, block_n=64, block_k=32, tma=tma)
    ref = _reference(h, w, t, b)
    assert out.dtype == torch.float32 and out.shape == (n,)
    assert (out.double() - ref).abs().max().item() <= MAX_ABS_ERROR


@pytest.mark.skipif(DEVICE != "cuda", reason="real shapes with the default tiles: minutes in the interpreter")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,c,v,bias", [(1000, 768, 50257, False), (333, 64, 1000, True), (4097, 128, 50304, False),
                                        (130, 40, 257, True)])
def test_default_tiles_at_real_shapes_match_float64_reference(dtype, n, c, v, bias):
    """GPT-2's vocabulary and width, ragged row counts, bf16 (which the interpreter lacks); every row within
    1e-4 nats: longer dot products than the CPU cases, the same fp32 arithmetic."""
    g = torch.Generator(device="cuda").manual_seed(n + v)
    h = torch.randn(n, c, device="cuda", generator=g).to(dtype)
    w = (0.05 * torch.randn(v, c, device="cuda", generator=g)).to(dtype)
    b = torch.randn(v, device="cuda", generator=g).to(dtype) if bias else None
    t = torch.randint(0, v, (n,), device="cuda", generator=g)
    out = fused_loss.fused_token_nll(h, w, t, b)
    assert not torch.isnan(out).any()
    assert (out.double() - _reference(h, w, t, b)).abs().max().item() <= 1e-4


def test_descriptors_only_where_they_pay_and_the_alignment_allows():
    """Bulk copies need 16-byte row strides: 12 fp16 columns (24 bytes) take the pointer path, and still
    give the right answer; 16 columns take descriptors; fp32 inputs never do (20x slower on the H200)."""
    h = torch.randn(40, 12, device=DEVICE).half()
    w = torch.randn(100, 12, device=DEVICE).half()
    assert not fused_loss._tma_fits(h, w)
    assert not fused_loss._tma_fits(torch.randn(40, 16, device=DEVICE), torch.randn(100, 16, device=DEVICE))
    fits = fused_loss._tma_fits(torch.randn(40, 16, device=DEVICE).half(), torch.randn(100, 16, device=DEVICE).half())
    assert fits == (fused_loss.TensorDescriptor is not None and fused_loss._has_tma(torch.device(DEVICE)))
    t = torch.randint(0, 100, (40,), device=DEVICE)
    out = fused_loss.fused_token_nll(h, w, t, block_m=32, block_n=64, block_k=32)
    assert (out.double() - _reference(h, w, t, None)).abs().max().item() <= MAX_ABS_ERROR


def test_no_rows_launches_nothing():
    w = torch.randn(100, 16, device=DEVICE).half()
    out = fused_loss.fused_token_nll(torch.empty(0, 16, device=DEVICE).half(), w,
                                     torch.empty(0, dtype=torch.long, device=DEVICE))
    assert out.shape == (0,) and out.dtype == torch.float32


@pytest.mark.slow
def test_compiled_op_with_a_bias_equals_the_eager_kernel():
    """Under torch.compile the kernel is one opaque custom op, with or without a bias (a bias used to bypass
    the op and let Dynamo trace the launch and its host-side descriptors)."""
    fused_loss.register_compiled_op()
    g = torch.Generator().manual_seed(3)
    h, w = torch.randn(40, 16, generator=g).to(DEVICE), torch.randn(100, 16, generator=g).to(DEVICE)
    b, t = torch.randn(100, generator=g).to(DEVICE), torch.randint(0, 100, (40,), generator=g).to(DEVICE)
    compiled = torch.compile(fused_loss.fused_token_nll_op, fullgraph=True)
    assert torch.equal(compiled(h, w, t, b), fused_loss.fused_token_nll(h, w, t, b))


@pytest.mark.parametrize("tma", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_vocabulary_segments_agree_and_a_row_does_not_depend_on_its_batch(tma):
    """The vocabulary split over several programs per row block (and combined after) against one program per row
    block, within the kernel's fp32 tolerance; and each row's NLL bit for bit the same when the batch holds other
    rows (the segment count is fixed by the vocabulary, not the row count)."""
    g = torch.Generator().manual_seed(5)
    n, c, v = 97, 64, 700   # 10 whole tiles of 64 and a partial one: the last segment takes the partial tile
    h = torch.randn(n, c, generator=g).to(torch.float16).to(DEVICE)
    w = (0.3 * torch.randn(v, c, generator=g)).to(torch.float16).to(DEVICE)
    t = torch.randint(0, v, (n,), generator=g).to(DEVICE)
    tiles = dict(block_m=32, block_n=64, block_k=32, tma=tma)
    assert fused_loss.vocabulary_segments(v, 64) == fused_loss.VOCABULARY_SEGMENTS > 1
    split = fused_loss.fused_token_nll(h, w, t, **tiles)
    whole = fused_loss.fused_token_nll(h, w, t, segments=1, **tiles)
    assert (split.double() - _reference(h, w, t, None)).abs().max().item() <= MAX_ABS_ERROR
    assert (split - whole).abs().max().item() <= MAX_ABS_ERROR
    rows = torch.tensor([3, 40, 41, 96]).to(DEVICE)
    alone = fused_loss.fused_token_nll(h[rows], w, t[rows], **tiles)
    if DEVICE == "cuda":
        assert torch.equal(alone, split[rows])
    else:   # the interpreter's tl.dot is numpy's, whose products may round a row's last bit by the rows beside it
        assert (alone - split[rows]).abs().max().item() <= 2e-6
    assert fused_loss.vocabulary_segments(50, 64) == 1 and fused_loss.vocabulary_segments(50257, 256) == 9


@pytest.mark.slow
def test_pointer_offsets_in_int64_where_int32_would_wrap(monkeypatch):
    """Row x stride past 2^31 elements wrapped in int32 on the pointer path (a wrong read, or an illegal access):
    such shapes take int64 offsets. The int64 variant is checked here on a small input, forced on."""
    assert not fused_loss.needs_64bit_offsets(65_536, 768, 50_257, 768)          # GPT-2, batch 64 x 1024
    assert fused_loss.needs_64bit_offsets(2_796_203, 768, 50_257, 768)           # fp32 GPT-2 at 2,731 x 1024
    assert fused_loss.needs_64bit_offsets(1_000, 4_096, 524_288, 4_096)          # a vocabulary x width past it
    g = torch.Generator().manual_seed(3)
    h = torch.randn(70, 40, generator=g).to(DEVICE)
    w = (0.3 * torch.randn(257, 40, generator=g)).to(DEVICE)
    b = torch.randn(257, generator=g).to(DEVICE)
    t = torch.randint(0, 257, (70,), generator=g).to(DEVICE)
    int32 = fused_loss.fused_token_nll(h, w, t, b, block_m=32, block_n=64, block_k=32, tma=False)
    monkeypatch.setattr(fused_loss, "needs_64bit_offsets", lambda *shape: True)
    int64 = fused_loss.fused_token_nll(h, w, t, b, block_m=32, block_n=64, block_k=32, tma=False)
    assert torch.equal(int64, int32)
    assert (int64.double() - _reference(h, w, t, b)).abs().max().item() <= MAX_ABS_ERROR
