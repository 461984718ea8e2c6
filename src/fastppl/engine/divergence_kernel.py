"""The divergence of two models' logits in one Triton kernel (CUDA): the COLUMNS of fastppl.engine.divergence for a
chunk of rows, reading each (c, V) logit tensor twice and in the model's dtype, where the torch version runs a
dozen passes over two fp32 copies. One program per row; the first pass finds each model's maximum logit (and its
lowest index), the second sums, in float64 lanes, with the torch version's formula:

    S = Σ_v exp(d_v) with d = logit - max,   KL(A ‖ B) = Σ_v exp(dA_v) (dA_v - dB_v) / S_A + ln(S_B / S_A)

each term rounded in fp32 as the torch version rounds it. Reference: divergence._divergence_of_logits."""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

N_COLUMNS = 5
BLOCK = 2048


if triton is not None:
    @triton.jit
    def _row_maximum(row_ptr, V, BLOCK: tl.constexpr):
        """The row's largest value and the lowest index holding it."""
        lane_max = tl.full([BLOCK], float("-inf"), tl.float32)
        lane_index = tl.zeros([BLOCK], tl.int32)
        for start in range(0, V, BLOCK):
            columns = start + tl.arange(0, BLOCK)
            x = tl.load(row_ptr + columns, mask=columns < V, other=float("-inf")).to(tl.float32)
            better = x > lane_max                       # strict: a lane keeps its first (lowest) index on a tie
            lane_index = tl.where(better, columns, lane_index)
            lane_max = tl.where(better, x, lane_max)
        maximum = tl.max(lane_max, 0)
        index = tl.min(tl.where(lane_max == maximum, lane_index, V), 0)
        return maximum, index

    @triton.jit
    def _divergence_kernel(logits_ptr, reference_ptr, targets_ptr, out_ptr, V, stride_row, reference_stride_row,
                           BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        row_ptr = logits_ptr + row * stride_row
        reference_row_ptr = reference_ptr + row * reference_stride_row
        maximum, top = _row_maximum(row_ptr, V, BLOCK)                          # model B
        reference_maximum, reference_top = _row_maximum(reference_row_ptr, V, BLOCK)   # reference A
        exp_sum = tl.zeros([BLOCK], tl.float64)
        reference_exp_sum = tl.zeros([BLOCK], tl.float64)
        cross = tl.zeros([BLOCK], tl.float64)
        for start in range(0, V, BLOCK):
            columns = start + tl.arange(0, BLOCK)
            valid = columns < V
            shifted = tl.load(row_ptr + columns, mask=valid, other=0.0).to(tl.float32) - maximum
            reference_shifted = tl.load(reference_row_ptr + columns, mask=valid, other=0.0).to(tl.float32) \
                - reference_maximum
            reference_exp = tl.where(valid, tl.exp(reference_shifted), 0.0)
            exp_sum += tl.where(valid, tl.exp(shifted), 0.0).to(tl.float64)
            reference_exp_sum += reference_exp.to(tl.float64)
            cross += (reference_exp * (reference_shifted - shifted)).to(tl.float64)
        s_b = tl.sum(exp_sum, 0)
        s_a = tl.sum(reference_exp_sum, 0)
        target = tl.load(targets_ptr + row)
        target_shifted = tl.load(row_ptr + target).to(tl.float64) - maximum.to(tl.float64)
        reference_target_shifted = tl.load(reference_row_ptr + target).to(tl.float64) \
            - reference_maximum.to(tl.float64)
        out = out_ptr + row * 5
        tl.store(out, (tl.log(s_b) - target_shifted).to(tl.float32))
        tl.store(out + 1, (tl.log(s_a) - reference_target_shifted).to(tl.float32))
        tl.store(out + 2, (tl.sum(cross, 0) / s_a + tl.log(s_b / s_a)).to(tl.float32))
        tl.store(out + 3, tl.where(top == reference_top, 1.0, 0.0).to(tl.float32))
        tl.store(out + 4, (tl.exp(target_shifted) / s_b - tl.exp(reference_target_shifted) / s_a).to(tl.float32))


def divergence_of_logits_triton(logits: torch.Tensor, reference_logits: torch.Tensor, targets: torch.Tensor,
                                block: int = BLOCK) -> torch.Tensor:
    """(c, 5) fp32 COLUMNS of (c, V) logits of the model and of the reference (any float dtype, each row's
    entries contiguous), and (c,) int64 targets. The inputs are only read."""
    assert triton is not None, "the divergence kernel needs Triton"
    assert logits.shape == reference_logits.shape and logits.stride(1) == reference_logits.stride(1) == 1
    rows, vocabulary = logits.shape
    out = torch.empty((rows, N_COLUMNS), dtype=torch.float32, device=logits.device)
    if rows:
        _divergence_kernel[(rows,)](logits, reference_logits, targets.contiguous(), out, vocabulary,
                                    logits.stride(0), reference_logits.stride(0), BLOCK=block, num_warps=8)
    return out
