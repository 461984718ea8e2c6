"""The evaluation pipeline, a composition of named stages:
read -> tokenize -> plan -> accelerate -> choose batches -> score -> result."""
from __future__ import annotations

import json
import math
import threading
import time
from typing import Any, Callable, Optional

import numpy as np
import torch
import torch.nn as nn

from . import __version__
from .accel.apply import Acceleration
from .accel.batch_size import balanced_batch_size
from .accel.compile import finish_compiled_run
from .accel.context_fit import explaining_ctx
from .accel.warm_up import start_cuda_warm_up
from .config import EvalConfig, check_ctx, check_one_process
from .data.corpus import Document, Fields, check_sources_distinct, corpus_documents, corpus_sha256
from .data.packing import BatchPlan, plan_batches
from .data.protocols import PROTOCOLS, Protocol, read_protocol_corpus
from .data.streams import WindowPlan, plan_corpus, sliding_stride, with_decoded_text
from .data.tokenize import (Tokenizer, check_ids_in_vocabulary, default_tokenizer_name, encode_documents,
                            load_tokenizer)
from .distributed import init_distributed, shard_plans, stop_all_on_failure
from .engine.cached_sliding import choose_kv_cache
from .engine.precision import resolve_device, resolve_dtype
from .engine.score import DeviceSums
from .errors import FastpplError
from .models import load_model
from .models.loading import position_limit_note
from .offline import explain_offline
from .reference import (add_divergence, check_reference_fits, check_reference_matches, load_reference,
                        reference_tokenizer, resolve_reference_device)
from .report.progress import Progress
from .report.result import EvalResult, assemble_result
from .reuse import Reuse
from .runner import Runner, choose_placement
from .stages import Batches, Corpus, Run, RunRecord, Scored, Windows
from .report.stats import bootstrap_unit_count, check_bootstrap_work, needs_token_sums
from .resume import (NOT_IN_FINGERPRINT, Checkpointer, document_ids_sha256, model_files, run_fingerprint,
                     weights_digest)


