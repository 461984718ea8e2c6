"""Brute-force restatements of the two windowing schemes fastppl must reproduce, written from their
descriptions (issue 2), independently of fastppl.data.windows. Each returns the (context, target)
pairs a scheme scores, as stream indices: target j is predicted from stream[context_start : j].

Stream coordinates are those of fastppl.data.windows: chunked streams are [BOS] + tokens (stream
index k + 1 is token k); sliding streams are the bare tokens, or [BOS] + tokens with --bos.
"""
from __future__ import annotations


def hf_guide_pairs(n_stream: int, max_length: int, stride: int) -> list[tuple[int, int]]:
    """The loop of the Hugging Face guide "Perplexity of fixed-length models", literally:

        prev_end_loc = 0
        for begin_loc in range(0, seq_len, stride):
            end_loc = min(begin_loc + max_length, seq_len)
            trg_len = end_loc - prev_end_loc
            input_ids = ids[begin_loc:end_loc]; labels = input_ids, with labels[:-trg_len] = -100
            loss = model(input_ids, labels=labels)      # the model shifts: logits[i] predict labels[i+1]
            prev_end_loc = end_loc
            if end_loc == seq_len: break

    A label at window position i (i >= 1, not -100) is stream index begin_loc + i, predicted from
    stream[begin_loc : begin_loc + i]. Returns [(context_start, target)] in the order scored.
    """
    pairs = []
    prev_end_loc = 0
    for begin_loc in range(0, n_stream, stride):
        end_loc = min(begin_loc + max_length, n_stream)
        trg_len = end_loc - prev_end_loc
        window = list(range(begin_loc, end_loc))          # stream indices fed to the model
        labels = [None] * (len(window) - trg_len) + window[len(window) - trg_len:]
        for i in range(1, len(window)):                   # the shift: position 0 has no prediction
            if labels[i] is not None:
                pairs.append((begin_loc, labels[i]))
        prev_end_loc = end_loc
        if end_loc == n_stream:
            break
    return pairs


def rolling_token_windows(tokens: list, prefix_token, max_seq_len: int, context_len: int):
    """lm-evaluation-harness's rolling windows as described: the first window is the prefix token
    followed by the first max_seq_len - 1 tokens and predicts the first min(max_seq_len, n) tokens;
    each later window predicts the next (up to) max_seq_len - context_len + 1 tokens and reads the
    max_seq_len tokens just before its last prediction (so the last window is right-aligned).
    Yields (input tokens, predicted tokens)."""
    n = len(tokens)
    if n == 0:
        return
    new_per_window = max_seq_len - context_len + 1
    first = min(max_seq_len, n)
    yield [prefix_token] + tokens[:first - 1], tokens[:first]
    predicted = first
    while predicted < n:
        count = min(n - predicted, new_per_window)
        end = predicted + count                 # predicts tokens[end - count : end]
        assert end - max_seq_len - 1 >= 0, "only context_len = 1 is restated here"
        yield tokens[end - max_seq_len - 1:end - 1], tokens[end - count:end]
        predicted = end


def make_disjoint_window(window):
    """lm-evaluation-harness's make_disjoint_window: drop from the context the tokens that the
    continuation re-reads, so that context + continuation[:-1] is exactly what the model reads."""
    context, continuation = window
    return context[:len(context) - (len(continuation) - 1)], continuation


def lm_eval_rolling_pairs(n_tokens: int, ctx: int) -> list[tuple[int, int]]:
    """loglikelihood_rolling over tokens 0..n-1 with the BOS prefix, context_len = 1, disjoint
    windows, expressed in chunked-stream indices (BOS = 0, token k = k + 1)."""
    BOS = "BOS"
    stream_index = {BOS: 0, **{k: k + 1 for k in range(n_tokens)}}
    pairs = []
    for window in rolling_token_windows(list(range(n_tokens)), BOS, ctx, 1):
        context, continuation = make_disjoint_window(window)
        read = context + continuation[:-1]       # what the model reads, in order
        # harness windows are contiguous in the stream: the model reads stream[s : s + len(read)]
        start = stream_index[read[0]]
        assert [stream_index[t] for t in read] == list(range(start, start + len(read)))
        for i, target in enumerate(continuation):
            j = stream_index[target]
            assert j == start + len(context) + i  # target follows the tokens read before it
            pairs.append((start, j))
    return pairs


def window_pairs(windows) -> list[tuple[int, int]]:
    """(context_start, target) pairs that fastppl Windows score."""
    return [(w.start, j) for w in windows for j in w.scored_targets()]
