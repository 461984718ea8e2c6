"""From token ids to the windows a run scores: each document becomes a stream (with a BOS token in front when
it conditions on one), each stream is cut into windows (fastppl.data.windows), and the plan counts what every
window, document and the corpus scores."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import numpy as np

from ..config import PROTOCOL_MIN_CTX
from ..errors import FastpplError
from .batching import WindowRef
from .corpus import Document
from .tokenize import Tokenizer
from .protocols import Protocol
from .windows import block_windows, chunked_windows, sliding_windows


@dataclass
class Stream:
    """One document as the model reads it: [BOS] + tokens (chunked, or sliding with --bos) or tokens."""
    ids: np.ndarray       # (n,) int64
    bos: bool
    token_offset: int     # index of this document's first token in the corpus' token array

    @property
    def offset_of_target(self) -> int:
        # target stream index j is corpus token token_offset + j - (1 if bos else 0)
        return self.token_offset + (0 if self.bos else 1)


def sliding_stride(stride: Optional[int], ctx: int) -> int:
    """--stride, or by default half the context (each window after the first scores its last ctx/2 tokens)."""
    return stride or max(ctx // 2, 1)


def make_streams(tokens: list[np.ndarray], bos_id: Optional[int], use_bos: bool) -> list[Stream]:
    streams, offset = [], 0
    for ids in tokens:
        stream_ids = np.concatenate([[bos_id], ids]).astype(np.int64) if use_bos else ids
        streams.append(Stream(stream_ids, use_bos, offset))
        offset += len(ids)
    return streams


def plan_windows(window: str, stride: Optional[int], streams: list[Stream], ctx: int,
                 protocol: Optional[Protocol] = None) -> list[WindowRef]:
    """Every stream's windows, in order: chunked (lm-eval's rolling windows), sliding (the HF guide's) or blocks
    (a protocol's: GPTQ's, llama.cpp's)."""
    refs = []
    for doc, stream in enumerate(streams):
        if window == "chunked":
            windows = chunked_windows(len(stream.ids) - 1, ctx)
        elif window == "sliding":
            windows = sliding_windows(len(stream.ids), ctx, sliding_stride(stride, ctx))
        else:
            windows = block_windows(len(stream.ids), ctx, ctx // 2 if protocol.score_second_half else 0,
                                    protocol.max_blocks)
        refs.extend(WindowRef(doc, w) for w in windows)
    return refs


def check_blocks(protocol: Protocol, streams: list[Stream], ctx: int) -> None:
    """A blocks protocol's one text holds at least min_blocks blocks of ctx tokens (llama-perplexity refuses
    fewer than two). (That a block scores something at all, EvalConfig checks: config.PROTOCOL_MIN_CTX.)"""
    n_stream = sum(len(s.ids) for s in streams)
    if n_stream < protocol.min_blocks * ctx:
        what = (f"one block of --ctx = {ctx}" if protocol.min_blocks == 1
                else f"{protocol.min_blocks} x --ctx = {protocol.min_blocks * ctx}")
        fits = n_stream // protocol.min_blocks   # the largest --ctx that the text fills
        fix = (f"lower --ctx to {fits} or less, or pass a longer text" if fits >= PROTOCOL_MIN_CTX.get(protocol.name, 2)
               else "pass a longer text")
        raise FastpplError(f"--protocol {protocol.name} needs at least {what} tokens, and the text has {n_stream}; "
                           f"{fix}")


def with_bos_each_block(stream: Stream, ctx: int, bos_id: int) -> Stream:
    """llama.cpp's rule: the first token of every block reads as BOS. Those positions are never targets, so the
    stream keeps its coordinates and every target its token."""
    ids = stream.ids.copy()
    ids[::ctx] = bos_id
    return dataclasses.replace(stream, ids=ids)


@dataclass
class WindowPlan:
    """What a run scores: the streams, their windows, and the counts the batches and the report need."""
    streams: list[Stream]
    refs: list[WindowRef]
    n_tokens: int                    # tokens in the corpus
    window_lengths: np.ndarray       # (n_windows,) int64: positions each window reads
    scored_by_window: np.ndarray     # (n_windows,) int64
    scored_by_document: np.ndarray   # (n_documents,) int64
    scored_documents: np.ndarray     # indices of the documents with something to score

    @property
    def n_scored(self) -> int:
        return int(self.scored_by_window.sum())

    @property
    def n_positions(self) -> int:
        return int(self.window_lengths.sum())

    @property
    def stream_ids(self) -> list[np.ndarray]:
        return [s.ids for s in self.streams]

    @property
    def target_offsets(self) -> list[int]:
        return [s.offset_of_target for s in self.streams]

    @property
    def document_starts(self) -> np.ndarray:
        return np.array([s.token_offset for s in self.streams], dtype=np.int64)


def plan_corpus(tokens: list[np.ndarray], tokenizer: Tokenizer, window: str, stride: Optional[int],
                bos: bool, ctx: int, protocol: Optional[Protocol] = None) -> WindowPlan:
    """The windows of every document, refusing a corpus with nothing to score. Documents with nothing to score
    (empty, or one token when sliding without --bos) are skipped. A protocol that tokenizes as the tokenizer does
    by default starts each stream with the token the tokenizer adds (Llama: BOS; GPT-2: none)."""
    n_tokens = sum(len(t) for t in tokens)
    if n_tokens < 2:   # a corpus, not a document: one document of a set may well be a single token
        raise FastpplError(f"the corpus has {n_tokens} token(s); at least 2 are needed; pass a longer text")
    if protocol is not None and protocol.tokenizer_bos:
        bos_id = tokenizer.default_prefix()
        use_bos = bos_id is not None
    else:
        bos_id, use_bos = tokenizer.bos_id, window == "chunked" or bos
        if use_bos and bos_id is None:
            raise FastpplError(f"tokenizer {tokenizer.name!r} has no BOS or end-of-text token to condition on; "
                               "use --window sliding without --bos")
    streams = make_streams(tokens, bos_id, use_bos)
    if window == "blocks":
        check_blocks(protocol, streams, ctx)
        if protocol.bos_each_block and use_bos:
            streams = [with_bos_each_block(s, ctx, bos_id) for s in streams]
    refs = plan_windows(window, stride, streams, ctx, protocol)
    scored_by_window = np.array([r.window.n_scored for r in refs], dtype=np.int64)
    if scored_by_window.sum() == 0:
        raise FastpplError("no token can be scored (every document is a single token); add text or use --bos")
    scored_by_document = np.bincount([r.doc for r in refs], weights=scored_by_window,
                                     minlength=len(tokens)).astype(np.int64)
    return WindowPlan(streams, refs, n_tokens, np.array([r.window.length for r in refs], dtype=np.int64),
                      scored_by_window, scored_by_document, np.flatnonzero(scored_by_document))


def scored_bytes_by_document(documents: list[Document], tokens: list[np.ndarray], plan: WindowPlan,
                             tokenizer: Tokenizer) -> np.ndarray:
    """(n_documents,) UTF-8 bytes of each document's scored text: all of it, less the bytes of the tokens
    no window scores (sliding: each document's first token without --bos, and with --stride equal to
    --ctx each window's first)."""
    total = np.array([len(d.text_counted.encode("utf-8")) for d in documents], dtype=np.int64)
    scored = [np.zeros(len(t), dtype=bool) for t in tokens]
    for ref in plan.refs:
        w, stream = ref.window, plan.streams[ref.doc]
        first = w.start + w.score_from + 1 - (1 if stream.bos else 0)   # stream index j is token j - bos
        scored[ref.doc][first:first + w.n_scored] = True
    for doc, (ids, mask) in enumerate(zip(tokens, scored)):
        total[doc] -= sum(tokenizer.token_n_bytes(ids, int(i)) for i in np.flatnonzero(~mask))
    return total


def with_decoded_text(document: Document, tokenizer: Tokenizer, vocab_size: int) -> Document:
    """A pre-tokenised document (.npy) with its text decoded from its ids, so that bytes and words count
    the text the ids stand for; the ids themselves are scored as they are, never re-encoded."""
    largest = int(document.token_ids.max())
    if largest >= vocab_size:
        raise FastpplError(f"{document.id}: token id {largest:,} is outside the model's vocabulary of "
                           f"{vocab_size:,}; the ids must come from the model's tokenizer")
    if largest >= tokenizer.vocab_size:   # in a padded vocabulary: scored, but no text (no bytes) stands for it
        raise FastpplError(f"{document.id}: token id {largest:,} is not a token of tokenizer {tokenizer.name!r}, "
                           f"which has {tokenizer.vocab_size:,} ids (the model's {vocab_size:,} pad its vocabulary); "
                           "the ids must come from the model's tokenizer")
    return dataclasses.replace(document, text=tokenizer.decode(document.token_ids.tolist()))
