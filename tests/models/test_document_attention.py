"""Packed rows at the model: positions restart per document and no document attends to another; the
kernels that keep documents apart (SDPA mask, FlexAttention, variable-length flash attention) agree.

GPU tolerances (bf16, GPT-2 124M and llama-tiny with random weights): per-token NLL of the same window
through varlen, FlexAttention and alone (plain causal SDPA) within 0.125 nats (a few bf16 ulps of the
logits), and total NLL within 2e-4 relative."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fastppl.data.batching import WindowRef, batch_from_plan, document_segments
from fastppl.data.packing import plan_batches
from fastppl.data.windows import Window
from fastppl.models import attention
from fastppl.models.attention import (
    DocumentSpans, causal_attention, document_attention_backend, flex_document_attention, varlen_available,
    varlen_document_attention, varlen_signature,
)
from fastppl.models.loading import random_gpt2, random_native

SPANS = (10, 12, 8)   # three documents in one row of 30


def _packed_row(generator):
    ids = torch.randint(0, 50257, (1, sum(SPANS)), generator=generator)
    position_ids = torch.cat([torch.arange(n) for n in SPANS])[None]
    document_ids = torch.cat([torch.full((n,), d) for d, n in enumerate(SPANS)])[None]
    return ids, position_ids, document_ids


@torch.inference_mode()
@pytest.mark.parametrize("preset", ["gpt2-tiny", "llama-tiny"])
def test_each_packed_document_reads_as_if_alone(preset):
    model = random_native(preset).eval()
    ids, position_ids, document_ids = _packed_row(torch.Generator().manual_seed(0))
    packed = model(ids, position_ids, document_ids)                        # (1, 30, C)
    begin = 0
    for n in SPANS:
        alone = model(ids[:, begin:begin + n])                             # positions 0.. of its own
        torch.testing.assert_close(packed[:, begin:begin + n], alone, rtol=0, atol=1e-5)
        begin += n


@torch.inference_mode()
def test_changing_one_packed_document_leaves_the_others_bit_identical():
    model = random_gpt2("gpt2-tiny").eval()
    generator = torch.Generator().manual_seed(1)
    ids, position_ids, document_ids = _packed_row(generator)
    changed = ids.clone()
    changed[0, 10:22] = torch.randint(0, 50257, (12,), generator=generator)   # the middle document
    before, after = model(ids, position_ids, document_ids), model(changed, position_ids, document_ids)
    assert torch.equal(before[0, :10], after[0, :10]) and torch.equal(before[0, 22:], after[0, 22:])
    assert (before[0, 10:22] - after[0, 10:22]).abs().max() > 1e-2


@pytest.mark.slow
def test_flex_attention_block_mask_matches_the_sdpa_mask():
    """The CUDA path's block mask, run through the eager (reference) flex_attention on the CPU."""
    import warnings
    from torch.nn.attention.flex_attention import flex_attention
    generator = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 4, 40, 16, generator=generator) for _ in range(3))
    document_ids = torch.tensor([[0] * 10 + [1] * 25 + [-1] * 5, [7] * 40])   # -1: padding, a span of its own
    expected = causal_attention(q, k, v, document_ids)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # "flex_attention called without torch.compile()"
        got = flex_document_attention(q, k, v, document_ids, flex_attention)
        # grouped-query attention: 4 query heads over 2 key/value heads
        got_gqa = flex_document_attention(q, k[:, :2], v[:, :2], document_ids, flex_attention)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(got_gqa, causal_attention(q, k[:, :2], v[:, :2], document_ids), rtol=0, atol=1e-5)
    # the second row is one document: plain causal attention
    torch.testing.assert_close(got[1:], F.scaled_dot_product_attention(q[1:], k[1:], v[1:], is_causal=True),
                               rtol=0, atol=1e-5)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@needs_cuda
def test_cuda_flex_path_matches_the_cpu_sdpa_mask():
    generator = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(4, 4, 256, 64, generator=generator) for _ in range(3))
    spans = torch.randint(1, 60, (4, 40), generator=generator).cumsum(1)
    document_ids = (torch.arange(256)[None, :, None] >= spans[:, None, :]).sum(-1)        # (4, 256) runs of ids
    expected = causal_attention(q, k, v, document_ids)                                     # CPU: SDPA mask
    got = causal_attention(q.cuda(), k.cuda(), v.cuda(), document_ids.cuda())             # CUDA: FlexAttention
    torch.testing.assert_close(got.cpu(), expected, rtol=0, atol=2e-5)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("compile_setting", ["off", "on"])
