"""Two models on the same tokens: per scored token, the NLL of each, KL(reference ‖ model), whether their top-1
tokens agree and Δp, computed in fp32 from the two models' final hidden states a chunk of rows at a time, so
that a chunk holds at most WORKING_SET_TENSORS (chunk_rows, V) fp32 tensors' worth at once, never (B, T, V)."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..models.attention import DocumentIds, DocumentSpans

# the columns of a divergence scorer's (B, T, 5) output, of DeviceSums.divergence and of --per-token's array
COLUMNS = ("nll", "reference_nll", "kld", "same_top1", "delta_p")
KLD_COLUMN = COLUMNS.index("kld")
# at most this many logits of each model at once (the rows of a chunk: --loss-chunk-rows or fewer), so that the
# divergence adds little to one forward pass' activations (GPT-2: 333 rows); with 2 ** 26, a GPT-2 batch of
# 16 x 1024 peaked 3.1x above a one-model run.
CHUNK_LOGITS = 2 ** 24
# the vocabulary sums of a chunk run over this many blocks of its rows: torch.sum(dtype=float64) first copies its
# fp32 input to float64 (twice its size), so that three whole-chunk sums held five (rows, V) fp32 tensors' worth
# at once. By blocks a chunk holds at most WORKING_SET_TENSORS of them: both models' logits, a block's exp and
# its float64 copy (GPT-2: 2.75 x 64 MiB).
SUM_BLOCKS = 4
WORKING_SET_TENSORS = 2 + 3 / SUM_BLOCKS


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
    Identical logits give a KL of exactly 0: each term is p_A(v) times a difference of equal numbers.
    The logits are upcast to fp32 a chunk of rows at a time."""
    pieces = []
    for begin in range(0, hidden.shape[0], chunk_rows):
        rows = slice(begin, begin + chunk_rows)
        # each upcast at once, so that no (c, V) tensor in the model's dtype outlives its product
        logits = F.linear(hidden[rows], weight, bias).float()                                          # (c, V)
        reference_logits = F.linear(reference_hidden[rows], reference_weight, reference_bias).float()  # (c, V)
        pieces.append(_divergence_of_logits(logits, reference_logits, targets[rows]))
    return torch.cat(pieces) if len(pieces) > 1 else pieces[0]


def _divergence_of_logits(logits: torch.Tensor, reference_logits: torch.Tensor,
                          targets: torch.Tensor) -> torch.Tensor:
    """The COLUMNS of one chunk; both (c, V) fp32 logit tensors are overwritten (in place: beside them, at most a
    block of rows' exp and its float64 copy exist at a time, _row_sums_float64).

    Written for fp32's rounding, with d = logit - max logit of the row and S = Σ_v exp(d_v):
        ln p(v) = d_v - ln S,   KL(A ‖ B) = Σ_v exp(dA_v) (dA_v - dB_v) / S_A + ln(S_B / S_A)
    The sums over the vocabulary are float64, and no ln S (about ln V) is subtracted from another: the tokens
    that carry the probability have d near 0, where fp32 is finest. Against a float64 softmax of the same
    logits the KL is within about 1e-7 relative (a plain fp32 log-softmax: 1e-5)."""
    same_top1 = (logits.argmax(-1) == reference_logits.argmax(-1)).float()                     # (c,)
    maximum, reference_maximum = logits.amax(-1, keepdim=True), reference_logits.amax(-1, keepdim=True)
    # the targets' d in float64, exact: a low-probability target's d rounded to fp32 would be off by its ulp
    target_shifted = (logits.gather(1, targets[:, None]).double() - maximum.double())[:, 0]
    reference_target_shifted = (reference_logits.gather(1, targets[:, None]).double()
                                - reference_maximum.double())[:, 0]
    shifted = logits.sub_(maximum)                                                             # dB
    reference_shifted = reference_logits.sub_(reference_maximum)                               # dA
    exp_sum = _row_sums_float64(shifted, torch.exp)                                            # S_B
    log_ratio = shifted.sub_(reference_shifted).neg_()                                         # dA - dB
    reference_exp = reference_shifted.exp_()                                                   # exp(dA)
    reference_exp_sum = _row_sums_float64(reference_exp)                                       # S_A
    cross = _row_sums_float64(log_ratio.mul_(reference_exp))
    kld = cross / reference_exp_sum + torch.log(exp_sum / reference_exp_sum)
    nll = torch.log(exp_sum) - target_shifted
    reference_nll = torch.log(reference_exp_sum) - reference_target_shifted
    delta_p = torch.exp(target_shifted) / exp_sum - torch.exp(reference_target_shifted) / reference_exp_sum
    return torch.stack([nll, reference_nll, kld, same_top1.double(), delta_p], dim=1).float()


