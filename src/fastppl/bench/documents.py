"""fastppl bench --corpus docs: many documents of mixed lengths, every batching mode and an lm-eval-style
baseline on the same weights and tokens, in one process.

The corpus is fastppl.data.synthetic.synthetic_documents (10,000 documents of random token ids, lengths
log-uniform between 20 and 1,500 tokens). Every document is a stream [BOS] + tokens cut into chunked windows
of ctx, so every token is scored once, conditioned on BOS and on nothing outside its document:

  packed    fastppl, several windows per row of ctx, each attending to itself   \
  bucketed  fastppl, one window per row, rows of a few bucket lengths            } plan_batches + batch_from_plan
  padded    fastppl, one window per row of ctx                                  /  + make_score_fn + score_batches
  baseline  what lm-evaluation-harness's loglikelihood does: windows sorted longest first, batches right-padded
            to their longest window, transformers GPT2LMHeadModel (the same weights) to full (B, T, V) logits,
            log_softmax over the vocabulary in fp32, gather the targets. Generous to lm-eval: the sum stays on
            the device (lm-eval also loops over each request on the host).
  dense     fastppl on the same tokens as one stream in full rows: the speed that packing should keep

The first four score the same tokens with the same contexts, so their total NLL must agree (within 1e-4
relative in bf16, 1e-6 in fp32); the check failing makes the command exit 1. dense reads other contexts, so
its NLL differs slightly and is not checked."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Sequence

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from ..data.batching import WindowRef, batch_from_plan
from ..data.packing import BATCHING_MODES, padding_waste, plan_batches
from ..data.synthetic import synthetic_documents
from ..data.windows import chunked_windows
from ..engine.precision import resolve_device
from ..errors import FastpplError
from .timers import peak_bytes, reset_peak

BOS_ID = 50256              # GPT-2's end-of-text; every random preset's vocabulary holds GPT-2's
NLL_TOLERANCE = {"bfloat16": 1e-4, "float32": 1e-6}   # relative, on the total NLL of the same tokens
TARGETS = {"packed_over_dense": 0.90, "packed_over_baseline": 3.0, "packed_padding_waste": 0.02}
CHECKED_MODES = (*BATCHING_MODES, "baseline")


@dataclass
class ChunkedCorpus:
    """Documents as the pipeline reads them under --window chunked: [BOS] + tokens, cut into windows of ctx."""
    streams: list[np.ndarray]   # (n_d + 1,) int64 each
    target_offsets: list[int]   # target stream index j of document d is corpus token target_offsets[d] + j - 1
    refs: list[WindowRef]
    n_tokens: int               # real tokens, all scored

    @property
    def window_lengths(self) -> np.ndarray:
        return np.array([r.window.length for r in self.refs], dtype=np.int64)


def chunked_corpus(documents: Sequence[np.ndarray], ctx: int, bos_id: int = BOS_ID) -> ChunkedCorpus:
    streams, offsets, refs, offset = [], [], [], 0
    for doc, ids in enumerate(documents):
        streams.append(np.concatenate([[bos_id], ids]).astype(np.int64))
        offsets.append(offset)
        offset += len(ids)
        refs.extend(WindowRef(doc, w) for w in chunked_windows(len(ids), ctx))
    return ChunkedCorpus(streams, offsets, refs, offset)


@dataclass
class ModeResult:
    name: str
    seconds: float
    nll_sum: float
    padding_waste: float
    batches: int
    peak_bytes: Optional[int]
    note: str
    # token positions the windows read (scored tokens plus the context a right-aligned last window re-reads)
    positions: Optional[int] = None


def _timed(device: torch.device, run: Callable[[], torch.Tensor]) -> tuple[float, float]:
    """(seconds, value) of run(), which returns a device scalar. On CUDA the time is that of CUDA events
    recorded around the work on the stream (host stalls between kernels included), after a synchronize."""
    if device.type != "cuda":
        started = time.perf_counter()
        value = float(run().item())
        return time.perf_counter() - started, value
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    total = run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1000, float(total.item())


def time_fastppl_mode(name: str, score_fn, corpus: ChunkedCorpus, mode: str, ctx: int, batch_size: int,
                      device: torch.device) -> ModeResult:
    """The pipeline's scoring on one mode: plans, batches built on the host as they are scored, device sums
    (per-document sums included, as eval keeps them). Warm-up: one batch of every shape, untimed."""
    from ..engine.score import DeviceSums, score_batches
    plans = plan_batches(corpus.window_lengths, mode, ctx, min(batch_size, len(corpus.refs)))
    build = lambda plan: batch_from_plan(plan, corpus.refs, corpus.streams, corpus.target_offsets)  # noqa: E731
    new_sums = lambda: DeviceSums.zeros(ctx, device, n_documents=len(corpus.streams))  # noqa: E731
    first_of_shape = {}
    for plan in plans:
        first_of_shape.setdefault((plan.n_rows, plan.seq_len), plan)
    score_batches(score_fn, map(build, first_of_shape.values()), new_sums(), device)
    reset_peak(device)
    sums = new_sums()
    seconds, nll_sum = _timed(device, lambda: score_batches(score_fn, map(build, plans), sums, device).nll_sum)
    shapes = sorted({p.seq_len for p in plans})
    note = f"{len(plans)} batches, row length{'s' if len(shapes) > 1 else ''} {','.join(map(str, shapes))}"
    return ModeResult(name, seconds, nll_sum, padding_waste(plans, corpus.window_lengths), len(plans),
                      peak_bytes(device), note, int(corpus.window_lengths.sum()))


def _baseline_batches(corpus: ChunkedCorpus, batch_size: int) -> list[list[WindowRef]]:
    """lm-eval's order: longest first (ties in corpus order), batch_size windows per batch."""
    order = np.argsort(-corpus.window_lengths, kind="stable")
    return [[corpus.refs[i] for i in order[b:b + batch_size]] for b in range(0, len(order), batch_size)]


