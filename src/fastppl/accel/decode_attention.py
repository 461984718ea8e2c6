"""One query per row over a KV cache (a decode step's attention) as a split-KV Triton kernel:
masked_attention's kernel "split_kv".

SDPA gives a single query to cuDNN's flash kernel, which pads it to a 64-row tile; at batch 64 that took
18 us a layer where reading the layer's keys and values takes ~10 (docs/BENCHMARKS.md, sessions 7 and 16).
Here one program takes one (row, key head, chunk of BLOCK_SLOTS slots): it loads the chunk's keys and values
once for the key head's g query heads, and writes the chunk's softmax statistics (max, sum, weighted values,
fp32); the chunks are then combined with plain tensor operations, which Inductor fuses into one kernel. The
op is a torch.library.triton_op, so that a compiled decode step keeps it inside its graph (and CUDA graph).

Arithmetic is fp32 from the loaded bf16/fp16/fp32 values; the mask is masked_attention's bool one, and each
query must see at least one slot (its own, in a decode step)."""
from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
    from torch.library import triton_op, wrap_triton
except ImportError:  # CPU-only installs, or a torch without triton_op
    triton = None

BLOCK_SLOTS = 64   # cache slots a program reads (read at each call: scripts/gpu_decode_attention.py sweeps it)


def split_kv_supported(device: torch.device) -> bool:
    """Whether the kernel can run on device: CUDA with Triton, or the CPU under Triton's interpreter (tests)."""
    if triton is None:
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


if triton is not None:
    @triton.jit
    def _split_kv_kernel(q_ptr, k_ptr, v_ptr, mask_ptr, max_ptr, sum_ptr, acc_ptr, n_slots, scale,
                         stride_qb, stride_qh, stride_kb, stride_kh, stride_kl, stride_mb,
                         NKV: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr, HS: tl.constexpr,
                         BLOCK_SLOTS: tl.constexpr):
        row_head = tl.program_id(0)              # row * NKV + key head
        chunk = tl.program_id(1)
        n_chunks = tl.num_programs(1)
        row = row_head // NKV
        kv = row_head % NKV
        slots = chunk * BLOCK_SLOTS + tl.arange(0, BLOCK_SLOTS)
        dims = tl.arange(0, HS)
        heads = tl.arange(0, BLOCK_G)            # the g query heads of key head kv (padded to a power of 2)
        in_range = slots < n_slots
        kv_offsets = row * stride_kb + kv * stride_kh + slots[:, None] * stride_kl + dims[None, :]
        k = tl.load(k_ptr + kv_offsets, mask=in_range[:, None], other=0.0).to(tl.float32)    # (SLOTS, HS)
        v = tl.load(v_ptr + kv_offsets, mask=in_range[:, None], other=0.0).to(tl.float32)
        allowed = tl.load(mask_ptr + row * stride_mb + slots, mask=in_range, other=0) != 0
        q_offsets = row * stride_qb + (kv * G + heads)[:, None] * stride_qh + dims[None, :]
        q = tl.load(q_ptr + q_offsets, mask=(heads < G)[:, None], other=0.0).to(tl.float32)   # (BLOCK_G, HS)
        # a product of one (or g) queries: broadcast and sum, no tensor-core tile to pad
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale                          # (BLOCK_G, SLOTS)
        scores = tl.where(allowed[None, :], scores, -float("inf"))
        chunk_max = tl.max(scores, axis=1)
        # a chunk with no allowed slot has max -inf: shift by 0 so that its weights are exp(-inf) = 0, not NaN
        weights = tl.exp(scores - tl.where(chunk_max == -float("inf"), 0.0, chunk_max)[:, None])
        out = (row_head * G + heads) * n_chunks + chunk
        tl.store(max_ptr + out, chunk_max, mask=heads < G)
        tl.store(sum_ptr + out, tl.sum(weights, axis=1), mask=heads < G)
        acc = tl.sum(weights[:, :, None] * v[None, :, :], axis=1)                                  # (BLOCK_G, HS)
        tl.store(acc_ptr + out[:, None] * HS + dims[None, :], acc, mask=(heads < G)[:, None])

    @triton_op("fastppl::split_kv_attention", mutates_args={})
    def split_kv_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
                           block_slots: int = BLOCK_SLOTS) -> torch.Tensor:
        """q (B, nh, 1, hs); k, v (B, nkv, L, hs) caches (last axis contiguous); allowed (B, L') uint8 with
        L' <= L: the slots each row's query sees -> (B, nh, 1, hs) in q's dtype. Query head h reads key head
        h // (nh / nkv)."""
        B, nh, _, hs = q.shape
        nkv = k.shape[1]
        g = nh // nkv
        n_slots = allowed.shape[1]
        n_chunks = triton.cdiv(n_slots, block_slots)
        q_rows = q.reshape(B, nh, hs)
        chunk_max = torch.empty(B * nh, n_chunks, device=q.device, dtype=torch.float32)
        chunk_sum = torch.empty_like(chunk_max)
        chunk_acc = torch.empty(B * nh, n_chunks, hs, device=q.device, dtype=torch.float32)
        wrap_triton(_split_kv_kernel)[(B * nkv, n_chunks)](
            q_rows, k, v, allowed, chunk_max, chunk_sum, chunk_acc, n_slots, hs ** -0.5,
            q_rows.stride(0), q_rows.stride(1), k.stride(0), k.stride(1), k.stride(2), allowed.stride(0),
            NKV=nkv, G=g, BLOCK_G=max(2, triton.next_power_of_2(g)), HS=hs, BLOCK_SLOTS=block_slots)
        top = chunk_max.amax(dim=1, keepdim=True)      # finite: every query sees a slot
        scale = torch.exp(chunk_max - top)             # (B*nh, n_chunks)
        y = (scale[..., None] * chunk_acc).sum(1) / (scale * chunk_sum).sum(1)[:, None]
        return y.to(q.dtype).reshape(B, nh, 1, hs)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """masked_attention's arguments for one query (q (B, nh, 1, hs), bool mask (B, 1, 1, L')) ->
    (B, nh, 1, hs)."""
    B, L = q.shape[0], mask.shape[-1]
    return split_kv_attention(q, k, v, mask.reshape(B, L).to(torch.uint8), BLOCK_SLOTS)