@stop_all_on_failure   # under torchrun: a failing rank makes every rank stop
@explain_offline   # offline: one line for all that is not local
def evaluate(config: EvalConfig, reuse: Optional[Reuse] = None) -> EvalResult:
    """One run; `reuse` holds what the runs of a table share (fastppl.reuse), a fresh one by default."""
    started = time.perf_counter()
    reuse = reuse or Reuse()
    dist = init_distributed(config.device)
    device = dist.device if dist else resolve_device(config.device)
    run = Run(config, device, resolve_dtype(config.dtype, device), dist, started)
    if dist:
        check_one_process(config)   # the options were checked when config was built; these need one process
    reference_device = resolve_reference_device(config, device)
    # overlaps the CUDA context's creation and Triton's first use with reading corpus, tokenizer and weights
    warm_ups = start_cuda_warm_up(device) if not dist else []
    corpus_key = corpus_identity(config)
    documents, protocol, datasets_read = reuse.corpus(corpus_key, lambda: read_corpus(config))
    run.stage_done("read_corpus")
    tokenizer_name = config.tokenizer or default_tokenizer_name(config.model, config.data_dir)
    tokenizer = reuse.tokenizer(tokenizer_name, lambda: load_tokenizer(tokenizer_name))
    if protocol is not None and protocol.specials_as_text:
        tokenizer = tokenizer.with_specials_as_text()
    run.stage_done("load_tokenizer")
    # tokenizing needs neither the model nor the GPU: it runs beside the weights' loading and the CUDA start
    encoding = InBackground(lambda: encode_once(reuse, corpus_key, documents, tokenizer), "fastppl-tokenize")
    # where the weights rest (fastppl.runner): on the device, or in host memory for the streamed path
    placement = choose_placement(config, device, run.dtype)
    model = reuse.model("model", (config.model, config.backend, run.dtype, config.seed, str(device),
                                  placement.streamed, placement.offload_bytes),
                        lambda: load_model(config.model, config.backend, run.dtype, config.seed, device,
                                           placement.streamed, placement.offload_bytes))
    reference = reuse.model("reference", (*reference_identity(config, run.dtype, reference_device),
                                          placement.streamed),
                            lambda: load_reference(config, run.dtype, reference_device, placement.streamed)) \
        if config.reference_model else None
    if reference is not None:   # loaded now or kept from an earlier run of a table: checked against this model
        own = reuse.tokenizer(("reference", config.reference_model),
                              lambda: reference_tokenizer(config.reference_model))
        check_reference_matches(config, reference, model, tokenizer, own)
    run.stage_done("load_model")
    ctx = check_model_fits(config, tokenizer, model)
    check_reference_fits(config, reference, ctx)
    use_kv_cache, kv_cache_reason = choose_kv_cache(config.kv_cache, config.window, model)
    documents, tokens = tokenize(documents, tokenizer, model, encoding.result())
    run.stage_seconds["tokenize"] = encoding.seconds   # on its own thread, beside load_model and this wait
    run.stage_done("wait_for_tokenize")
    plan = plan_corpus(tokens, tokenizer, config.window, config.stride, config.bos, ctx, protocol)
    if config.bootstrap:   # before scoring: a bootstrap that cannot finish is refused now, not after the run
        check_bootstrap_work(config.bootstrap, *bootstrap_unit_count(plan))
    corpus = Corpus(documents, tokens, tokenizer, corpus_sha256(documents), protocol, datasets_read)
    windows = Windows(plan, ctx, use_kv_cache, kv_cache_reason)
    run.stage_started = time.perf_counter()    # planning is no stage of its own: "prepare" starts here
    if dist:   # ranks that read other inputs would sum to a wrong result without a word
        dist.check_same_inputs(inputs_by_part(run, documents, corpus.digest, tokenizer, model, plan, ctx, reference))
    runner = Runner(run, placement, model, reference)
    prepared = runner.prepare(plan)
    run.stage_done("prepare")
    for thread in warm_ups:
        thread.join()   # before the first kernel (accel/warm_up.start_cuda_warm_up says why)
    run.stage_done("wait_for_warm_up")
    cuda_start = [thread.seconds for thread in warm_ups if getattr(thread, "seconds", None) is not None]
    if cuda_start:   # on its own thread from the start, beside every stage before wait_for_warm_up
        run.stage_seconds["cuda_start"] = cuda_start[0]
    # one row of ctx positions out of GPU memory: a one-line error naming the largest --ctx that fits (one model's)
    ctx_fit = dict(model=model if reference is None else None, ctx=ctx, device=run.device, dtype=run.dtype,
                   loss=prepared.acceleration.loss, chunk_rows=config.loss_chunk_rows)
    batches = explaining_ctx(lambda: choose_batches(run, runner, plan, prepared.acceleration, ctx), **ctx_fit)
    run.stage_done("choose_batch_size")
    fingerprint = resume_fingerprint(run, corpus, prepared.acceleration, batches, plan, ctx)
    scored = explaining_ctx(lambda: score(run, runner, windows, batches, fingerprint), **ctx_fit)
    run.stage_seconds["scoring"] = scored.seconds
    # how long compiling took (within scoring) and whether its code came from the cache (accel/compile_cache.py)
    prepared.acceleration.compile_reason += finish_compiled_run(prepared.score_fn, run.stage_seconds)
    result = assemble_result(run, corpus, windows, prepared, scored)
    if reference is None:
        return result
    result = add_divergence(result, config, scored.sums, corpus.documents, corpus.tokens, plan)
    if scored.record.layer_error is not None:
        result.divergence["layer_error"] = scored.record.layer_error
    return result


def corpus_identity(config: EvalConfig) -> tuple:
    """What decides the documents read_corpus reads: runs that agree on it share them."""
    return (tuple(config.data), config.split, config.text_field, config.id_field, config.group_by, config.data_dir,
            config.errors, config.protocol)


def reference_identity(config: EvalConfig, dtype: torch.dtype, device: torch.device) -> tuple:
    seed = config.seed if config.reference_seed is None else config.reference_seed
    return config.reference_model, config.backend, dtype, seed, str(device)


