"""The scoring loop: batches of windows -> per-token NLL -> float64 sums kept on the device.

Nothing in the loop waits for the device: inputs are copied asynchronously from pinned memory, sums
accumulate in device tensors, and the caller reads them once at the end (one host sync per run)."""
from __future__ import annotations

from dataclasses import dataclass
from collections import deque
from typing import Callable, Iterable, NamedTuple, Optional, Sequence

import numpy as np
import torch
import torch.nn as nn

from ..data.batching import Batch
from ..errors import is_out_of_memory
from ..models.attention import DocumentIds, DocumentSpans
from .divergence import COLUMNS as DIVERGENCE_COLUMNS, KLD_COLUMN
from .loss import token_nll_fn

# (input_ids, targets, score_mask[, position_ids, document_ids][, scored_rows=]) -> (B, T) NLL
ScoreFn = Callable[..., torch.Tensor]
# (final hidden (B, T, C)[, a reference model's final hidden], targets, score_mask, scored_rows) -> (B, T[, 5]) NLL
LossFn = Callable[..., torch.Tensor]

# batches with fewer scored positions than this share of their B*T run the loss on the scored ones only
GATHER_BELOW = 0.97
GATHER_MULTIPLE = 64


def make_loss_fn(model: nn.Module, chunk_rows: int = 8192, loss: str = "chunked") -> LossFn:
    """(hidden (B, T, C), targets (B, T), score_mask (B, T), scored_rows=None) -> (B, T) fp32 NLL, 0 where not
    scored: the output projection and the loss of make_score_fn, on final hidden states however they were made
    (the layer-major path, fastppl.engine.streamed, makes them a block at a time)."""
    weight = model.lm_head.weight
    bias = getattr(model.lm_head, "bias", None)
    token_nll = token_nll_fn(loss, chunk_rows)

    def loss_of_hidden(hidden: torch.Tensor, targets: torch.Tensor, score_mask: torch.Tensor,
                       scored_rows: Optional[torch.Tensor] = None) -> torch.Tensor:
        B, T = targets.shape
        hidden, targets = hidden.reshape(B * T, -1), targets.reshape(B * T)
        if scored_rows is None:
            nll = token_nll(hidden, weight, targets, bias)
            return torch.where(score_mask, nll.view(B, T), 0.0)
        nll = token_nll(hidden.index_select(0, scored_rows), weight, targets.index_select(0, scored_rows), bias)
        return nll.new_zeros(B * T).index_copy_(0, scored_rows, nll).view(B, T)

    return loss_of_hidden


