"""Tokenisation and corpora: nanoGPT's TinyShakespeare token counts, the on-disk token cache, and the
built-in corpus (local copies, verification, offline errors). The network is never used: urlopen is
replaced by a function that fails, or serves the local copy, in every test here."""
import io
import json
import shutil
import urllib.error
import urllib.request

import numpy as np
import pytest

from fastppl.cli import main
from fastppl.data import tokenize
from fastppl.data.corpus import BUILTINS, load_documents, split_text
from fastppl.data.tokenize import encode_cached, load_tokenizer
from fastppl.errors import FastpplError

CORPUS = BUILTINS["tinyshakespeare"]


@pytest.fixture(autouse=True)
def no_network(monkeypatch):
    def offline(*args, **kwargs):
        raise urllib.error.URLError("network disabled in tests")
    monkeypatch.setattr(urllib.request, "urlopen", offline)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A fresh, empty cache directory for this test alone."""
    root = tmp_path / "cache"
    monkeypatch.setenv("FASTPPL_CACHE_DIR", str(root))
    monkeypatch.delenv("FASTPPL_DATA_DIR", raising=False)
    return root


@pytest.fixture(scope="module")
def gpt2(tokenizer_dir):
    return load_tokenizer(str(tokenizer_dir))


# -------------------------------------------------------------------------------- token counts
@pytest.mark.slow
def test_tinyshakespeare_token_counts(shakespeare, gpt2):
    """nanoGPT's published counts: GPT-2 BPE of the 90 % / 10 % character split, no special tokens."""
    text = shakespeare.read_text(encoding="utf-8")
    assert len(text.encode("utf-8")) == CORPUS.n_bytes
    val = load_documents(str(shakespeare), "val")[0].text
    train = load_documents(str(shakespeare), "train")[0].text
    assert train + val == text and val == split_text(text, "val")
    assert len(gpt2.encode(val)) == 36_059
    assert len(gpt2.encode(train)) == 301_966


def test_tokenizer_fields(gpt2):
    assert gpt2.vocab_size == 50257 and gpt2.bos_id == 50256   # <|endoftext|> stands in for BOS
    assert gpt2.encode("Hello world").tolist() == [15496, 995]  # no BOS/EOS added
    assert gpt2.encode("").dtype == np.int64


# ------------------------------------------------------------------------------------ the cache
LONG_TEXT = "ROMEO:\nBut, soft! what light through yonder window breaks?\n" * 80   # over 4,096 characters


def _forbid_encoding(monkeypatch):
    def refuse(self, text):
        raise AssertionError("tokenised again although the cache holds these ids")
    monkeypatch.setattr(tokenize.Tokenizer, "encode", refuse)
    monkeypatch.setattr(tokenize.Tokenizer, "encode_many", refuse)


def test_cache_is_used_on_the_second_call(cache, gpt2, monkeypatch):
    first = encode_cached(gpt2, LONG_TEXT)
    files = list((cache / "tokens").glob("*.tokens"))
    assert len(files) == 1 and gpt2.fingerprint in files[0].name
    _forbid_encoding(monkeypatch)
    second = encode_cached(gpt2, LONG_TEXT)
    assert second.dtype == np.int64 and np.array_equal(first, second)


def test_cache_is_keyed_by_text(cache, gpt2, monkeypatch):
    encode_cached(gpt2, LONG_TEXT)
    _forbid_encoding(monkeypatch)
    with pytest.raises(AssertionError, match="tokenised again"):
        encode_cached(gpt2, LONG_TEXT + "!")        # another text must be tokenised, not looked up


@pytest.mark.slow
def test_cache_is_keyed_by_tokenizer(cache, gpt2, tokenizer_dir, tmp_path):
    # the same vocabulary with a prefix space added maps the same text to other ids
    other_dir = tmp_path / "other-tokenizer"
    shutil.copytree(tokenizer_dir, other_dir)
    config = json.loads((other_dir / "tokenizer_config.json").read_text())
    config["add_prefix_space"] = True
    (other_dir / "tokenizer_config.json").write_text(json.dumps(config))
    other = load_tokenizer(str(other_dir))
    assert other.fingerprint != gpt2.fingerprint
    ids = encode_cached(gpt2, LONG_TEXT)
    other_ids = encode_cached(other, LONG_TEXT)
    assert not np.array_equal(ids, other_ids)          # a cache keyed on the text alone would return ids
    assert np.array_equal(other_ids, other.encode(LONG_TEXT))
    assert len(list((cache / "tokens").glob("*.tokens"))) == 2