def read_corpus(config: EvalConfig) -> tuple[list[Document], Optional[Protocol], list[dict]]:
    """The documents to score, the protocol that prepared them (with its corpus' rules), and the datasets read."""
    if config.protocol is None:
        fields = Fields(config.text_field, config.id_field, config.group_by)
        return corpus_documents(config.data, config.split, config.data_dir, config.errors, fields), None, []
    check_sources_distinct(config.data)
    return read_protocol_corpus(PROTOCOLS[config.protocol], config.data, config.split, config.text_field,
                                config.data_dir, config.errors)


def check_model_fits(config: EvalConfig, tokenizer: Tokenizer, model: nn.Module) -> int:
    """The context the run uses, after checking the tokenizer and --ctx against the model, and the options that
    depend on the context against the model's maximum when no --ctx was given (EvalConfig checked them with
    --ctx)."""
    if tokenizer.vocab_size > model.vocab_size:
        raise FastpplError(
            f"tokenizer {tokenizer.name!r} has {tokenizer.vocab_size:,} ids but the model's vocabulary has "
            f"{model.vocab_size:,}; pass the model's own tokenizer with --tokenizer"
        )
    ctx = config.ctx or model.max_positions
    if ctx > model.max_positions:
        raise FastpplError(f"--ctx {ctx} exceeds the model's maximum of {model.max_positions} positions"
                           f"{position_limit_note(model)}; lower --ctx")
    if config.ctx is None:
        check_ctx(config, ctx)
    return ctx


# arguments that may differ between ranks: paths, whose contents are compared instead, and what rank 0 alone writes
RANK_LOCAL_ARGUMENTS = ("model", "reference_model", "tokenizer", "data", "data_dir", "per_token") + NOT_IN_FINGERPRINT


def inputs_by_part(run: Run, documents: list[Document], corpus_digest: str, tokenizer: Tokenizer,
                   model: nn.Module, plan: WindowPlan, ctx: int,
                   reference: Optional[nn.Module] = None) -> dict[str, str]:
    """What every rank of a job must share, as {what: value or digest} (Distributed.check_same_inputs)."""
    arguments = {f"--{name.replace('_', '-')}": json.dumps(value, sort_keys=True)
                 for name, value in run.config.to_dict().items() if name not in RANK_LOCAL_ARGUMENTS}
    if reference is not None:
        arguments["reference model weights"] = weights_digest(reference)
    return {**arguments, "--per-token": str(bool(run.config.per_token)), "corpus": corpus_digest,
            "document ids": document_ids_sha256(documents), "tokenizer": tokenizer.fingerprint,
            "model weights": weights_digest(model), "dtype": str(run.dtype),
            "windows": f"{len(plan.refs)} windows of ctx {ctx}, {plan.n_scored} tokens scored"}


class InBackground:
    """fn() on a thread of its own; result() waits for it and returns its value, or raises its exception on the
    caller's thread; seconds is the thread's own wall time. A daemon, so that an error of the caller's exits at
    once, without waiting for it."""

    def __init__(self, fn: Callable[[], Any], name: str):
        self.seconds, self._value, self._error = 0.0, None, None
        self._thread = threading.Thread(target=self._run, args=(fn,), name=name, daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[[], Any]) -> None:
        started = time.perf_counter()
        try:
            self._value = fn()
        except BaseException as e:   # raised again by result(), on the caller's thread
            self._error = e
        finally:
            self.seconds = time.perf_counter() - started

    def result(self) -> Any:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value


def encode_texts(documents: list[Document], tokenizer: Tokenizer) -> list[Optional[np.ndarray]]:
    """Each text document's token ids (from the token cache where it holds them); None for a pre-tokenised one."""
    encoded = iter(encode_documents(tokenizer, [d.text for d in documents if d.token_ids is None]))
    return [next(encoded) if d.token_ids is None else None for d in documents]


