"""Added tokens that only tokenizer_config.json declares (added_tokens_decoder): fastppl reads them as transformers
does, so that a text is cut into the same ids."""
import json
import shutil

import pytest
from transformers import AutoTokenizer

from fastppl.data.tokenize import load_tokenizer

TEXT = "Hello <|im_start|>user x <tok>   y the cat  <|endoftext|> <gap> z <|im_end|>\n" * 3


def _entry(content, **flags):
    return {"content": content, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
            "special": False, **flags}


@pytest.mark.parametrize("declared", [
    {"50257": _entry("<|im_start|>", special=True), "50258": _entry("<|im_end|>", special=True),
     "50259": _entry("<tok>", lstrip=True, rstrip=True)},
    {"50256": _entry("<|endoftext|>", special=True, normalized=True, lstrip=True)},   # other flags than the file's
    # not at the id it would get: transformers loads it
    pytest.param({"50300": _entry("<gap>", special=True)}, marks=pytest.mark.slow),
], ids=["new tokens", "other flags", "another id"])
def test_tokens_declared_in_the_config_alone_cut_text_as_transformers_does(tokenizer_dir, tmp_path, declared):
    shutil.copytree(tokenizer_dir, tmp_path / "tok")
    config_path = tmp_path / "tok" / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "added_tokens_decoder": declared}))
    plain = load_tokenizer(str(tokenizer_dir))
    tokenizer = load_tokenizer(str(tmp_path / "tok"))
    expected = AutoTokenizer.from_pretrained(str(tmp_path / "tok"))(TEXT, add_special_tokens=False)["input_ids"]
    assert tokenizer.encode(TEXT).tolist() == expected != plain.encode(TEXT).tolist()
    assert tokenizer.fingerprint != plain.fingerprint   # the token cache keeps their ids apart
    assert tokenizer.vocab_size == len(AutoTokenizer.from_pretrained(str(tmp_path / "tok")))
