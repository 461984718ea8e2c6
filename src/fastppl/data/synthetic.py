"""A synthetic many-document corpus for benchmarks (`fastppl bench --corpus docs`): token ids, no text."""
from __future__ import annotations

import numpy as np


def synthetic_document_lengths(
    n_documents: int = 10_000, min_tokens: int = 20, max_tokens: int = 1_500, seed: int = 0,
) -> np.ndarray:
    """(n_documents,) int64 lengths, log-uniform between min_tokens and max_tokens (both included)."""
    assert 1 <= min_tokens <= max_tokens and n_documents >= 0
    rng = np.random.default_rng(seed)
    log_lengths = rng.uniform(np.log(min_tokens), np.log(max_tokens + 1), size=n_documents)
    return np.clip(np.floor(np.exp(log_lengths)), min_tokens, max_tokens).astype(np.int64)


def synthetic_documents(
    n_documents: int = 10_000, min_tokens: int = 20, max_tokens: int = 1_500, vocab_size: int = 50_257,
    seed: int = 0,
) -> list[np.ndarray]:
    """Documents of uniformly random token ids in [0, vocab_size) with synthetic_document_lengths."""
    lengths = synthetic_document_lengths(n_documents, min_tokens, max_tokens, seed)
    ids = np.random.default_rng(seed + 1).integers(0, vocab_size, size=int(lengths.sum()), dtype=np.int64)
    return np.split(ids, np.cumsum(lengths)[:-1]) if n_documents else []
