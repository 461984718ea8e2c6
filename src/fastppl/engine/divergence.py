"""Two models on the same tokens: per scored token, the NLL of each, KL(reference ‖ model) and its reverse, whether
their top-1 tokens agree, Δp, each model's entropy, the target's rank in the model, the reference's top-1
probability and the overlap of the two models' top-5 and top-10 tokens, computed in fp32 from the two models' final
hidden states a chunk of rows at a time, so that a chunk holds at most WORKING_SET_TENSORS (chunk_rows, V) fp32
tensors' worth at once, never (B, T, V). On CUDA the same columns come from one Triton kernel that writes no logit
(engine/fused_divergence.py), all but the top-k overlaps."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..models.attention import DocumentIds, DocumentSpans

# the per-token columns of a divergence run: a divergence scorer's (B, T, len(COLUMNS)) output, DeviceSums.divergence
# and --per-token's array (the report names them in "per_token_columns"); the statistics read them by name
COLUMNS = ("nll", "reference_nll", "kld", "same_top1", "delta_p", "reverse_kld", "entropy", "reference_entropy",
           "target_rank", "reference_top1_p", "top5_overlap", "top10_overlap")
KLD_COLUMN = COLUMNS.index("kld")
TOP_K = (5, 10)            # the top-k overlaps' k (the chunked path only)
# at most this many logits of each model at once (the rows of a chunk: --loss-chunk-rows or fewer), so that the
# divergence adds little to one forward pass' activations (GPT-2: 333 rows); with 2 ** 26, a GPT-2 batch of
# 16 x 1024 peaked 3.1x above a one-model run.
CHUNK_LOGITS = 2 ** 24
# the vocabulary sums of a chunk run over this many blocks of its rows: torch.sum(dtype=float64) first copies its
# fp32 input to float64 (twice its size), so that whole-chunk sums held five (rows, V) fp32 tensors' worth at
# once. By blocks a chunk holds at most WORKING_SET_TENSORS of them: both models' logits, a block's elementwise
# terms and their float64 copy (GPT-2: 2.75 x 64 MiB).
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
    """(N, len(COLUMNS)) fp32: -ln p_B(target), -ln p_A(target), KL(A ‖ B) = Σ_v p_A(v) (ln p_A(v) - ln p_B(v)),
    1.0 where argmax p_A = argmax p_B (the lowest id on a tie, as torch.argmax picks), p_B(target) - p_A(target),
    KL(B ‖ A), the entropies -Σ_v p ln p of B and of A, the target's rank in B (how many ids B's logits put above
    it, counting equal logits of lower ids as above: rank 0 is B's top-1), max_v p_A(v), and |top-k(A) ∩ top-k(B)|
    / k for k in TOP_K. Identical logits give both KLs exactly 0: each term is p times a difference of equal
    numbers. The logits are upcast to fp32 a chunk of rows at a time."""
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
    block of rows' elementwise terms and their float64 copy exist at a time, _row_sums_float64).

    Written for fp32's rounding, with d = logit - max logit of the row and S = Σ_v exp(d_v):
        ln p(v) = d_v - ln S,   KL(A ‖ B) = Σ_v exp(dA_v) (dA_v - dB_v) / S_A + ln(S_B / S_A),
        H(A) = ln S_A - Σ_v exp(dA_v) dA_v / S_A,   max_v p_A(v) = 1 / S_A
    The sums over the vocabulary are float64, and no ln S (about ln V) is subtracted from another: the tokens
    that carry the probability have d near 0, where fp32 is finest. Against a float64 softmax of the same
    logits the KL is within about 1e-7 relative (a plain fp32 log-softmax: 1e-5)."""
    same_top1 = (logits.argmax(-1) == reference_logits.argmax(-1)).double()                   # (c,)
    overlaps = _top_k_overlaps(logits, reference_logits)
    rank = _row_sums_float64(logits, _above_target, targets)                                # (c,)
    maximum, reference_maximum = logits.amax(-1, keepdim=True), reference_logits.amax(-1, keepdim=True)
    # the targets' d in float64, exact: a low-probability target's d rounded to fp32 would be off by its ulp
    target_shifted = (logits.gather(1, targets[:, None]).double() - maximum.double())[:, 0]
    reference_target_shifted = (reference_logits.gather(1, targets[:, None]).double()
                                - reference_maximum.double())[:, 0]
    shifted = logits.sub_(maximum)                                                            # dB
    reference_shifted = reference_logits.sub_(reference_maximum)                              # dA
    exp_sum, reference_exp_sum = (_row_sums_float64(x, torch.exp) for x in (shifted, reference_shifted))
    moment, reference_moment = (_row_sums_float64(x, lambda d: torch.exp(d).mul_(d))           # Σ exp(d) d
                                for x in (shifted, reference_shifted))
    reverse_cross = _row_sums_float64(shifted, lambda d, other: torch.exp(d).mul_(d - other), reference_shifted)
    cross = _row_sums_float64(reference_shifted, lambda d, other: torch.exp(d).mul_(d - other), shifted)
    log_ratio = torch.log(exp_sum / reference_exp_sum)                                        # ln(S_B / S_A)
    kld = cross / reference_exp_sum + log_ratio
    reverse_kld = reverse_cross / exp_sum - log_ratio
    nll = torch.log(exp_sum) - target_shifted
    reference_nll = torch.log(reference_exp_sum) - reference_target_shifted
    delta_p = torch.exp(target_shifted) / exp_sum - torch.exp(reference_target_shifted) / reference_exp_sum
    entropy = torch.log(exp_sum) - moment / exp_sum
    reference_entropy = torch.log(reference_exp_sum) - reference_moment / reference_exp_sum
    return torch.stack([nll, reference_nll, kld, same_top1, delta_p, reverse_kld, entropy, reference_entropy, rank,
                        1 / reference_exp_sum, *overlaps], dim=1).float()


