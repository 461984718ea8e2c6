"""The evaluation pipeline: corpus -> tokens -> windows -> batches -> device sums -> metrics."""
from __future__ import annotations

import dataclasses
import inspect
import math
import os
import platform
import sys
import signal
import time
from collections import Counter
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from . import __version__
from .accel.batch_size import auto_batch_size, balanced_batch_size, scoring_memory_bound
from .accel.compile import allow_shapes, compile_score_fn, model_family, use_compile
from .accel.cublaslt import (TuningChoice, picks_store, route_linears, start_tuning, stop_tuning, unroute_linears,
                             use_tuning)
from .accel.fused_mlp import fuse_mlp_epilogue
from .accel.warm_up import start_cuda_warm_up
from .config import EvalConfig
from .data.batching import WindowRef, batch_from_plan, make_batch
from .data.corpus import Document, corpus_sha256, load_documents
from .data.packing import padding_waste, plan_batches, resolve_batching, split_rows
from .data.tokenize import Tokenizer, encode_cached, load_tokenizer
from .data.windows import chunked_windows, sliding_windows
from .distributed import init_distributed, shard_plans, stop_all_on_failure
from .engine.cached_sliding import choose_kv_cache, score_cached_sliding
from .engine.precision import resolve_device, resolve_dtype
from .engine.loss import resolve_loss
from .engine.score import DeviceSums, make_score_fn, score_batches, score_plans
from .errors import FastpplError
from .metrics import lm_eval_word_count, per_unit_metrics, perplexity
from .models import load_model
from .models.loading import position_limit_note
from .models.hf_backend import HFCausalLM
from .models.attention import document_attention_backend, varlen_available, varlen_failure
from .models.gpt2 import GPT2
from .models.llama import Llama
from .progress import Progress
from .resume import KILL_AFTER_BATCHES_ENV, Checkpointer, document_ids_sha256, model_files, run_fingerprint


@dataclass
class Stream:
    """One document as the model reads it: [BOS] + tokens (chunked, or sliding with --bos) or tokens."""
    ids: np.ndarray       # (n,) int64
    bos: bool
    token_offset: int     # index of this document's first token in the corpus' token array

    @property
    def offset_of_target(self) -> int:
        # target stream index j is corpus token token_offset + j - (1 if bos else 0)
        return self.token_offset + (0 if self.bos else 1)


