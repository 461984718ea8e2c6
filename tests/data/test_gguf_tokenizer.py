"""A GGUF's tokenizer gives llama.cpp's ids for every tokenizer.ggml.pre fastppl supports, and a pre-tokenizer it
cannot reproduce is refused. The expected ids in llama_cpp_tokenize.json are llama.cpp's own: llama-tokenize, built
from llama.cpp's source on the CPU, run as `llama-tokenize -m FILE -f TEXT --ids --no-escape --log-disable
--no-parse-special` (as llama-perplexity tokenizes; and without --no-parse-special, its default, on the text that
spells special tokens) on the files gguf_vocab.write_vocab_gguf writes, under one name of each distinct rule of
fastppl.data.gguf_tokenizer.PRE_TOKENIZERS, under no name, and with no add_bos_token key; and on
SmolLM2-135M-Instruct's GGUF (tests/models/test_gguf_smollm2.py)."""
import json
from pathlib import Path

import pytest

from fastppl.data.gguf_tokenizer import PRE_TOKENIZERS
from fastppl.data.tokenize import load_tokenizer
from fastppl.errors import FastpplError

from gguf_vocab import write_vocab_gguf

pytest.importorskip("gguf")

FIXTURE = json.loads((Path(__file__).parent / "llama_cpp_tokenize.json").read_text(encoding="utf-8"))


def fastppl_ids(tokenizer, text: str) -> list[int]:
    """The ids fastppl scores for a text read as llama.cpp reads it: the default prefix, then encode()."""
    prefix = tokenizer.default_prefix()
    return ([] if prefix is None else [prefix]) + tokenizer.encode(text).tolist()


def _label(case: dict) -> str:
    return f"{case['pre']}" + ("" if case["add_bos"] is not None else ", no add_bos key")


@pytest.mark.parametrize("case", FIXTURE["cases"], ids=_label)
def test_a_ggufs_ids_are_llama_cpps(case, tmp_path, tokenizer_dir):
    tokenizer = load_tokenizer(str(write_vocab_gguf(tmp_path / "vocab.gguf", tokenizer_dir, case["pre"],
                                                    case["add_bos"])))
    as_llama_cpp_reads = tokenizer.with_specials_as_text()   # llama.cpp tokenizes without parse_special
    for text, ids in zip(FIXTURE["texts"], case["ids"]):
        assert fastppl_ids(as_llama_cpp_reads, text) == ids, text
    # llama-tokenize's default parses "<|endoftext|>" as the special token: fastppl's default too
    assert fastppl_ids(tokenizer, FIXTURE["texts"][FIXTURE["special_text"]]) == case["parsed_special"]


def test_the_fixture_covers_every_rule_of_the_table():
    covered = {case["pre"] for case in FIXTURE["cases"]}
    assert {PRE_TOKENIZERS[name] for name in covered if name} == set(PRE_TOKENIZERS.values())


def test_digits_are_split_off_before_the_words_where_the_pre_tokenizer_says(tmp_path, tokenizer_dir):
    """SmolLM2's rule: "a  1" is a, two spaces, 1 (GPT-2's: a, space, space-1)."""
    def tokens(pre):
        tokenizer = load_tokenizer(str(write_vocab_gguf(tmp_path / f"{pre}.gguf", tokenizer_dir, pre)))
        return [tokenizer.backend.id_to_token(int(i)) for i in tokenizer.encode("a  1")]
    assert tokens("smollm") == ["a", "\u0120\u0120", "1"]
    assert tokens("gpt-2") == ["a", "\u0120", "\u01201"]


@pytest.mark.parametrize("pre", ["kimi-k2", "gemma4", "no-such-pre"])
def test_a_pre_tokenizer_fastppl_does_not_reproduce_is_refused_by_name(pre, tmp_path, tokenizer_dir):
    path = write_vocab_gguf(tmp_path / "vocab.gguf", tokenizer_dir, pre)
    with pytest.raises(FastpplError, match=rf"tokenizer\.ggml\.pre '{pre}' .*pass --tokenizer PATH") as error:
        load_tokenizer(str(path))
    assert "\n" not in str(error.value)