def test_cuda_packed_equals_padded_in_fp32(tokenizer_dir, shakespeare, tmp_path, compile_setting):
    from fastppl import EvalConfig, evaluate
    text = shakespeare.read_text()
    for i in range(40):
        (tmp_path / f"{i:02d}.txt").write_text(text[i * 997:i * 997 + 50 + 37 * i])
    results = {
        mode: evaluate(EvalConfig(model="random:gpt2-tiny", tokenizer=str(tokenizer_dir), data=[str(tmp_path)],
                                  ctx=256, device="cuda", dtype="fp32", quiet=True, batching=mode,
                                  compile=compile_setting, per_doc="(returned)"))
        for mode in ("packed", "bucketed", "padded")
    }
    if compile_setting == "on":
        # packed rows under torch.compile hit an illegal memory access in Inductor (torch 2.11, H200):
        # fastppl runs them eagerly and says so; the other modes do compile
        assert results["packed"]["compile"].startswith("off (packed rows run eager")
        assert results["bucketed"]["compile"].startswith("on") and results["padded"]["compile"].startswith("on")
    for mode in ("packed", "bucketed"):
        assert results[mode]["nll_sum"] == pytest.approx(results["padded"]["nll_sum"], rel=1e-6)
        for a, b in zip(results[mode].per_doc, results["padded"].per_doc):
            assert a["nll_sum"] == pytest.approx(b["nll_sum"], rel=1e-6)


# ---- DocumentSpans and the variable-length attention adapter (CPU: stand-ins for torch's varlen_attn) ----

@pytest.fixture(autouse=True)
def _no_varlen_failure(monkeypatch):
    # the fallback to FlexAttention is sticky for the process: every test starts without one
    monkeypatch.setattr(attention, "_varlen_failure", [])


def _spans(document_ids: torch.Tensor) -> DocumentSpans:
    cu_seqlens, max_seqlen = document_segments(document_ids.numpy())
    return DocumentSpans(document_ids, torch.from_numpy(cu_seqlens), max_seqlen)


def _segment_attention(query, key, value, cu_seqlens):
    """(N, nh, hs) causal attention inside each segment, one SDPA call per segment: the reference."""
    out = torch.empty_like(query)
    for a, b in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()):
        q, k, v = (t[a:b].transpose(0, 1) for t in (query, key, value))                   # (nh, L, hs)
        out[a:b] = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                  enable_gqa=k.shape[0] != q.shape[0]).transpose(0, 1)
    return out


def _fake_varlen_window_size(calls):
    """torch 2.13's signature: causal is window_size=(-1, 0); takes enable_gqa."""
    def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                    window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):
        calls.append(dict(shapes=(query.shape, key.shape, value.shape), cu=(cu_seq_q, cu_seq_k), max=(max_q, max_k),
                          window_size=window_size, enable_gqa=enable_gqa))
        assert enable_gqa or key.shape[1] == query.shape[1]
        return _segment_attention(query, key, value, cu_seq_q)
    return varlen_attn


def _fake_varlen_is_causal(calls):
    """torch 2.11's signature: is_causal, no enable_gqa."""
    def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, is_causal=False, return_aux=None,
                    scale=None):
        calls.append(dict(shapes=(query.shape, key.shape, value.shape), cu=(cu_seq_q, cu_seq_k), max=(max_q, max_k),
                          is_causal=is_causal))
        assert key.shape[1] == query.shape[1], "this signature has no grouped-query attention"
        return _segment_attention(query, key, value, cu_seq_q)
    return varlen_attn


DOCUMENT_IDS = torch.tensor([[0] * 10 + [1] * 25 + [-1] * 5, [7] * 40, [2] + [3] * 38 + [-1]])