def _row_sums_float64(x: torch.Tensor, elementwise=None) -> torch.Tensor:
    """(c,) float64 sums over the rows of x (c, V) fp32, or of elementwise(x), SUM_BLOCKS blocks of rows at a
    time: the float64 copy that the sum makes (and elementwise's output) are a block's, not the chunk's."""
    return torch.cat([(block if elementwise is None else elementwise(block)).sum(-1, dtype=torch.float64)
                      for block in x.tensor_split(SUM_BLOCKS)])


def make_divergence_score_fn(model: nn.Module, reference: nn.Module, chunk_rows: int = 8192):
    """A scorer as fastppl.engine.score.make_score_fn's, whose output is (B, T, 5) fp32 (the COLUMNS, 0 where not
    scored) instead of (B, T): column 0 is the model's NLL, which every NLL sum reads. Both models read the same
    rows (and packed rows' positions and documents). A reference on a device of its own runs its forward there;
    its hidden states come to the model's device, where a copy of its output projection computes its logits."""
    device, reference_device = model.lm_head.weight.device, reference.lm_head.weight.device
    bias = getattr(model.lm_head, "bias", None)
    reference_weight = reference.lm_head.weight.to(device)
    reference_bias = getattr(reference.lm_head, "bias", None)
    reference_bias = None if reference_bias is None else reference_bias.to(device)
    chunk_rows = max(1, min(chunk_rows, CHUNK_LOGITS // model.lm_head.weight.shape[0]))

    def score(input_ids: torch.Tensor, targets: torch.Tensor, score_mask: torch.Tensor,
              position_ids: Optional[torch.Tensor] = None, document_ids: Optional[DocumentIds] = None,
              scored_rows: Optional[torch.Tensor] = None) -> torch.Tensor:
        B, T = input_ids.shape
        packed = () if document_ids is None else (position_ids, document_ids)
        hidden = model(input_ids, *packed).reshape(B * T, -1)                                 # (B * T, C)
        if reference_device == device:
            reference_hidden = reference(input_ids, *packed)                                  # (B, T, C')
        else:
            reference_hidden = reference(*_moved((input_ids, *packed), reference_device)).to(device)
        reference_hidden, targets = reference_hidden.reshape(B * T, -1), targets.reshape(B * T)
        if scored_rows is None:
            values = chunked_divergence(hidden, model.lm_head.weight, reference_hidden, reference_weight, targets,
                                        bias, reference_bias, chunk_rows)             # (B * T, 5)
            return torch.where(score_mask[..., None], values.view(B, T, len(COLUMNS)), 0.0)
        # the vocabulary products on the scored rows only: a sliding window's context and padding rows skip them
        values = chunked_divergence(
            hidden.index_select(0, scored_rows), model.lm_head.weight, reference_hidden.index_select(0, scored_rows),
            reference_weight, targets.index_select(0, scored_rows), bias, reference_bias, chunk_rows)
        return values.new_zeros(B * T, len(COLUMNS)).index_copy_(0, scored_rows, values).view(B, T, len(COLUMNS))

    # the scoring loop passes scored_rows= (fastppl.engine.score.scored_rows_of); a compiled scorer takes none
    score.gathers_scored_rows = True
    return score


def _moved(inputs: tuple, device: torch.device) -> tuple:
    """A batch's tensors (and DocumentSpans) on another device."""
    return tuple(DocumentSpans(x.ids.to(device), x.cu_seqlens.to(device), x.max_seqlen)
                 if isinstance(x, DocumentSpans) else x.to(device) for x in inputs)
