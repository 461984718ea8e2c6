"""Causal self-attention shared by the architectures, optionally restricted to one document per
span of a packed row (document_ids), so that packed documents never attend to each other.

A packed batch's documents come as a DocumentSpans (or, from callers that build rows by hand, a bare
(B, T) id tensor). Which kernel runs them:

  CUDA, bf16/fp16, torch's varlen_attn usable   variable-length flash attention over the flattened B*T
                                                tokens, causal inside each segment of cu_seqlens
  CUDA otherwise (fp32, no varlen, bare ids)    FlexAttention with a block mask, which skips the blocks
                                                that lie wholly outside every document
  elsewhere                                     SDPA under a boolean (B, 1, T, T) mask

If varlen_attn raises once (other than out of memory), FlexAttention serves the rest of the process."""
from __future__ import annotations

import functools
import inspect
import warnings
from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch
import torch.nn.functional as F

from ..errors import is_out_of_memory


@dataclass(frozen=True)
class DocumentSpans:
    """The documents of a packed batch in the two forms the kernels read. Segments are the runs of equal ids
    along each row of the flattened (B*T) tokens; padding at the end of a row is a segment of its own (its
    outputs are never scored), and no segment crosses a row boundary."""
    ids: torch.Tensor          # (B, T) int64: equal ids attend to each other; -1 padding
    cu_seqlens: torch.Tensor   # (n_segments + 1,) int32: first flat token of each segment, then B*T
    max_seqlen: int            # longest segment, in tokens (a host int: no device sync to read it)


DocumentIds = Union[torch.Tensor, DocumentSpans]


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,   # (B, nh, T, hs); k, v may have fewer heads (GQA)
    document_ids: Optional[DocumentIds] = None,          # (B, T) ids, or DocumentSpans; None: one document
) -> torch.Tensor:
    """(B, nh, T, hs) attention output. Plain causal attention uses SDPA's fused kernels."""
    enable_gqa = k.shape[1] != q.shape[1]
    if document_ids is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=enable_gqa)
    ids = document_ids
    if isinstance(document_ids, DocumentSpans):
        ids = document_ids.ids
        if varlen_available(q.device, q.dtype):
            try:
                return varlen_document_attention(q, k, v, document_ids, _varlen_attn_fn())
            except Exception as error:   # noqa: BLE001 -- any kernel failure falls back, once and for good
                if is_out_of_memory(error):
                    raise   # the scorer's back-off halves the batch; FlexAttention would need more memory
                _varlen_failed(error)
    if q.device.type == "cuda":
        return flex_document_attention(q, k, v, ids, _flex_attention_fn())
    T = q.shape[2]
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    same_document = ids[:, :, None] == ids[:, None, :]                          # (B, T, T)
    mask = (causal & same_document)[:, None]                                    # (B, 1, T, T)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=enable_gqa)


# ---- variable-length flash attention (torch.nn.attention.varlen) ----------------------------------------

# The first error varlen_attn raised, as one line; once set, FlexAttention serves every packed batch.
_varlen_failure: list[str] = []


def _varlen_failed(error: BaseException) -> None:
    message = f"{type(error).__name__}: {(str(error).splitlines() or [''])[0]}"
    _varlen_failure.append(message)
    warnings.warn(f"varlen_attn failed ({message}); packed rows use FlexAttention from now on", RuntimeWarning)


def varlen_failure() -> Optional[str]:
    """The error that switched this process from varlen_attn to FlexAttention, if any."""
    return _varlen_failure[0] if _varlen_failure else None


def _varlen_attn_fn() -> Optional[Callable]:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:   # torch before 2.9
        return None
    return varlen_attn


