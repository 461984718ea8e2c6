"""Per-token NLL from final hidden states, applying the output projection a chunk of rows at a time,
so that at most (chunk_rows, V) logits exist at once instead of (B, T, V)."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ..errors import FastpplError


def chunked_token_nll(
    hidden: torch.Tensor,            # (N, C) in the model's dtype
    weight: torch.Tensor,            # (V, C) output projection
    targets: torch.Tensor,           # (N,) int64 token ids
    bias: Optional[torch.Tensor] = None,
    chunk_rows: int = 8192,
) -> torch.Tensor:
    """(N,) fp32 negative log-likelihood of each target. Logits are upcast to fp32 before the
    log-softmax, so bf16 weights lose only the rounding of the logits themselves."""
    pieces = []
    for begin in range(0, hidden.shape[0], chunk_rows):
        logits = F.linear(hidden[begin:begin + chunk_rows], weight, bias).float()   # (c, V)
        rows_targets = targets[begin:begin + chunk_rows]
        pieces.append(_summed_nll(logits, rows_targets) if logits.device.type == "cpu"
                      else F.cross_entropy(logits, rows_targets, reduction="none"))
    # concatenated, not written into a preallocated buffer: slice assignment inside a compiled
    # loop hit an illegal memory access in Inductor on torch 2.11 (on the H200)
    return torch.cat(pieces) if len(pieces) > 1 else pieces[0]


def _summed_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """What F.cross_entropy gives, with its sum of exponentials taken by torch.sum: on the CPU, cross_entropy adds
    the vocabulary's terms into running fp32 sums, which round away the smallest ones, so every token's NLL came
    out low (by 1.8e-5 nats on average for SmolLM2's 49,152 ids); torch.sum's cascade adds them in fp32 without
    that bias. The logits are overwritten, unless autograd needs them."""
    target_logits = logits.gather(1, targets[:, None])[:, 0]
    maximum = logits.amax(1, keepdim=True)
    if logits.requires_grad:
        sum_of_exponentials = (logits - maximum).exp().sum(1)
    else:
        sum_of_exponentials = logits.sub_(maximum).exp_().sum(1)
    return (maximum[:, 0] - target_logits) + sum_of_exponentials.log()


def fused_loss_available(device: torch.device) -> bool:
    """The fused kernel needs CUDA and Triton (found without importing it: that costs start-up)."""
    import importlib.util
    return device.type == "cuda" and importlib.util.find_spec("triton") is not None


def resolve_loss(loss: str, device: torch.device) -> str:
    """--loss auto|chunked|fused -> the loss that runs: auto takes the fused kernel where it is available."""
    if loss == "auto":
        return "fused" if fused_loss_available(device) else "chunked"
    if loss == "fused" and not fused_loss_available(device):
        raise FastpplError("--loss fused needs a CUDA device and Triton; use --loss chunked")
    return loss


def token_nll_fn(kind: str, chunk_rows: int = 8192):
    """The per-token NLL function for --loss chunked|fused: (hidden, weight, targets, bias) -> (N,) fp32."""
    if kind == "fused":
        from .fused_loss import fused_token_nll_op
        return fused_token_nll_op
    assert kind == "chunked", kind
    return lambda hidden, weight, targets, bias=None: chunked_token_nll(hidden, weight, targets, bias, chunk_rows)
