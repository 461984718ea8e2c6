"""Fused output projection + cross-entropy for CUDA (Triton): per-token fp32 NLL without ever
writing a logit to memory. Each program owns BLOCK_M rows of hidden states and walks a segment of the
vocabulary (a ninth, vocabulary_segments) in BLOCK_N tiles: a tile of logits is a (BLOCK_M, BLOCK_N) fp32 matmul
result held on chip, folded into a running max / sum-of-exponentials (online logsumexp, in base 2) and a running
target logit; a second kernel combines each row's segments.

    nll[r] = logsumexp_v(h[r] . W[v] + b[v]) - (h[r] . W[target[r]] + b[target[r]])

The logits stay fp32 (never rounded to bf16), so this is slightly more exact than the chunked loss,
which rounds each logit to the model dtype before upcasting. Reference: engine/loss.py."""
from __future__ import annotations

import functools
import os
from typing import Optional

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # Triton before 3.4: pointer loads only
    TensorDescriptor = None


if triton is not None:
    LOG2E = tl.constexpr(1.4426950408889634)
    LN2 = tl.constexpr(0.6931471805599453)

    @triton.jit
    def _k_step(hidden_src, weight_src, rows, row_ok, cols, col_ok, row_start, v_start, k_start, C, stride_hn,
                stride_wv, logits, BLOCK_K: tl.constexpr, INPUT_PRECISION: tl.constexpr, TAIL: tl.constexpr,
                EVEN_K: tl.constexpr, TMA: tl.constexpr, OFFSETS_64: tl.constexpr):
        """logits + h[rows, k_start : k_start + BLOCK_K] . W[cols, same k]^T. TAIL: the tile runs past V, so its
        columns are masked; whole tiles need no masks (peeling the tail off moved the loss from 11.1 to 9.6 ms at
        GPT-2's shape on the H200). TMA: hidden_src and weight_src are tensor descriptors (Hopper's bulk
        copies, zero past the edges) instead of pointers. OFFSETS_64: the pointer offsets are computed in int64
        (row or vocabulary index x stride reaches 2^31 elements, where int32 wraps)."""
        if TMA:
            h = hidden_src.load([row_start, k_start])                                             # (M, K)
            w = weight_src.load([v_start, k_start]).T                                             # (K, N)
        else:
            k = k_start + tl.arange(0, BLOCK_K)
            if OFFSETS_64:
                h_ptrs = hidden_src + rows[:, None].to(tl.int64) * stride_hn + k[None, :]
                w_ptrs = weight_src + cols[None, :].to(tl.int64) * stride_wv + k[:, None]
            else:
                h_ptrs = hidden_src + rows[:, None] * stride_hn + k[None, :]
                w_ptrs = weight_src + cols[None, :] * stride_wv + k[:, None]
            if EVEN_K:
                h = tl.load(h_ptrs, mask=row_ok[:, None], other=0.0)                              # (M, K)
                if TAIL:
                    w = tl.load(w_ptrs, mask=col_ok[None, :], other=0.0)                          # (K, N)
                else:
                    w = tl.load(w_ptrs)
            else:
                h = tl.load(h_ptrs, mask=row_ok[:, None] & (k[None, :] < C), other=0.0)
                w = tl.load(w_ptrs, mask=col_ok[None, :] & (k[:, None] < C), other=0.0)
        return tl.dot(h, w, logits, input_precision=INPUT_PRECISION)

    @triton.jit
    def _fold_logits(logits, bias_ptr, cols, col_ok, targets, running_max, running_sum, target_logit,
                     HAS_BIAS: tl.constexpr, TAIL: tl.constexpr):
        """Fold one (BLOCK_M, BLOCK_N) tile of logits into the running logsumexp (base 2) and target logit."""
        if HAS_BIAS:
            logits += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        if TAIL:
            logits = tl.where(col_ok[None, :], logits, float("-inf"))
        is_target = cols[None, :] == targets[:, None]
        target_logit += tl.sum(tl.where(is_target, logits, 0.0), axis=1)
        # Base 2: each exponential is one multiply-add and exp2 (with the descriptor loads, -6 to -8 % of the
        # loss's time on the H200).
        new_max = tl.maximum(running_max, tl.max(logits, axis=1) * LOG2E)
        running_sum = running_sum * tl.exp2(running_max - new_max) + tl.sum(
            tl.exp2(logits * LOG2E - new_max[:, None]), axis=1)
        return new_max, running_sum, target_logit

    @triton.jit
    def _fused_nll_kernel(
        hidden_src, weight_src, bias_ptr, target_ptr, out_ptr, partial_ptr,
        N, V, C, full_tiles_end,       # full_tiles_end = V rounded down to whole BLOCK_N tiles
        stride_hn, stride_wv,
        HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        INPUT_PRECISION: tl.constexpr, EVEN_K: tl.constexpr, TMA: tl.constexpr, SEGMENTS: tl.constexpr,
        OFFSETS_64: tl.constexpr,
    ):
        """Program (row block, segment) folds the segment's whole vocabulary tiles (the last segment also the
        partial tile) into its rows' running statistics; with one segment it writes the NLL, else the statistics
        to partial_ptr (3, SEGMENTS, N) for _combine_segments_kernel."""
        pid = tl.program_id(0)
        segment = tl.program_id(1)
        row_start = pid * BLOCK_M
        rows = row_start + tl.arange(0, BLOCK_M)
        row_ok = rows < N
        targets = tl.load(target_ptr + rows, mask=row_ok, other=0)
        running_max = tl.full((BLOCK_M,), float("-inf"), tl.float32)     # base-2 units
        running_sum = tl.zeros((BLOCK_M,), tl.float32)
        target_logit = tl.zeros((BLOCK_M,), tl.float32)
        # Whole tiles, as one loop over (tile, k) steps rather than a k loop inside a tile loop: Triton pipelines
        # one loop, so the next tile's first loads are in flight during a tile's logsumexp instead of the
        # pipeline draining and refilling at every tile.
        k_steps = tl.cdiv(C, BLOCK_K)
        full_tiles = full_tiles_end // BLOCK_N
        first_tile = segment * full_tiles // SEGMENTS
        end_tile = (segment + 1) * full_tiles // SEGMENTS
        logits = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for step in range(first_tile * k_steps, end_tile * k_steps):
            k_index = step % k_steps
            v_start = step // k_steps * BLOCK_N
            cols = v_start + tl.arange(0, BLOCK_N)
            logits = _k_step(hidden_src, weight_src, rows, row_ok, cols, cols < V, row_start, v_start,
                             k_index * BLOCK_K, C, stride_hn, stride_wv, logits, BLOCK_K, INPUT_PRECISION, False,
                             EVEN_K, TMA, OFFSETS_64)
            if k_index == k_steps - 1:
                running_max, running_sum, target_logit = _fold_logits(
                    logits, bias_ptr, cols, cols < V, targets, running_max, running_sum, target_logit, HAS_BIAS,
                    False)
                logits = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        if full_tiles_end < V and segment == SEGMENTS - 1:   # the last, partial tile, with masks
            cols = full_tiles_end + tl.arange(0, BLOCK_N)
            for k_start in range(0, C, BLOCK_K):
                logits = _k_step(hidden_src, weight_src, rows, row_ok, cols, cols < V, row_start, full_tiles_end,
                                 k_start, C, stride_hn, stride_wv, logits, BLOCK_K, INPUT_PRECISION, True, EVEN_K,
                                 TMA, OFFSETS_64)
            running_max, running_sum, target_logit = _fold_logits(
                logits, bias_ptr, cols, cols < V, targets, running_max, running_sum, target_logit, HAS_BIAS, True)
        if SEGMENTS == 1:
            nll = (running_max + tl.log2(running_sum)) * LN2 - target_logit
            tl.store(out_ptr + rows, nll, mask=row_ok)
        else:
            partial = partial_ptr + segment * N + rows
            tl.store(partial, running_max, mask=row_ok)
            tl.store(partial + SEGMENTS * N, running_sum, mask=row_ok)
            tl.store(partial + 2 * SEGMENTS * N, target_logit, mask=row_ok)

    @triton.jit
    def _combine_segments_kernel(partial_ptr, out_ptr, N, SEGMENTS: tl.constexpr, BLOCK: tl.constexpr):
        """Each row's NLL from its segments' statistics, added one segment after the other: a fixed order per row,
        whatever layout the compiler picks for the block (a reduction over a (segments, rows) block was summed in
        another order when N was not a multiple of 16, so a row's NLL changed with the rows beside it)."""
        rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = rows < N
        row_max = tl.full((BLOCK,), float("-inf"), tl.float32)                           # base 2
        for segment in tl.static_range(SEGMENTS):
            row_max = tl.maximum(row_max, tl.load(partial_ptr + segment * N + rows, mask=ok, other=float("-inf")))
        total = tl.zeros((BLOCK,), tl.float32)
        target_logit = tl.zeros((BLOCK,), tl.float32)
        for segment in tl.static_range(SEGMENTS):
            at = partial_ptr + segment * N + rows
            segment_max = tl.load(at, mask=ok, other=float("-inf"))
            total += tl.load(at + SEGMENTS * N, mask=ok, other=0.0) * tl.exp2(segment_max - row_max)
            target_logit += tl.load(at + 2 * SEGMENTS * N, mask=ok, other=0.0)
        tl.store(out_ptr + rows, (row_max + tl.log2(total)) * LN2 - target_logit, mask=ok)


