"""What the runs of one process share when `fastppl eval` scores a table of models × corpora (fastppl.table):
each corpus read once, each tokenizer loaded once, each corpus tokenized once per tokenizer, each model loaded
once. A run given no Reuse gets a fresh one, which keeps nothing past the run.

Models are kept one at a time: the table scores a model on every corpus before the next model is loaded, so the
next load first lets the last model go (its GPU memory freed), and a run's memory is that of its separate run.
The reference model has a slot of its own, kept for the whole table. A model is never shared between the two
slots: each is accelerated in place for its role (fastppl.accel.apply), and a cell must find it as its separate
run would."""
from __future__ import annotations

import gc
from typing import Any, Callable, Hashable

import torch


class Reuse:
    def __init__(self):
        self._corpora: dict[Hashable, Any] = {}
        self._tokenizers: dict[str, Any] = {}
        self._encodings: dict[Hashable, Any] = {}
        self._slots: dict[str, tuple[Hashable, Any]] = {}   # "model" | "reference" -> (key, model)

    def corpus(self, key: Hashable, read: Callable[[], Any]) -> Any:
        if key not in self._corpora:
            self._corpora[key] = read()
        return self._corpora[key]

    def tokenizer(self, name: Hashable, load: Callable[[], Any]) -> Any:
        if name not in self._tokenizers:
            self._tokenizers[name] = load()
        return self._tokenizers[name]

    def encoding(self, key: Hashable, encode: Callable[[], Any]) -> Any:
        """A corpus' token ids under one tokenizer (key: the corpus' key and the tokenizer's fingerprint)."""
        if key not in self._encodings:
            self._encodings[key] = encode()
        return self._encodings[key]

    def model(self, slot: str, key: Hashable, load: Callable[[], Any]) -> Any:
        """The model of `key` in `slot`: the one kept there if it is that model, else the kept one let go (and
        its memory freed) before `load` runs."""
        kept = self._slots.get(slot)
        if kept is not None and kept[0] == key:
            return kept[1]
        if kept is not None:
            self.release(slot)
        model = load()
        self._slots[slot] = (key, model)
        return model

    def release(self, slot: str) -> None:
        if self._slots.pop(slot, None) is not None:
            gc.collect()   # the model's last references are in cycles of its modules' hooks and caches
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.empty_cache()
