"""Causal self-attention shared by the architectures, optionally restricted to one document per
span of a packed row (document_ids), so that packed documents never attend to each other."""
from __future__ import annotations

from typing import Optional

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
    T = q.shape[2]
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    same_document = document_ids[:, :, None] == document_ids[:, None, :]          # (B, T, T)
    mask = (causal & same_document)[:, None]                                    # (B, 1, T, T)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=enable_gqa)


def masked_attention(
    q: torch.Tensor,                    # (B, nh, T, hs)
    k: torch.Tensor, v: torch.Tensor,   # (B, nkv, L, hs): a whole KV cache; nh is a multiple of nkv
    mask: torch.Tensor,                 # (B, 1, T, L) bool: True where the query may attend
) -> torch.Tensor:
    """(B, nh, T, hs) attention under an explicit mask (the KV-cache path). With grouped-query attention
    the g = nh / nkv query heads that share a key head are stacked along the query axis, so that the
    keys and values are read once and never copied to nh heads (SDPA's enable_gqa would fall back to its
    math kernel, which copies them, as soon as there is a mask)."""
    B, nh, T, hs = q.shape
    nkv = k.shape[1]
    if nkv == nh:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    g = nh // nkv
    # query head h = kv * g + i reads key head kv; stacked row i * T + t is query t of head i in group kv
    q = q.reshape(B, nkv, g * T, hs)
    mask = mask.repeat(1, 1, g, 1) if T > 1 else mask                           # (B, 1, g*T or 1, L)
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)                 # (B, nkv, g*T, hs)
    return y.view(B, nh, T, hs)