VOCABULARY_SEGMENTS = 9


def vocabulary_segments(V: int, block_n: int) -> int:
    """Programs per row block, each over a ninth of the vocabulary's whole tiles. With one program per row block
    (128 rows) the grid ran in few waves, and the last wave left SMs idle: 512 row blocks for GPT-2's 64 x 1024
    rows fill 3.88 waves of 132 SMs, 3 % of the loss idle, and other row counts up to 25 %. Nine segments make
    the waves nine times finer (GPT-2's 64 x 1024 rows: 34.9 waves). Fixed, not chosen from the row count, so
    that a row's NLL is computed the same way whichever rows share its batch."""
    return max(1, min(VOCABULARY_SEGMENTS, V // block_n))


@functools.cache
def _has_tma(device: torch.device) -> bool:
    if device.type != "cuda":
        return True    # Triton's interpreter (the CPU tests) emulates descriptors
    # NVIDIA compute capability 9+ (Hopper, Blackwell); ROCm reports 9.x too, where this was never measured
    return torch.version.hip is None and torch.cuda.get_device_capability(device)[0] >= 9


def _tma_fits(*tensors: torch.Tensor) -> bool:
    """Bulk copies need 16-byte aligned base addresses and row strides. 16-bit inputs only: with fp32 inputs
    (exact products, no tf32) the descriptor path ran 20x slower than pointer loads on the H200."""
    return TensorDescriptor is not None and _has_tma(tensors[0].device) and all(
        t.element_size() == 2 and t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0
        for t in tensors)


INT32_OFFSETS_LIMIT = 2 ** 31


def needs_64bit_offsets(n_rows: int, row_stride: int, n_vocab: int, vocab_stride: int) -> bool:
    """Whether pointer loads reach an element offset int32 cannot hold (e.g. fp32 GPT-2 at 2,731 rows x 1,024
    positions: 2.8 M rows x 768). Only then are offsets computed in int64, so the usual kernel is unchanged."""
    return max(n_rows * row_stride, n_vocab * vocab_stride) >= INT32_OFFSETS_LIMIT


def fused_token_nll(
    hidden: torch.Tensor,            # (N, C) bf16/fp16/fp32, CUDA
    weight: torch.Tensor,            # (V, C) same dtype
    targets: torch.Tensor,           # (N,) int64
    bias: Optional[torch.Tensor] = None,
    block_m: int = 128, block_n: Optional[int] = None, block_k: Optional[int] = None, num_warps: int = 8,
    num_stages: int = 3, tma: Optional[bool] = None, segments: Optional[int] = None,
) -> torch.Tensor:
    """(N,) fp32 NLL of each target, as engine.loss.chunked_token_nll, in one kernel. Tiles of
    128 x 256 x 64 for 16-bit inputs (measured fastest on the H200); fp32 inputs take half-size
    tiles to fit shared memory, and exact fp32 products (no tf32). tma: load through tensor descriptors
    (default: 16-bit inputs where the GPU and the alignment allow; False forces pointer loads). segments: how many
    programs share a row block's vocabulary (default vocabulary_segments)."""
    # interpreter: CPU check
    assert triton is not None and (hidden.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")
    wide = hidden.element_size() == 4
    block_n = block_n or (128 if wide else 256)
    block_k = block_k or (32 if wide else 64)
    hidden = hidden.contiguous()
    weight = weight.contiguous()
    bias = bias.contiguous() if bias is not None else None   # the kernel reads it at stride 1
    N, C = hidden.shape
    V = weight.shape[0]
    if N == 0:   # a descriptor needs a non-empty tensor; nothing to launch anyway
        return torch.empty(0, dtype=torch.float32, device=hidden.device)
    if tma is None:
        tma = _tma_fits(hidden, weight)
    if tma:
        hidden_src = TensorDescriptor.from_tensor(hidden, [block_m, block_k])
        weight_src = TensorDescriptor.from_tensor(weight, [block_n, block_k])
    else:
        hidden_src, weight_src = hidden, weight
    out = torch.empty(N, dtype=torch.float32, device=hidden.device)
    segments = vocabulary_segments(V, block_n) if segments is None else segments
    partial = torch.empty((3, segments, N) if segments > 1 else (1,), dtype=torch.float32, device=hidden.device)
    # row blocks vary fastest: the programs running at once share a segment, so W is read once per wave
    grid = (triton.cdiv(N, block_m), segments)
    _fused_nll_kernel[grid](
        hidden_src, weight_src, bias if bias is not None else hidden, targets.contiguous(), out, partial,
        N, V, C, V // block_n * block_n, hidden.stride(0), weight.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        INPUT_PRECISION="ieee" if wide else "tf32", EVEN_K=C % block_k == 0, TMA=tma, SEGMENTS=segments,
        # descriptors address in 64 bits themselves
        OFFSETS_64=not tma and needs_64bit_offsets(N, hidden.stride(0), V, weight.stride(0)),
        num_warps=num_warps, num_stages=num_stages,
    )
    if segments > 1:
        _combine_segments_kernel[(triton.cdiv(N, 256),)](partial, out, N, SEGMENTS=segments, BLOCK=256)
    return out


_compiled_op = None


def register_compiled_op() -> None:
    """Register the kernel as a custom op, so that torch.compile treats it as one opaque call inside a
    compiled scorer. Done only before compiling: registering imports torch's compiler machinery, which
    costs seconds of start-up that an eager run need not pay."""
    global _compiled_op
    if _compiled_op is not None or triton is None:
        return

    @torch.library.custom_op("fastppl::fused_token_nll", mutates_args=())
    def op(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
           bias: Optional[torch.Tensor]) -> torch.Tensor:
        return fused_token_nll(hidden, weight, targets, bias)

    @op.register_fake
    def _(hidden, weight, targets, bias):
        return hidden.new_empty(hidden.shape[0], dtype=torch.float32)

    _compiled_op = op


def fused_token_nll_op(hidden, weight, targets, bias=None):
    if torch.compiler.is_compiling():
        assert _compiled_op is not None, "accel.compile.compile_score_fn registers the op before compiling"
        return _compiled_op(hidden, weight, targets, bias)
    return fused_token_nll(hidden, weight, targets, bias)
