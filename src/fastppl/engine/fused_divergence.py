"""Fused divergence for CUDA (Triton): both models' output projections and every per-token column of
engine.divergence (but the top-k overlaps) in one pass over the vocabulary, in fp32, without writing a logit.

Each program owns BLOCK_M rows of both models' hidden states and walks a segment of the vocabulary in BLOCK_N
tiles, as the fused loss does (engine/fused_loss.py, whose tile product it shares): a tile of each model's logits
is a (BLOCK_M, BLOCK_N) fp32 product held on chip and folded into running statistics of each row, with m the
running maximum logit, d = logit - m and the sums

    S = Σ exp(d),  U = Σ exp(d) d,  X_BA = Σ exp(dB) (dB - dA),  X_AB = Σ exp(dA) (dA - dB)

rescaled when a maximum grows by δ (U → e^-δ (U - δ S); X_BA → e^-δB (X_BA - (δB - δA) S_B)), kept in float64
(a tile's own sums are fp32, as the chunked path's exponentials are); plus each model's
top-1 (the lowest id on a tie), the target's logit in each, and how many ids the model puts above the target. The
segments' statistics are combined in float64 by the same rules (combine_segments), and the columns follow as in
engine.divergence: KL(A ‖ B) = X_AB / S_A + ln(S_B / S_A), H = ln S - U / S, max p_A = 1 / S_A, ... No ln S is
subtracted from another, and the heavy tokens have d near 0, as in the chunked formula.

The target's rank needs the target's logit before the pass: it is computed beforehand as a dot product in fp32,
whose rounding may differ from the tile product's by an ulp, so an id whose logit is within that of the target's
may land on either side of it (the target itself never counts). The reference's top-1's rank in the model is not
computed: it is unknown until the pass ends."""
from __future__ import annotations

import os
from typing import Optional

import torch

from .divergence import COLUMNS
from .fused_loss import TensorDescriptor, _tma_fits, needs_64bit_offsets, triton, vocabulary_segments

