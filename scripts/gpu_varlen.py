"""Packed rows through variable-length flash attention on the H200 (issue 4): checks, then tokens/s.

    PYTHONPATH=src python3 scripts/gpu_varlen.py          (about 90 s; writes $OUT/gpu_varlen.json)

Checks (bf16, random weights; any failure makes the exit status 1, after the timings):
  kernel    varlen_document_attention == the SDPA mask in fp32 on the same bf16 inputs (GQA 8 over 2 heads too)
  gpt2      GPT-2 124M, packed batches: per-token NLL through varlen, FlexAttention and each window alone
            within 0.125 nats, totals within 2e-4 relative (tests/test_document_attention.py's tolerances)
  llama     the same for llama-tiny (grouped-query attention: 4 query heads over 2 key/value heads)
  auto      resolve_batching("auto", several documents) is packed where varlen runs
  timed     the timed packed (varlen) and bucketed modes agree on the total NLL within 1e-4 (bench tolerance)
Timings: GPT-2 124M, bf16, eager, fused loss, ctx 1024, 64 rows; 3,000 synthetic documents (20..1,500 tokens,
log-uniform), the pipeline's own loop (bench_docs.time_fastppl_mode: host batches, device sums); best of two.
The Markdown table is printed last."""
from __future__ import annotations

import functools
import inspect
import json
import os
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch

from fastppl.bench_docs import chunked_corpus, packed_kernel_agreement, time_fastppl_mode
from fastppl.data.batching import document_segments
from fastppl.data.packing import resolve_batching
from fastppl.data.synthetic import synthetic_documents
from fastppl.engine.loss import fused_loss_available
from fastppl.engine.score import make_score_fn
from fastppl.models import attention
from fastppl.models.attention import DocumentSpans, document_attention_backend, varlen_available
from fastppl.models.loading import random_native

STARTED = time.perf_counter()
DEVICE = torch.device("cuda")
TOKEN_ATOL, TOTAL_RTOL, BENCH_RTOL = 0.125, 2e-4, 1e-4
CTX, ROWS, N_DOCUMENTS = 1024, 64, 3000
checks: list[dict] = []
timings: list[dict] = []


def check(name: str, ok: bool, detail: str) -> None:
    checks.append({"name": name, "ok": bool(ok), "detail": detail})
    print(f"check {name}: {'ok' if ok else 'FAILED'}  {detail}", flush=True)


def guarded(name: str, fn) -> None:
    """One failing check or variant prints one line and leaves the rest to run."""
    try:
        fn()
    except Exception as error:   # noqa: BLE001
        line = f"{type(error).__name__}: {(str(error).splitlines() or [''])[0]}"
        print(f"{name} raised {line}", flush=True)
        traceback.print_exc(limit=3)
        checks.append({"name": name, "ok": False, "detail": f"raised {line}"})


def environment() -> dict:
    fn = attention._varlen_attn_fn()
    env = {"torch": torch.__version__, "cuda": torch.version.cuda, "device": torch.cuda.get_device_name(DEVICE),
           "varlen_attn": None if fn is None else str(inspect.signature(fn)),
           "varlen_signature": None if fn is None else repr(attention.varlen_signature(fn)),
           "varlen_available_bf16": varlen_available(DEVICE, torch.bfloat16)}
    for key, value in env.items():
        print(f"{key}: {value}", flush=True)
    return env


