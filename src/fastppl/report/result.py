"""The result of `fastppl eval`: the metrics from the run's float64 sums, divided once, and what ran and why, as an
EvalResult whose to_dict() is the --json report."""
from __future__ import annotations

import math
import os
import platform
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Optional

import numpy as np
import torch

from .. import __version__
from ..data.corpus import Document
from ..data.packing import padding_waste
from ..data.streams import WindowPlan, scored_bytes_by_document, sliding_stride
from ..data.tokenize import Tokenizer
from ..engine.score import DeviceSums
from .groups import group_results
from .metrics import lm_eval_word_count, per_unit_metrics, perplexity
from ..stages import Corpus, Prepared, Run, Scored, Windows
from .positions import loss_by_position_buckets
from .protocol_card import protocol_card
from .stats import bootstrap, bootstrap_units, standard_errors



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


def _fields(part) -> dict:
    """A dataclass' fields as a dict, in their order, the values themselves (not copies)."""
    return {f.name: getattr(part, f.name) for f in fields(part)}


@dataclass
class Metrics:
    """The corpus' figures from the run's float64 sums, divided once, and their error bars."""
    nll: float
    ppl: float
    nll_sum: float
    tokens_scored: int
    tokens_total: int
    bits_per_token: float
    bytes: int
    bits_per_byte: float
    words: int
    word_perplexity: float
    byte_perplexity: float
    stderr: dict                  # nll_stderr, ppl_stderr, bits_per_byte_stderr (report.stats.standard_errors)
    bootstrap: Optional[dict]     # --bootstrap's intervals and the units it resampled
    groups: Optional[dict]        # --group-by's results (report.groups.group_results)

    def to_dict(self) -> dict:
        figures = {k: v for k, v in _fields(self).items() if k not in ("stderr", "bootstrap", "groups")}
        return {**figures, **self.stderr, "bootstrap": self.bootstrap, "groups": self.groups}


@dataclass
class CorpusSummary:
    """What was read: documents, the corpus' digest, how it was tokenized, and the windows it made."""
    documents: int
    corpus_sha256: str
    tokenization: str
    documents_skipped: int        # documents with no token to score
    windows: int


@dataclass
class HowItRan:
    """Batching, attention, the windows, compile, fusions, products and batch size: each choice and why."""
    batching: str
    batching_reason: str
    batches: Optional[int]                      # None: the KV-cache path makes rows of its own
    document_attention: Optional[str]           # the kernel that kept packed documents apart
    document_attention_fallback: Optional[str]  # why varlen gave way to FlexAttention, if it did
    padding_waste: Optional[float]
    ctx: int
    stride: Optional[int]
    window: str
    dtype: str
    backend: str                                # native, or transformers and why
    placement: str                              # resident, streamed or offloaded (fastppl.runner)
    placement_reason: str
    streaming: Optional[dict]                   # streamed: waves, bytes_streamed, copy_seconds(_hidden), blocks_rest_in
    compile: str
    mlp_epilogue: str
    residual_norms: str
    products: str
    loss: str
    batch_size: int
    batch_size_reason: str
    kv_cache: str
    tokens_forwarded: int                       # positions run through the model
    tokens_forwarded_without_cache: int


@dataclass
class Timings:
    """Where the time and memory went; stage_seconds names each stage of fastppl.pipeline.evaluate."""
    wall_seconds: float
    scoring_seconds: float
    stage_seconds: dict[str, float]
    tokens_per_second: float      # this run's tokens over its scoring time (NaN where it scored none)
    peak_memory_bytes: Optional[int]
    peak_host_memory_bytes: Optional[int]


@dataclass
class ByPosition:
    """Mean NLL, its population standard deviation and the count at each position inside the window."""
    nll: list
    nll_std: list
    tokens: list[int]
    buckets: list          # log-spaced buckets of positions (fastppl.report.positions)


