"""Causal self-attention shared by the architectures, optionally restricted to one document per
span of a packed row (document_ids), so that packed documents never attend to each other.

On CUDA a document mask runs through FlexAttention with a block mask, which skips the blocks that lie
wholly outside every document; elsewhere it is a boolean (B, 1, T, T) mask for SDPA."""
from __future__ import annotations

import math
from typing import Callable, Optional

import torch
import torch.nn.functional as F


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,   # (B, nh, T, hs); k, v may have fewer heads (GQA)
    document_ids: Optional[torch.Tensor] = None,          # (B, T) int: equal ids attend to each other
) -> torch.Tensor:
    """(B, nh, T, hs) attention output. Plain causal attention uses SDPA's fused kernels."""
    enable_gqa = k.shape[1] != q.shape[1]
    if document_ids is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=enable_gqa)
    if q.device.type == "cuda":
        return flex_document_attention(q, k, v, document_ids, _flex_attention_fn())
    T = q.shape[2]
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    same_document = document_ids[:, :, None] == document_ids[:, None, :]          # (B, T, T)
    mask = (causal & same_document)[:, None]                                    # (B, 1, T, T)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=enable_gqa)


MASKED_ATTENTION = ("sdpa", "matmul", "reduction")   # the kernels masked_attention can use


def masked_attention(
    q: torch.Tensor,                    # (B, nh, T, hs)
    k: torch.Tensor, v: torch.Tensor,   # (B, nkv, L, hs): a whole KV cache; nh is a multiple of nkv
    mask: torch.Tensor,                 # (B, 1, T, L') bool (True: may attend) or additive float; L' <= L
    kernel: str = "sdpa",               # one of MASKED_ATTENTION
) -> torch.Tensor:
    """(B, nh, T, hs) attention under an explicit mask (the KV-cache path), over the first L' slots only.
    With grouped-query attention the g = nh / nkv query heads that share a key head are stacked along the
    query axis, so that the keys and values are read once and never copied to nh heads (SDPA's enable_gqa
    would fall back to its math kernel, which copies them, as soon as there is a mask).

    kernel: "sdpa" calls SDPA's fused kernels; "matmul" writes it as two matmuls around an fp32 softmax, and
    "reduction" as broadcast products summed in fp32, so that a compiler can fuse mask, scale and softmax
    (both are meant for a decode step's single query: "reduction" materialises (B, nkv, g*T, L', hs)
    when run eagerly)."""
    B, nh, T, hs = q.shape
    nkv = k.shape[1]
    L = mask.shape[-1]
    if L < k.shape[2]:
        k, v = k[:, :, :L], v[:, :, :L]      # views: the slots past L' are never read
    g = nh // nkv
    if g > 1:
        # query head h = kv * g + i reads key head kv; stacked row i * T + t is query t of head i in group kv
        q = q.reshape(B, nkv, g * T, hs)
        mask = mask.repeat(1, 1, g, 1) if T > 1 else mask                       # (B, 1, g*T or 1, L')
    if kernel == "sdpa":
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)             # (B, nkv, g*T, hs)
    elif kernel == "matmul":
        scores = (q @ k.transpose(-2, -1)).float() * hs ** -0.5                 # (B, nkv, g*T, L')
        probs = _masked_softmax(scores, mask).to(v.dtype)
        y = probs @ v
    elif kernel == "reduction":
        scores = (q.float()[:, :, :, None, :] * k.float()[:, :, None]).sum(-1) * hs ** -0.5   # (B, nkv, g*T, L')
        probs = _masked_softmax(scores, mask)
        y = (probs[..., None] * v.float()[:, :, None]).sum(-2).to(q.dtype)     # (B, nkv, g*T, hs)
    else:
        raise ValueError(f"unknown masked attention kernel {kernel!r}; use one of {MASKED_ATTENTION}")
    return y.view(B, nh, T, hs)


def _masked_softmax(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """fp32 softmax over the last axis of scores, under a bool or additive mask."""
    if mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, -math.inf)
    else:
        scores = scores + mask.float()
    return scores.softmax(dim=-1)


# The block mask of the last document_ids seen: every layer of one forward passes the same tensor, so it is
# built once per forward, not once per layer. The cache keeps the tensor alive, so `is` cannot be fooled
# by a new tensor at a reused address; document_ids are never written in place.
_last_block_mask: list = []
_compiled_flex_attention: list = []


def _flex_attention_fn() -> Callable:
    """flex_attention itself inside a compiled scorer; compiled on its own otherwise (eager flex_attention
    is an unfused reference that materialises the (T, T) scores)."""
    from torch.nn.attention.flex_attention import flex_attention
    if torch.compiler.is_compiling():
        return flex_attention
    if not _compiled_flex_attention:
        _compiled_flex_attention.append(torch.compile(flex_attention, dynamic=False))
    return _compiled_flex_attention[0]


def document_block_mask(document_ids: torch.Tensor):
    """FlexAttention BlockMask: causal, and only within equal document ids (B, T); shared by all heads."""
    from torch.nn.attention.flex_attention import create_block_mask
    caching = not torch.compiler.is_compiling()
    if caching and _last_block_mask and _last_block_mask[0] is document_ids:
        return _last_block_mask[1]
    B, T = document_ids.shape

    def same_document_causal(b, h, q_index, kv_index):
        return (q_index >= kv_index) & (document_ids[b, q_index] == document_ids[b, kv_index])

    block_mask = create_block_mask(same_document_causal, B, None, T, T, device=document_ids.device)
    if caching:
        _last_block_mask[:] = [document_ids, block_mask]
    return block_mask


def flex_document_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, document_ids: torch.Tensor, flex_attention_fn: Callable,
) -> torch.Tensor:
    """(B, nh, T, hs) causal attention within documents through FlexAttention (any device the function runs
    on; tests call it on the CPU with the eager reference)."""
    block_mask = document_block_mask(document_ids)
    return flex_attention_fn(q, k, v, block_mask=block_mask, enable_gqa=k.shape[1] != q.shape[1])
