"""Corpora, tokenisation with a disk cache, and windowing (pure functions)."""
