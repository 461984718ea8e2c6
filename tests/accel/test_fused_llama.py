"""The fused Llama trunk (models/llama_trunk.forward_with_fused_trunk with accel/fused_llama.py's kernels) against the
model's own forward, and each kernel against its plain
module, on the CPU through Triton's interpreter (conftest.py) and on a GPU where there is one. Tolerances: fp32
within 1e-5 relative (summation order only); bf16 within 2e-2 relative on the final hidden states (one rounding
per product instead of two, fp32 RoPE angles)."""
import os

import pytest
import torch
import torch.nn.functional as F
from fused_forward import plain_and_fused, relative_difference

fused_llama = pytest.importorskip("fastppl.accel.fused_llama")
if fused_llama.triton is None or (not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"):
    pytest.skip("needs triton, and a GPU or TRITON_INTERPRET=1", allow_module_level=True)
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = [pytest.mark.gpu] if torch.cuda.is_available() else []


_rel = relative_difference


def _model(dtype=torch.float32, **overrides):
    from fastppl.models.llama import PRESETS, Llama
    import dataclasses
    config = dataclasses.replace(PRESETS["llama-tiny"], **overrides)
    model = Llama(config).to(DEVICE)
    model.init_weights(torch.Generator(device=DEVICE).manual_seed(0))
    g = torch.Generator(device=DEVICE).manual_seed(3)
    with torch.no_grad():   # unit norms and zero biases would hide a weight or bias read from the wrong place
        for name, parameter in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                parameter.add_(0.3 * torch.randn(parameter.shape, device=DEVICE, generator=g))
    return model.eval().to(dtype)


@pytest.mark.parametrize("biases", [False, pytest.param(True, marks=pytest.mark.slow)])
@pytest.mark.parametrize("packed", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_fused_forward_equals_the_plain_forward(biases, packed):
    model = _model(qkv_bias=biases, o_bias=biases, mlp_bias=biases)
    plain, fused = plain_and_fused(model, fused_llama.fuse_llama_trunk, fused_llama.unfuse_llama_trunk, DEVICE,
                                   packed)
    assert _rel(fused, plain) <= 1e-5


def test_rms_norm_kernel_rounds_as_the_module_does():
    from fastppl.models.llama import RMSNorm
    norm = RMSNorm(96, 1e-5).to(DEVICE)
    x = torch.randn(7, 96, device=DEVICE) * 3
    with torch.no_grad():
        norm.weight.normal_(1, 0.2)
        for dtype, tolerance in ((torch.float32, 1e-6), (torch.bfloat16, 1e-2)):
            module = norm.to(dtype)
            assert _rel(fused_llama.rms_norm(x.to(dtype), module.weight, 1e-5), module(x.to(dtype))) <= tolerance


def test_rope_kernel_rotates_q_and_k_and_leaves_v():
    from fastppl.models.llama import apply_rotary
    B, T, n_head, n_kv_head, head_dim = 2, 9, 4, 2, 16
    qkv = torch.randn(B * T, (n_head + 2 * n_kv_head) * head_dim, device=DEVICE)
    angles = torch.arange(T, device=DEVICE)[:, None].float() * torch.rand(head_dim // 2, device=DEVICE)
    angles = torch.cat((angles, angles), -1)
    heads = qkv.view(B, T, -1, head_dim).transpose(1, 2)
    expected = torch.cat([apply_rotary(heads[:, :n_head + n_kv_head], angles.cos(), angles.sin()),
                          heads[:, n_head + n_kv_head:]], dim=1)
    fused_llama.rotate_queries_and_keys_(qkv, angles.cos(), angles.sin(), n_head + n_kv_head, head_dim)
    assert _rel(qkv.view(B, T, -1, head_dim).transpose(1, 2), expected) <= 1e-6


def test_swiglu_kernel_equals_silu_times_up():
    gate_up = torch.randn(5, 2 * 1500, device=DEVICE) * 4   # inner 1500: two column blocks, the second partial
    gate, up = gate_up.split(1500, -1)
    assert _rel(fused_llama.swiglu(gate_up), F.silu(gate) * up) <= 1e-6


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 kernels: GPU only (the interpreter lacks bf16)")
def test_bf16_fused_forward_is_close_to_the_plain_forward():
    model = _model(torch.bfloat16, qkv_bias=True)
    ids = torch.randint(0, 50257, (4, 128), device=DEVICE, generator=torch.Generator(device=DEVICE).manual_seed(1))
    with torch.inference_mode():
        reference = _model(torch.float32, qkv_bias=True)(ids)
        plain = model(ids)
        assert fused_llama.fuse_llama_trunk(model)
        fused = model(ids)
    # no further from the fp32 model than the plain bf16 forward is, give or take
    assert _rel(fused, reference) <= 1.5 * _rel(plain, reference) + 1e-3


def test_qwen3_is_not_fused():
    """The fused trunk has no kernel for Qwen3's per-head q/k norms: its spec offers none, so it runs plain."""
    from fastppl.models.loading import random_native
    assert not fused_llama.fuse_llama_trunk(random_native("qwen3-tiny", 0, DEVICE))


@pytest.mark.parametrize("dtype", [torch.float32] + ([torch.bfloat16] if torch.cuda.is_available() else []))
def test_the_fused_trunk_streamed_a_block_at_a_time_equals_its_resident_forward_bit_for_bit(dtype):
    """The layer-major path runs the fused trunk's split (fastppl.engine.streamed): two batches through each block
    in turn, the blocks copied into two reused buffers, give the resident fused forward's hidden states exactly."""
    from fastppl.engine.score import DeviceBatch
    from fastppl.engine.streamed import StreamedTrunk
    model = _model(dtype, n_layer=3, qkv_bias=True)
    generator = torch.Generator(device=DEVICE).manual_seed(1)
    batches = [torch.randint(0, 50257, (rows, 40), device=DEVICE, generator=generator) for rows in (3, 2)]
    with torch.inference_mode():
        assert fused_llama.fuse_llama_trunk(model)
        resident = [model(ids) for ids in batches]
        fused_llama.unfuse_llama_trunk(model)
        trunk = StreamedTrunk(model, DEVICE, fused_llama.fused_trunk_split(model))
        wave = [DeviceBatch(ids, None, None, None, None, None) for ids in batches]
        streamed = trunk.final_hidden(wave, more_waves=True) + trunk.final_hidden(wave[:1], more_waves=False)
    for got, expected in zip(streamed, resident + resident[:1]):
        assert torch.equal(got, expected)
    assert trunk.blocks.bytes_streamed == 2 * 3 * trunk.blocks.block_bytes   # each block once a wave
