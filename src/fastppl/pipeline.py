"""The evaluation pipeline: corpus -> tokens -> windows -> batches -> device sums -> metrics."""
from __future__ import annotations

import math
import platform
import time
from dataclasses import dataclass

import numpy as np
import torch

from . import __version__
from .accel.compile import compile_score_fn, use_compile
from .config import EvalConfig
from .data.batching import WindowRef, iter_batches
from .data.corpus import Document, load_documents
from .data.tokenize import Tokenizer, encode_cached, load_tokenizer
from .data.windows import chunked_windows, sliding_windows
from .engine.precision import resolve_device, resolve_dtype
from .engine.score import DeviceSums, make_score_fn, score_batches
from .errors import FastpplError
from .models import load_model
from .progress import Progress


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


def default_tokenizer_name(model_spec: str) -> str:
    return "gpt2" if model_spec.startswith("random:gpt2") else model_spec


def plan_windows(config: EvalConfig, streams: list[Stream], ctx: int) -> list[WindowRef]:
    refs = []
    for doc, stream in enumerate(streams):
        if config.window == "chunked":
            windows = chunked_windows(len(stream.ids) - 1, ctx)
        else:
            windows = sliding_windows(len(stream.ids), ctx, config.stride or max(ctx // 2, 1))
        refs.extend(WindowRef(doc, w) for w in windows)
    return refs


def scored_bytes(config: EvalConfig, documents: list[Document], tokens: list[np.ndarray], tokenizer: Tokenizer) -> int:
    """UTF-8 bytes of the scored text: all of it, less the first token of each document when sliding
    without --bos leaves that token unscored."""
    total = sum(len(d.text.encode("utf-8")) for d in documents)
    if config.window == "sliding" and not config.bos:
        total -= sum(tokenizer.n_bytes(t[:1]) for t in tokens if len(t))
    return total


def _environment(device: torch.device) -> dict:
    env = {"fastppl": __version__, "torch": torch.__version__, "python": platform.python_version(),
           "device": str(device), "device_name": "cpu"}
    if device.type == "cuda":
        env["device_name"] = torch.cuda.get_device_name(device)
        env["cuda"] = torch.version.cuda
    else:
        env["device_name"] = platform.processor() or platform.machine()
    return env


def evaluate(config: EvalConfig) -> dict:
    started = time.perf_counter()
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)

    documents = [d for source in config.data for d in load_documents(
        source, config.split, config.text_field, config.data_dir, config.errors)]
    model = load_model(config.model, config.backend, dtype, config.seed)
    tokenizer = load_tokenizer(config.tokenizer or default_tokenizer_name(config.model))
    if tokenizer.vocab_size > model.vocab_size:
        raise FastpplError(
            f"tokenizer {tokenizer.name!r} has {tokenizer.vocab_size:,} ids but the model's vocabulary has "
            f"{model.vocab_size:,}; pass the model's own tokenizer with --tokenizer"
        )
    ctx = config.ctx or model.max_positions
    if ctx > model.max_positions:
        raise FastpplError(f"--ctx {ctx} exceeds the model's maximum of {model.max_positions} positions; lower --ctx")
    stride = config.stride
    if config.window == "sliding" and stride is not None and not 1 <= stride <= ctx:
        raise FastpplError(f"--stride must be between 1 and --ctx ({ctx}), got {stride}")

    tokens = [encode_cached(tokenizer, d.text) for d in documents]
    n_tokens = sum(len(t) for t in tokens)
    if n_tokens < 2:
        raise FastpplError(f"the corpus has {n_tokens} token(s); at least 2 are needed to score anything")
    use_bos = config.window == "chunked" or config.bos
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

    model = model.to(device)
    score_fn = make_score_fn(model, config.loss_chunk_rows)
    compiled, compile_reason = use_compile(config.compile, device, n_scored)
    if compiled:
        score_fn = compile_score_fn(score_fn)
    # longest first: the first (compiled) shape is the largest, and a memory error shows at once
    refs.sort(key=lambda r: -r.window.length)
    batch_size = min(config.batch_size, len(refs))

    sums = DeviceSums.zeros(ctx, device, n_tokens if config.per_token else None)
    progress = Progress(n_scored, enabled=not config.quiet)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    scoring_started = time.perf_counter()
    score_batches(
        score_fn, iter_batches(refs, [s.ids for s in streams], [s.offset_of_target for s in streams], batch_size, ctx),
        sums, device, on_batch=lambda b: progress.advance(b.n_scored),
    )
    nll_sum = float(sums.nll_sum.item())   # the run's one host sync
    scoring_seconds = time.perf_counter() - scoring_started
    progress.close()
    if not math.isfinite(nll_sum):
        raise FastpplError("the model produced a non-finite loss; try --dtype fp32")

    n_bytes = scored_bytes(config, documents, tokens, tokenizer)
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
        "ppl": math.exp(nll),
        "nll_sum": nll_sum,
        "tokens_scored": n_scored,
        "tokens_total": n_tokens,
        "bits_per_token": nll / math.log(2),
        "bytes": n_bytes,
        "bits_per_byte": nll_sum / math.log(2) / n_bytes if n_bytes else float("nan"),
        "documents": len(documents),
        "windows": len(refs),
        "ctx": ctx,
        "stride": (config.stride or max(ctx // 2, 1)) if config.window == "sliding" else None,
        "window": config.window,
        "dtype": str(dtype).replace("torch.", ""),
        "compile": compile_reason,
        "wall_seconds": wall,
        "scoring_seconds": scoring_seconds,
        "tokens_per_second": n_scored / scoring_seconds if scoring_seconds > 0 else float("nan"),
        "peak_memory_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
        "nll_by_position": [None if math.isnan(x) else float(x) for x in by_position],
        "nll_by_position_std": [None if math.isnan(x) else float(x) for x in std_by_position],
        "tokens_by_position": [int(c) for c in counts],
        "config": config.to_dict(),
        "environment": _environment(device),
    }
    if config.per_token:
        result["_per_token"] = sums.per_token[:-1].cpu().numpy()
    return result
