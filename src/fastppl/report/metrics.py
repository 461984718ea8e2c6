"""Corpus metrics from float64 sums, as lm-evaluation-harness defines them for its wikitext task:
weighted sums over documents, divided once (never a mean of per-document means)."""
from __future__ import annotations

import math

import numpy as np

# the ASCII characters that re's \s and str.isspace() both count as whitespace (they agree on every code point)
_ASCII_SPACE = np.zeros(128, dtype=bool)
_ASCII_SPACE[[9, 10, 11, 12, 13, 28, 29, 30, 31, 32]] = True
_CHUNK_CHARS = 1 << 24


def lm_eval_word_count(text: str) -> int:
    """len(re.split(r"\\s+", text)), lm-eval's word count: Unicode whitespace separates words, and leading
    or trailing whitespace each add one (empty) word, exactly as lm-eval counts them. It is one more than the
    whitespace runs, counted without the list of words (re.split took 1.4–2.2 s over a 33 MB text)."""
    if not text:
        return 1
    if not text.isascii():   # str.split() splits at the same whitespace as re, and drops the two ends' ''
        return len(text.split()) + text[0].isspace() + text[-1].isspace()
    runs, previous_is_space = 0, False
    for start in range(0, len(text), _CHUNK_CHARS):   # in chunks: a few bytes of temporaries per character
        is_space = _ASCII_SPACE[np.frombuffer(text[start:start + _CHUNK_CHARS].encode("ascii"), dtype=np.uint8)]
        runs += int(is_space[0] and not previous_is_space) + int(np.count_nonzero(is_space[1:] & ~is_space[:-1]))
        previous_is_space = bool(is_space[-1])
    return runs + 1


def perplexity(nll: float) -> float:
    """exp(nll), inf past float64's range (a mean NLL above ~709.78 nats) instead of OverflowError."""
    try:
        return math.exp(nll)
    except OverflowError:
        return float("inf")


def per_unit_metrics(nll_sum: float, n_bytes: int, n_words: int) -> dict:
    """word_perplexity = exp(nll_sum / words), byte_perplexity = exp(nll_sum / bytes)."""
    def exp_per(n: int) -> float:
        return perplexity(nll_sum / n) if n else float("nan")
    return {"words": n_words, "word_perplexity": exp_per(n_words), "byte_perplexity": exp_per(n_bytes)}