@functools.lru_cache(maxsize=None)
def varlen_signature(fn: Callable) -> Optional[tuple[dict, bool]]:
    """(keyword arguments that make fn causal, whether fn takes enable_gqa), or None for a signature this
    adapter does not know. torch has spelled causality two ways:
        varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, *, is_causal=False, ...)             (earlier, 2.11 among them)
        varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, *, window_size=(-1, -1), ...)        (later; (-1, 0) is causal)
    and only the later ones take enable_gqa."""
    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return None
    if "window_size" in parameters:
        causal = {"window_size": (-1, 0)}   # a tuple: varlen_attn tests `window_size == (-1, 0)`
    elif "is_causal" in parameters:
        causal = {"is_causal": True}
    else:
        return None
    return causal, "enable_gqa" in parameters


def varlen_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether packed rows on (device, dtype) run through varlen_attn: CUDA, bf16 or fp16 (the flash
    kernel's dtypes), a varlen_attn of a known signature, and no earlier failure in this process."""
    if torch.device(device).type != "cuda" or dtype not in (torch.bfloat16, torch.float16) or _varlen_failure:
        return False
    fn = _varlen_attn_fn()
    return fn is not None and varlen_signature(fn) is not None


def document_attention_backend(device: torch.device, dtype: torch.dtype) -> str:
    """The kernel that packed rows of DocumentSpans get on (device, dtype): varlen, flex or sdpa-mask."""
    if varlen_available(device, dtype):
        return "varlen"
    return "flex" if torch.device(device).type == "cuda" else "sdpa-mask"


def varlen_document_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spans: DocumentSpans, varlen_attn_fn: Callable,
) -> torch.Tensor:
    """(B, nh, T, hs) causal attention within the segments of spans.cu_seqlens, through varlen_attn_fn
    (torch's varlen_attn, or a stand-in of either signature in the tests)."""
    B, nh, T, hs = q.shape
    signature = varlen_signature(varlen_attn_fn)
    if signature is None:
        raise TypeError(f"unknown varlen_attn signature {inspect.signature(varlen_attn_fn)}")
    causal, takes_gqa = signature
    # (B, nh, T, hs) -> (B*T, nh, hs): a view when q was a transposed (B, T, nh, hs), as the models make it
    q, k, v = (t.transpose(1, 2).reshape(B * T, t.shape[1], hs) for t in (q, k, v))
    extra = dict(causal)
    if k.shape[1] != nh:
        if takes_gqa:
            extra["enable_gqa"] = True
        else:   # query head h reads key head h // (nh / nkv), as SDPA's enable_gqa
            k, v = (t.repeat_interleave(nh // t.shape[1], dim=1) for t in (k, v))
    cu, longest = spans.cu_seqlens, spans.max_seqlen
    y = varlen_attn_fn(q, k, v, cu, cu, longest, longest, **extra)                # (B*T, nh, hs)
    return y.reshape(B, T, nh, hs).transpose(1, 2)                                # (B, nh, T, hs)


# ---- the KV-cache path and FlexAttention -------------------------------------------------------------

def masked_attention(
    q: torch.Tensor,                    # (B, nh, T, hs)
    k: torch.Tensor, v: torch.Tensor,   # (B, nkv, L, hs): a whole KV cache; nh is a multiple of nkv
    mask: torch.Tensor,                 # (B, 1, T, L) bool: True where the query may attend to the slot
) -> torch.Tensor:
    """(B, nh, T, hs) attention under an explicit mask (the KV-cache path), through SDPA's fused kernels.
    With grouped-query attention the g = nh / nkv query heads that share a key head are stacked along the
    query axis, so that the keys and values are read once and never copied to nh heads (SDPA's enable_gqa
    would fall back to its math kernel, which copies them, as soon as there is a mask)."""
    B, nh, T, hs = q.shape
    nkv = k.shape[1]
    g = nh // nkv
    if g > 1:
        # query head h = kv * g + i reads key head kv; stacked row i * T + t is query t of head i in group kv
        q = q.reshape(B, nkv, g * T, hs)
        mask = mask.repeat(1, 1, g, 1) if T > 1 else mask                       # (B, 1, g*T or 1, L)
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)                 # (B, nkv, g*T, hs)
    return y.reshape(B, nh, T, hs)   # not view: SDPA's fp32 output can be strided (B, g*T, nkv, hs)


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
