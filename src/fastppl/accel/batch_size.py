"""--batch-size auto: the largest batch that fits with headroom, from a memory bound or one measured probe batch."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn as nn

from ..errors import is_out_of_memory

MAX_AUTO_BATCH = 256
BOUND_SAFETY = 2.0   # the bound below counts every tensor a layer could hold at once; then doubles it


@dataclass(frozen=True)
class MemoryBound:
    """Bytes that one scoring batch can add above the weights: per_row × rows + fixed."""
    per_row: float
    fixed: float

    def total(self, rows: int) -> float:
        return self.per_row * rows + self.fixed


def scoring_memory_bound(model: nn.Module, seq_len: int, element_size: int, loss: str,
                         chunk_rows: int, attention_scores: bool = True) -> Optional[MemoryBound]:
    """An upper bound on a no-grad scoring forward's memory for fastppl's own models (None for others,
    whose batches the probe measures). Per row: the residual stream, a norm's output, q, k, v, the attention
    output and the gathered loss rows (7 model widths, 8 counted), the MLP's inner tensors (up to 3 for SwiGLU, 4
    counted), fp32 attention scores in case a math kernel runs, and the per-token fp32 outputs; the chunked
    loss adds one chunk's logits in the model's dtype and in fp32, whatever the row count. attention_scores=False
    leaves the scores out, where the attention kernels never write them (CUDA's in half precision)."""
    from ..models.registry import spec_of
    spec = spec_of(model)
    if spec is None:
        return None
    shape = spec.shape(model.config)
    width, inner, heads, vocab = shape.width, shape.mlp_inner, shape.n_head, shape.vocab_size
    per_row = seq_len * element_size * (8 * width + 4 * inner) + attention_scores * heads * seq_len ** 2 * 4 \
        + seq_len * 8 * 8
    fixed = chunk_rows * vocab * (element_size + 2 * 4) if loss == "chunked" else 0
    return MemoryBound(BOUND_SAFETY * per_row, BOUND_SAFETY * fixed)


def _free_bytes(device: torch.device) -> int:
    """Free device memory, counting what the caching allocator holds but does not use."""
    free, _total = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def _measured_bytes_per_row(probe: Callable[[int], None], rows: int, device: torch.device) -> float:
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    probe(rows)
    torch.cuda.synchronize(device)
    return max((torch.cuda.max_memory_allocated(device) - base) / rows, 1.0)


def _whole_rows(rows: int) -> int:
    return rows if rows < 8 else rows - rows % 8


def auto_batch_size(
    probe: Callable[[int], None], n_windows: int, device: torch.device, headroom: float = 0.75,
    probe_rows: int = 4, bound: Optional[MemoryBound] = None,
) -> tuple[int, str]:
    """(rows, how they were chosen). probe(rows) runs one scoring batch of that many rows. Peak memory grows
    linearly with rows (activations of one layer and one loss chunk per row), so one probe gives the slope.
    Where `bound` shows that the largest batch fits, the probe is skipped: it would choose the same rows,
    and its first batch costs kernel loads (and, compiled, a graph of its own shape)."""
    if device.type != "cuda":
        return min(8, n_windows), "auto: 8 rows off CUDA"
    largest = min(MAX_AUTO_BATCH, n_windows)
    if bound is not None and bound.total(largest) <= headroom * _free_bytes(device):
        # every window in one batch as it is; else a whole number of 8-row tiles
        return largest if largest == n_windows else _whole_rows(largest), "auto: fits a memory bound, no probe"
    probe_rows = min(probe_rows, n_windows)
    too_many = None
    while True:
        try:
            per_row = _measured_bytes_per_row(probe, probe_rows, device)
            break
        except Exception as error:   # noqa: BLE001 - only out of memory is handled; the rest re-raised
            if not is_out_of_memory(error) or probe_rows == 1:
                raise
        # outside the except block, whose traceback would keep the failed batch's tensors alive
        too_many, probe_rows = probe_rows, probe_rows // 2
    rows = max(1, min(int(headroom * _free_bytes(device) / per_row), largest))
    out_of_memory = f" ({too_many} ran out of memory)" if too_many else ""
    return _whole_rows(rows), f"auto: probed {probe_rows} rows{out_of_memory}"


def balanced_batch_size(rows: int, n_windows: int) -> int:
    """The smallest batch (a multiple of 8 from 8 rows on) that needs no more batches of one window per row
    than `rows` does: a last batch padded to the full shape would otherwise run padding rows (330 windows at
    256 rows ran 512; at 168 they run 336). Callers keep it only where their plans then run fewer slots."""
    n_batches = -(-n_windows // rows)
    balanced = -(-n_windows // n_batches)
    if balanced >= 8:
        balanced = -(-balanced // 8) * 8
    return min(rows, balanced)