def _above_target(block: torch.Tensor, block_targets: torch.Tensor) -> torch.Tensor:
    """For _row_sums_float64: True where an id ranks above its row's target (a higher logit, or an equal one of a
    lower id), so that the row's sum is the target's rank."""
    target_logit = block.gather(1, block_targets[:, None])
    ids = torch.arange(block.shape[1], device=block.device)
    return (block > target_logit) | ((block == target_logit) & (ids < block_targets[:, None]))


def _top_k_overlaps(logits: torch.Tensor, reference_logits: torch.Tensor) -> list[torch.Tensor]:
    """|top-k(A) ∩ top-k(B)| / k for each k in TOP_K, each (c,) float64."""
    k = max(TOP_K)
    top, reference_top = logits.topk(k, -1).indices, reference_logits.topk(k, -1).indices        # (c, k) each
    return [(top[:, :n, None] == reference_top[:, None, :n]).any(-1).sum(-1).double() / n for n in TOP_K]


def _row_sums_float64(x: torch.Tensor, elementwise=None, other: Optional[torch.Tensor] = None) -> torch.Tensor:
    """(c,) float64 sums over the rows of x (c, V) fp32, or of elementwise(x's block[, other's block]), SUM_BLOCKS
    blocks of rows at a time: the float64 copy that the sum makes (and elementwise's output) are a block's, not
    the chunk's."""
    pieces = []
    for i, block in enumerate(x.tensor_split(SUM_BLOCKS)):
        if elementwise is not None:
            block = elementwise(block) if other is None else elementwise(block, other.tensor_split(SUM_BLOCKS)[i])
        pieces.append(block.sum(-1, dtype=torch.float64))
    return torch.cat(pieces)