def _baseline_arrays(refs: list[WindowRef], streams: list[np.ndarray]) -> tuple[np.ndarray, ...]:
    """(B, T) inputs, targets and score mask, right-padded to the batch's longest window (its first)."""
    T = refs[0].window.length
    inputs = np.zeros((len(refs), T), dtype=np.int64)
    targets = np.zeros((len(refs), T), dtype=np.int64)
    scored = np.zeros((len(refs), T), dtype=bool)
    for row, ref in enumerate(refs):
        w, stream = ref.window, streams[ref.doc]
        inputs[row, :w.length] = stream[w.start:w.start + w.length]
        targets[row, :w.length] = stream[w.start + 1:w.start + w.length + 1]
        scored[row, w.score_from:w.length] = True
    return inputs, targets, scored


def time_lm_eval_baseline(hf_model: nn.Module, corpus: ChunkedCorpus, batch_size: int,
                          device: torch.device) -> ModeResult:
    batches = _baseline_batches(corpus, batch_size)

    @torch.inference_mode()
    def nll_sum_of(batch_refs: Iterator[list[WindowRef]]) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float64, device=device)
        for refs in batch_refs:
            inputs, targets, scored = (torch.from_numpy(a).to(device) for a in _baseline_arrays(refs, corpus.streams))
            logits = hf_model(input_ids=inputs).logits                           # (B, T, V)
            log_probs = F.log_softmax(logits.float(), dim=-1)                    # (B, T, V) fp32
            target_log_probs = log_probs.gather(-1, targets[..., None])[..., 0]  # (B, T)
            total -= torch.where(scored, target_log_probs, 0.0).sum(dtype=torch.float64)
        return total

    nll_sum_of(batches[:1])   # warm-up: the largest shape
    reset_peak(device)
    seconds, nll_sum = _timed(device, lambda: nll_sum_of(batches))
    slots = sum(len(refs) * refs[0].window.length for refs in batches)
    waste = (slots - int(corpus.window_lengths.sum())) / int(corpus.window_lengths.sum())
    return ModeResult("baseline", seconds, nll_sum, waste, len(batches), peak_bytes(device),
                      f"lm-eval style: sorted, right-padded, HF full log_softmax, {len(batches)} batches",
                      int(corpus.window_lengths.sum()))


