"""Windowing: which tokens each forward pass sees and which of its predictions are scored.

Pure functions of (number of tokens, ctx, stride); no tensors, no model. Coordinates are those of the
*stream* of one document: the token ids, prefixed by BOS when the mode conditions on it.

A window is `Window(start, length, score_from)`: the model reads stream[start : start+length]
and, at window position p, predicts stream[start+p+1]. Positions score_from .. length-1 are scored.
So target stream index j is scored by exactly one window, at position p = j - start - 1.

chunked (lm-evaluation-harness `loglikelihood_rolling`, context_len=1, windows made disjoint)
    The stream is [BOS] + tokens, so every token (the first one too) is scored exactly once.
    Windows take `ctx` inputs each and score all their positions; the last window is right-aligned
    (it reads the ctx tokens before its end and scores only the new ones).

    Worked example: 7 tokens t0..t6, ctx = 3. Stream s = [B t0 t1 t2 t3 t4 t5 t6] (s[k+1] = t_k).

        window   reads            predicts        scored
        0        B  t0 t1         t0 t1 t2        t0 t1 t2   (start 0, score_from 0)
        1        t2 t3 t4         t3 t4 t5        t3 t4 t5   (start 3, score_from 0)
        2        t3 t4 t5         t4 t5 t6        t6         (start 4, score_from 2: right-aligned)

sliding (the strided loop of the Hugging Face guide "Perplexity of fixed-length models")
    Windows of at most ctx stream tokens start at 0, S, 2S, ...; each scores the tokens that no
    earlier window scored, so a scored token sees at least ctx - S tokens of context once that many
    exist. Without --bos the stream is the bare tokens and t0 is never scored (as in the guide);
    with --bos the stream is [BOS] + tokens. A window's last stream token is only a target: the guide
    feeds it to the model but its prediction (of the token after) is discarded, so we do not read it.

    Worked example: 7 tokens, no BOS, ctx = 4, S = 2. Stream s = t0..t6.

        guide window     reads         scored targets
        s[0:4]           t0 t1 t2      t1 t2 t3          (start 0, length 3, score_from 0)
        s[2:6]           t2 t3 t4      t4 t5             (start 2, length 3, score_from 1)
        s[4:7]           t4 t5         t6                (start 4, length 2, score_from 1)
                                      (stops: the window reached the end of the stream)

blocks (GPTQ's evaluation loop; llama.cpp's perplexity with score_from = ctx // 2)
    The stream is cut into n = n_stream // ctx disjoint blocks of ctx tokens; the tail (fewer than ctx
    tokens) is dropped. Each block reads its first ctx - 1 tokens and scores window positions
    score_from .. ctx - 2, i.e. its targets score_from + 1 .. ctx - 1: its first token is never a target.

    Worked example: 7 tokens, ctx = 3, score_from = 0. Stream s = t0..t6.

        block    reads      scored targets
        s[0:3]   t0 t1      t1 t2      (start 0, length 2, score_from 0)
        s[3:6]   t3 t4      t4 t5      (start 3, length 2, score_from 0)
                                       (t6, the tail, is dropped)
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Window:
    start: int        # first stream index read
    length: int       # number of stream tokens read (<= ctx)
    score_from: int   # window positions score_from .. length-1 are scored

    @property
    def n_scored(self) -> int:
        return self.length - self.score_from

    def scored_targets(self) -> range:
        """Stream indices of the targets this window scores."""
        return range(self.start + self.score_from + 1, self.start + self.length + 1)


def chunked_windows(n_tokens: int, ctx: int) -> list[Window]:
    """Disjoint rolling windows over a stream of n_tokens + 1 (BOS first); every token scored once."""
    assert ctx >= 1 and n_tokens >= 0
    windows = []
    predicted = 0  # tokens t0 .. t_{predicted-1} are scored; token t_k is stream index k + 1
    while predicted < n_tokens:
        end = min(predicted + ctx, n_tokens)     # score t_predicted .. t_{end-1}
        start = max(end - ctx, 0)                # read stream[start : end], right-aligned
        length = end - start
        windows.append(Window(start=start, length=length, score_from=predicted - start))
        predicted = end
    return windows


def sliding_windows(n_stream: int, ctx: int, stride: int) -> list[Window]:
    """The Hugging Face guide's strided windows over a stream of n_stream tokens."""
    assert 1 <= stride <= ctx and ctx >= 2
    windows = []
    previous_end = 0
    for begin in range(0, n_stream, stride):
        end = min(begin + ctx, n_stream)          # the guide's window is stream[begin:end]
        n_targets = end - previous_end            # the guide's trg_len
        first_target = max(end - n_targets, begin + 1)
        if end - begin >= 2:
            windows.append(Window(start=begin, length=end - 1 - begin, score_from=first_target - begin - 1))
        previous_end = end
        if end == n_stream:
            break
    return windows


def block_windows(n_stream: int, ctx: int, score_from: int = 0, max_blocks: int | None = None) -> list[Window]:
    """Disjoint blocks of ctx stream tokens (at most max_blocks), the tail dropped; each scores positions
    score_from .. ctx - 2."""
    assert ctx >= 2 and 0 <= score_from <= ctx - 2
    n_blocks = n_stream // ctx if max_blocks is None else min(n_stream // ctx, max_blocks)
    return [Window(start=b * ctx, length=ctx - 1, score_from=score_from) for b in range(n_blocks)]
