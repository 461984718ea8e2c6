"""A preallocated, static-shape key/value cache, attached to a built model's attention layers.

    setup_kv_cache(model, batch, max_len)    # every attention layer gets a KVCache of L = max_len slots
    hidden = model(ids, positions, cache_step=CacheStep(slots, mask))
    hidden = model(ids)                      # no cache_step: the plain forward, cache or not
    remove_kv_cache(model)                   # frees the cache

The model's forward is the same with and without a cache. Given a cache_step, each attention layer
writes the keys and values of the T new tokens into the slots named by `cache_step.slots`, then its
queries attend to all L slots under `cache_step.mask`. Which slot holds which token, and who may see it, is the
caller's business (generation: slot = step; cached sliding windows: a ring buffer), so the cache is
nothing but two tensors and an indexed write. Shapes never change, which is what CUDA graphs need.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn


@dataclass
class CacheStep:
    """What a cached forward of T new tokens needs, for every layer alike."""
    # (B, T) int64: the cache slot each new token's key and value go to; or (T,) when every row writes the
    # same slots (generation), which index_copy_ writes without a (B, nkv, T, hs) index
    slots: torch.Tensor
    # (B, 1, T, L) bool, True where the query may attend to the slot
    mask: torch.Tensor
    # rotary models only. None: keys are cached rotated at their own positions (generation).
    # Set: keys are cached unrotated and rotated on every read by these cos, sin (B, L, hs), so that a
    # slot's position can change from step to step (cached sliding windows use window-relative positions).
    key_rope: Optional[tuple[torch.Tensor, torch.Tensor]] = None


class KVCache(nn.Module):
    def __init__(self, batch: int, n_kv_head: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        super().__init__()
        shape = (batch, n_kv_head, max_len, head_dim)
        # zeros, not empty: slots that are never written are still read (under a False mask), and
        # 0 * NaN garbage would poison the attention output
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def update(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v (B, nkv, T, hs) into slots (B, T) or (T,); return the whole cache (B, nkv, L, hs) twice."""
        if slots.dim() == 1:
            self.k.index_copy_(2, slots, k)
            self.v.index_copy_(2, slots, v)
            return self.k, self.v
        # an index_put_, not a scatter_ with an expanded index: Inductor writes the first in place, but turns
        # the second into a copy of the whole cache and a copy back
        rows = torch.arange(k.shape[0], device=slots.device)[:, None]             # (B, 1)
        self.k[rows, :, slots] = k.transpose(1, 2)                                 # (B, T, nkv, hs)
        self.v[rows, :, slots] = v.transpose(1, 2)
        return self.k, self.v


def attention_layers(model: nn.Module) -> list[nn.Module]:
    """The modules that can hold a cache (they declare a `kv_cache` attribute, None when uncached)."""
    layers = [m for m in model.modules() if hasattr(m, "kv_cache")]
    assert layers, f"{type(model).__name__} has no attention layers that take a KV cache"
    return layers


def supports_kv_cache(model: nn.Module) -> bool:
    return any(hasattr(m, "kv_cache") for m in model.modules())


def setup_kv_cache(model: nn.Module, batch: int, max_len: int, dtype: Optional[torch.dtype] = None,
                   device: Optional[torch.device] = None) -> nn.Module:
    """Attach a fresh zeroed cache of max_len slots to every attention layer (dtype and device default to
    the model's). Returns the model."""
    weight = next(model.parameters())
    dtype = dtype or weight.dtype
    device = device or weight.device
    for layer in attention_layers(model):
        layer.kv_cache = KVCache(batch, layer.n_kv_head, max_len, layer.head_dim, dtype, device)
    return model


def ensure_kv_cache(model: nn.Module, batch: int, max_len: int) -> nn.Module:
    """setup_kv_cache unless the attached caches already have this shape. Keeping the same tensors
    keeps a compiled decode step's guards and CUDA graph addresses valid from call to call; stale
    contents are harmless, since masks hide every slot a step has not written."""
    weight = next(model.parameters())
    shape = None
    for layer in attention_layers(model):
        cache = layer.kv_cache
        if cache is None or cache.k.dtype != weight.dtype or cache.k.device != weight.device:
            shape = None
            break
        shape = (cache.k.shape[0], cache.k.shape[2])
    if shape != (batch, max_len):
        setup_kv_cache(model, batch, max_len)
    return model


def remove_kv_cache(model: nn.Module) -> nn.Module:
    for layer in attention_layers(model):
        layer.kv_cache = None
    return model