@pytest.mark.parametrize("fake", [_fake_varlen_window_size, _fake_varlen_is_causal])
@pytest.mark.parametrize("n_kv_head", [4, 2])
def test_varlen_adapter_passes_each_signature_the_right_arguments(fake, n_kv_head):
    generator = torch.Generator().manual_seed(4)
    q = torch.randn(3, 4, 40, 16, generator=generator)
    k, v = (torch.randn(3, n_kv_head, 40, 16, generator=generator) for _ in range(2))
    spans, calls = _spans(DOCUMENT_IDS), []
    got = varlen_document_attention(q, k, v, spans, fake(calls))
    torch.testing.assert_close(got, causal_attention(q, k, v, DOCUMENT_IDS), rtol=0, atol=1e-5)   # the SDPA mask
    (call,) = calls
    assert call["cu"][0] is spans.cu_seqlens and call["cu"][1] is spans.cu_seqlens
    assert call["cu"][0].tolist() == [0, 10, 35, 40, 80, 81, 119, 120] and call["max"] == (40, 40)
    if fake is _fake_varlen_window_size:
        assert call["window_size"] == (-1, 0) and isinstance(call["window_size"], tuple)
        assert call["enable_gqa"] == (n_kv_head != 4)
        assert call["shapes"] == ((120, 4, 16), (120, n_kv_head, 16), (120, n_kv_head, 16))
    else:   # no enable_gqa: the key/value heads arrive repeated to the query heads
        assert call["is_causal"] is True
        assert call["shapes"] == ((120, 4, 16),) * 3


def test_varlen_adapter_refuses_an_unknown_signature():
    def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k):
        raise AssertionError("never called")
    assert varlen_signature(varlen_attn) is None
    q = torch.zeros(1, 2, 4, 8)
    with pytest.raises(TypeError, match="signature"):
        varlen_document_attention(q, q, q, _spans(torch.zeros(1, 4, dtype=torch.long)), varlen_attn)


def test_cpu_dispatch_takes_the_sdpa_mask_and_spans_change_nothing():
    """Plumbing: on the CPU spans and bare ids take the same mask path (cu_seqlens are checked against a
    brute force and a stand-in kernel above; the kernel itself in the GPU tests below)."""
    generator = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(3, 4, 40, 16, generator=generator) for _ in range(3))
    assert torch.equal(causal_attention(q, k, v, _spans(DOCUMENT_IDS)), causal_attention(q, k, v, DOCUMENT_IDS))
    assert document_attention_backend(torch.device("cpu"), torch.bfloat16) == "sdpa-mask"
    assert document_attention_backend(torch.device("cuda"), torch.float32) == "flex"     # flash needs bf16/fp16
    assert not varlen_available(torch.device("cpu"), torch.bfloat16)
    assert varlen_available(torch.device("cuda"), torch.bfloat16) == (attention._varlen_attn_fn() is not None)


@torch.inference_mode()
def test_packed_nll_is_identical_with_spans_and_with_bare_ids():
    """Plumbing: the scorer passes DocumentSpans through to the model unchanged (CPU: the same mask path)."""
    from fastppl.engine.score import make_score_fn
    model = random_gpt2("gpt2-tiny").eval()
    generator = np.random.default_rng(6)
    lengths = [1, 64, 17, 40, 3, 64, 30]
    streams = [generator.integers(0, 50257, size=n + 1) for n in lengths]
    refs = [WindowRef(d, Window(0, n, 0)) for d, n in enumerate(lengths)]
    (plan,) = plan_batches(lengths, "packed", 64, 8)
    batch = batch_from_plan(plan, refs, streams, [0] * len(streams))
    score = make_score_fn(model)
    arrays = [torch.from_numpy(a) for a in (batch.input_ids, batch.targets, batch.score_mask, batch.position_ids)]
    ids = torch.from_numpy(batch.document_ids)
    spans = DocumentSpans(ids, torch.from_numpy(batch.cu_seqlens), batch.max_seqlen)
    assert torch.equal(score(*arrays, spans), score(*arrays, ids))


def test_a_failing_varlen_kernel_falls_back_for_the_rest_of_the_process(monkeypatch):
    calls = []

    def broken(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, window_size=(-1, -1), enable_gqa=False):
        calls.append(1)
        raise RuntimeError("FlashAttention only supports Ampere GPUs or newer.\nmore lines")

    # as on a CUDA device with varlen_attn: the CPU stands in for it, so the fallback is the SDPA mask
    monkeypatch.setattr(attention, "varlen_available", lambda device, dtype: not attention._varlen_failure)
    monkeypatch.setattr(attention, "_varlen_attn_fn", lambda: broken)
    generator = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(3, 4, 40, 16, generator=generator) for _ in range(3))
    expected = causal_attention(q, k, v, DOCUMENT_IDS)
    with pytest.warns(RuntimeWarning, match="FlexAttention from now on"):
        assert torch.equal(causal_attention(q, k, v, _spans(DOCUMENT_IDS)), expected)
    assert torch.equal(causal_attention(q, k, v, _spans(DOCUMENT_IDS)), expected)
    assert calls == [1]   # sticky: the kernel is not tried again
    assert attention.varlen_failure() == "RuntimeError: FlashAttention only supports Ampere GPUs or newer."


