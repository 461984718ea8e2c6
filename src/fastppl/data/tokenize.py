"""Tokenizer loading and tokenisation with an on-disk cache of token ids."""
from __future__ import annotations

import hashlib
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from ..config import cache_dir
from ..errors import FastpplError


@dataclass
class Tokenizer:
    """The few things scoring needs from a Hugging Face tokenizer."""
    hf: object               # a transformers PreTrainedTokenizerFast
    name: str
    fingerprint: str         # changes whenever the mapping text -> ids could change
    bos_id: Optional[int]    # BOS, else end-of-text: what lm-evaluation-harness conditions on
    vocab_size: int          # ids are < vocab_size

    def encode(self, text: str) -> np.ndarray:
        ids = self.hf(text, add_special_tokens=False, verbose=False)["input_ids"]
        return np.asarray(ids, dtype=np.int64)

    def n_bytes(self, ids) -> int:
        return len(self.hf.decode(list(ids)).encode("utf-8"))

    def token_n_bytes(self, ids: np.ndarray, i: int) -> int:
        """UTF-8 bytes that token ids[i] adds to the decoded text. Decoded after up to 8 tokens of left
        context, not alone, because decoders treat the start of a text specially (SentencePiece drops
        the leading space of its first token)."""
        left = max(i - 8, 0)
        return self.n_bytes(ids[left:i + 1].tolist()) - self.n_bytes(ids[left:i].tolist())


def load_tokenizer(name_or_path: str, offline_hint: str = "") -> Tokenizer:
    from transformers import AutoTokenizer

    if name_or_path.startswith((".", "/", "~")) and not Path(name_or_path).expanduser().exists():
        raise FastpplError(f"{name_or_path}: no such tokenizer directory; check --tokenizer")
    try:
        hf = AutoTokenizer.from_pretrained(name_or_path, use_fast=True)
    except Exception as e:  # transformers raises many types for missing/offline/corrupt tokenizers
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise FastpplError(
            f"cannot load tokenizer {name_or_path!r} ({first_line[:200]}); "
            f"pass --tokenizer PATH to a local tokenizer directory{offline_hint}"
        ) from None
    if len(hf.get_vocab()) <= len(set(hf.all_special_ids)):
        # transformers builds an empty tokenizer from a model directory that holds no tokenizer files
        raise FastpplError(
            f"{name_or_path}: holds no tokenizer vocabulary; pass --tokenizer PATH to a tokenizer directory"
            f"{offline_hint}"
        )
    hf.model_max_length = 1 << 62  # we window ourselves; silence the "sequence too long" warning
    backend = getattr(hf, "backend_tokenizer", None)
    serialised = backend.to_str() if backend is not None else repr(sorted(hf.get_vocab().items()))
    fingerprint = hashlib.sha256(serialised.encode("utf-8")).hexdigest()[:16]
    bos_id = hf.bos_token_id if hf.bos_token_id is not None else hf.eos_token_id
    return Tokenizer(hf=hf, name=name_or_path, fingerprint=fingerprint, bos_id=bos_id, vocab_size=len(hf))


def encode_cached(tokenizer: Tokenizer, text: str, use_cache: bool = True) -> np.ndarray:
    """Token ids of text, from the cache when the same tokenizer has seen the same text before."""
    text_hash = hashlib.sha256(text.encode("utf-8", errors="surrogatepass")).hexdigest()[:24]
    path = cache_dir() / "tokens" / f"{tokenizer.fingerprint}-{text_hash}.npy"
    if use_cache and path.exists():
        try:
            return np.load(path).astype(np.int64)
        except (OSError, ValueError):
            pass  # a damaged cache entry is simply recomputed
    ids = tokenizer.encode(text)
    if use_cache and len(text) >= 4096:  # small texts tokenise faster than a file round trip
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".npy")
            with os.fdopen(fd, "wb") as f:
                np.save(f, ids.astype(np.int32 if tokenizer.vocab_size < 2**31 else np.int64))
            os.replace(tmp, path)
        except OSError:
            pass  # a read-only cache only costs speed
    return ids