def make_divergence_loss_fn(model: nn.Module, reference: nn.Module, chunk_rows: int = 8192, fused_fn=None):
    """(hidden (B, T, C), reference_hidden (B, T, C'), targets, score_mask, scored_rows=None) -> (B, T,
    len(COLUMNS)) fp32, 0 where not scored: make_divergence_score_fn's columns from both models' final hidden
    states however they were made (the layer-major path, fastppl.engine.streamed, makes them a block at a time).
    Both hidden states are on the model's device, where a copy of the reference's output projection is."""
    device = model.lm_head.weight.device
    bias = getattr(model.lm_head, "bias", None)
    reference_weight = reference.lm_head.weight.to(device)
    reference_bias = getattr(reference.lm_head, "bias", None)
    reference_bias = None if reference_bias is None else reference_bias.to(device)
    chunk_rows = max(1, min(chunk_rows, CHUNK_LOGITS // model.lm_head.weight.shape[0]))

    def divergence(*args):
        return chunked_divergence(*args, chunk_rows) if fused_fn is None else fused_fn(*args)

    def divergence_of_hidden(hidden: torch.Tensor, reference_hidden: torch.Tensor, targets: torch.Tensor,
                             score_mask: torch.Tensor, scored_rows: Optional[torch.Tensor] = None) -> torch.Tensor:
        B, T = targets.shape
        hidden, reference_hidden = hidden.reshape(B * T, -1), reference_hidden.reshape(B * T, -1)
        targets = targets.reshape(B * T)
        if scored_rows is None:
            values = divergence(hidden, model.lm_head.weight, reference_hidden, reference_weight, targets, bias,
                                reference_bias)                                       # (B * T, len(COLUMNS))
            return torch.where(score_mask[..., None], values.view(B, T, len(COLUMNS)), 0.0)
        # the vocabulary products on the scored rows only: a sliding window's context and padding rows skip them
        values = divergence(
            hidden.index_select(0, scored_rows), model.lm_head.weight, reference_hidden.index_select(0, scored_rows),
            reference_weight, targets.index_select(0, scored_rows), bias, reference_bias)
        return values.new_zeros(B * T, len(COLUMNS)).index_copy_(0, scored_rows, values).view(B, T, len(COLUMNS))

    return divergence_of_hidden


def make_divergence_score_fn(model: nn.Module, reference: nn.Module, chunk_rows: int = 8192, fused_fn=None):
    """A scorer as fastppl.engine.score.make_score_fn's, whose output is (B, T, len(COLUMNS)) fp32 (the COLUMNS, 0
    where not scored) instead of (B, T): column 0 is the model's NLL, which every NLL sum reads. Both models read
    the same rows (and packed rows' positions and documents). A reference on a device of its own runs its forward
    there; its hidden states come to the model's device, where a copy of its output projection computes its
    logits. fused_fn: what computes the columns instead of chunked_divergence (engine.fused_divergence's kernel on
    CUDA, as accel.apply chooses), with chunked_divergence's arguments but chunk_rows."""
    device, reference_device = model.lm_head.weight.device, reference.lm_head.weight.device
    divergence_of_hidden = make_divergence_loss_fn(model, reference, chunk_rows, fused_fn)

    def score(input_ids: torch.Tensor, targets: torch.Tensor, score_mask: torch.Tensor,
              position_ids: Optional[torch.Tensor] = None, document_ids: Optional[DocumentIds] = None,
              scored_rows: Optional[torch.Tensor] = None) -> torch.Tensor:
        packed = () if document_ids is None else (position_ids, document_ids)
        hidden = model(input_ids, *packed)                                                    # (B, T, C)
        if reference_device == device:
            reference_hidden = reference(input_ids, *packed)                                  # (B, T, C')
        else:
            reference_hidden = reference(*_moved((input_ids, *packed), reference_device)).to(device)
        return divergence_of_hidden(hidden, reference_hidden, targets, score_mask, scored_rows)

    # the scoring loop passes scored_rows= (fastppl.engine.score.scored_rows_of); a compiled scorer takes none
    score.gathers_scored_rows = True
    return score


def _moved(inputs: tuple, device: torch.device) -> tuple:
    """A batch's tensors (and DocumentSpans) on another device."""
    return tuple(DocumentSpans(x.ids.to(device), x.cu_seqlens.to(device), x.max_seqlen)
                 if isinstance(x, DocumentSpans) else x.to(device) for x in inputs)