def encode_once(reuse: Reuse, corpus_key: tuple, documents: list[Document],
                tokenizer: Tokenizer) -> list[Optional[np.ndarray]]:
    """encode_texts, once per corpus and tokenizer fingerprint in a table's process. How the ids were made (the
    tokenizer's counts of texts encoded and cached, and why a text was encoded whole: the report's tokenization
    note) is kept with them and given to each run's tokenizer, as its separate run would have it."""
    def encode():
        tokenizer.texts_encoded, tokenizer.texts_from_cache, tokenizer.whole_text_reason = 0, 0, None
        ids = encode_texts(documents, tokenizer)
        return ids, (tokenizer.texts_encoded, tokenizer.texts_from_cache, tokenizer.whole_text_reason)
    ids, how = reuse.encoding((corpus_key, tokenizer.fingerprint), encode)
    tokenizer.texts_encoded, tokenizer.texts_from_cache, tokenizer.whole_text_reason = how
    return ids


def tokenize(documents: list[Document], tokenizer: Tokenizer, model: nn.Module,
             encoded: list[Optional[np.ndarray]]) -> tuple[list[Document], list[np.ndarray]]:
    """Each document's token ids: the text documents' from encode_texts; pre-tokenised documents keep their ids
    (checked against the model's vocabulary) and get the text those stand for."""
    documents = [d if d.token_ids is None else with_decoded_text(d, tokenizer, model.vocab_size) for d in documents]
    tokens = [ids if d.token_ids is None else d.token_ids for d, ids in zip(documents, encoded)]
    for ids in tokens:   # whatever their source: an id past the embedding is a one-line error, not an IndexError
        check_ids_in_vocabulary(ids, model.vocab_size, tokenizer.name)
    return documents, tokens


def choose_batches(run: Run, runner: Runner, plan: WindowPlan, acceleration: Acceleration, ctx: int) -> Batches:
    """--batch-size, or the most rows that fit (Runner.auto_batch_size; the fewest over ranks), then the batches
    of the chosen batching, balanced where fewer rows pad the last batch less."""
    config, refs = run.config, plan.refs
    if config.batch_size != "auto":
        size = min(config.batch_size, len(refs))
        return Batches(size, "--batch-size", plan_batches(plan.window_lengths, acceleration.batching, ctx, size))
    size, reason = runner.auto_batch_size(plan, ctx)
    if run.dist:
        fewest = run.dist.min_over_ranks(size)
        if fewest < size:
            size, reason = fewest, reason + f", the fewest over ranks: {fewest}"
    plans = plan_batches(plan.window_lengths, acceleration.batching, ctx, size)
    balanced = balanced_batch_size(size, len(refs))
    balanced_plans = plan_batches(plan.window_lengths, acceleration.batching, ctx, balanced) if balanced < size \
        else plans
    if sum(p.n_rows * p.seq_len for p in balanced_plans) < sum(p.n_rows * p.seq_len for p in plans):
        return Batches(balanced, reason + f", balanced to {balanced} rows", balanced_plans)  # less padding
    return Batches(size, reason, plans)


def resume_fingerprint(run: Run, corpus: Corpus, acceleration: Acceleration, batches: Batches, plan: WindowPlan,
                       ctx: int) -> Optional[dict]:
    """What a checkpoint must match to be resumed (None without --resume)."""
    config, documents, tokenizer = run.config, corpus.documents, corpus.tokenizer
    if not config.resume:
        return None
    resolved = dict(ctx=ctx, tokenizer=config.tokenizer or default_tokenizer_name(config.model, config.data_dir),
                    stride=sliding_stride(config.stride, ctx) if config.window == "sliding" else None,
                    batch_size=batches.size, batching=acceleration.batching, device=str(run.device),
                    dtype=str(run.dtype))
    return run_fingerprint(
        config.to_dict(), resolved, corpus_sha256=corpus.digest, document_ids_sha256=document_ids_sha256(documents),
        tokenizer_fingerprint=tokenizer.fingerprint, model_files=model_files(config.model), windows=len(plan.refs),
        fastppl=__version__,
        # a reference model's files, as the model's: other weights at the same path are another run
        # and which path computes the divergence: the fused kernel's columns and the chunked path's differ in fp32's
        # last digits
        **({"reference_model_files": model_files(config.reference_model), "divergence_path": acceleration.loss}
           if config.reference_model else {}),
    )