def kernel_check() -> None:
    """The adapter on the real kernel, against the SDPA mask in fp32. If the strided (B*T, nh, hs) views
    are refused but contiguous copies pass, the rest of the run uses copies (and says so)."""
    fn = attention._varlen_attn_fn()
    if fn is None or attention.varlen_signature(fn) is None:
        check("kernel", False, "no usable torch.nn.attention.varlen.varlen_attn: packed rows fall back to flex")
        return
    generator = torch.Generator(device=DEVICE).manual_seed(0)
    ids = torch.tensor([[0] * 300 + [1] * 700 + [-1] * 24, [2] * 1 + [3] * 1023, [4] * 1024], device=DEVICE)
    cu_seqlens, max_seqlen = document_segments(ids.cpu().numpy())
    spans = DocumentSpans(ids, torch.from_numpy(cu_seqlens).to(DEVICE), max_seqlen)
    for n_kv in (8, 2):
        # (B, T, 3, nh, hs) -> q, k, v as the models make them: strided (B, nh, T, hs) views of one projection
        qkv = torch.randn(3, 1024, 8, 3, 64, device=DEVICE, generator=generator).to(torch.bfloat16)
        q, k, v = (qkv[:, :, :, i].transpose(1, 2) for i in range(3))
        k, v = k[:, :n_kv], v[:, :n_kv]
        expected = attention.causal_attention(*(t.cpu().float() for t in (q, k, v)), ids.cpu())   # SDPA mask
        try:
            got = attention.varlen_document_attention(q, k, v, spans, fn)
            how = "strided views"
        except RuntimeError as error:
            print(f"varlen on strided views raised {str(error).splitlines()[0]}; trying contiguous copies")
            got = attention.varlen_document_attention(q.contiguous(), k.contiguous(), v.contiguous(), spans, fn)
            how = "contiguous copies (strided views refused)"

            @functools.wraps(fn)
            def contiguous_varlen(query, key, value, *args, **kwargs):
                return fn(query.contiguous(), key.contiguous(), value.contiguous(), *args, **kwargs)
            attention._varlen_attn_fn = lambda: contiguous_varlen
        error = (got.float().cpu() - expected).abs().max().item()
        check(f"kernel nkv={n_kv}", error < 2e-2, f"max |varlen - fp32 SDPA mask| {error:.2e} (< 2e-2), {how}")


def agreement_check(name: str, preset: str, ctx: int) -> None:
    model = random_native(preset, 0, DEVICE).to(torch.bfloat16).eval()
    documents = synthetic_documents(80, min_tokens=1, max_tokens=ctx + 200, vocab_size=50257, seed=9)
    report = packed_kernel_agreement(model, documents, ctx, 16, DEVICE)
    ok = (report["spans_attention"] == "varlen"
          and max(report["spans_vs_alone_max_abs"], report["ids_vs_alone_max_abs"]) <= TOKEN_ATOL
          and max(report["spans_vs_alone_total_rel"], report["ids_vs_alone_total_rel"]) <= TOTAL_RTOL)
    check(name, ok, f"{report['tokens']:,} tokens, spans ran {report['spans_attention']}; per-token max |diff| vs "
                    f"alone: varlen {report['spans_vs_alone_max_abs']:.3g}, flex {report['ids_vs_alone_max_abs']:.3g},"
                    f" varlen-flex {report['spans_vs_ids_max_abs']:.3g}; total rel: varlen "
                    f"{report['spans_vs_alone_total_rel']:.1e}, flex {report['ids_vs_alone_total_rel']:.1e}")
    del model
    if attention.varlen_failure():
        # the fallback is sticky for the process: note it, then let the later stages try varlen again
        check(f"{name} no fallback", False, f"varlen failed: {attention.varlen_failure()}")
        attention._varlen_failure.clear()


def auto_check() -> None:
    mode, why = resolve_batching("auto", 3000, True, varlen_available(DEVICE, torch.bfloat16))
    check("auto", mode == "packed", f"auto -> {why}")


