"""Tokenizers saved by transformers 5 (tokenizer_class TokenizersBackend), or named PreTrainedTokenizerFast, load
through `tokenizers` alone, with the ids and special tokens that transformers' AutoTokenizer gives them."""
import json
import os
import subprocess
import sys

import pytest
import transformers
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from fastppl.data.tokenize import load_tokenizer

LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")
TEXT = ("First Citizen:\nBefore we proceed any further, hear me speak.\r\n\r\n   spaces  and\ttabs 12345678 "
        "東京 Москва 😀👍🏽 e\u0301 <|endoftext|> <s> </s> <|begin_of_text|>x<|end_of_text|> don't I'LL")


def _gpt2(tokenizer_dir) -> Tokenizer:
    return Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))


def _llama3_style(tokenizer_dir) -> Tokenizer:
    tokenizer = _gpt2(tokenizer_dir)
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    return tokenizer


def _sentencepiece_style(shakespeare) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tokenizer.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    tokenizer.train_from_iterator(shakespeare.read_text()[:100_000].splitlines(), trainer=trainer)
    return tokenizer


CASES = {   # name: (backend builder, the saving class's keyword arguments)
    "gpt2": (_gpt2, {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"}),
    "llama3-style": (_llama3_style, {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>",
                                     "additional_special_tokens": ["<|begin_of_text|>", "<|end_of_text|>"],
                                     "add_bos_token": True}),
    "sentencepiece-style": (None, {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}),
    "no specials": (_gpt2, {}),
}


@pytest.fixture(params=list(CASES))
def saved(request, tmp_path, tokenizer_dir, shakespeare):
    """A tokenizer directory as transformers 5 saves it (tokenizer_class TokenizersBackend)."""
    build, kwargs = CASES[request.param]
    backend = _sentencepiece_style(shakespeare) if build is None else build(tokenizer_dir)
    PreTrainedTokenizerFast(tokenizer_object=backend, **kwargs).save_pretrained(tmp_path / "saved")
    assert json.loads((tmp_path / "saved" / "tokenizer_config.json").read_text())["tokenizer_class"] == \
        "TokenizersBackend"
    return tmp_path / "saved"


def _without_transformers(monkeypatch):
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained",
                        lambda *a, **k: pytest.fail("the tokenizer was loaded through transformers"))


def _same_as_transformers(directory, monkeypatch):
    reference = AutoTokenizer.from_pretrained(str(directory))
    _without_transformers(monkeypatch)
    fast = load_tokenizer(str(directory))
    assert fast.encode(TEXT).tolist() == reference(TEXT, add_special_tokens=False)["input_ids"]
    assert (fast.bos_id, fast.eos_id, fast.vocab_size) == (
        reference.bos_token_id if reference.bos_token_id is not None else reference.eos_token_id,
        reference.eos_token_id, len(reference))
    return fast


def test_tokenizers_backend_loads_without_transformers(saved, monkeypatch):
    _same_as_transformers(saved, monkeypatch)


def test_pretrained_tokenizer_fast_loads_without_transformers(saved, monkeypatch):
    config = json.loads((saved / "tokenizer_config.json").read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    (saved / "tokenizer_config.json").write_text(json.dumps(config))
    _same_as_transformers(saved, monkeypatch)


@pytest.mark.slow   # a process of its own
def test_the_fast_path_never_imports_transformers(tmp_path, tokenizer_dir):
    """transformers' import alone takes seconds: a fresh process loads the tokenizer without it."""
    PreTrainedTokenizerFast(tokenizer_object=_gpt2(tokenizer_dir), bos_token="<|endoftext|>",
                            eos_token="<|endoftext|>").save_pretrained(tmp_path)
    script = (f"import sys, time; from fastppl.data.tokenize import load_tokenizer; t = time.perf_counter(); "
              f"tokenizer = load_tokenizer({str(tmp_path)!r}); print(time.perf_counter() - t); "
              f"assert tokenizer.bos_id == 50256; assert 'transformers' not in sys.modules, 'transformers imported'")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.returncode == 0, done.stderr


@pytest.mark.slow
def test_a_class_with_its_own_pipeline_goes_through_transformers(tmp_path, tokenizer_dir):
    """LlamaTokenizer and the like may rebuild the tokenizer from its vocabulary: tokenizer.json alone is not
    what transformers would use."""
    PreTrainedTokenizerFast(tokenizer_object=_gpt2(tokenizer_dir)).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "LlamaTokenizer"}))
    used = []
    real = transformers.AutoTokenizer.from_pretrained
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: used.append(1) or real(*a, **k))
        load_tokenizer(str(tmp_path))
    assert used


@pytest.mark.slow
def test_truncation_and_padding_in_tokenizer_json_are_ignored(tmp_path, tokenizer_dir, shakespeare):
    """Scoring reads every token: a tokenizer.json saved with truncation and padding (for a classifier) neither
    truncates a text nor pads the pieces encoded together."""
    backend = _gpt2(tokenizer_dir)
    backend.enable_truncation(max_length=16)
    backend.enable_padding(pad_id=50256, pad_token="<|endoftext|>")
    backend.save(str(tmp_path / "tokenizer.json"))
    text = shakespeare.read_text()[:300_000]
    tokenizer = load_tokenizer(str(tmp_path))
    assert tokenizer.encode(text).tolist() == _gpt2(tokenizer_dir).encode(text).ids
    short = ["First Citizen:", "Before we proceed any further, hear me speak."]
    assert [ids.tolist() for ids in tokenizer.encode_many(short)] == [_gpt2(tokenizer_dir).encode(t).ids
                                                                       for t in short]


@pytest.mark.parametrize("files", [("tokenizer.json", "vocab.json", "merges.txt"), ("vocab.json", "merges.txt")])
@pytest.mark.parametrize("name, settings", [("tokenizer_config.json", "[1]"), ("special_tokens_map.json", '"x"')])
def test_a_settings_file_that_holds_no_object_is_one_line(tmp_path, tokenizer_dir, files, name, settings):
    """transformers (or the fast path) failed on it with an AttributeError, a traceback through the CLI."""
    from fastppl.errors import FastpplError
    for file in files:
        (tmp_path / file).write_bytes((tokenizer_dir / file).read_bytes())
    (tmp_path / name).write_text(settings)
    with pytest.raises(FastpplError, match=rf"^{tmp_path / name}: holds a JSON (list|str), not an object of settings"):
        load_tokenizer(str(tmp_path))