@dataclass(eq=False)
class EvalResult(Mapping):
    """What fastppl.evaluate returns. to_dict() is the report `fastppl eval --json` writes (its fields in its
    order); as a read-only mapping, result["nll"] reads that report's field. per_token and per_doc hold what
    --per-token and --per-doc write (None unless asked for)."""
    metrics: Metrics
    corpus: CorpusSummary
    how_it_ran: HowItRan
    timings: Timings
    by_position: ByPosition
    per_doc_path: Optional[str]
    resumed_from_batch: Optional[int]     # --resume: the first batch this run scored
    windows_scored_this_run: int
    config: dict                          # EvalConfig.to_dict()
    environment: dict
    protocol: dict                        # report.protocol_card.protocol_card
    world_size: Optional[int] = None      # under torchrun
    divergence: Optional[dict] = None     # --reference-model (fastppl.reference.add_divergence)
    # (n_tokens,) float32 NLL, NaN where unscored; with a reference model (n_tokens, 12): engine.divergence.COLUMNS
    per_token: Optional[np.ndarray] = field(default=None, repr=False)
    per_doc: Optional[list[dict]] = field(default=None, repr=False)   # {"id", "tokens", "bytes", "words", "nll_sum"}

    def to_dict(self) -> dict:
        """The --json report (NaN and inf as floats: report.files.write_json writes them as null)."""
        report = {
            **self.metrics.to_dict(), **_fields(self.corpus), **_fields(self.how_it_ran), **_fields(self.timings),
            "nll_by_position": self.by_position.nll, "per_doc_path": self.per_doc_path,
            "resumed_from_batch": self.resumed_from_batch, "windows_scored_this_run": self.windows_scored_this_run,
            "nll_by_position_std": self.by_position.nll_std, "tokens_by_position": self.by_position.tokens,
            "nll_by_position_buckets": self.by_position.buckets,
            "config": self.config, "environment": self.environment,
        }
        if self.world_size:
            report["world_size"] = self.world_size
        report["protocol"] = self.protocol
        if self.divergence is not None:
            report["divergence"] = self.divergence
        return report

    def __getitem__(self, name: str) -> Any:
        return self.to_dict()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.to_dict())

    def __len__(self) -> int:
        return len(self.to_dict())


def _finite_or_none(values: np.ndarray) -> list:
    return [None if math.isnan(x) else float(x) for x in values]


def by_position(sums: DeviceSums) -> ByPosition:
    counts = sums.position_count.cpu().numpy()
    mean = np.where(counts > 0, sums.position_nll_sum.cpu().numpy() / np.maximum(counts, 1), np.nan)
    # E[x^2] - E[x]^2, clipped at 0 where float64 rounding makes a near-constant position's variance negative
    mean_square = np.where(counts > 0, sums.position_nll_sq_sum.cpu().numpy() / np.maximum(counts, 1), np.nan)
    std = np.sqrt(np.maximum(mean_square - mean ** 2, 0.0))
    return ByPosition(_finite_or_none(mean), _finite_or_none(std), [int(c) for c in counts],
                      loss_by_position_buckets(sums.position_nll_sum.cpu().numpy(), counts))


def corpus_metrics(nll_sum: float, plan: WindowPlan, n_bytes: int, n_words: int) -> dict:
    nll = nll_sum / plan.n_scored
    return {
        "nll": nll, "ppl": perplexity(nll), "nll_sum": nll_sum, "tokens_scored": plan.n_scored,
        "tokens_total": plan.n_tokens, "bits_per_token": nll / math.log(2), "bytes": n_bytes,
        "bits_per_byte": nll_sum / math.log(2) / n_bytes if n_bytes else float("nan"),
        **per_unit_metrics(nll_sum, n_bytes, n_words),
    }


def how_it_ran(run: Run, windows: Windows, prepared: Prepared, scored: Scored) -> HowItRan:
    acceleration, plan, use_kv_cache = prepared.acceleration, windows.plan, windows.use_kv_cache
    config, record = run.config, scored.record
    return HowItRan(
        # the cached sliding path scores document rows of its own, not the planned batches
        batching="kv-cache rows" if use_kv_cache else acceleration.batching,
        batching_reason="one row per document (--kv-cache on)" if use_kv_cache else acceleration.batching_reason,
        batches=None if use_kv_cache else len(scored.plans),
        document_attention=record.document_attention, document_attention_fallback=record.document_attention_fallback,
        padding_waste=None if use_kv_cache else padding_waste(scored.plans, plan.window_lengths),
        ctx=windows.ctx, stride=sliding_stride(config.stride, windows.ctx) if config.window == "sliding" else None,
        window=config.window, dtype=str(run.dtype).replace("torch.", ""),
        backend=record.backend, placement=record.placement, placement_reason=record.placement_reason,
        streaming=record.streaming,
        compile=acceleration.compile_reason, mlp_epilogue=acceleration.mlp_epilogue,
        residual_norms=acceleration.residual_norms, products=scored.products, loss=acceleration.loss,
        batch_size=scored.batch_size, batch_size_reason=scored.batch_size_reason, kv_cache=windows.kv_cache_reason,
        tokens_forwarded=plan.n_scored if use_kv_cache else plan.n_positions,
        tokens_forwarded_without_cache=plan.n_positions,
    )