@torch.inference_mode()
def packed_kernel_agreement(model: nn.Module, documents: Sequence[np.ndarray], ctx: int, batch_size: int,
                            device: torch.device) -> dict:
    """The same packed batches scored three ways: DocumentSpans (variable-length flash attention where it
    runs), bare document ids (FlexAttention on CUDA) and every window alone in a row of its own (plain causal
    SDPA). Per-token NLL differences (max absolute, nats) and total-NLL relative differences against alone."""
    from ..engine.score import make_score_fn, to_device
    from ..models.attention import DocumentSpans, document_attention_backend
    corpus = chunked_corpus(documents, ctx)
    score = make_score_fn(model)
    nll: dict[str, list[torch.Tensor]] = {"spans": [], "ids": [], "alone": []}
    for plan in plan_batches(corpus.window_lengths, "packed", ctx, batch_size):
        batch = batch_from_plan(plan, corpus.refs, corpus.streams, corpus.target_offsets)
        input_ids, targets, score_mask, position_ids = (
            to_device(a, device) for a in (batch.input_ids, batch.targets, batch.score_mask, batch.position_ids))
        ids = to_device(batch.document_ids, device)
        spans = DocumentSpans(ids, to_device(batch.cu_seqlens, device), batch.max_seqlen)
        nll["spans"].append(score(input_ids, targets, score_mask, position_ids, spans)[score_mask])
        nll["ids"].append(score(input_ids, targets, score_mask, position_ids, ids)[score_mask])
        alone = torch.zeros_like(score_mask, dtype=torch.float32)                  # (B, T)
        for window, row, column in zip(plan.windows, plan.rows, plan.columns):
            span = slice(int(column), int(column) + corpus.refs[window].window.length)
            alone[row, span] = score(input_ids[row:row + 1, span], targets[row:row + 1, span],
                                     score_mask[row:row + 1, span])[0]
        nll["alone"].append(alone[score_mask])
    flat = {name: torch.cat(parts).double() for name, parts in nll.items()}
    total = {name: float(x.sum()) for name, x in flat.items()}
    max_abs = lambda a, b: float((flat[a] - flat[b]).abs().max())  # noqa: E731
    relative = lambda a, b: abs(total[a] - total[b]) / abs(total[b])  # noqa: E731
    dtype = next(model.parameters()).dtype
    return {"spans_attention": document_attention_backend(device, dtype),
            "ids_attention": "flex" if device.type == "cuda" else "sdpa-mask",
            "tokens": int(flat["alone"].numel()), "windows": len(corpus.refs),
            "spans_vs_alone_max_abs": max_abs("spans", "alone"), "ids_vs_alone_max_abs": max_abs("ids", "alone"),
            "spans_vs_ids_max_abs": max_abs("spans", "ids"),
            "spans_vs_alone_total_rel": relative("spans", "alone"), "ids_vs_alone_total_rel": relative("ids", "alone")}


class _ModeScorers:
    """The scorer of each batching mode as eval builds it (fastppl.accel.apply): the fusions of its choice applied
    to the model, and one compiled function shared by every mode that compiles."""

    def __init__(self, model: nn.Module, device: torch.device, dtype: torch.dtype, loss: str, compile: str,
                 corpus: "ChunkedCorpus", n_documents: int):
        self.model, self.device, self.dtype, self.loss, self.compile = model, device, dtype, loss, compile
        self.n_scored, self.n_positions = corpus.n_tokens, int(corpus.window_lengths.sum())
        self.n_documents = n_documents
        self.compiled_fn = None

    def choose(self, mode: str):
        """(the acceleration, the score function) of a --batching mode; its fusions now applied to the model."""
        from ..accel.apply import apply_fusions, choose_acceleration, score_fn_for
        from ..accel.compile import allow_shapes
        acceleration = apply_fusions(self.model, self.device, choose_acceleration(
            self.model, self.device, self.dtype, loss=self.loss, compile=self.compile, batching=mode,
            n_scored=self.n_scored, n_positions=self.n_positions, n_documents=self.n_documents))
        if not acceleration.compiled:
            return acceleration, score_fn_for(self.model, acceleration)
        if self.compiled_fn is None:
            self.compiled_fn = score_fn_for(self.model, acceleration)
            allow_shapes(32)   # every mode's shapes share one compiled function: bucketed alone has up to ~10
        return acceleration, self.compiled_fn


