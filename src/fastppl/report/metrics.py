"""Corpus metrics from float64 sums, as lm-evaluation-harness defines them for its wikitext task:
weighted sums over documents, divided once (never a mean of per-document means)."""
from __future__ import annotations

import math
import re

_WHITESPACE = re.compile(r"\s+")


def lm_eval_word_count(text: str) -> int:
    """len(re.split(r"\\s+", text)), lm-eval's word count: Unicode whitespace separates words, and leading
    or trailing whitespace each add one (empty) word, exactly as lm-eval counts them."""
    return len(_WHITESPACE.split(text))


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