def timings_run() -> None:
    model = random_native("gpt2", 0, DEVICE).to(torch.bfloat16).eval()
    loss = "fused" if fused_loss_available(DEVICE) else "chunked"
    score_fn = make_score_fn(model, loss=loss)

    def flex_score_fn(input_ids, targets, score_mask, position_ids=None, document_ids=None):
        # the same packed batches with bare ids: FlexAttention, as before varlen
        ids = document_ids.ids if isinstance(document_ids, DocumentSpans) else document_ids
        return score_fn(input_ids, targets, score_mask, position_ids, ids)

    documents = synthetic_documents(N_DOCUMENTS, vocab_size=model.vocab_size, seed=0)
    corpus = chunked_corpus(documents, CTX)
    dense = chunked_corpus([np.concatenate(documents)], CTX)
    print(f"timing: {N_DOCUMENTS:,} documents, {corpus.n_tokens:,} tokens, {loss} loss", flush=True)
    variants = [("dense full rows", dense, "padded", score_fn),
                ("packed (varlen)", corpus, "packed", score_fn),
                ("packed (flex)", corpus, "packed", flex_score_fn),
                ("bucketed", corpus, "bucketed", score_fn)]
    for name, data, mode, fn in variants:
        if time.perf_counter() - STARTED > 100:
            print(f"{name}: skipped (over 100 s)", flush=True)
            continue
        try:
            best = None
            for _ in range(2):
                result = time_fastppl_mode(name, fn, data, mode, CTX, ROWS, DEVICE)
                best = result if best is None or result.seconds < best.seconds else best
            row = {"variant": name, "tokens": data.n_tokens, "seconds": best.seconds,
                   "tokens_per_second": data.n_tokens / best.seconds, "padding_waste": best.padding_waste,
                   "nll_sum": best.nll_sum, "peak_gib": (best.peak_bytes or 0) / 2**30, "note": best.note}
            if mode == "packed" and fn is score_fn:
                row["note"] = f"{document_attention_backend(DEVICE, torch.bfloat16)} attention; " + row["note"]
            timings.append(row)
            print(f"{name}: {row['tokens_per_second']:,.0f} tok/s  waste {100 * row['padding_waste']:.1f} %  "
                  f"nll_sum {row['nll_sum']:.3f}  {row['note']}", flush=True)
        except Exception as error:   # noqa: BLE001
            print(f"{name} raised {type(error).__name__}: {(str(error).splitlines() or [''])[0]}", flush=True)
            timings.append({"variant": name, "error": f"{type(error).__name__}: {error}"[:300]})
    by_name = {t["variant"]: t for t in timings if "error" not in t}
    if "packed (varlen)" in by_name and "bucketed" in by_name:
        a, b = by_name["packed (varlen)"]["nll_sum"], by_name["bucketed"]["nll_sum"]
        check("timed", abs(a - b) / abs(b) <= BENCH_RTOL,
              f"packed (varlen) vs bucketed total NLL rel {abs(a - b) / abs(b):.1e} (<= {BENCH_RTOL:.0e})")


def table() -> str:
    dense = next((t["tokens_per_second"] for t in timings if t["variant"] == "dense full rows" and "error" not in t),
                 None)
    lines = ["| variant | tokens/s | of dense | padding waste | peak GiB | note |",
             "| --- | --- | --- | --- | --- | --- |"]
    for t in timings:
        if "error" in t:
            lines.append(f"| {t['variant']} | error | | | | {t['error'][:120]} |")
            continue
        share = f"{100 * t['tokens_per_second'] / dense:.1f} %" if dense else "n/a"
        lines.append(f"| {t['variant']} | {t['tokens_per_second']:,.0f} | {share} | {100 * t['padding_waste']:.1f} % "
                     f"| {t['peak_gib']:.2f} | {t['note']} |")
    lines.append("")
    lines.append("| check | result | detail |")
    lines.append("| --- | --- | --- |")
    lines.extend(f"| {c['name']} | {'ok' if c['ok'] else 'FAILED'} | {c['detail']} |" for c in checks)
    return "\n".join(lines)


def main() -> int:
    if not torch.cuda.is_available():
        print("needs a CUDA device")
        return 1
    env = environment()
    guarded("kernel", kernel_check)
    guarded("gpt2", lambda: agreement_check("gpt2", "gpt2", 1024))
    guarded("llama", lambda: agreement_check("llama", "llama-tiny", 256))
    guarded("auto", auto_check)
    timings_run()
    if attention.varlen_failure():
        check("no fallback", False, f"varlen failed during the run: {attention.varlen_failure()}")
    out = Path(os.environ.get("OUT", "."))
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_varlen.json").write_text(json.dumps(
        {"environment": env, "checks": checks, "timings": timings,
         "wall_seconds": time.perf_counter() - STARTED}, indent=2))
    print(f"\nwall {time.perf_counter() - STARTED:.0f} s\n")
    print(table())
    return 0 if checks and all(c["ok"] for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