def run_docs_bench(model_spec: str = "random:gpt2", n_documents: int = 10_000, ctx: int = 1024,
                   batch_size: int = 64, device_name: str = "auto", loss: str = "auto", compile: str = "auto",
                   seed: int = 0, log: Callable[[str], None] = print) -> dict:
    from ..engine.loss import resolve_loss
    from ..models.attention import document_attention_backend
    from ..models.loading import RANDOM_PREFIX, native_to_hf, random_native
    device = resolve_device(device_name)
    on_cuda = device.type == "cuda"
    dtype = torch.bfloat16 if on_cuda else torch.float32
    if not model_spec.startswith(RANDOM_PREFIX):
        raise FastpplError(f"bench --corpus docs takes a random:<preset> model, got {model_spec!r}")
    if n_documents < 1 or batch_size < 1:
        raise FastpplError("--documents and --batch-size must be at least 1")
    native = random_native(model_spec[len(RANDOM_PREFIX):], seed, device)
    if ctx > native.max_positions:
        raise FastpplError(f"--ctx {ctx} exceeds the model's {native.max_positions} positions")
    loss = resolve_loss(loss, device)

    documents = synthetic_documents(n_documents, vocab_size=native.vocab_size, seed=seed)
    corpus = chunked_corpus(documents, ctx)
    # dense: the same tokens as one stream, in full rows of ctx (what eval does with one long text)
    dense = chunked_corpus([np.concatenate(documents)], ctx)
    log(f"{n_documents:,} documents, {corpus.n_tokens:,} tokens, {len(corpus.refs):,} windows of <= {ctx}")

    # the same weights in transformers' GPT2LMHeadModel (native_to_hf copies them), then both in dtype
    hf_model = native_to_hf(native).to(device=device, dtype=dtype).eval()
    model = native.to(dtype).eval()
    # each mode runs what eval runs for a run of this size with that --batching (fastppl.accel.apply)
    scorer = _ModeScorers(model, device, dtype, loss, compile, corpus, n_documents)
    compile_reason = scorer.choose("padded")[0].compile_reason
    log(f"fastppl: {loss} loss, compile {compile_reason}, dtype {str(dtype).replace('torch.', '')}")

    results: list[ModeResult] = []

    def record(result: ModeResult) -> None:
        results.append(result)
        log(f"{result.name:<9} {corpus.n_tokens / result.seconds:>12,.0f} tok/s  waste "
            f"{100 * result.padding_waste:6.1f} %  nll_sum {result.nll_sum:.6f}  {result.note}")

    for mode in BATCHING_MODES:
        # packed rows take eval's path: eager on CUDA, the kernel of document_attention
        result = time_fastppl_mode(mode, scorer.choose(mode)[1], corpus, mode, ctx, batch_size, device)
        if mode == "packed":
            result.note = f"{document_attention_backend(device, dtype)} attention; " + result.note
        record(result)
    record(time_lm_eval_baseline(hf_model, corpus, batch_size, device))
    del hf_model
    dense_result = time_fastppl_mode("dense", scorer.choose("padded")[1], dense, "padded", ctx, batch_size, device)
    dense_result.note = "the same tokens as one stream, full rows; " + dense_result.note
    record(dense_result)
    return docs_report(results, corpus.n_tokens, model=model_spec, documents=n_documents, ctx=ctx,
                       batch_size=batch_size, device=device, dtype=dtype, loss=loss, compile=compile_reason,
                       document_attention=document_attention_backend(device, dtype))


