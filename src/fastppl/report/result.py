"""The result of `fastppl eval`: the metrics from the run's float64 sums, divided once, and what ran and why."""
from __future__ import annotations

import math
import os
import platform
import sys
import time
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
import torch.nn as nn

from .. import __version__
from ..data.corpus import Document
from ..data.packing import BatchPlan, padding_waste
from ..data.streams import WindowPlan, scored_bytes_by_document, sliding_stride
from ..data.tokenize import Tokenizer
from ..engine.score import DeviceSums
from ..models.attention import document_attention_backend, varlen_failure
from ..models.hf_backend import HFCausalLM
from .groups import group_results
from .metrics import lm_eval_word_count, per_unit_metrics, perplexity
from .positions import loss_by_position_buckets
from .stats import bootstrap, bootstrap_units, standard_errors


@dataclass
class Scored:
    """What the scoring stage returns: the sums of every rank, and how the batches ran."""
    sums: DeviceSums
    nll_sum: float
    seconds: float
    scored_before: int     # tokens a resumed run found scored in its checkpoint
    start_batch: int       # the first batch this run scored (after a checkpoint's)
    batch_size: int
    batch_size_reason: str
    plans: list[BatchPlan]
    products: str


def environment(device: torch.device) -> dict:
    env = {"fastppl": __version__, "torch": torch.__version__, "python": platform.python_version(),
           "device": str(device), "device_name": "cpu"}
    if device.type == "cuda":
        env["device_name"] = torch.cuda.get_device_name(device)
        env["cuda"] = torch.version.cuda
    else:
        env["device_name"] = f"cpu ({platform.processor() or platform.machine()})"   # not a bare "x86_64"
    return env


def seconds_since_process_start() -> Optional[float]:
    """How long this process has run, to about 10 ms (Linux): the interpreter's start and the imports before a
    stage began. None where /proc does not say."""
    try:
        with open("/proc/self/stat") as stat, open("/proc/uptime") as uptime:
            start_ticks = int(stat.read().rsplit(")", 1)[1].split()[19])   # field 22, starttime, in clock ticks
            return max(float(uptime.read().split()[0]) - start_ticks / os.sysconf("SC_CLK_TCK"), 0.0)
    except (OSError, ValueError, IndexError):
        return None


def peak_host_memory_bytes() -> Optional[int]:
    """The process' peak resident set size, so that a CPU run reports its peak memory too. On Linux VmHWM, this
    program's own peak: getrusage's ru_maxrss also counts the parent's resident memory at the fork (a parent that
    held a 10 GB model made a 2.5 GB checkpoint's load read as 12.9 GB)."""
    try:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:"))
    except (OSError, StopIteration, ValueError, IndexError):
        pass
    try:
        import resource
    except ImportError:  # Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024   # Linux reports KiB, macOS bytes


def _finite_or_none(values: np.ndarray) -> list:
    return [None if math.isnan(x) else float(x) for x in values]


def by_position(sums: DeviceSums) -> dict:
    """Mean NLL, its population standard deviation and the count at each position inside the window."""
    counts = sums.position_count.cpu().numpy()
    mean = np.where(counts > 0, sums.position_nll_sum.cpu().numpy() / np.maximum(counts, 1), np.nan)
    # E[x^2] - E[x]^2, clipped at 0 where float64 rounding makes a near-constant position's variance negative
    mean_square = np.where(counts > 0, sums.position_nll_sq_sum.cpu().numpy() / np.maximum(counts, 1), np.nan)
    std = np.sqrt(np.maximum(mean_square - mean ** 2, 0.0))
    return {"nll_by_position": _finite_or_none(mean), "nll_by_position_std": _finite_or_none(std),
            "tokens_by_position": [int(c) for c in counts],
            "nll_by_position_buckets": loss_by_position_buckets(sums.position_nll_sum.cpu().numpy(), counts)}


def corpus_metrics(nll_sum: float, plan: WindowPlan, n_bytes: int, n_words: int) -> dict:
    nll = nll_sum / plan.n_scored
    return {
        "nll": nll, "ppl": perplexity(nll), "nll_sum": nll_sum, "tokens_scored": plan.n_scored,
        "tokens_total": plan.n_tokens, "bits_per_token": nll / math.log(2), "bytes": n_bytes,
        "bits_per_byte": nll_sum / math.log(2) / n_bytes if n_bytes else float("nan"),
        **per_unit_metrics(nll_sum, n_bytes, n_words),
    }


def how_it_ran(acceleration, scored: Scored, plan: WindowPlan, model: nn.Module, device: torch.device,
               dtype: torch.dtype, use_kv_cache: bool, window: dict, kv_cache: str) -> dict:
    """Batching, attention, the windows, compile, fusions, products and batch size: each choice and why."""
    packed = acceleration.batching == "packed" and not use_kv_cache
    return {
        # the cached sliding path scores document rows of its own, not the planned batches
        "batching": "kv-cache rows" if use_kv_cache else acceleration.batching,
        "batching_reason": "one row per document (--kv-cache on)" if use_kv_cache else acceleration.batching_reason,
        "batches": None if use_kv_cache else len(scored.plans),
        # the kernel that kept packed documents apart: varlen, flex or sdpa-mask (after any fallback)
        "document_attention": document_attention_backend(device, dtype) if packed else None,
        "document_attention_fallback": varlen_failure(),   # why varlen gave way to FlexAttention, if it did
        "padding_waste": None if use_kv_cache else padding_waste(scored.plans, plan.window_lengths),
        **window, "dtype": str(dtype).replace("torch.", ""),
        # native, or transformers and why (asked for, or what the native model lacks)
        "backend": f"transformers ({model.why})" if isinstance(model, HFCausalLM) else "native",
        "compile": acceleration.compile_reason, "mlp_epilogue": acceleration.mlp_epilogue,
        "residual_norms": acceleration.residual_norms, "products": scored.products, "loss": acceleration.loss,
        "batch_size": scored.batch_size, "batch_size_reason": scored.batch_size_reason, "kv_cache": kv_cache,
        "tokens_forwarded": plan.n_scored if use_kv_cache else plan.n_positions,   # positions run through the model
        "tokens_forwarded_without_cache": plan.n_positions,
    }


