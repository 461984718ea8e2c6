"""fastppl.report.protocol_card: llama-perplexity's estimate against a direct computation, and the card's
choices and reported figures for a run without a protocol and under each kind of --protocol."""
import math
from types import SimpleNamespace

import numpy as np
import pytest

from fastppl.data.protocols import PROTOCOLS
from fastppl.report.protocol_card import llama_cpp_estimate, protocol_card
from fastppl.report.result import Metrics

BOS = 50256


class FakeTokenizer:
    """What the card reads of a tokenizer: its BOS id, what it adds before a text, and how it decodes an id."""
    bos_id = BOS

    def __init__(self, prefix=None):
        self.prefix = prefix

    def default_prefix(self):
        return self.prefix

    def decode(self, ids):
        return {BOS: "<|endoftext|>", 1: "<s>"}[ids[0]]


def _metrics(nll_sum=30.0, tokens=10, n_bytes=40, words=8) -> Metrics:
    nll = nll_sum / tokens
    return Metrics(nll=nll, ppl=math.exp(nll), nll_sum=nll_sum, tokens_scored=tokens, tokens_total=tokens,
                   bits_per_token=nll / math.log(2), bytes=n_bytes, bits_per_byte=nll_sum / math.log(2) / n_bytes,
                   words=words, word_perplexity=math.exp(nll_sum / words), byte_perplexity=math.exp(nll_sum / n_bytes),
                   stderr={}, bootstrap=None, groups=None)


def _config(window="chunked", bos=False, stride=None):
    return SimpleNamespace(window=window, bos=bos, stride=stride)


def test_llama_cpp_estimate_is_its_formula():
    nll = np.array([2.0, 3.5, 1.25, 4.0, 2.75])
    ppl, plus_minus = llama_cpp_estimate(nll.sum(), (nll ** 2).sum(), len(nll))
    mean = nll.mean()
    assert ppl == pytest.approx(math.exp(mean), rel=1e-12)
    # llama.cpp: PPL * sqrt((mean of squares - square of mean) / (count - 1))
    assert plus_minus == pytest.approx(ppl * math.sqrt(((nll ** 2).mean() - mean ** 2) / (len(nll) - 1)), rel=1e-9)


def test_llama_cpp_estimate_has_no_plus_minus_without_spread():
    assert llama_cpp_estimate(6.0, 12.0, 3) == (pytest.approx(math.exp(2.0)), None)   # constant NLL
    assert llama_cpp_estimate(2.0, 4.0, 1)[1] is None                                  # one token


def test_a_run_without_protocol_states_its_choices_and_reports_nothing_extra():
    card = protocol_card(_config(), None, None, FakeTokenizer(), 16, [], _metrics(), 100.0)
    assert card["name"] is None and card["reproduces"] is None and "reported" not in card
    assert card["corpus"] == "each document scored on its own"
    assert card["windows"].startswith("lm-eval rolling windows of ctx 16")
    assert card["bos"] == "'<|endoftext|>' (id 50256) before each document, so its first token is scored"
    assert card["normaliser"] == "ppl = exp(nll_sum / tokens_scored), a mean over scored tokens"
    sliding = protocol_card(_config("sliding", stride=4), None, None, FakeTokenizer(), 16, [], _metrics(), 100.0)
    assert "ctx 16, stride 4" in sliding["windows"] and sliding["bos"].startswith("none:")


def test_llama_cpp_reports_its_estimate_line():
    plan = SimpleNamespace(refs=[SimpleNamespace(window=SimpleNamespace(score_from=8))] * 3,
                           streams=[SimpleNamespace(ids=np.zeros(50))])
    metrics = _metrics()
    card = protocol_card(_config("blocks"), PROTOCOLS["llama.cpp"], plan, FakeTokenizer(prefix=1), 16,
                         [{"dataset": "local"}], metrics, nll_sq_sum=95.0)
    ppl, plus_minus = llama_cpp_estimate(metrics.nll_sum, 95.0, metrics.tokens_scored)
    assert card["reported"] == {"ppl": ppl, "ppl_plus_minus": plus_minus,
                                "line": f"Final estimate: PPL = {ppl:.4f} +/- {plus_minus:.5f}"}
    assert card["windows"].startswith("3 disjoint blocks of ctx 16") and card["tail"].startswith("dropped: the 2 ")
    assert card["bos"] == "each block's first token replaced by '<s>' (id 1)" and card["datasets"] == [
        {"dataset": "local"}]
    flat = protocol_card(_config("blocks"), PROTOCOLS["llama.cpp"], plan, FakeTokenizer(prefix=1), 16, [], metrics,
                         nll_sq_sum=90.0)   # every token's NLL the same
    assert flat["reported"]["ppl_plus_minus"] is None and "no +/-" in flat["reported"]["line"]


def test_lm_eval_wikitext_reports_word_and_byte_figures_and_other_protocols_ppl():
    metrics = _metrics()
    card = protocol_card(_config(), PROTOCOLS["lm-eval-wikitext"], None, FakeTokenizer(), 16, [], metrics, 0.0)
    assert card["reported"]["word_perplexity"] == metrics.word_perplexity
    assert card["reported"]["bits_per_byte"] == metrics.bits_per_byte
    assert card["reported"]["line"].startswith("word_perplexity ") and "words and bytes" in card["normaliser"]
    rolling = protocol_card(_config(), PROTOCOLS["lm-eval-rolling"], None, FakeTokenizer(), 16, [], metrics, 0.0)
    assert rolling["reported"] == {"ppl": metrics.ppl, "line": f"ppl {metrics.ppl:.4f}"}
    assert rolling["reproduces"] == PROTOCOLS["lm-eval-rolling"].reference