def test_out_of_memory_in_varlen_propagates_for_the_batch_back_off(monkeypatch):
    def out_of_memory(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, is_causal=False):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(attention, "varlen_available", lambda device, dtype: True)
    monkeypatch.setattr(attention, "_varlen_attn_fn", lambda: out_of_memory)
    q = torch.zeros(3, 4, 40, 16)
    with pytest.raises(torch.OutOfMemoryError):
        causal_attention(q, q, q, _spans(DOCUMENT_IDS))
    assert attention.varlen_failure() is None


@pytest.mark.slow
def test_packed_kernel_agreement_on_the_cpu():
    """The helper the GPU checks use: on the CPU all three ways are the SDPA mask or plain SDPA (fp32)."""
    from fastppl.bench.documents import packed_kernel_agreement
    from fastppl.data.synthetic import synthetic_documents
    documents = synthetic_documents(12, min_tokens=1, max_tokens=150, seed=8)
    report = packed_kernel_agreement(random_gpt2("gpt2-tiny").eval(), documents, 128, 4, torch.device("cpu"))
    assert report["spans_attention"] == report["ids_attention"] == "sdpa-mask"
    assert report["tokens"] == sum(len(d) for d in documents) and report["windows"] > 12   # some split at ctx
    assert report["spans_vs_ids_max_abs"] == 0.0
    assert report["spans_vs_alone_max_abs"] < 1e-4 and report["spans_vs_alone_total_rel"] < 1e-6


# ---- on the GPU -------------------------------------------------------------------------------------------

BF16_TOKEN_ATOL, BF16_TOTAL_RTOL = 0.125, 2e-4   # see the module docstring


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("preset,ctx", [("gpt2", 1024), ("llama-tiny", 256)])   # llama-tiny: GQA, 4 over 2 heads
def test_cuda_varlen_packed_nll_matches_flex_and_one_document_at_a_time(preset, ctx):
    from fastppl.bench.documents import packed_kernel_agreement
    from fastppl.data.synthetic import synthetic_documents
    if not varlen_available(torch.device("cuda"), torch.bfloat16):
        pytest.skip(f"torch {torch.__version__} has no usable varlen_attn")
    model = random_native(preset, 0, "cuda").to(torch.bfloat16).eval()
    documents = synthetic_documents(60, min_tokens=1, max_tokens=ctx + 200, vocab_size=50257, seed=9)
    report = packed_kernel_agreement(model, documents, ctx, 8, torch.device("cuda"))
    assert report["spans_attention"] == "varlen" and attention.varlen_failure() is None
    for way in ("spans", "ids"):
        assert report[f"{way}_vs_alone_max_abs"] <= BF16_TOKEN_ATOL, report
        assert report[f"{way}_vs_alone_total_rel"] <= BF16_TOTAL_RTOL, report


@pytest.mark.gpu
@needs_cuda
def test_cuda_auto_batching_packs_documents_through_varlen(tokenizer_dir, shakespeare, tmp_path):
    from fastppl import EvalConfig, evaluate
    if not varlen_available(torch.device("cuda"), torch.bfloat16):
        pytest.skip(f"torch {torch.__version__} has no usable varlen_attn")
    text = shakespeare.read_text()
    for i in range(40):
        (tmp_path / f"{i:02d}.txt").write_text(text[i * 997:i * 997 + 50 + 37 * i])
    run = lambda batching: evaluate(EvalConfig(  # noqa: E731
        model="random:gpt2", tokenizer=str(tokenizer_dir), data=[str(tmp_path)], ctx=256, device="cuda",
        dtype="bf16", quiet=True, batching=batching, compile="off"))
    auto, padded = run("auto"), run("padded")
    assert auto["batching"] == "packed" and auto["document_attention"] == "varlen", auto["batching_reason"]
    assert auto["nll_sum"] == pytest.approx(padded["nll_sum"], rel=BF16_TOTAL_RTOL)