def per_document(documents: list[Document], plan: WindowPlan, sums: DeviceSums, n_bytes: np.ndarray,
                 n_words: np.ndarray) -> list[dict]:
    nll_by_document = sums.per_document[:-1].cpu().numpy()
    return [{"id": documents[d].id, "tokens": int(plan.scored_by_document[d]), "bytes": int(n_bytes[d]),
             "words": int(n_words[d]), "nll_sum": float(nll_by_document[d])} for d in plan.scored_documents]


def error_bars(config, documents: list[Document], tokens: list[np.ndarray], tokenizer: Tokenizer, plan: WindowPlan,
               sums: DeviceSums, nll_sum: float, bytes_by_document: np.ndarray) -> dict:
    """The standard errors, the bootstrap intervals (--bootstrap) and the per-group results (--group-by)."""
    n_bytes = int(bytes_by_document[plan.scored_documents].sum())
    fields = standard_errors(nll_sum, float(sums.position_nll_sq_sum.sum()), plan.n_scored, n_bytes)
    fields["bootstrap"] = None
    if config.bootstrap:
        units = bootstrap_units(documents, tokens, plan, sums, bytes_by_document, tokenizer)
        fields["bootstrap"] = bootstrap(units, config.bootstrap, config.bootstrap_seed)
    fields["groups"] = None
    if config.group_by:
        fields["groups"] = group_results(config.group_by, documents, plan, sums.per_document[:-1].cpu().numpy(),
                                         bytes_by_document)
    return fields


def tokenization_note(tokenizer: Tokenizer) -> str:
    """How the corpus was tokenized: long texts in parallel pieces (fastppl.data.pieces) unless the tokenizer
    allows no exact cut; texts the token cache gave were tokenized by an earlier run."""
    if tokenizer.whole_text_reason:
        return f"whole texts: {tokenizer.whole_text_reason}"
    if tokenizer.texts_encoded == 0 and tokenizer.texts_from_cache:
        return "from the token cache (an earlier run's ids)"
    return "exact, long texts in parallel pieces"


def assemble_result(config, device: torch.device, dtype: torch.dtype, documents: list[Document], corpus_digest: str,
                    tokens: list[np.ndarray], tokenizer: Tokenizer, model: nn.Module, plan: WindowPlan,
                    acceleration, scored: Scored, *, ctx: int, kv_cache: str, use_kv_cache: bool,
                    stage_seconds: dict, started: float, world_size: Optional[int]) -> dict:
    """The report's fields ("_per_token" and "_per_doc" hold what goes to --per-token and --per-doc); started:
    the run's perf_counter() at its start, for wall_seconds."""
    bytes_by_document = scored_bytes_by_document(documents, tokens, plan, tokenizer)
    words_by_document = np.array([lm_eval_word_count(d.text_counted) for d in documents], dtype=np.int64)
    scored_here = plan.n_scored - scored.scored_before
    window = {"ctx": ctx, "stride": sliding_stride(config.stride, ctx) if config.window == "sliding" else None,
              "window": config.window}
    positions = by_position(scored.sums)
    # lm-eval's wikitext task counts the words of every page, an empty one's too; elsewhere the scored documents'
    counted = np.arange(len(documents)) if config.protocol == "lm-eval-wikitext" else plan.scored_documents
    result = {
        **corpus_metrics(scored.nll_sum, plan, int(bytes_by_document[counted].sum()),
                         int(words_by_document[counted].sum())),
        **error_bars(config, documents, tokens, tokenizer, plan, scored.sums, scored.nll_sum, bytes_by_document),
        "documents": len(documents), "corpus_sha256": corpus_digest,
        # long texts go through the tokenizer in parallel pieces (fastppl.data.pieces) unless it allows no exact cut
        "tokenization": tokenization_note(tokenizer),
        "documents_skipped": len(documents) - len(plan.scored_documents), "windows": len(plan.refs),
        **how_it_ran(acceleration, scored, plan, model, device, dtype, use_kv_cache, window, kv_cache),
        "wall_seconds": time.perf_counter() - started, "scoring_seconds": scored.seconds,
        "stage_seconds": stage_seconds,
        # this run's tokens over this run's time (a resumed run timed only what it scored; a finished one, nothing)
        "tokens_per_second": scored_here / scored.seconds if scored.seconds > 0 and scored_here > 0 else float("nan"),
        "peak_memory_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
        "peak_host_memory_bytes": peak_host_memory_bytes(),
        "nll_by_position": positions["nll_by_position"], "per_doc_path": config.per_doc,
        "resumed_from_batch": scored.start_batch if config.resume else None,
        "windows_scored_this_run": int(sum(len(p.windows) for p in scored.plans[scored.start_batch:])),
        "nll_by_position_std": positions["nll_by_position_std"], "tokens_by_position": positions["tokens_by_position"],
        "nll_by_position_buckets": positions["nll_by_position_buckets"],   # log-spaced (fastppl.report.positions)
        "config": config.to_dict(), "environment": environment(device),
    }
    if world_size:
        result["world_size"] = world_size
    if config.per_token:
        result["_per_token"] = scored.sums.per_token[:-1].cpu().numpy()
    if config.per_doc:
        result["_per_doc"] = per_document(documents, plan, scored.sums, bytes_by_document, words_by_document)
    return result
