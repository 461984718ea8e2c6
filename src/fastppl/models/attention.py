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
