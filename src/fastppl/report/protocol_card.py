"""The protocol card of a report: every choice that decides the number (corpus preparation, tokens, windows, BOS
rule, tail, normaliser, datasets), and under --protocol the figures as that protocol's own tool prints them."""
from __future__ import annotations

from typing import Optional

from ..data.protocols import Protocol
from ..data.streams import WindowPlan, sliding_stride
from ..data.tokenize import Tokenizer
from .metrics import perplexity
from .stats import mean_standard_error


def llama_cpp_estimate(nll_sum: float, nll_sq_sum: float, count: int) -> tuple[float, Optional[float]]:
    """llama-perplexity's final estimate, computed as it computes it: with mean = sum / count and
    mean_sq = sum of squares / count, PPL = exp(mean) and +/- = PPL * sqrt((mean_sq - mean^2) / (count - 1)).
    The +/- is None where that variance is not positive (llama.cpp prints an error instead)."""
    ppl = perplexity(nll_sum / count)
    mean = nll_sum / count
    if count < 2 or not nll_sq_sum / count - mean * mean > 0:
        return ppl, None
    return ppl, mean_standard_error(nll_sum, nll_sq_sum, count) * ppl


def _token(tokenizer: Tokenizer, token_id: Optional[int]) -> str:
    return "none" if token_id is None else f"{tokenizer.decode([token_id])!r} (id {token_id})"


def _corpus(protocol: Optional[Protocol]) -> str:
    if protocol is None or protocol.join is None and not protocol.detokenize:
        if protocol is not None and protocol.drop_final_newline:
            return "one text, as llama-perplexity -f reads it: one final newline dropped"
        return "one text, as read" if protocol and protocol.one_text else "each document scored on its own"
    if protocol.detokenize:
        return ("each page rewritten by lm-eval's wikitext detokenizer and scored on its own; words and bytes "
                "counted on the original page")
    return f"the rows of --data joined by {protocol.join!r} into one text"


def _windows(window: str, protocol: Optional[Protocol], plan: WindowPlan, ctx: int, stride: int) -> dict:
    if window == "chunked":
        return {"windows": f"lm-eval rolling windows of ctx {ctx}, disjoint: every token scored once",
                "tail": "scored: the last window is right-aligned"}
    if window == "sliding":
        return {"windows": f"the Hugging Face guide's strided windows of ctx {ctx}, stride {stride}: each scores "
                           "the tokens no earlier window scored", "tail": "scored: the last window ends the text"}
    score_from = plan.refs[0].window.score_from
    n_stream = sum(len(s.ids) for s in plan.streams)
    blocks = len(plan.refs)
    return {"windows": f"{blocks} disjoint blocks of ctx {ctx}; each reads its first {ctx - 1} tokens and scores "
                       f"its tokens {score_from + 1}..{ctx - 1} ({ctx - 1 - score_from} a block)",
            "tail": f"dropped: the {n_stream - blocks * ctx} tokens after block {blocks}"
                    + (f" (at most {protocol.max_blocks} blocks)" if protocol.max_blocks else "")}


def _bos(config, protocol: Optional[Protocol], tokenizer: Tokenizer) -> tuple[str, str]:
    """(how the text is tokenized, the BOS rule)."""
    if protocol is not None and protocol.tokenizer_bos:
        prefix = tokenizer.default_prefix()
        tokens = "as tokenizer(text) does by default: " + (
            "no special token added" if prefix is None else f"{_token(tokenizer, prefix)} before the text")
        if protocol.specials_as_text:
            tokens += "; a special token's spelling in the text (such as '<|endoftext|>') is text, as llama.cpp has it"
        if prefix is None:
            return tokens, "none: the tokenizer adds no BOS, so the first token is never a target"
        if protocol.bos_each_block:
            return tokens, f"each block's first token replaced by {_token(tokenizer, prefix)}"
        return tokens, f"{_token(tokenizer, prefix)} once, at the start of the text"
    tokens = "each document on its own, no special tokens added"
    if config.window == "chunked" or config.bos:
        return tokens, f"{_token(tokenizer, tokenizer.bos_id)} before each document, so its first token is scored"
    return tokens, "none: each document's first token is never a target"


def _normaliser(protocol: Optional[Protocol]) -> str:
    if protocol is not None and protocol.detokenize:
        return ("word_perplexity = exp(nll_sum / words), byte_perplexity = exp(nll_sum / bytes), bits_per_byte = "
                "nll_sum / bytes / ln 2, words and bytes of the original pages summed over pages")
    normaliser = "ppl = exp(nll_sum / tokens_scored), a mean over scored tokens"
    if protocol is not None and protocol.name == "gptq":
        normaliser += " (GPTQ's exp of the mean of the blocks' mean losses: the same, each block scoring ctx - 1)"
    if protocol is not None and protocol.name == "llama.cpp":
        normaliser += "; +/- = PPL * sqrt((mean of nll^2 - mean nll^2) / (tokens_scored - 1)), llama.cpp's"
    return normaliser


def _reported(protocol: Protocol, metrics, nll_sq_sum: float) -> dict:
    """The figures as the protocol's tool prints them, from the run's metrics (report.result.Metrics)."""
    if protocol.name == "llama.cpp":
        ppl, plus_minus = llama_cpp_estimate(metrics.nll_sum, nll_sq_sum, metrics.tokens_scored)
        line = f"Final estimate: PPL = {ppl:.4f} +/- {plus_minus:.5f}" if plus_minus is not None else \
            f"PPL = {ppl:.4f} (no +/-: the NLL does not vary)"
        return {"ppl": ppl, "ppl_plus_minus": plus_minus, "line": line}
    if protocol.detokenize:
        figures = {k: getattr(metrics, k) for k in ("word_perplexity", "byte_perplexity", "bits_per_byte")}
        return {**figures, "line": ", ".join(f"{k} {v:.4f}" for k, v in figures.items())}
    return {"ppl": metrics.ppl, "line": f"ppl {metrics.ppl:.4f}"}


def protocol_card(config, protocol: Optional[Protocol], plan: WindowPlan, tokenizer: Tokenizer, ctx: int,
                  datasets: list[dict], metrics, nll_sq_sum: float) -> dict:
    """The report's "protocol": every choice of the run, and with --protocol the figures as its tool reports them
    (from metrics, the run's report.result.Metrics)."""
    tokens, bos = _bos(config, protocol, tokenizer)
    card = {"name": protocol.name if protocol else None, "reproduces": protocol.reference if protocol else None,
            "corpus": _corpus(protocol), "tokens": tokens,
            **_windows(config.window, protocol, plan, ctx, sliding_stride(config.stride, ctx)), "bos": bos,
            "normaliser": _normaliser(protocol), "datasets": datasets}
    if protocol is not None:
        card["reported"] = _reported(protocol, metrics, nll_sq_sum)
    return card