def score(run: Run, runner: Runner, windows: Windows, batches: Batches, fingerprint: Optional[dict]) -> Scored:
    """Every window scored into the device sums (this rank's batches; all ranks' sums after the all-reduce)."""
    config, dist, device, plan, ctx = run.config, run.dist, run.device, windows.plan, windows.ctx
    # each rank scores its share of the batches; the batches are those of one process
    plans_here = shard_plans(batches.plans, dist.rank, dist.world_size) if dist else batches.plans
    # per-token NLL for --per-token, and for a bootstrap over the windows of a single document
    keep_tokens = config.per_token or needs_token_sums(config.bootstrap, plan)
    sums = DeviceSums.zeros(ctx, device, plan.n_tokens if keep_tokens else None, len(plan.streams),
                            plan.n_tokens if config.reference_model else None)
    checkpointer, start_batch = None, 0
    if fingerprint is not None:
        checkpointer = Checkpointer(config.resume, fingerprint, batches.plans, len(plan.refs),
                                    config.checkpoint_batches, config.checkpoint_seconds)
        start_batch = checkpointer.load(sums)
    scored_before = int(sum(plan.scored_by_window[p.windows].sum() for p in batches.plans[:start_batch]))
    progress = Progress(plan.n_scored, enabled=not config.quiet and (dist is None or dist.is_main))
    progress.advance(scored_before)
    on_batch = batch_hook(run, plan, plans_here, progress, checkpointer, sums, start_batch)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    scoring = runner.score(windows, batches, plans_here[start_batch:], sums, on_batch, progress.advance,
                           resumable=checkpointer is not None)
    batch_size_reason = batches.reason
    if scoring.backed_off_to:
        batch_size_reason += f"; out of memory at it, later batches ran {scoring.backed_off_to} rows"
    return finish_scoring(run, plan, batches, sums, checkpointer, start_batch, scored_before, progress,
                          scoring.started, batch_size_reason, scoring.products, runner.record(windows))


def batch_hook(run: Run, plan: WindowPlan, plans_here: list[BatchPlan], progress: Progress,
               checkpointer: Optional[Checkpointer], sums: DeviceSums, start_batch: int):
    """What runs after each scored batch: progress (over all ranks under torchrun) and checkpoints."""
    advance = lambda batch: progress.advance(batch.n_scored)  # noqa: E731
    if run.dist:
        scored_here = int(sum(plan.scored_by_window[p.windows].sum() for p in plans_here))
        advance = run.dist.batch_hook(progress, scored_here, plan.n_scored)
        run.dist.wait_for_peers("to the start of scoring")   # so that scoring_seconds times the whole job
    batches_done = start_batch

    def after_batch(batch) -> None:
        nonlocal batches_done
        batches_done += 1
        advance(batch)
        if checkpointer is not None:
            checkpointer.after_batch(batches_done, sums)

    return after_batch


def finish_scoring(run: Run, plan: WindowPlan, batches: Batches, sums: DeviceSums,
                   checkpointer: Optional[Checkpointer], start_batch: int, scored_before: int, progress: Progress,
                   started: float, batch_size_reason: str, products: str, record: RunRecord) -> Scored:
    """All ranks' sums, read to the host once; the finished checkpoint saved; a non-finite loss refused."""
    if run.dist:
        run.dist.all_reduce_sums(sums, plan.n_scored)
    nll_sum = float(sums.nll_sum.item())   # the run's one host sync
    if checkpointer is not None and start_batch < len(batches.plans):
        checkpointer.save(len(batches.plans), sums)   # complete: a rerun gives the result without scoring
    seconds = time.perf_counter() - started
    progress.close()
    if not math.isfinite(nll_sum):
        raise FastpplError("the model produced a non-finite loss; try --dtype fp32" if run.dtype != torch.float32
                           else "the model produced a non-finite loss in fp32; check its weights for NaN or inf")
    return Scored(sums=sums, nll_sum=nll_sum, seconds=seconds, scored_before=scored_before, start_batch=start_batch,
                  batch_size=batches.size, batch_size_reason=batch_size_reason, plans=batches.plans,
                  products=products, record=record)