@pytest.mark.slow
def test_cache_is_keyed_by_the_tokenizer_file(cache, gpt2, tokenizer_dir, tmp_path):
    # tokenizer.json alone changed (read without transformers, fingerprinted by its bytes): other ids
    other_dir = tmp_path / "edited-tokenizer"
    shutil.copytree(tokenizer_dir, other_dir)
    spec = json.loads((other_dir / "tokenizer.json").read_text())
    spec["pre_tokenizer"]["add_prefix_space"] = True
    (other_dir / "tokenizer.json").write_text(json.dumps(spec))
    other = load_tokenizer(str(other_dir))
    assert other.fingerprint != gpt2.fingerprint
    assert load_tokenizer(str(tokenizer_dir)).fingerprint == gpt2.fingerprint   # stable across loads
    ids = encode_cached(gpt2, LONG_TEXT)
    other_ids = encode_cached(other, LONG_TEXT)
    assert not np.array_equal(ids, other_ids)
    assert np.array_equal(other_ids, other.encode(LONG_TEXT))


@pytest.mark.parametrize("damage", [b"not an npy file", b""])   # b"": np.load raised EOFError, a traceback
def test_damaged_cache_entry_is_recomputed(cache, gpt2, damage):
    ids = encode_cached(gpt2, LONG_TEXT)
    [entry] = (cache / "tokens").glob("*.tokens")
    entry.write_bytes(damage)
    assert np.array_equal(encode_cached(gpt2, LONG_TEXT), ids)


@pytest.mark.slow
def test_pipeline_uses_the_cache(cache, tmp_path, tokenizer_dir, monkeypatch):
    data = tmp_path / "long.txt"
    data.write_text(LONG_TEXT)
    args = ["eval", "--model", "random:gpt2-tiny", "--tokenizer", str(tokenizer_dir), "--data", str(data),
            "--ctx", "128", "--device", "cpu", "--quiet", "--json", str(tmp_path / "r.json")]
    assert main(args) == 0
    first = json.loads((tmp_path / "r.json").read_text())
    _forbid_encoding(monkeypatch)
    assert main(args) == 0
    assert json.loads((tmp_path / "r.json").read_text())["nll_sum"] == first["nll_sum"]


# ------------------------------------------------------------------------------ built-in corpus
def test_builtin_from_data_dir(cache, shakespeare):
    [doc] = load_documents("tinyshakespeare", "val", data_dir=str(shakespeare.parent))
    assert doc.text == split_text(shakespeare.read_text(), "val") and doc.id == "tinyshakespeare"


def test_builtin_from_environment(cache, shakespeare, monkeypatch):
    monkeypatch.setenv("FASTPPL_DATA_DIR", str(shakespeare.parent))
    [doc] = load_documents("tinyshakespeare", "all")
    assert doc.text == shakespeare.read_text()


@pytest.mark.parametrize("damage", ["same size, one byte changed", "truncated"])
def test_builtin_with_wrong_sha_is_rejected(cache, shakespeare, tmp_path, damage):
    raw = bytearray(shakespeare.read_bytes())
    if damage == "truncated":
        raw = raw[:-10]
    else:
        raw[1000] ^= 0x01
    (tmp_path / CORPUS.filename).write_bytes(bytes(raw))
    with pytest.raises(FastpplError, match="is not the tinyshakespeare corpus"):
        load_documents("tinyshakespeare", "val", data_dir=str(tmp_path))


def test_builtin_data_dir_without_the_file(cache, tmp_path, monkeypatch):
    monkeypatch.delenv("FASTPPL_DATA_DIR", raising=False)
    with pytest.raises(FastpplError, match="no tinyshakespeare.txt in .*drop --data-dir$"):
        load_documents("tinyshakespeare", "val", data_dir=str(tmp_path))
    monkeypatch.setenv("FASTPPL_DATA_DIR", str(tmp_path))   # the variable alone: the message names it, not --data-dir
    with pytest.raises(FastpplError, match="no tinyshakespeare.txt in .*drop FASTPPL_DATA_DIR$"):
        load_documents("tinyshakespeare", "val")


