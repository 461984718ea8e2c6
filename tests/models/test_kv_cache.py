"""The same forward with and without a KV cache: prefill + one token at a time = one full forward."""
import pytest
import torch

from fastppl.decode import padded_mask
from fastppl.models.kv_cache import CacheStep, remove_kv_cache, setup_kv_cache
from fastppl.models.loading import random_native


def _model(preset: str):
    model = random_native(preset).eval()
    with torch.no_grad():   # sharper than the 0.02 init, so that attention is far from uniform
        for name, p in model.named_parameters():
            if "norm" not in name and "ln" not in name:
                p.normal_(0.0, 0.1)
    return model


def _cached_forward(model, ids: torch.Tensor, pad: torch.Tensor, prefill_len: int, cache_len: int):
    """Hidden states of left-padded ids (B, T): the first prefill_len slots at once, the rest one by one."""
    B, T = ids.shape
    setup_kv_cache(model, B, cache_len)
    pieces = []
    try:
        for begin, end in [(0, prefill_len)] + [(t, t + 1) for t in range(prefill_len, T)]:
            slots = torch.arange(begin, end)
            positions = (slots[None, :] - pad[:, None]).clamp(min=0)
            step = CacheStep(slots.expand(B, -1), padded_mask(pad, slots, cache_len))
            pieces.append(model(ids[:, begin:end], positions, cache_step=step))
    finally:
        remove_kv_cache(model)
    return torch.cat(pieces, dim=1)


@pytest.mark.parametrize("preset", ["gpt2-tiny", "llama-tiny", "qwen3-tiny"])
def test_cached_forward_equals_uncached(preset):
    model = _model(preset)
    ids = torch.randint(0, 50257, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(ids)
        got = _cached_forward(model, ids, torch.zeros(2, dtype=torch.long), prefill_len=25, cache_len=64)
        assert all(layer.kv_cache is None for layer in model.modules() if hasattr(layer, "kv_cache"))
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(model(ids), expected, rtol=0, atol=0)   # removing the cache restores the plain path


@pytest.mark.parametrize("preset", ["gpt2-tiny", "llama-tiny", "qwen3-tiny"])
def test_left_padded_rows_equal_their_unpadded_selves(preset):
    model = _model(preset)
    generator = torch.Generator().manual_seed(1)
    rows = [torch.randint(0, 50257, (n,), generator=generator) for n in (30, 22)]
    T = 30
    ids = torch.stack([torch.cat([torch.zeros(T - len(r), dtype=torch.long), r]) for r in rows])
    pad = torch.tensor([T - len(r) for r in rows])
    with torch.no_grad():
        got = _cached_forward(model, ids, pad, prefill_len=26, cache_len=T)
        assert torch.isfinite(got).all()     # padding queries attend to themselves: never NaN
        for row, r in enumerate(rows):
            expected = model(r[None])[0]
            torch.testing.assert_close(got[row, pad[row]:], expected, rtol=1e-5, atol=1e-5)


def test_cache_is_sized_by_the_model_and_not_in_the_state_dict():
    model = random_native("llama-tiny")
    keys_before = set(model.state_dict())
    setup_kv_cache(model, batch=3, max_len=16)
    cache = model.blocks[0].attn.kv_cache
    assert cache.k.shape == (3, model.config.n_kv_head, 16, model.config.head_dim)
    assert set(model.state_dict()) == keys_before
    ids = torch.randint(0, 50257, (3, 10))
    with torch.no_grad():
        with_cache = model(ids)                # no cache_step: the plain forward, cache attached or not
        remove_kv_cache(model)
        torch.testing.assert_close(model(ids), with_cache, rtol=0, atol=0)
    assert model.blocks[0].attn.kv_cache is None


DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu,
                                               pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")])]


@pytest.mark.parametrize("device", DEVICES)   # on CUDA, SDPA's fp32 output is strided differently
@pytest.mark.parametrize("T", [1, 5])
def test_grouped_masked_attention_equals_expanded_heads(T, device):
    from fastppl.models.attention import masked_attention
    generator = torch.Generator().manual_seed(T)
    q = torch.randn(2, 8, T, 16, generator=generator).to(device)
    k, v = (torch.randn(2, 2, 11, 16, generator=generator).to(device) for _ in range(2))
    mask = torch.rand(2, 1, T, 11, generator=generator).to(device) > 0.4
    mask[..., 0] = True
    expected = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(4, dim=1), v.repeat_interleave(4, dim=1), attn_mask=mask)
    torch.testing.assert_close(masked_attention(q, k, v, mask), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("nkv", [8, 2])
def test_slots_the_mask_hides_are_never_read(nkv, device):
    """A decode step's mask spans the whole cache, most of it not yet written: over 12 slots with the last
    5 hidden (holding values far from the others), masked attention equals attention over the first 7 alone."""
    from fastppl.models.attention import masked_attention
    generator = torch.Generator().manual_seed(nkv)
    q = torch.randn(3, 8, 1, 16, generator=generator).to(device)
    k, v = (torch.randn(3, nkv, 12, 16, generator=generator).to(device) for _ in range(2))
    k[:, :, 7:], v[:, :, 7:] = 50.0, -1e4
    mask = torch.rand(3, 1, 1, 7, generator=generator).to(device) > 0.4
    mask[..., 0] = True
    full = torch.cat([mask, torch.zeros(3, 1, 1, 5, dtype=torch.bool, device=device)], dim=-1)   # (B, 1, 1, 12)
    g = 8 // nkv
    expected = torch.nn.functional.scaled_dot_product_attention(
        q, k[:, :, :7].repeat_interleave(g, dim=1), v[:, :, :7].repeat_interleave(g, dim=1), attn_mask=mask)
    torch.testing.assert_close(masked_attention(q, k, v, full), expected, rtol=1e-5, atol=1e-6)


def test_cache_writes_per_row_and_shared_equal_scatter():
    from fastppl.models.kv_cache import KVCache
    generator = torch.Generator().manual_seed(0)
    k, v = (torch.randn(2, 3, 2, 4, generator=generator) for _ in range(2))
    per_row, shared = (KVCache(2, 3, 6, 4, torch.float32, torch.device("cpu")) for _ in range(2))
    slots = torch.tensor([[4, 1], [0, 5]])
    per_row.update(slots, k, v)
    expected = torch.zeros(2, 3, 6, 4).scatter_(2, slots[:, None, :, None].expand_as(k), k)
    assert torch.equal(per_row.k, expected)
    shared.update(slots[0], k, v)                       # (T,): both rows write slots 4 and 1
    assert torch.equal(shared.k[:, :, [4, 1]], k) and torch.equal(shared.v[:, :, [4, 1]], v)
    assert shared.k[:, :, [0, 2, 3, 5]].abs().sum() == 0