def per_document(documents: list[Document], plan: WindowPlan, sums: DeviceSums, n_bytes: np.ndarray,
                 n_words: np.ndarray) -> list[dict]:
    nll_by_document = sums.per_document[:-1].cpu().numpy()
    return [{"id": documents[d].id, "tokens": int(plan.scored_by_document[d]), "bytes": int(n_bytes[d]),
             "words": int(n_words[d]), "nll_sum": float(nll_by_document[d])} for d in plan.scored_documents]


def metrics(config, corpus: Corpus, plan: WindowPlan, scored: Scored, bytes_by_document: np.ndarray,
            words_by_document: np.ndarray) -> Metrics:
    """The corpus' figures, the standard errors, the bootstrap intervals (--bootstrap) and the per-group results
    (--group-by)."""
    documents, sums = corpus.documents, scored.sums
    # lm-eval's wikitext task counts the words of every page, an empty one's too; elsewhere the scored documents'
    counted = np.arange(len(documents)) if config.protocol == "lm-eval-wikitext" else plan.scored_documents
    figures = corpus_metrics(scored.nll_sum, plan, int(bytes_by_document[counted].sum()),
                             int(words_by_document[counted].sum()))
    n_bytes = int(bytes_by_document[plan.scored_documents].sum())
    stderr = standard_errors(scored.nll_sum, float(sums.position_nll_sq_sum.sum()), plan.n_scored, n_bytes)
    boot = groups = None
    if config.bootstrap:
        units = bootstrap_units(documents, corpus.tokens, plan, sums, bytes_by_document, corpus.tokenizer)
        boot = bootstrap(units, config.bootstrap, config.bootstrap_seed)
    if config.group_by:
        groups = group_results(config.group_by, documents, plan, sums.per_document[:-1].cpu().numpy(),
                               bytes_by_document)
    return Metrics(**figures, stderr=stderr, bootstrap=boot, groups=groups)


def tokenization_note(tokenizer: Tokenizer) -> str:
    """How the corpus was tokenized: long texts in parallel pieces (fastppl.data.pieces) unless the tokenizer
    allows no exact cut; texts the token cache gave were tokenized by an earlier run."""
    if tokenizer.whole_text_reason:
        return f"whole texts: {tokenizer.whole_text_reason}"
    if tokenizer.texts_encoded == 0 and tokenizer.texts_from_cache:
        return "from the token cache (an earlier run's ids)"
    return "exact, long texts in parallel pieces"


def timings(run: Run, scored: Scored, scored_here: int) -> Timings:
    """scored_here: the tokens this run scored (a resumed run timed only those; a finished one, none)."""
    rate = scored_here / scored.seconds if scored.seconds > 0 and scored_here > 0 else float("nan")
    return Timings(wall_seconds=time.perf_counter() - run.started, scoring_seconds=scored.seconds,
                   stage_seconds=run.stage_seconds, tokens_per_second=rate,
                   peak_memory_bytes=torch.cuda.max_memory_allocated(run.device) if run.device.type == "cuda"
                   else None,
                   peak_host_memory_bytes=peak_host_memory_bytes())


def assemble_result(run: Run, corpus: Corpus, windows: Windows, prepared: Prepared, scored: Scored) -> EvalResult:
    """The result from the stages' own results (fastppl.pipeline.evaluate)."""
    config, documents, plan = run.config, corpus.documents, windows.plan
    bytes_by_document = scored_bytes_by_document(documents, corpus.tokens, plan, corpus.tokenizer)
    words_by_document = np.array([lm_eval_word_count(d.text_counted) for d in documents], dtype=np.int64)
    figures = metrics(config, corpus, plan, scored, bytes_by_document, words_by_document)
    return EvalResult(
        metrics=figures,
        corpus=CorpusSummary(documents=len(documents), corpus_sha256=corpus.digest,
                             tokenization=tokenization_note(corpus.tokenizer),
                             documents_skipped=len(documents) - len(plan.scored_documents), windows=len(plan.refs)),
        how_it_ran=how_it_ran(run, windows, prepared, scored),
        timings=timings(run, scored, plan.n_scored - scored.scored_before),
        by_position=by_position(scored.sums), per_doc_path=config.per_doc,
        resumed_from_batch=scored.start_batch if config.resume else None,
        windows_scored_this_run=int(sum(len(p.windows) for p in scored.plans[scored.start_batch:])),
        config=config.to_dict(), environment=environment(run.device),
        protocol=protocol_card(config, corpus.protocol, plan, corpus.tokenizer, windows.ctx, corpus.datasets,
                               figures, float(scored.sums.position_nll_sq_sum.sum().item())),
        world_size=run.dist.world_size if run.dist else None,
        per_token=scored.sums.per_token[:-1].cpu().numpy() if config.per_token else None,
        per_doc=per_document(documents, plan, scored.sums, bytes_by_document, words_by_document)
        if config.per_doc else None,
    )