def test_builtin_offline_without_a_copy(cache, tokenizer_dir, tmp_path, capsys):
    with pytest.raises(FastpplError) as e:
        load_documents("tinyshakespeare", "val")
    message = str(e.value)
    assert "\n" not in message and "--data-dir" in message and "FASTPPL_DATA_DIR" in message
    assert not (cache / "data").exists() or not any((cache / "data").iterdir())   # nothing partial left
    # through the CLI: one line, exit 2, no report written
    out = tmp_path / "r.json"
    rc = main(["eval", "--model", "random:gpt2-tiny", "--tokenizer", str(tokenizer_dir), "--data", "tinyshakespeare",
               "--device", "cpu", "--quiet", "--json", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("fastppl: error: cannot download") and err.count("\n") == 1
    assert not out.exists()


def _serve(payload: bytes):
    def urlopen(url, timeout=None):
        assert url == CORPUS.url
        return io.BytesIO(payload)
    return urlopen


def test_builtin_download_is_verified_and_cached(cache, shakespeare, monkeypatch):
    monkeypatch.setattr(urllib.request, "urlopen", _serve(shakespeare.read_bytes()))
    [doc] = load_documents("tinyshakespeare", "all")
    assert doc.text == shakespeare.read_text()
    assert (cache / "data" / CORPUS.filename).stat().st_size == CORPUS.n_bytes
    # the second time, the verified copy in the cache serves: no download
    monkeypatch.setattr(urllib.request, "urlopen", _serve(b""))
    assert load_documents("tinyshakespeare", "all")[0].text == doc.text


def test_builtin_download_with_wrong_content_leaves_nothing(cache, monkeypatch):
    monkeypatch.setattr(urllib.request, "urlopen", _serve(b"<html>captive portal</html>"))
    with pytest.raises(FastpplError, match="does not match its sha256"):
        load_documents("tinyshakespeare", "all")
    assert not any((cache / "data").iterdir())


def test_tokenizer_json_fast_path_equals_transformers(tokenizer_dir, shakespeare):
    """tokenizer.json read by `tokenizers` alone (the fast start-up path) must tokenise exactly as
    transformers' AutoTokenizer does, specials included."""
    from transformers import AutoTokenizer
    from fastppl.data.tokenize import load_tokenizer

    fast = load_tokenizer(str(tokenizer_dir))
    reference = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    text = shakespeare.read_text()[:20000] + " 東京 😀 é́ \r\n\t  tabs<|endoftext|>end"
    assert fast.encode(text).tolist() == reference(text, add_special_tokens=False)["input_ids"]
    assert (fast.bos_id, fast.eos_id, fast.vocab_size) == (reference.bos_token_id, reference.eos_token_id,
                                                           len(reference))
    assert fast.decode(fast.encode(text)) == text


@pytest.mark.parametrize("files, end_of_text", [
    # the hub's own gpt2: tokenizer_config.json holds only the length; GPT2TokenizerFast's defaults give BOS/EOS
    ({"tokenizer_config.json": {"model_max_length": 1024}, "config.json": {"model_type": "gpt2"}}, 50256),
    # specials named in special_tokens_map.json only
    ({"tokenizer_config.json": {"tokenizer_class": "PreTrainedTokenizerFast"},
      "special_tokens_map.json": {"bos_token": "<|endoftext|>", "eos_token": {"content": "<|endoftext|>"}}}, 50256),
    # a generic fast tokenizer that names no specials has none (no GPT-2 default)
    ({"tokenizer_config.json": {"tokenizer_class": "PreTrainedTokenizerFast"}}, None),
], ids=["hub-gpt2", "special-tokens-map", "no-specials"])
def test_fast_path_finds_bos_and_eos_where_transformers_does(tmp_path, tokenizer_dir, files, end_of_text):
    """Before, only tokenizer_config.json was read for them: eval with the hub's gpt2 tokenizer stopped with
    "no BOS or end-of-text token"."""
    import json as json_module
    from transformers import AutoTokenizer
    from fastppl.data.tokenize import load_tokenizer
    directory = tmp_path / "tok"
    directory.mkdir()
    shutil.copy(tokenizer_dir / "tokenizer.json", directory / "tokenizer.json")
    for name, content in files.items():
        (directory / name).write_text(json_module.dumps(content))
    fast = load_tokenizer(str(directory))
    reference = AutoTokenizer.from_pretrained(str(directory))
    assert (fast.bos_id, fast.eos_id) == (reference.bos_token_id, reference.eos_token_id)
    assert fast.bos_id == fast.eos_id == end_of_text


def test_hub_tokenizer_goes_through_the_fast_path(tokenizer_dir, monkeypatch):
    """A hub id's tokenizer files are fetched with huggingface_hub (faked here: no network in tests)
    and read by `tokenizers` directly, without transformers' AutoTokenizer."""
    import huggingface_hub
    import transformers
    from fastppl.data.tokenize import load_tokenizer

    asked = []
    monkeypatch.setattr(huggingface_hub, "snapshot_download",
                        lambda repo_id, **kwargs: asked.append((repo_id, kwargs)) or str(tokenizer_dir))
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained",
                        lambda *a, **k: (_ for _ in ()).throw(AssertionError("transformers was used")))
    tokenizer = load_tokenizer("openai-community/gpt2")
    assert asked and asked[0][0] == "openai-community/gpt2" and "tokenizer.json" in asked[0][1]["allow_patterns"]
    assert tokenizer.encode("Hello world").tolist() == [15496, 995]


def test_vocab_and_merges_alone_tokenise_as_tokenizer_json(tmp_path, tokenizer_dir, shakespeare, gpt2):
    """GPT-2's original files without tokenizer.json (docs/llama-and-generation.md lists the layout): the same ids,
    BOS and EOS."""
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("vocab.json", "merges.txt"):
        shutil.copy(tokenizer_dir / name, bare / name)
    loaded = load_tokenizer(str(bare))
    text = shakespeare.read_text()[:200_000] + " <|endoftext|> ünï 中文 😀 e\u0301\r\n"
    assert loaded.backend.encode(text).ids == gpt2.backend.encode(text).ids
    assert (loaded.bos_id, loaded.eos_id, loaded.vocab_size) == (gpt2.bos_id, gpt2.eos_id, gpt2.vocab_size) == \
        (50256, 50256, 50257)