if triton is not None:
    import triton.language as tl
    from .fused_loss import _k_step

    LOG2E = tl.constexpr(1.4426950408889634)

    @triton.jit
    def _running_max(z, cols, m, arg):
        """The row maxima and their lowest ids after a tile: a later tile's equal maximum keeps the earlier id."""
        tile_max = tl.max(z, axis=1)
        tile_arg = tl.argmax(z, axis=1, tie_break_left=True) + tl.min(cols, axis=0)
        arg = tl.where(tile_max > m, tile_arg, arg)
        return tl.maximum(m, tile_max), arg

    @triton.jit
    def _fold_pair(z, ref_z, cols, col_ok, targets, rank_logit, m, s, u, x, arg, ref_m, ref_s, ref_u, ref_x, ref_arg,
                   t, ref_t, rank, TAIL: tl.constexpr):
        """Fold one tile of each model's logits (B: z, A: ref_z) into the rows' running statistics."""
        if TAIL:
            z = tl.where(col_ok[None, :], z, float("-inf"))
            ref_z = tl.where(col_ok[None, :], ref_z, float("-inf"))
        is_target = cols[None, :] == targets[:, None]
        t += tl.sum(tl.where(is_target, z, 0.0), axis=1)
        ref_t += tl.sum(tl.where(is_target, ref_z, 0.0), axis=1)
        above = (z > rank_logit[:, None]) | ((z == rank_logit[:, None]) & (cols[None, :] < targets[:, None]))
        rank += tl.sum((above & (cols[None, :] != targets[:, None])).to(tl.int32), axis=1)
        new_m, arg = _running_max(z, cols, m, arg)
        new_ref_m, ref_arg = _running_max(ref_z, cols, ref_m, ref_arg)
        # the running sums are float64 (as the chunked path's vocabulary sums): in fp32, KL = X_AB / S_A +
        # ln(S_B / S_A) of two close models kept the sums' rounding, 1e-7 of ln(S_B / S_A), as 1e-5 of a small KL
        delta, ref_delta = (new_m - m).to(tl.float64), (new_ref_m - ref_m).to(tl.float64)
        started = s > 0    # before the first tile m = -inf, δ = inf: the old sums are 0 and stay 0
        scale, ref_scale = tl.exp(-delta), tl.exp(-ref_delta)
        u = tl.where(started, scale * (u - delta * s), 0.0)
        ref_u = tl.where(started, ref_scale * (ref_u - ref_delta * ref_s), 0.0)
        x = tl.where(started, scale * (x - (delta - ref_delta) * s), 0.0)
        ref_x = tl.where(started, ref_scale * (ref_x - (ref_delta - delta) * ref_s), 0.0)
        s, ref_s = scale * s, ref_scale * ref_s
        d, ref_d = z - new_m[:, None], ref_z - new_ref_m[:, None]
        e, ref_e = tl.exp2(d * LOG2E), tl.exp2(ref_d * LOG2E)
        if TAIL:   # past V: e = 0, and d = -inf, whose products with it would be NaN
            d = tl.where(col_ok[None, :], d, 0.0)
            ref_d = tl.where(col_ok[None, :], ref_d, 0.0)
        s += tl.sum(e, axis=1).to(tl.float64)
        ref_s += tl.sum(ref_e, axis=1).to(tl.float64)
        u += tl.sum(e * d, axis=1).to(tl.float64)
        ref_u += tl.sum(ref_e * ref_d, axis=1).to(tl.float64)
        x += tl.sum(e * (d - ref_d), axis=1).to(tl.float64)
        ref_x += tl.sum(ref_e * (ref_d - d), axis=1).to(tl.float64)
        return new_m, s, u, x, arg, new_ref_m, ref_s, ref_u, ref_x, ref_arg, t, ref_t, rank

    @triton.jit
    def _tile_logits(hidden_src, weight_src, bias_ptr, rows, row_ok, cols, row_start, v_start, N, V, C,
                     stride_hn, stride_wv, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, INPUT_PRECISION: tl.constexpr, TAIL: tl.constexpr, EVEN_K: tl.constexpr,
                     TMA: tl.constexpr, OFFSETS_64: tl.constexpr):
        """One model's (BLOCK_M, BLOCK_N) fp32 logits of a tile."""
        logits = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for k_start in range(0, C, BLOCK_K):
            logits = _k_step(hidden_src, weight_src, rows, row_ok, cols, cols < V, row_start, v_start, k_start, C,
                             stride_hn, stride_wv, logits, BLOCK_K, INPUT_PRECISION, TAIL, EVEN_K, TMA, OFFSETS_64)
        if HAS_BIAS:
            logits += tl.load(bias_ptr + cols, mask=cols < V, other=0.0).to(tl.float32)[None, :]
        return logits

    @triton.jit
    def _fused_divergence_kernel(
        hidden_src, weight_src, bias_ptr, ref_hidden_src, ref_weight_src, ref_bias_ptr, target_ptr, rank_logit_ptr,
        partial_ptr, N, V, C, REF_C, full_tiles_end, stride_hn, stride_wv, ref_stride_hn, ref_stride_wv,
        HAS_BIAS: tl.constexpr, REF_HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr, INPUT_PRECISION: tl.constexpr, EVEN_K: tl.constexpr, REF_EVEN_K: tl.constexpr,
        TMA: tl.constexpr, SEGMENTS: tl.constexpr, OFFSETS_64: tl.constexpr,
    ):
        """Program (row block, segment) folds its segment's tiles (the last segment also the partial tile) and
        writes its rows' statistics to partial_ptr (13, SEGMENTS, N) float64, the fields in _fold_pair's order."""
        pid = tl.program_id(0)
        segment = tl.program_id(1)
        row_start = pid * BLOCK_M
        rows = row_start + tl.arange(0, BLOCK_M)
        row_ok = rows < N
        targets = tl.load(target_ptr + rows, mask=row_ok, other=0)
        rank_logit = tl.load(rank_logit_ptr + rows, mask=row_ok, other=0.0)
        m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        ref_m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        s = tl.zeros((BLOCK_M,), tl.float64)
        u, x, ref_s, ref_u, ref_x = s, s, s, s, s
        t = tl.zeros((BLOCK_M,), tl.float32)
        ref_t = t
        arg = tl.zeros((BLOCK_M,), tl.int32)
        ref_arg, rank = arg, arg
        full_tiles = full_tiles_end // BLOCK_N
        for tile in range(segment * full_tiles // SEGMENTS, (segment + 1) * full_tiles // SEGMENTS):
            v_start = tile * BLOCK_N
            cols = v_start + tl.arange(0, BLOCK_N)
            z = _tile_logits(hidden_src, weight_src, bias_ptr, rows, row_ok, cols, row_start, v_start, N, V, C,
                             stride_hn, stride_wv, HAS_BIAS, BLOCK_M, BLOCK_N, BLOCK_K, INPUT_PRECISION, False,
                             EVEN_K, TMA, OFFSETS_64)
            ref_z = _tile_logits(ref_hidden_src, ref_weight_src, ref_bias_ptr, rows, row_ok, cols, row_start, v_start,
                                 N, V, REF_C, ref_stride_hn, ref_stride_wv, REF_HAS_BIAS, BLOCK_M, BLOCK_N, BLOCK_K,
                                 INPUT_PRECISION, False, REF_EVEN_K, TMA, OFFSETS_64)
            m, s, u, x, arg, ref_m, ref_s, ref_u, ref_x, ref_arg, t, ref_t, rank = _fold_pair(
                z, ref_z, cols, cols < V, targets, rank_logit, m, s, u, x, arg, ref_m, ref_s, ref_u, ref_x, ref_arg,
                t, ref_t, rank, False)
        if full_tiles_end < V and segment == SEGMENTS - 1:   # the last, partial tile, with masks
            cols = full_tiles_end + tl.arange(0, BLOCK_N)
            z = _tile_logits(hidden_src, weight_src, bias_ptr, rows, row_ok, cols, row_start, full_tiles_end, N, V, C,
                             stride_hn, stride_wv, HAS_BIAS, BLOCK_M, BLOCK_N, BLOCK_K, INPUT_PRECISION, True,
                             EVEN_K, TMA, OFFSETS_64)
            ref_z = _tile_logits(ref_hidden_src, ref_weight_src, ref_bias_ptr, rows, row_ok, cols, row_start,
                                 full_tiles_end, N, V, REF_C, ref_stride_hn, ref_stride_wv, REF_HAS_BIAS, BLOCK_M,
                                 BLOCK_N, BLOCK_K, INPUT_PRECISION, True, REF_EVEN_K, TMA, OFFSETS_64)
            m, s, u, x, arg, ref_m, ref_s, ref_u, ref_x, ref_arg, t, ref_t, rank = _fold_pair(
                z, ref_z, cols, cols < V, targets, rank_logit, m, s, u, x, arg, ref_m, ref_s, ref_u, ref_x, ref_arg,
                t, ref_t, rank, True)
        at = partial_ptr + segment * N + rows
        step = SEGMENTS * N
        tl.store(at, m.to(tl.float64), mask=row_ok)
        tl.store(at + step, s, mask=row_ok)
        tl.store(at + 2 * step, u, mask=row_ok)
        tl.store(at + 3 * step, x, mask=row_ok)
        tl.store(at + 4 * step, arg.to(tl.float64), mask=row_ok)
        tl.store(at + 5 * step, ref_m.to(tl.float64), mask=row_ok)
        tl.store(at + 6 * step, ref_s, mask=row_ok)
        tl.store(at + 7 * step, ref_u, mask=row_ok)
        tl.store(at + 8 * step, ref_x, mask=row_ok)
        tl.store(at + 9 * step, ref_arg.to(tl.float64), mask=row_ok)
        tl.store(at + 10 * step, t.to(tl.float64), mask=row_ok)
        tl.store(at + 11 * step, ref_t.to(tl.float64), mask=row_ok)
        tl.store(at + 12 * step, rank.to(tl.float64), mask=row_ok)


def combine_segments(partial: torch.Tensor) -> torch.Tensor:
    """(N, len(COLUMNS)) fp32 from the kernel's (13, segments, N) float64 statistics, combined: each segment's
    sums brought to the row's maximum by the kernel's own rescaling rules; the top-1 from the first segment that
    holds the maximum (the lowest id on a tie); the target's logits and the rank added over the segments. The
    top-k overlaps are NaN (not computed)."""
    (m, s, u, x, arg, ref_m, ref_s, ref_u, ref_x, ref_arg, t, ref_t, rank) = partial.unbind(0)   # (seg, N) each
    top, ref_top = m.max(0), ref_m.max(0)
    delta, ref_delta = top.values - m, ref_top.values - ref_m
    scale, ref_scale = torch.exp(-delta), torch.exp(-ref_delta)
    exp_sum, ref_exp_sum = (scale * s).sum(0), (ref_scale * ref_s).sum(0)
    moment, ref_moment = (scale * (u - delta * s)).sum(0), (ref_scale * (ref_u - ref_delta * ref_s)).sum(0)
    reverse_cross = (scale * (x - (delta - ref_delta) * s)).sum(0)
    cross = (ref_scale * (ref_x - (ref_delta - delta) * ref_s)).sum(0)
    same_top1 = (arg.gather(0, top.indices[None])[0] == ref_arg.gather(0, ref_top.indices[None])[0]).double()
    target_shifted, ref_target_shifted = t.sum(0) - top.values, ref_t.sum(0) - ref_top.values
    log_ratio = torch.log(exp_sum / ref_exp_sum)
    nan = torch.full_like(exp_sum, float("nan"))
    values = {
        "nll": torch.log(exp_sum) - target_shifted, "reference_nll": torch.log(ref_exp_sum) - ref_target_shifted,
        "kld": cross / ref_exp_sum + log_ratio, "same_top1": same_top1,
        "delta_p": torch.exp(target_shifted) / exp_sum - torch.exp(ref_target_shifted) / ref_exp_sum,
        "reverse_kld": reverse_cross / exp_sum - log_ratio,
        "entropy": torch.log(exp_sum) - moment / exp_sum,
        "reference_entropy": torch.log(ref_exp_sum) - ref_moment / ref_exp_sum,
        "target_rank": rank.sum(0), "reference_top1_p": 1 / ref_exp_sum,
    }
    return torch.stack([values.get(name, nan) for name in COLUMNS], dim=1).float()


def _target_logits(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                   bias: Optional[torch.Tensor]) -> torch.Tensor:
    """(N,) fp32 logit of each row's target, for its rank (a dot product in fp32, ROWS rows at a time)."""
    pieces = []
    for begin in range(0, hidden.shape[0], 4096):
        rows = slice(begin, begin + 4096)
        logit = (hidden[rows].float() * weight[targets[rows]].float()).sum(-1)
        pieces.append(logit if bias is None else logit + bias[targets[rows]].float())
    return torch.cat(pieces)


def fused_divergence(
    hidden: torch.Tensor, weight: torch.Tensor,                        # (N, C), (V, C): the model under test (B)
    reference_hidden: torch.Tensor, reference_weight: torch.Tensor,    # (N, C'), (V, C'): the reference (A)
    targets: torch.Tensor,                                             # (N,) int64
    bias: Optional[torch.Tensor] = None, reference_bias: Optional[torch.Tensor] = None,
    block_m: int = 128, block_n: Optional[int] = None, block_k: Optional[int] = None, num_warps: int = 8,
    num_stages: int = 3, tma: Optional[bool] = None, segments: Optional[int] = None,
) -> torch.Tensor:
    """(N, len(COLUMNS)) fp32, engine.divergence.chunked_divergence's columns (the top-k overlaps NaN), in one
    kernel. Tiles of 128 x 128 x 64 for 16-bit inputs (two fp32 accumulators, one per model, live at once: half
    the fused loss's tile width), 64 x 64 x 32 for fp32, whose products are exact (no tf32). tma and segments: as
    engine.fused_loss.fused_token_nll."""
    assert triton is not None and (hidden.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")
    wide = hidden.element_size() == 4
    block_n = block_n or (64 if wide else 128)
    block_k = block_k or (32 if wide else 64)
    if wide:
        block_m = min(block_m, 64)
    hidden, weight = hidden.contiguous(), weight.contiguous()
    reference_hidden, reference_weight = reference_hidden.contiguous(), reference_weight.contiguous()
    bias = bias.contiguous() if bias is not None else None
    reference_bias = reference_bias.contiguous() if reference_bias is not None else None
    targets = targets.contiguous()
    (N, C), (V, REF_C) = hidden.shape, reference_weight.shape
    if N == 0:
        return torch.empty(0, len(COLUMNS), dtype=torch.float32, device=hidden.device)
    if tma is None:
        tma = _tma_fits(hidden, weight, reference_hidden, reference_weight)
    sources = [hidden, weight, reference_hidden, reference_weight]
    if tma:
        sources = [TensorDescriptor.from_tensor(x, [block_m if i % 2 == 0 else block_n, block_k])
                   for i, x in enumerate(sources)]
    segments = vocabulary_segments(V, block_n) if segments is None else segments
    partial = torch.empty((13, segments, N), dtype=torch.float64, device=hidden.device)
    rank_logit = _target_logits(hidden, weight, targets, bias)
    offsets_64 = not tma and (needs_64bit_offsets(N, hidden.stride(0), V, weight.stride(0))
                              or needs_64bit_offsets(N, reference_hidden.stride(0), V, reference_weight.stride(0)))
    _fused_divergence_kernel[(triton.cdiv(N, block_m), segments)](
        sources[0], sources[1], bias if bias is not None else hidden,
        sources[2], sources[3], reference_bias if reference_bias is not None else hidden,
        targets, rank_logit, partial, N, V, C, REF_C, V // block_n * block_n,
        hidden.stride(0), weight.stride(0), reference_hidden.stride(0), reference_weight.stride(0),
        HAS_BIAS=bias is not None, REF_HAS_BIAS=reference_bias is not None, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=block_k, INPUT_PRECISION="ieee" if wide else "tf32", EVEN_K=C % block_k == 0,
        REF_EVEN_K=REF_C % block_k == 0, TMA=tma, SEGMENTS=segments, OFFSETS_64=offsets_64,
        num_warps=num_warps, num_stages=num_stages,
    )
    return combine_segments(partial)


_compiled_op = None


def register_compiled_op() -> None:
    """The kernel as a custom op, one opaque call inside a compiled scorer (as engine.fused_loss registers its
    own, and only before compiling)."""
    global _compiled_op
    if _compiled_op is not None or triton is None:
        return

    @torch.library.custom_op("fastppl::fused_divergence", mutates_args=())
    def op(hidden: torch.Tensor, weight: torch.Tensor, reference_hidden: torch.Tensor,
           reference_weight: torch.Tensor, targets: torch.Tensor, bias: Optional[torch.Tensor],
           reference_bias: Optional[torch.Tensor]) -> torch.Tensor:
        return fused_divergence(hidden, weight, reference_hidden, reference_weight, targets, bias, reference_bias)

    @op.register_fake
    def _(hidden, weight, reference_hidden, reference_weight, targets, bias, reference_bias):
        return hidden.new_empty(hidden.shape[0], len(COLUMNS), dtype=torch.float32)

    _compiled_op = op


def fused_divergence_op(hidden, weight, reference_hidden, reference_weight, targets, bias=None,
                        reference_bias=None):
    if torch.compiler.is_compiling():
        assert _compiled_op is not None, "accel.compile.compile_score_fn registers the op before compiling"
        return _compiled_op(hidden, weight, reference_hidden, reference_weight, targets, bias, reference_bias)
    return fused_divergence(hidden, weight, reference_hidden, reference_weight, targets, bias, reference_bias)