def sliding_stride(stride: Optional[int], ctx: int) -> int:
    """--stride, or by default half the context (each window after the first scores its last ctx/2 tokens)."""
    return stride or max(ctx // 2, 1)


def default_tokenizer_name(model_spec: str) -> str:
    # random weights have no tokenizer of their own; every preset's vocabulary holds GPT-2's
    return "gpt2" if model_spec.startswith("random:") else model_spec


def plan_windows(config: EvalConfig, streams: list[Stream], ctx: int) -> list[WindowRef]:
    refs = []
    for doc, stream in enumerate(streams):
        if config.window == "chunked":
            windows = chunked_windows(len(stream.ids) - 1, ctx)
        else:
            windows = sliding_windows(len(stream.ids), ctx, sliding_stride(config.stride, ctx))
        refs.extend(WindowRef(doc, w) for w in windows)
    return refs


def scored_bytes_by_document(documents: list[Document], tokens: list[np.ndarray], streams: list[Stream],
                             refs: list[WindowRef], tokenizer: Tokenizer) -> np.ndarray:
    """(n_documents,) UTF-8 bytes of each document's scored text: all of it, less the bytes of the tokens
    no window scores (sliding: each document's first token without --bos, and with --stride equal to
    --ctx each window's first)."""
    total = np.array([len(d.text.encode("utf-8")) for d in documents], dtype=np.int64)
    scored = [np.zeros(len(t), dtype=bool) for t in tokens]
    for ref in refs:
        w, stream = ref.window, streams[ref.doc]
        first = w.start + w.score_from + 1 - (1 if stream.bos else 0)   # stream index j is token j - bos
        scored[ref.doc][first:first + w.n_scored] = True
    for doc, (ids, mask) in enumerate(zip(tokens, scored)):
        total[doc] -= sum(tokenizer.token_n_bytes(ids, int(i)) for i in np.flatnonzero(~mask))
    return total


def with_decoded_text(document: Document, tokenizer: Tokenizer, vocab_size: int) -> Document:
    """A pre-tokenised document (.npy) with its text decoded from its ids, so that bytes and words count
    the text the ids stand for; the ids themselves are scored as they are, never re-encoded."""
    largest = int(document.token_ids.max())
    if largest >= vocab_size:
        raise FastpplError(f"{document.id}: token id {largest:,} is outside the model's vocabulary of "
                           f"{vocab_size:,}; the ids must come from the model's tokenizer")
    return dataclasses.replace(document, text=tokenizer.decode(document.token_ids.tolist()))


def takes_document_ids(model: torch.nn.Module) -> bool:
    """Whether the model's forward can keep packed documents apart (the native architectures can)."""
    return "document_ids" in inspect.signature(model.forward).parameters


def _environment(device: torch.device) -> dict:
    env = {"fastppl": __version__, "torch": torch.__version__, "python": platform.python_version(),
           "device": str(device), "device_name": "cpu"}
    if device.type == "cuda":
        env["device_name"] = torch.cuda.get_device_name(device)
        env["cuda"] = torch.version.cuda
    else:
        env["device_name"] = f"cpu ({platform.processor() or platform.machine()})"   # not a bare "x86_64"
    return env


def _peak_host_memory_bytes() -> Optional[int]:
    """The process' peak resident set size, so a CPU run reports its peak memory too."""
    try:
        import resource
    except ImportError:  # Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024   # Linux reports KiB, macOS bytes


@stop_all_on_failure   # under torchrun: a failing rank makes every rank stop
def evaluate(config: EvalConfig) -> dict:
    started = time.perf_counter()
    timings: dict[str, float] = {}   # seconds by stage, so that start-up costs are visible
    dist = init_distributed(config.device)   # None on one process
    device = dist.device if dist else resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    # overlaps the CUDA context's creation and Triton's first use with reading corpus, tokenizer and weights
    warm_ups = start_cuda_warm_up(device) if not dist else []

    documents = [d for source in config.data for d in load_documents(
        source, config.split, config.text_field, config.data_dir, config.errors)]
    timings["read_corpus"] = time.perf_counter() - started
    mark = time.perf_counter()
    tokenizer = load_tokenizer(config.tokenizer or default_tokenizer_name(config.model))
    timings["load_tokenizer"] = time.perf_counter() - mark
    mark = time.perf_counter()
    model = load_model(config.model, config.backend, dtype, config.seed, device)
    timings["load_model"] = time.perf_counter() - mark
    mark = time.perf_counter()
    if tokenizer.vocab_size > model.vocab_size:
        raise FastpplError(
            f"tokenizer {tokenizer.name!r} has {tokenizer.vocab_size:,} ids but the model's vocabulary has "
            f"{model.vocab_size:,}; pass the model's own tokenizer with --tokenizer"
        )
    ctx = config.ctx or model.max_positions
    if ctx > model.max_positions:
        raise FastpplError(f"--ctx {ctx} exceeds the model's maximum of {model.max_positions} positions"
                           f"{position_limit_note(model)}; lower --ctx")
    stride = config.stride
    if config.window == "sliding" and stride is not None and not 1 <= stride <= ctx:
        raise FastpplError(f"--stride must be between 1 and --ctx ({ctx}), got {stride}")
    # refused before any work: after the batch-size probe, these came seconds late on a GPU
    use_kv_cache, kv_cache_reason = choose_kv_cache(config.kv_cache, config.window, model)
    if dist and (use_kv_cache or config.resume):
        flag = "--resume" if config.resume else "--kv-cache on"
        raise FastpplError(f"{flag} runs in one process only; drop it or run without --nproc / torchrun")
    if use_kv_cache and config.batching != "auto":   # it would be ignored: the cached path makes its own rows
        raise FastpplError(f"--batching {config.batching} does not apply with --kv-cache on, which scores a row per "
                           "document; drop one of them")
    if use_kv_cache and config.resume:
        # the cached path scores documents row by row, not in the planned batches that checkpoints count
        raise FastpplError("--resume does not work with --kv-cache on; drop one of them")
    documents = [d if d.token_ids is None else with_decoded_text(d, tokenizer, model.vocab_size) for d in documents]
    tokens = [encode_cached(tokenizer, d.text) if d.token_ids is None else d.token_ids for d in documents]
    timings["tokenize"] = time.perf_counter() - mark
    corpus_digest = corpus_sha256(documents)   # the report's, and the resume fingerprint's
    n_tokens = sum(len(t) for t in tokens)
    use_bos = config.window == "chunked" or config.bos
    if n_tokens < 2:   # a corpus, not a document: one document of a set may well be a single token
        raise FastpplError(f"the corpus has {n_tokens} token(s); at least 2 are needed; pass a longer text")
    if use_bos and tokenizer.bos_id is None:
        raise FastpplError(f"tokenizer {tokenizer.name!r} has no BOS or end-of-text token to condition on; "
                           "use --window sliding without --bos")

    streams, offset = [], 0
    for ids in tokens:
        stream_ids = np.concatenate([[tokenizer.bos_id], ids]).astype(np.int64) if use_bos else ids
        streams.append(Stream(stream_ids, use_bos, offset))
        offset += len(ids)
    refs = plan_windows(config, streams, ctx)
    n_scored = sum(r.window.n_scored for r in refs)
    if n_scored == 0:
        raise FastpplError("no token can be scored (every document is a single token); add text or use --bos")
    # documents with nothing to score (empty, or one token when sliding without --bos) are skipped
    scored_by_window = np.array([r.window.n_scored for r in refs], dtype=np.int64)
    scored_by_document = np.bincount([r.doc for r in refs], weights=scored_by_window,
                                     minlength=len(documents)).astype(np.int64)
    scored_documents = np.flatnonzero(scored_by_document)

    mark = time.perf_counter()
    model = model.to(device)
    loss = config.loss
    loss = resolve_loss(loss, device)
    window_lengths = np.array([r.window.length for r in refs], dtype=np.int64)
    compiled, compile_reason = use_compile(config.compile, device, n_scored, loss, model_family(model),
                                           scored_share=n_scored / int(window_lengths.sum()))
    # asked only where auto could pack: its first call imports torch's varlen module (0.3 s on the H200)
    varlen = len(scored_documents) > 1 and varlen_available(device, dtype)
    batching, batching_reason = resolve_batching(config.batching, len(scored_documents), takes_document_ids(model),
                                                 varlen, compiled)
    if compiled and batching == "packed" and device.type == "cuda":
        # FlexAttention document masks inside the compiled scorer hit an illegal memory access in
        # Inductor on torch 2.11 (tests/test_document_attention.py on the H200); eager packing is exact.
        # varlen rows stay eager too: each batch's segment count and longest segment would recompile
        compiled, compile_reason = False, "off (packed rows run eager: compiled FlexAttention failed on torch 2.11)"
    mlp_epilogue = "plain"
    if device.type == "cuda" and not compiled and fuse_mlp_epilogue(model):
        mlp_epilogue = "fused bias+GELU (cuBLASLt)"   # measured +4 % eager on the H200 (docs/BENCHMARKS.md)
    residual_norms = "plain"
    if device.type == "cuda" and not compiled:
        from .accel.fused_norm import fuse_residual_norms
        if fuse_residual_norms(model):
            residual_norms = "residual adds inside the projections (cuBLAS), bias sums in the LayerNorms (Triton)"
    score_fn = make_score_fn(model, config.loss_chunk_rows, loss)
    if compiled:
        score_fn = compile_score_fn(score_fn)
    stream_ids, target_offsets = [s.ids for s in streams], [s.offset_of_target for s in streams]
    timings["prepare"] = time.perf_counter() - mark
    mark = time.perf_counter()
    for thread in warm_ups:
        thread.join()   # before the first kernel (accel/warm_up.start_cuda_warm_up says why)
    timings["wait_for_warm_up"] = time.perf_counter() - mark
    mark = time.perf_counter()
    if config.batch_size == "auto":
        probe_sums = DeviceSums.zeros(ctx, device)
        longest = [refs[int(np.argmax(window_lengths))]]   # every rank probes with the same window
        # rows of ctx positions: a padded or packed row is ctx long, and a bucket's rows hold as many positions
        bound = scoring_memory_bound(model, ctx, dtype.itemsize, loss, config.loss_chunk_rows)
        batch_size, batch_size_reason = auto_batch_size(
            lambda rows: score_batches(score_fn, [make_batch(longest * rows, stream_ids, target_offsets, rows, ctx)],
                                       probe_sums, device), len(refs), device, bound=bound)
        if dist:
            fewest = dist.min_over_ranks(batch_size)
            if fewest < batch_size:
                batch_size, batch_size_reason = fewest, batch_size_reason + f", the fewest over ranks: {fewest}"
    else:
        batch_size, batch_size_reason = min(config.batch_size, len(refs)), "--batch-size"
    plans = plan_batches(window_lengths, batching, ctx, batch_size)
    if config.batch_size == "auto":
        balanced = balanced_batch_size(batch_size, len(refs))
        balanced_plans = plan_batches(window_lengths, batching, ctx, balanced) if balanced < batch_size else plans
        if sum(p.n_rows * p.seq_len for p in balanced_plans) < sum(p.n_rows * p.seq_len for p in plans):
            batch_size, plans = balanced, balanced_plans   # fewer padding rows in the last batch
            batch_size_reason += f", balanced to {balanced} rows"
    timings["choose_batch_size"] = time.perf_counter() - mark
    if compiled:
        allow_shapes(len({(p.n_rows, p.seq_len) for p in plans}))
    # each rank scores its share of the batches; the batches are those of one process
    plans_here = shard_plans(plans, dist.rank, dist.world_size) if dist else plans

    sums = DeviceSums.zeros(ctx, device, n_tokens if config.per_token else None, len(documents))
    checkpointer, start_batch = None, 0
    if config.resume:
        fingerprint = run_fingerprint(
            config.to_dict(), corpus_sha256=corpus_digest, document_ids_sha256=document_ids_sha256(documents),
            tokenizer_fingerprint=tokenizer.fingerprint,
            model_files=model_files(config.model), resolved_device=str(device), resolved_dtype=str(dtype),
            resolved_batching=batching, resolved_batch_size=batch_size, windows=len(refs), fastppl=__version__,
        )
        checkpointer = Checkpointer(config.resume, fingerprint, plans, len(refs),
                                    config.checkpoint_batches, config.checkpoint_seconds)
        start_batch = checkpointer.load(sums)
    scored_before = int(sum(scored_by_window[p.windows].sum() for p in plans[:start_batch]))
    progress = Progress(n_scored, enabled=not config.quiet and (dist is None or dist.is_main))
    progress.advance(scored_before)
    kill_after = int(os.environ.get(KILL_AFTER_BATCHES_ENV, "0"))   # tests only: a crash at a chosen batch
    batches_done = start_batch
    advance = lambda batch: progress.advance(batch.n_scored)  # noqa: E731
    if dist:
        advance = dist.batch_hook(progress, int(sum(scored_by_window[p.windows].sum() for p in plans_here)), n_scored)
        dist.wait_for_peers("to the start of scoring")   # so that scoring_seconds times the whole job

    def after_batch(batch) -> None:
        nonlocal batches_done
        batches_done += 1
        advance(batch)
        if checkpointer is not None:
            checkpointer.after_batch(batches_done, sums)
        if kill_after and batches_done - start_batch == kill_after:
            os.kill(os.getpid(), signal.SIGKILL)

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    # after the batch size is chosen, so that the probe's shapes are not timed
    positions_by_rows = Counter()   # a batch's products have its positions as rows; this process's batches only
    for plan in plans_here[start_batch:]:
        positions_by_rows[plan.n_rows * plan.seq_len] += plan.n_rows * plan.seq_len
    tuning = use_tuning(config.tune_products, device, dtype, positions_by_rows, compiled)
    if tuning.mode != "off" and not isinstance(model, (GPT2, Llama)):
        tuning = TuningChoice("off", "torch's picks (tuning is for fastppl's native models)")
    elif tuning.mode != "off" and use_kv_cache:
        tuning = TuningChoice("off", "torch's picks (the cached sliding rows change shape at every stride)")
    products = tuning.reason
    if tuning.mode != "off":
        route_linears(model)
        tuner = start_tuning(picks_store(), tuning.mode == "time", tuning.timed_rows)
    scoring_started = time.perf_counter()
    try:
        if use_kv_cache:
            # each window runs over its new tokens only (fastppl.engine.cached_sliding)
            score_cached_sliding(
                model, refs, stream_ids, target_offsets, ctx,
                sliding_stride(config.stride, ctx), batch_size, sums, device, on_step=progress.advance,
                compile_fn=compile_score_fn if compiled else None, chunk_rows=config.loss_chunk_rows,
                document_starts=np.array([s.token_offset for s in streams], dtype=np.int64),
            )
            tokens_forwarded = n_scored
        else:
            # out of memory: the failing batch is split by rows and scored again (not with --resume, whose
            # checkpoints count whole batches)
            backed_off_to = score_plans(score_fn, plans_here[start_batch:],
                                        lambda p: batch_from_plan(p, refs, stream_ids, target_offsets),
                                        sums, device, on_batch=after_batch, split=None if checkpointer else split_rows)
            if backed_off_to:
                batch_size_reason += f"; out of memory at it, later batches ran {backed_off_to} rows"
            tokens_forwarded = sum(r.window.length for r in refs)
        if tuning.mode != "off":
            products = f"{products}: {tuner.summary()}"
    finally:
        if tuning.mode != "off":
            stop_tuning()
            unroute_linears(model)
    if dist:
        dist.all_reduce_sums(sums, n_scored)
    nll_sum = float(sums.nll_sum.item())   # the run's one host sync
    if checkpointer is not None and start_batch < len(plans):
        checkpointer.save(len(plans), sums)   # complete: a rerun gives the result without scoring
    scoring_seconds = time.perf_counter() - scoring_started
    timings["scoring"] = scoring_seconds
    progress.close()
    if not math.isfinite(nll_sum):
        raise FastpplError("the model produced a non-finite loss; try --dtype fp32" if dtype != torch.float32 else
                           "the model produced a non-finite loss in fp32; check its weights for NaN or inf")

    bytes_by_document = scored_bytes_by_document(documents, tokens, streams, refs, tokenizer)
    words_by_document = np.array([lm_eval_word_count(d.text) for d in documents], dtype=np.int64)
    n_bytes = int(bytes_by_document[scored_documents].sum())
    n_words = int(words_by_document[scored_documents].sum())
    nll = nll_sum / n_scored
    counts = sums.position_count.cpu().numpy()
    by_position = np.where(counts > 0, sums.position_nll_sum.cpu().numpy() / np.maximum(counts, 1), np.nan)
    # population standard deviation of the token NLLs at each position: E[x^2] - E[x]^2, clipped at 0
    # where float64 rounding makes a near-constant position's variance slightly negative
    mean_square = np.where(counts > 0, sums.position_nll_sq_sum.cpu().numpy() / np.maximum(counts, 1), np.nan)
    std_by_position = np.sqrt(np.maximum(mean_square - by_position ** 2, 0.0))
    wall = time.perf_counter() - started
    result = {
        "nll": nll,
        "ppl": perplexity(nll),
        "nll_sum": nll_sum,
        "tokens_scored": n_scored,
        "tokens_total": n_tokens,
        "bits_per_token": nll / math.log(2),
        "bytes": n_bytes,
        "bits_per_byte": nll_sum / math.log(2) / n_bytes if n_bytes else float("nan"),
        **per_unit_metrics(nll_sum, n_bytes, n_words),
        "documents": len(documents),
        "corpus_sha256": corpus_digest,
        "documents_skipped": len(documents) - len(scored_documents),
        "windows": len(refs),
        # the cached sliding path scores document rows of its own, not the planned batches
        "batching": "kv-cache rows" if use_kv_cache else batching,
        "batching_reason": "one row per document (--kv-cache on)" if use_kv_cache else batching_reason,
        "batches": None if use_kv_cache else len(plans),
        # the kernel that kept packed documents apart: varlen, flex or sdpa-mask (after any fallback)
        "document_attention": document_attention_backend(device, dtype) if batching == "packed" and not use_kv_cache
                              else None,
        "document_attention_fallback": varlen_failure(),   # why varlen gave way to FlexAttention, if it did
        "padding_waste": None if use_kv_cache else padding_waste(plans, window_lengths),
        "ctx": ctx,
        "stride": sliding_stride(config.stride, ctx) if config.window == "sliding" else None,
        "window": config.window,
        "dtype": str(dtype).replace("torch.", ""),
        # native, or transformers and why (asked for, or what the native model lacks)
        "backend": f"transformers ({model.why})" if isinstance(model, HFCausalLM) else "native",
        "compile": compile_reason,
        "mlp_epilogue": mlp_epilogue,
        "residual_norms": residual_norms,
        "products": products,
        "loss": loss,
        "batch_size": batch_size,
        "batch_size_reason": batch_size_reason,
        "kv_cache": kv_cache_reason,
        "tokens_forwarded": tokens_forwarded,   # token positions run through the model
        "tokens_forwarded_without_cache": sum(r.window.length for r in refs),
        "wall_seconds": wall,
        "scoring_seconds": scoring_seconds,
        "stage_seconds": timings,
        # this run's tokens over this run's time (a resumed run timed only what it scored; a finished one, nothing)
        "tokens_per_second": ((n_scored - scored_before) / scoring_seconds
                              if scoring_seconds > 0 and n_scored > scored_before else float("nan")),
        "peak_memory_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
        "peak_host_memory_bytes": _peak_host_memory_bytes(),
        "nll_by_position": [None if math.isnan(x) else float(x) for x in by_position],
        "per_doc_path": config.per_doc,
        "resumed_from_batch": start_batch if config.resume else None,
        "windows_scored_this_run": int(sum(len(p.windows) for p in plans[start_batch:])),
        "nll_by_position_std": [None if math.isnan(x) else float(x) for x in std_by_position],
        "tokens_by_position": [int(c) for c in counts],
        "config": config.to_dict(),
        "environment": _environment(device),
    }
    if dist:
        result["world_size"] = dist.world_size
    if config.per_token:
        result["_per_token"] = sums.per_token[:-1].cpu().numpy()
    if config.per_doc:
        nll_by_document = sums.per_document[:-1].cpu().numpy()
        result["_per_doc"] = [
            {"id": documents[d].id, "tokens": int(scored_by_document[d]), "bytes": int(bytes_by_document[d]),
             "words": int(words_by_document[d]), "nll_sum": float(nll_by_document[d])}
            for d in scored_documents
        ]
    return result
