"""A --ctx too long for the GPU: when one row of ctx positions runs out of memory, a one-line error naming the largest
--ctx that fits, from the memory bound that --batch-size auto uses (fastppl.accel.batch_size) and the free memory.

The bound is not checked before the run: it counts fp32 attention scores (ctx² per head) in case a math kernel
runs, while the flash kernels need none, so at long contexts it is far above what a run needs and would refuse
runs that fit. Out of memory at one row is the proof; the bound then says how far to go down."""
from __future__ import annotations

from typing import Callable, Optional, TypeVar

import torch
import torch.nn as nn

from ..errors import FastpplError, is_out_of_memory
from . import batch_size

HEADROOM = 0.75   # of the free memory, as --batch-size auto leaves
Result = TypeVar("Result")


def on_gpu(device: torch.device) -> bool:
    return device.type == "cuda"


def largest_ctx_within(model: nn.Module, budget_bytes: float, element_size: int, loss: str, chunk_rows: int,
                       upto: int) -> Optional[int]:
    """The largest ctx <= upto whose one-row batch the memory bound keeps within budget_bytes (0 if none; None for
    a model without a bound). The bound grows with ctx: a binary search."""
    def fits(ctx: int) -> bool:
        return batch_size.scoring_memory_bound(model, ctx, element_size, loss, chunk_rows).total(1) <= budget_bytes
    if batch_size.scoring_memory_bound(model, 1, element_size, loss, chunk_rows) is None:
        return None
    low, high = 0, upto   # fits(low) or low == 0; the answer lies in [low, high]
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if fits(middle) else (low, middle - 1)
    return low


def ctx_error(model: Optional[nn.Module], ctx: int, device: torch.device, dtype: torch.dtype, loss: str,
              chunk_rows: int) -> Optional[FastpplError]:
    """The error for one row of ctx positions out of memory, where the bound agrees that it does not fit (else
    None: the cause lies elsewhere, and the out-of-memory error says more)."""
    free = batch_size._free_bytes(device)
    bound = batch_size.scoring_memory_bound(model, ctx, dtype.itemsize, loss, chunk_rows)
    if bound is None or bound.total(1) <= HEADROOM * free:
        return None
    largest = largest_ctx_within(model, HEADROOM * free, dtype.itemsize, loss, chunk_rows, ctx - 1)
    gib = 2 ** 30
    beside = f"--ctx {ctx} does not fit in GPU memory at batch size 1 ({free / gib:.1f} GiB free beside the model)"
    if not largest:
        return FastpplError(f"{beside}, nor does any --ctx; use a GPU with more memory or a smaller --dtype")
    return FastpplError(f"{beside}; the largest --ctx that fits by fastppl's memory bound is {largest} "
                        f"(an upper bound on memory: a little more may fit); lower --ctx")


def explaining_ctx(run: Callable[[], Result], model: Optional[nn.Module], ctx: int, device: torch.device,
                   dtype: torch.dtype, loss: str, chunk_rows: int) -> Result:
    """run(), whose out-of-memory error on a GPU becomes ctx_error's one line where the bound says one row of ctx
    positions does not fit."""
    try:
        return run()
    except Exception as error:   # noqa: BLE001 - only out of memory is handled; the rest re-raised
        if not on_gpu(device) or not is_out_of_memory(error):
            raise
        original = error.with_traceback(None)   # its frames hold the failed batch's tensors
    # outside the except block, whose traceback would keep those tensors allocated too
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    explained = ctx_error(model, ctx, device, dtype, loss, chunk_rows)
    if explained is None:
        raise original
    raise explained from None
