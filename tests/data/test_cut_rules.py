"""Cuts for parallel tokenisation (fastppl.data.cut_rules) only where they are proven to keep the ids: texts that
fooled a check by encoding around each cut, tokenizers outside the rules encoded whole, and a fuzz of random texts
against one encode for each family of tokenizer the rules admit, with the encoding check around each cut switched
off, so that the rules alone must be right."""
import random
import threading

import pytest
from tokenizers import AddedToken, Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers

from fastppl.data import pieces
from fastppl.data.cut_rules import GPT2_PATTERN, LLAMA3_PATTERN, O200K_PATTERN, QWEN2_PATTERN, unprovable_reason
from fastppl.data.pieces import encode_in_pieces

WORDS = "the quick brown fox jumps over 12 lazy dogs " * 8000


def _gpt2(tokenizer_dir) -> Tokenizer:
    return Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))


def _with_split(tokenizer_dir, pattern: str) -> Tokenizer:
    """GPT-2's vocabulary behind another regex, as Llama-3, Qwen2 and o200k tokenizers lay theirs out."""
    tokenizer = _gpt2(tokenizer_dir)
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    return tokenizer


def _trained(model, trainer, normalizer, pre_tokenizer, shakespeare) -> Tokenizer:
    tokenizer = Tokenizer(model)
    tokenizer.normalizer = normalizer
    tokenizer.pre_tokenizer = pre_tokenizer
    tokenizer.train_from_iterator(shakespeare.read_text()[:30_000].splitlines() + ["123 ½ é ж 東京"], trainer=trainer)
    return tokenizer


def _metaspace(shakespeare) -> Tokenizer:
    return _trained(models.BPE(unk_token="<unk>"), trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>"],
                                                                       show_progress=False),
                    normalizers.NFKC(), pre_tokenizers.Metaspace(), shakespeare)


def _same_ids(tokenizer, text) -> bool:
    encoded = encode_in_pieces(tokenizer, text)
    return encoded.ids.tolist() == tokenizer.encode(text, add_special_tokens=False).ids


def test_a_numeric_symbol_that_shifts_digit_groups_beyond_the_checked_context(tokenizer_dir):
    """½ is \\p{N}: Llama-3's regex groups the digits and ½ in threes from the run's start, 1,100 characters before
    the end of the run, beyond any context an encoding check around a cut reads."""
    text = "a" * 65137 + "1" * 100 + "½" * 700 + "1" * 300 + "a" * 65536
    assert _same_ids(_with_split(tokenizer_dir, LLAMA3_PATTERN), text)


@pytest.mark.slow
def test_a_strip_normalizer_is_never_cut(tokenizer_dir):
    tokenizer = _gpt2(tokenizer_dir)
    tokenizer.normalizer = normalizers.Strip()
    text = WORDS[:65236] + " " * 300 + WORDS[65236:]
    assert _same_ids(tokenizer, text)
    assert encode_in_pieces(tokenizer, text).whole_reason == "its normalizer Strip may act across a cut"


def test_an_added_token_that_takes_in_the_spaces_after_it(tokenizer_dir):
    tokenizer = _gpt2(tokenizer_dir)
    tokenizer.add_tokens([AddedToken("<tok>", rstrip=True)])
    text = WORDS[:65128] + "<tok>" + " " * 420 + WORDS[65128:]
    assert _same_ids(tokenizer, text)


@pytest.mark.slow
def test_an_added_token_that_takes_in_the_spaces_before_it(shakespeare):
    tokenizer = _metaspace(shakespeare)
    tokenizer.add_special_tokens([AddedToken("<mask>", lstrip=True, special=True)])
    for offset in (-300, -100):
        text = WORDS[:65536 + offset] + " " * 600 + "<mask>" + WORDS[65536 + offset:]
        assert _same_ids(tokenizer, text), offset


@pytest.mark.parametrize("change, reason", [
    (lambda t: setattr(t, "normalizer", normalizers.Prepend("▁")), "normalizer Prepend"),
    (lambda t: setattr(t, "normalizer", normalizers.Replace("a", "b")), "normalizer Replace"),
    (lambda t: setattr(t, "pre_tokenizer", pre_tokenizers.Split(Regex(r"\w+|\s+"), "isolated")), "pre-tokenizer Split"),
    (lambda t: setattr(t, "pre_tokenizer", pre_tokenizers.Metaspace(split=False)), "pre-tokenizer Metaspace"),
    (lambda t: setattr(t, "pre_tokenizer", pre_tokenizers.Sequence([pre_tokenizers.Digits(),
                                                                    pre_tokenizers.ByteLevel()])), "Digits"),
])
def test_tokenizers_outside_the_rules_are_encoded_whole(tokenizer_dir, change, reason):
    tokenizer = _gpt2(tokenizer_dir)
    assert unprovable_reason(tokenizer) is None
    change(tokenizer)
    assert reason in unprovable_reason(tokenizer)
    encoded = encode_in_pieces(tokenizer, WORDS[:140_000])
    assert encoded.pieces == 1 and reason in encoded.whole_reason


# ---- the fuzz ----

