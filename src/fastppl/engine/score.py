"""The scoring loop: batches of windows -> per-token NLL -> float64 sums kept on the device.

Nothing in the loop waits for the device: inputs are copied asynchronously from pinned memory, sums
accumulate in device tensors, and the caller reads them once at the end (one host sync per run)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import torch
import torch.nn as nn

from ..data.batching import Batch
from .loss import chunked_token_nll

ScoreFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def make_score_fn(model: nn.Module, chunk_rows: int = 8192) -> ScoreFn:
    """(input_ids, targets, score_mask), each (B, T) -> (B, T) fp32 NLL, 0 where not scored."""
    weight = model.lm_head.weight
    bias = getattr(model.lm_head, "bias", None)

    def score(input_ids: torch.Tensor, targets: torch.Tensor, score_mask: torch.Tensor) -> torch.Tensor:
        B, T = input_ids.shape
        hidden = model(input_ids)                                        # (B, T, C)
        nll = chunked_token_nll(hidden.reshape(B * T, -1), weight, targets.reshape(B * T), bias, chunk_rows)
        return torch.where(score_mask, nll.view(B, T), 0.0)

    return score


@dataclass
class DeviceSums:
    """Running sums on the device; read them with .to_host() once, at the end."""
    nll_sum: torch.Tensor                      # () float64
    position_nll_sum: torch.Tensor             # (T,) float64: by position inside the window
    position_count: torch.Tensor               # (T,) float64
    position_nll_sq_sum: torch.Tensor          # (T,) float64: sum of squared NLL, for the spread by position
    per_token: Optional[torch.Tensor] = None   # (n_tokens + 1,) fp32, NaN where unscored; last slot is a sink

    @classmethod
    def zeros(cls, seq_len: int, device: torch.device, n_tokens: Optional[int] = None) -> "DeviceSums":
        per_token = None
        if n_tokens is not None:
            per_token = torch.full((n_tokens + 1,), float("nan"), dtype=torch.float32, device=device)
        zeros = lambda *shape: torch.zeros(shape, dtype=torch.float64, device=device)  # noqa: E731
        return cls(zeros(), zeros(seq_len), zeros(seq_len), zeros(seq_len), per_token)


def _to_device(array, device: torch.device) -> torch.Tensor:
    tensor = torch.from_numpy(array)
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


@torch.inference_mode()
def score_batches(
    score_fn: ScoreFn, batches: Iterable[Batch], sums: DeviceSums, device: torch.device,
    on_batch: Optional[Callable[[Batch], None]] = None,
) -> DeviceSums:
    for batch in batches:
        input_ids = _to_device(batch.input_ids, device)
        targets = _to_device(batch.targets, device)
        score_mask = _to_device(batch.score_mask, device)
        nll = score_fn(input_ids, targets, score_mask)                   # (B, T) fp32
        sums.nll_sum += nll.sum(dtype=torch.float64)
        sums.position_nll_sum += nll.sum(dim=0, dtype=torch.float64)
        sums.position_count += score_mask.sum(dim=0, dtype=torch.float64)
        nll64 = nll.double()                        # an fp32 value squared is exact in float64
        sums.position_nll_sq_sum += (nll64 * nll64).sum(dim=0)
        if sums.per_token is not None:
            sink = sums.per_token.shape[0] - 1
            index = _to_device(batch.token_index, device).view(-1)
            index = torch.where(index >= 0, index, sink)
            sums.per_token.index_copy_(0, index, nll.view(-1))
        if on_batch is not None:
            on_batch(batch)
    return sums
