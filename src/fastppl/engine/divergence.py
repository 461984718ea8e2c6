"""Two models on the same tokens: per scored token, the NLL of each, KL(reference ‖ model), whether their top-1
tokens agree and Δp, computed in fp32 from the two models' final hidden states a chunk of rows at a time, so
that at most two (chunk_rows, V) fp32 logit tensors exist at once, never (B, T, V)."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..models.attention import DocumentIds

# the columns of a divergence scorer's (B, T, 5) output, of DeviceSums.divergence and of --per-token's array
COLUMNS = ("nll", "reference_nll", "kld", "same_top1", "delta_p")
KLD_COLUMN = COLUMNS.index("kld")


def chunked_divergence(
    hidden: torch.Tensor,              # (N, C) final hidden states of the model under test (B)
    weight: torch.Tensor,              # (V, C) its output projection
    reference_hidden: torch.Tensor,    # (N, C') the reference model's (A)
    reference_weight: torch.Tensor,    # (V, C')
    targets: torch.Tensor,             # (N,) int64
    bias: Optional[torch.Tensor] = None, reference_bias: Optional[torch.Tensor] = None,
    chunk_rows: int = 8192,
) -> torch.Tensor:
    """(N, 5) fp32, the COLUMNS: -ln p_B(target), -ln p_A(target), KL(A ‖ B) = Σ_v p_A(v) (ln p_A(v) - ln p_B(v)),
    1.0 where argmax p_A = argmax p_B (the lowest id on a tie, as torch.argmax picks), p_B(target) - p_A(target).
    Identical logits give a KL of exactly 0: each term is p_A(v) times a difference of equal numbers."""
    pieces = []
    for begin in range(0, hidden.shape[0], chunk_rows):
        rows = slice(begin, begin + chunk_rows)
        logits = F.linear(hidden[rows], weight, bias).float()                                    # (c, V)
        reference_logits = F.linear(reference_hidden[rows], reference_weight, reference_bias).float()  # (c, V)
        pieces.append(_divergence_of_logits(logits, reference_logits, targets[rows]))
    return torch.cat(pieces) if len(pieces) > 1 else pieces[0]


def _divergence_of_logits(logits: torch.Tensor, reference_logits: torch.Tensor,
                          targets: torch.Tensor) -> torch.Tensor:
    """The COLUMNS of one chunk; both (c, V) fp32 logit tensors are overwritten (in place: no third one)."""
    same_top1 = (logits.argmax(-1) == reference_logits.argmax(-1)).float()                     # (c,)
    log_p = logits.sub_(logits.logsumexp(-1, keepdim=True))                                    # ln p_B
    reference_log_p = reference_logits.sub_(reference_logits.logsumexp(-1, keepdim=True))      # ln p_A
    nll = -log_p.gather(1, targets[:, None])[:, 0]
    reference_nll = -reference_log_p.gather(1, targets[:, None])[:, 0]
    log_ratio = log_p.sub_(reference_log_p).neg_()                                             # ln p_A - ln p_B
    reference_p = reference_log_p.exp_()                                                       # p_A
    kld = (reference_p.unsqueeze(1) @ log_ratio.unsqueeze(2))[:, 0, 0]                         # row-wise dot
    delta_p = torch.exp(-nll) - torch.exp(-reference_nll)
    return torch.stack([nll, reference_nll, kld, same_top1, delta_p], dim=1)


def make_divergence_score_fn(model: nn.Module, reference: nn.Module, chunk_rows: int = 8192):
    """A scorer as fastppl.engine.score.make_score_fn's, whose output is (B, T, 5) fp32 (the COLUMNS, 0 where not
    scored) instead of (B, T): column 0 is the model's NLL, which every NLL sum reads. Both models, on one
    device, read the same rows (and packed rows' positions and documents)."""
    bias = getattr(model.lm_head, "bias", None)
    reference_bias = getattr(reference.lm_head, "bias", None)

    def score(input_ids: torch.Tensor, targets: torch.Tensor, score_mask: torch.Tensor,
              position_ids: Optional[torch.Tensor] = None, document_ids: Optional[DocumentIds] = None) -> torch.Tensor:
        B, T = input_ids.shape
        packed = () if document_ids is None else (position_ids, document_ids)
        hidden = model(input_ids, *packed)                                                    # (B, T, C)
        reference_hidden = reference(input_ids, *packed)                                      # (B, T, C')
        values = chunked_divergence(
            hidden.reshape(B * T, -1), model.lm_head.weight, reference_hidden.reshape(B * T, -1),
            reference.lm_head.weight, targets.reshape(B * T), bias, reference_bias, chunk_rows)   # (B * T, 5)
        return torch.where(score_mask[..., None], values.view(B, T, len(COLUMNS)), 0.0)

    return score
