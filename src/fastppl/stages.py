"""The stages' own results: what each stage of fastppl.pipeline.evaluate hands to the next, and what
fastppl.report.result assembles the run's result from."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch
import torch.nn as nn

from .accel.apply import Acceleration
from .config import EvalConfig
from .data.corpus import Document
from .data.packing import BatchPlan
from .data.protocols import Protocol
from .data.streams import WindowPlan
from .data.tokenize import Tokenizer
from .distributed import Distributed
from .engine.score import DeviceSums, ScoreFn


@dataclass
class Run:
    """Where and how a run computes, and the seconds each stage took (the report's stage_seconds)."""
    config: EvalConfig
    device: torch.device
    dtype: torch.dtype
    dist: Optional[Distributed]    # None on one process
    started: float
    stage_seconds: dict[str, float] = field(default_factory=dict)
    stage_started: float = 0.0

    def stage_done(self, stage: str) -> None:
        now = time.perf_counter()
        self.stage_seconds[stage] = now - (self.stage_started or self.started)
        self.stage_started = now


@dataclass
class Corpus:
    """What reading and tokenizing give: the documents, their token ids, the tokenizer, and where they came from."""
    documents: list[Document]
    tokens: list[np.ndarray]
    tokenizer: Tokenizer
    digest: str                   # corpus_sha256: the report's, and the resume fingerprint's
    protocol: Optional[Protocol]  # --protocol, with its corpus' rules
    datasets: list[dict]          # the datasets read (the protocol card's)


@dataclass
class Windows:
    """What planning gives: the windows, the context, and whether the KV cache scores them and why."""
    plan: WindowPlan
    ctx: int
    use_kv_cache: bool
    kv_cache_reason: str


@dataclass
class Prepared:
    """What accelerating gives: the model on its device with its transforms, what was chosen, and its scorer."""
    model: nn.Module
    acceleration: Acceleration
    score_fn: ScoreFn


@dataclass
class RunRecord:
    """What ran, as the Runner (fastppl.runner) records it: the report reads this, not the models."""
    backend: str                                # native, or transformers and why
    placement: str                              # resident, streamed or offloaded
    placement_reason: str
    streaming: Optional[dict]                   # streamed: waves, bytes_streamed, copy_seconds(_hidden), blocks_rest_in
    layer_error: Optional[list]                 # --layer-error: a row per block (fastppl.engine.layer_error)
    document_attention: Optional[str]           # the kernel that kept packed documents apart
    document_attention_fallback: Optional[str]  # why varlen gave way to FlexAttention, if it did


@dataclass
class Batches:
    size: int
    reason: str
    plans: list[BatchPlan]


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
    record: RunRecord      # what ran (fastppl.runner.Runner.record)
