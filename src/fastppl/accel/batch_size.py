"""--batch-size auto: the largest batch that fits with headroom, from one measured probe batch."""
from __future__ import annotations

from typing import Callable

import torch

MAX_AUTO_BATCH = 256


def auto_batch_size(
    probe: Callable[[int], None], n_windows: int, device: torch.device, headroom: float = 0.75,
    probe_rows: int = 4,
) -> int:
    """probe(rows) runs one scoring batch of that many rows. Peak memory grows linearly with rows
    (activations of one layer and one loss chunk per row), so one probe gives the slope."""
    if device.type != "cuda":
        return min(8, n_windows)
    probe_rows = min(probe_rows, n_windows)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    probe(probe_rows)
    torch.cuda.synchronize(device)
    per_row = max((torch.cuda.max_memory_allocated(device) - base) / probe_rows, 1.0)
    free, _total = torch.cuda.mem_get_info(device)
    free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    rows = int(headroom * free / per_row)
    rows = max(1, min(rows, MAX_AUTO_BATCH, n_windows))
    return rows if rows < 8 else rows - rows % 8


def balanced_batch_size(rows: int, n_windows: int) -> int:
    """The smallest batch (a multiple of 8 from 8 rows on) that needs no more batches of one window per row
    than `rows` does: a last batch padded to the full shape would otherwise run padding rows (330 windows at
    256 rows ran 512; at 168 they run 336). Callers keep it only where their plans then run fewer slots."""
    n_batches = -(-n_windows // rows)
    balanced = -(-n_windows // n_batches)
    if balanced >= 8:
        balanced = -(-balanced // 8) * 8
    return min(rows, balanced)