def make_score_fn(model: nn.Module, chunk_rows: int = 8192, loss: str = "chunked") -> ScoreFn:
    """(input_ids, targets, score_mask), each (B, T) -> (B, T) fp32 NLL, 0 where not scored.
    loss: "chunked" (any device) or "fused" (the Triton kernel, CUDA). Packed rows also pass
    position_ids (B, T) and document_ids ((B, T) ids or a DocumentSpans), which go to the model as they are.

    With the fused loss the scorer also takes scored_rows= (n,) int64, the flat indices of the scored
    positions (an index may repeat), and runs the loss on those rows only: a window's context and padding skip the
    vocabulary product (about a third of a GPT-2 forward). The fused kernel computes each row alone, so a row's NLL
    is bit for bit the same whichever rows share its batch. The chunked loss's matmul can round a row
    differently as the number of rows changes (BLAS picks its kernel by shape), which would break equal
    results across batch sizes and process counts, so it always runs on every position."""
    loss_of_hidden = make_loss_fn(model, chunk_rows, loss)

    def score(
        input_ids: torch.Tensor, targets: torch.Tensor, score_mask: torch.Tensor,
        position_ids: Optional[torch.Tensor] = None, document_ids: Optional[DocumentIds] = None,
        scored_rows: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        if document_ids is None:
            hidden = model(input_ids)                                    # (B, T, C)
        else:
            hidden = model(input_ids, position_ids, document_ids)        # (B, T, C)
        return loss_of_hidden(hidden, targets, score_mask, scored_rows)

    score.gathers_scored_rows = loss == "fused"
    return score


def scored_rows_of(batch: Batch, device: torch.device) -> Optional[torch.Tensor]:
    """The flat indices of the batch's scored positions, on the device, or None when (nearly) every
    position is scored and gathering them would only cost a copy."""
    # a row count that is a multiple of GATHER_MULTIPLE keeps the loss kernel to one compiled variant
    # (Triton specialises on divisibility by 16): the last row repeats, and its copies write the same value
    n_rows = batch.n_scored + -batch.n_scored % GATHER_MULTIPLE
    if batch.n_scored == 0 or n_rows > GATHER_BELOW * batch.score_mask.size:
        return None
    rows = np.flatnonzero(batch.score_mask.reshape(-1))
    return to_device(np.pad(rows, (0, n_rows - len(rows)), mode="edge"), device)


@dataclass
class DeviceSums:
    """Running sums on the device, read to the host once, at the end (a checkpoint copies them too)."""
    nll_sum: torch.Tensor                      # () float64
    position_nll_sum: torch.Tensor             # (T,) float64: by position inside the window
    position_count: torch.Tensor               # (T,) float64
    position_nll_sq_sum: torch.Tensor          # (T,) float64: sum of squared NLL, for the spread by position
    per_token: Optional[torch.Tensor] = None   # (n_tokens + 1,) fp32, NaN where unscored; last slot is a sink
    per_document: Optional[torch.Tensor] = None  # (n_documents + 1,) float64 NLL sums; last slot is a sink
    # with a reference model (fastppl.engine.divergence): each token's COLUMNS, NaN where unscored, last row a
    # sink; and the KL divergence summed by position inside the window
    divergence: Optional[torch.Tensor] = None        # (n_tokens + 1, 5) fp32
    position_kld_sum: Optional[torch.Tensor] = None  # (T,) float64

    @classmethod
    def zeros(
        cls, seq_len: int, device: torch.device, n_tokens: Optional[int] = None, n_documents: Optional[int] = None,
        divergence_tokens: Optional[int] = None,
    ) -> "DeviceSums":
        per_token = None
        if n_tokens is not None:
            per_token = torch.full((n_tokens + 1,), float("nan"), dtype=torch.float32, device=device)
        zeros = lambda *shape: torch.zeros(shape, dtype=torch.float64, device=device)  # noqa: E731
        per_document = zeros(n_documents + 1) if n_documents is not None else None
        divergence = position_kld_sum = None
        if divergence_tokens is not None:
            divergence = torch.full((divergence_tokens + 1, len(DIVERGENCE_COLUMNS)), float("nan"),
                                    dtype=torch.float32, device=device)
            position_kld_sum = zeros(seq_len)
        return cls(zeros(), zeros(seq_len), zeros(seq_len), zeros(seq_len), per_token, per_document, divergence,
                   position_kld_sum)


def to_device(array, device: torch.device) -> Optional[torch.Tensor]:
    if array is None:
        return None
    tensor = torch.from_numpy(array)
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def accumulate(
    sums: DeviceSums, nll: torch.Tensor, score_mask: torch.Tensor, device: torch.device,
    position_ids: Optional[torch.Tensor] = None,      # (B, T) on the device; None: column = position
    target_document=None, token_index=None,          # (B, T) host arrays, -1 where unscored
) -> None:
    """Add one batch's (B, T) fp32 NLL (0 where unscored) to every running sum, on the device. Everything
    that allocates (copies, casts, index tensors) happens before the first sum is touched, so an
    out-of-memory error in here leaves the sums as they were and the batch can be scored again.
    A divergence scorer's (B, T, 5) columns (fastppl.engine.divergence) give the NLL sums their column 0."""
    divergence = None
    if nll.dim() == 3:   # the probe of --batch-size auto keeps no divergence
        if sums.divergence is not None and token_index is not None:
            divergence = nll.reshape(-1, nll.shape[-1])                 # (B * T, 5)
        nll = nll[..., 0].contiguous()                                  # (B, T)
    flat_nll = nll.view(-1).double()                                    # (B * T,) for the scatter-adds
    flat_sq = flat_nll * flat_nll                                       # fp32 squared: exact in float64
    total = nll.sum(dtype=torch.float64)
    if position_ids is None:   # column == position inside the window; T < ctx when bucketed
        T = nll.shape[1]
        by_position = (nll.sum(dim=0, dtype=torch.float64), score_mask.sum(dim=0, dtype=torch.float64),
                       flat_sq.view_as(nll).sum(dim=0))
    else:
        positions = position_ids.reshape(-1)
        counts = score_mask.reshape(-1).double()
    document = token = None
    if sums.per_document is not None and target_document is not None:
        document = to_device(target_document, device).view(-1)
        document = torch.where(document >= 0, document, sums.per_document.shape[0] - 1)   # unscored: the sink
    if (sums.per_token is not None or sums.divergence is not None) and token_index is not None:
        token = to_device(token_index, device).view(-1)
        per_token_rows = sums.per_token if sums.per_token is not None else sums.divergence
        token = torch.where(token >= 0, token, per_token_rows.shape[0] - 1)   # unscored: the sink
        token_nll = nll.reshape(-1)
    if divergence is not None:
        kld = divergence[:, KLD_COLUMN].double()                              # (B * T,)
        kld_by_position = kld.view_as(nll).sum(dim=0) if position_ids is None else kld

    sums.nll_sum += total
    if position_ids is None:
        sums.position_nll_sum[:T] += by_position[0]
        sums.position_count[:T] += by_position[1]
        sums.position_nll_sq_sum[:T] += by_position[2]
    else:
        sums.position_nll_sum.index_add_(0, positions, flat_nll)
        sums.position_count.index_add_(0, positions, counts)
        sums.position_nll_sq_sum.index_add_(0, positions, flat_sq)
    if document is not None:
        sums.per_document.index_add_(0, document, flat_nll)   # a scatter-add on the device, no host sync
    if token is not None and sums.per_token is not None:
        sums.per_token.index_copy_(0, token, token_nll)
    if divergence is not None:
        sums.divergence.index_copy_(0, token, divergence)   # per_token and divergence have the same sink row
        if position_ids is None:
            sums.position_kld_sum[:T] += kld_by_position
        else:
            sums.position_kld_sum.index_add_(0, positions, kld_by_position)


class DeviceBatch(NamedTuple):
    """A batch's tensors on the device (fastppl.data.batching.Batch's arrays)."""
    input_ids: torch.Tensor
    targets: torch.Tensor
    score_mask: torch.Tensor
    position_ids: Optional[torch.Tensor]
    document_ids: Optional[DocumentIds]
    scored_rows: Optional[torch.Tensor]   # the scored positions, for a scorer that gathers them (scored_rows_of)

    @property
    def packed(self) -> tuple:
        """What a packed batch passes to the model beside its ids (nothing for an unpacked one)."""
        return () if self.document_ids is None else (self.position_ids, self.document_ids)


def batch_on_device(batch: Batch, device: torch.device, gathers_scored_rows: bool = False) -> DeviceBatch:
    document_ids = to_device(batch.document_ids, device)
    if document_ids is not None and batch.cu_seqlens is not None:
        # the same documents as segments too, for variable-length attention (fastppl.models.attention)
        document_ids = DocumentSpans(document_ids, to_device(batch.cu_seqlens, device), batch.max_seqlen)
    return DeviceBatch(to_device(batch.input_ids, device), to_device(batch.targets, device),
                       to_device(batch.score_mask, device), to_device(batch.position_ids, device), document_ids,
                       scored_rows_of(batch, device) if gathers_scored_rows else None)


@torch.inference_mode()
def score_batches(
    score_fn: ScoreFn, batches: Iterable[Batch], sums: DeviceSums, device: torch.device,
    on_batch: Optional[Callable[[Batch], None]] = None,
) -> DeviceSums:
    for batch in batches:
        on_device = batch_on_device(batch, device, getattr(score_fn, "gathers_scored_rows", False))
        # unpacked batches call score_fn with three arguments, as any scorer of (B, T) rows takes (and
        # scored_rows= when it says it gathers them)
        gather = {} if on_device.scored_rows is None else {"scored_rows": on_device.scored_rows}
        nll = score_fn(on_device.input_ids, on_device.targets, on_device.score_mask, *on_device.packed,
                       **gather)   # (B, T) fp32
        accumulate(sums, nll, on_device.score_mask, device, on_device.position_ids, batch.target_document,
                   batch.token_index)
        if on_batch is not None:
            on_batch(batch)
    return sums


def score_plans(
    score_fn: ScoreFn, plans: Sequence, build: Callable[[object], Batch], sums: DeviceSums, device: torch.device,
    on_batch: Optional[Callable[[Batch], None]] = None,
    split: Optional[Callable[[object, int], list]] = None,
    on_backoff: Optional[Callable[[int], None]] = None,
) -> int:
    """Score planned batches in order. On out-of-memory (when split is given) the failing batch is cut
    into halves by rows (split(plan, max_rows)) and every later batch is cut to that size too. The sums
    are only touched after a batch's scores exist, so a failed batch adds nothing: no window is lost or
    counted twice. Returns the rows a batch was cut to (0 if none ran out of memory)."""
    queue = deque(plans)
    max_rows = None
    while queue:
        plan = queue.popleft()
        if max_rows is not None and plan.n_rows > max_rows:
            queue.extendleft(reversed(split(plan, max_rows)))
            continue
        batch = build(plan)
        try:
            score_batches(score_fn, [batch], sums, device)
        except RuntimeError as error:
            if split is None or not is_out_of_memory(error) or plan.n_rows == 1:
                raise
        else:
            if on_batch is not None:   # outside the try: its own failure must not look like this batch's
                on_batch(batch)
            continue
        # out of memory, handled outside the except block, whose traceback keeps the failed batch's tensors
        del batch
        if device.type == "cuda":
            torch.cuda.empty_cache()
        max_rows = max(plan.n_rows // 2, 1)
        if on_backoff is not None:
            on_backoff(max_rows)
        queue.appendleft(plan)
    return max_rows or 0