ADDED = ["<|endoftext|>", "<mask>", "[MASK]", "ab", " x", "½½"]
RUNS = ["123", "7", "½", "²", "٣", "Ⅻ", " ", "  ", "\n", "\n\n", "\t", "\r\n", "word", "Word", "x", "é", "ß", "жук",
        "東京", "İ", "ΑΣ", "'s", "'LL", ",", "...", "😀", "ﬁ", "\u0301", "<MASK>", "<Mask>", "AB", "½½"]


def _random_text(rng: random.Random, n_runs: int) -> str:
    parts = []
    for _ in range(n_runs):
        if rng.random() < 0.5:   # the words a cut needs
            parts.append(" ".join(rng.choice(["cd", "ef9", "Word", "7", "gh"]) for _ in range(rng.randint(1, 6))))
        else:
            parts.append(rng.choice(RUNS + ADDED) * rng.choice([1, 1, 2, 3, 40, 300]))
    return "".join(parts)


def _added(tokenizer, rng: random.Random) -> Tokenizer:
    for content in ADDED:
        tokenizer.add_tokens([AddedToken(content, lstrip=rng.random() < 0.5, rstrip=rng.random() < 0.5,
                                         single_word=rng.random() < 0.3, normalized=rng.random() < 0.5)])
    return tokenizer


def _families(tokenizer_dir, shakespeare):
    wordpiece = _trained(models.WordPiece(unk_token="[UNK]"), trainers.WordPieceTrainer(
        vocab_size=300, special_tokens=["[UNK]"], show_progress=False),
        normalizers.BertNormalizer(lowercase=True), pre_tokenizers.BertPreTokenizer(), shakespeare)
    unigram = _trained(models.Unigram(), trainers.UnigramTrainer(vocab_size=200, unk_token="<unk>",
                                                                  special_tokens=["<unk>"], show_progress=False),
                       normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()]),
                       pre_tokenizers.Metaspace(prepend_scheme="first"), shakespeare)
    whitespace = _trained(models.WordLevel(unk_token="[UNK]"), trainers.WordLevelTrainer(
        vocab_size=300, special_tokens=["[UNK]"], show_progress=False), normalizers.NFD(),
        pre_tokenizers.Whitespace(), shakespeare)
    return {"gpt2": _gpt2(tokenizer_dir), "llama3": _with_split(tokenizer_dir, LLAMA3_PATTERN),
            "qwen2": _with_split(tokenizer_dir, QWEN2_PATTERN), "o200k": _with_split(tokenizer_dir, O200K_PATTERN),
            "gpt2-split": _with_split(tokenizer_dir, GPT2_PATTERN), "metaspace": _metaspace(shakespeare),
            "wordpiece": wordpiece, "unigram": unigram, "whitespace": whitespace}


@pytest.fixture
def rules_alone(monkeypatch):
    """Small pieces, many cuts, and no encoding check around them: the rules must give the ids by themselves."""
    monkeypatch.setattr(pieces, "PIECE_CHARS", 300)
    monkeypatch.setattr(pieces, "SEARCH_CHARS", 120)
    monkeypatch.setattr(pieces, "LEFT_CONTEXTS", (4,))
    monkeypatch.setattr(pieces, "RIGHT_CONTEXT", 4)
    monkeypatch.setattr(pieces, "_cut_is_exact", lambda checks: True)


def _fuzz(tokenizer_dir, shakespeare, texts: int, runs: int):
    rng = random.Random(0)
    for name, tokenizer in _families(tokenizer_dir, shakespeare).items():
        for with_added in (False, True):
            if with_added:
                tokenizer = _added(tokenizer, rng)
            cut = 0
            for _ in range(texts):
                text = _random_text(rng, runs)
                encoded = encode_in_pieces(tokenizer, text)
                assert encoded.ids.tolist() == tokenizer.encode(text, add_special_tokens=False).ids, (name, text)
                cut += encoded.pieces > 1
            assert cut, name   # the comparison means something: texts were cut


def test_fuzz_random_texts_in_pieces_give_the_ids_of_one_encode(rules_alone, tokenizer_dir, shakespeare):
    _fuzz(tokenizer_dir, shakespeare, texts=3, runs=120)


@pytest.mark.slow
def test_fuzz_more_and_longer_texts(rules_alone, tokenizer_dir, shakespeare):
    _fuzz(tokenizer_dir, shakespeare, texts=10, runs=400)


def test_parallel_encoding_does_not_depend_on_tokenizers_parallelism(tokenizer_dir, monkeypatch):
    """TOKENIZERS_PARALLELISM=false makes encode_batch run on one thread: fastppl's own threads share the pieces
    (two calls of the tokenizer run at once, which a barrier of two proves), and the ids are those of one encode."""
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    monkeypatch.setattr(pieces, "THREADS", 2)
    monkeypatch.setattr(pieces, "PIECE_CHARS", 4096)
    tokenizer, both_running = _gpt2(tokenizer_dir), threading.Barrier(2, timeout=20)

    class Recording:
        def __getattr__(self, name):
            return getattr(tokenizer, name)

        def encode_batch_fast(self, texts, add_special_tokens):
            both_running.wait()
            return tokenizer.encode_batch_fast(texts, add_special_tokens=add_special_tokens)

    text = WORDS[:60_000]
    encoded = encode_in_pieces(Recording(), text)
    assert encoded.pieces > 8 and encoded.ids.tolist() == tokenizer.encode(text).ids