def docs_report(results: list[ModeResult], n_tokens: int, *, device: torch.device, dtype: torch.dtype,
                **fields) -> dict:
    by_name = {r.name: r for r in results}
    speed = {r.name: n_tokens / r.seconds if r.seconds > 0 else float("nan") for r in results}
    reference = by_name["packed"].nll_sum
    difference = max(abs(by_name[m].nll_sum - reference) / abs(reference) for m in CHECKED_MODES)
    dtype_name = str(dtype).replace("torch.", "")
    tolerance = NLL_TOLERANCE[dtype_name]
    ratios = {"packed_over_dense": speed["packed"] / speed["dense"],
              "packed_over_baseline": speed["packed"] / speed["baseline"],
              "packed_padding_waste": by_name["packed"].padding_waste}
    packed, dense = by_name["packed"], by_name["dense"]
    # not a target: the same ratio per position read, which leaves out the windows' re-read context
    per_position = (packed.positions / packed.seconds) / (dense.positions / dense.seconds) if (
        packed.positions and dense.positions and packed.seconds > 0 and dense.seconds > 0) else None
    return {
        **fields, "corpus": "docs", "tokens": n_tokens, "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "dtype": dtype_name,
        "rows": [{"name": r.name, "tokens": n_tokens, "seconds": r.seconds, "tokens_per_second": speed[r.name],
                  "padding_waste": r.padding_waste, "nll_sum": r.nll_sum, "nll": r.nll_sum / n_tokens,
                  "batches": r.batches, "peak_memory_bytes": r.peak_bytes, "note": r.note} for r in results],
        **ratios,
        "packed_over_dense_per_position": per_position,
        "positions": {r.name: r.positions for r in results},
        "targets": TARGETS,
        "targets_met": {k: (v <= TARGETS[k]) if k.endswith("waste") else (v >= TARGETS[k]) for k, v in ratios.items()},
        "nll_checked_modes": list(CHECKED_MODES),
        "nll_max_relative_difference": difference,
        "nll_tolerance": tolerance,
        "nll_agrees": bool(difference <= tolerance),
        "date": time.strftime("%Y-%m-%d"),
    }


def format_docs_table(report: dict) -> str:
    lines = [f"fastppl bench --corpus docs  {report['model']}  {report['documents']:,} documents "
             f"({report['tokens']:,} tokens)  ctx {report['ctx']}  batch {report['batch_size']}  "
             f"{report['device_name']}  {report['dtype']}  torch {report['torch']}"
             + (f"  packed attention {report['document_attention']}" if report.get("document_attention") else ""),
             f"{'mode':<10}{'tokens/s':>14}{'padding waste':>15}{'nll_sum':>22}{'peak GiB':>10}  note"]
    for r in report["rows"]:
        peak = "n/a" if r["peak_memory_bytes"] is None else f"{r['peak_memory_bytes'] / 2**30:.2f}"
        lines.append(f"{r['name']:<10}{r['tokens_per_second']:>14,.0f}{100 * r['padding_waste']:>13.1f} %"
                     f"{r['nll_sum']:>22.6f}{peak:>10}  {r['note']}")
    # the targets are set for a GPU: off it the figures are shown, not judged
    on_gpu = report["device"].startswith("cuda")
    met = lambda key: ("met" if report["targets_met"][key] else "MISSED") if on_gpu else "a GPU target"  # noqa: E731
    lines.append(f"packed / dense {100 * report['packed_over_dense']:.1f} % "
                 f"(target >= 90 %, {met('packed_over_dense')})"
                 f"   packed / baseline {report['packed_over_baseline']:.2f}x (target >= 3x, "
                 f"{met('packed_over_baseline')})   packed padding waste {100 * report['packed_padding_waste']:.2f} %"
                 f" (target <= 2 %, {met('packed_padding_waste')})")
    if report.get("packed_over_dense_per_position"):
        p = report["positions"]
        why = (": a document's last window is right-aligned and re-reads context" if p["packed"] > report["tokens"]
               else ": no window re-reads context")
        lines.append(f"per position read: packed / dense {100 * report['packed_over_dense_per_position']:.1f} % "
                     f"(packed reads {p['packed']:,} positions for {report['tokens']:,} tokens{why}; "
                     f"dense reads {p['dense']:,})")
    verdict = "agree" if report["nll_agrees"] else "DISAGREE"
    lines.append(f"NLL of {', '.join(report['nll_checked_modes'])}: {verdict}, max relative difference "
                 f"{report['nll_max_relative_difference']:.2e} (tolerance {report['nll_tolerance']:.0e} in "
                 f"{report['dtype']}); dense reads other contexts and is not checked")
    return "\n".join(lines)
