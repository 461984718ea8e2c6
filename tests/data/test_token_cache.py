"""The verified token cache (an entry that does not verify is tokenised again, with one warning line, never used;
big entries memory-mapped), ids checked against the model's vocabulary, and inputs that cannot be read within
memory: one line, exit 2."""
import hashlib
import json

import numpy as np
import pytest

from fastppl.cli import main
from fastppl.data import corpus, token_cache, tokenize
from fastppl.data.tokenize import check_ids_in_vocabulary, encode_cached, load_tokenizer
from fastppl.errors import FastpplError

TEXT = "ROMEO:\nBut, soft! what light through yonder window breaks?\n" * 80   # over 4,096 characters


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("FASTPPL_CACHE_DIR", str(root))
    return root


@pytest.fixture(scope="module")
def gpt2(tokenizer_dir):
    return load_tokenizer(str(tokenizer_dir))


def _entry(cache):
    [path] = (cache / "tokens").glob("*.tokens")
    raw = path.read_bytes()
    end = raw.index(b"\n") + 1
    return path, raw[:end], np.frombuffer(raw[end:], dtype="<i4").copy()


def _rewrite(path, header: bytes, ids: np.ndarray, fix_checksum: bool = False) -> None:
    if fix_checksum:   # damage that keeps the entry self-consistent
        fields = json.loads(header)
        fields.update(count=int(ids.size), ids_sha256=hashlib.sha256(ids.astype("<i4").data).hexdigest())
        line = json.dumps(fields).encode()
        header = line + b" " * (len(header) - len(line) - 1) + b"\n"
    path.write_bytes(header + ids.astype("<i4").tobytes())


def _damage(kind: str, ids: np.ndarray) -> tuple[np.ndarray, bool]:
    changed = ids.copy()
    if kind == "one id changed":
        changed[len(ids) // 2] = (changed[len(ids) // 2] + 1) % 50257
        return changed, False
    if kind == "cut to 100 ids":
        return ids[:100], False
    assert kind == "an id past the vocabulary"
    changed[3] = 60_000
    return changed, True   # count and checksum rewritten to match: the vocabulary check catches it


@pytest.mark.parametrize("kind", ["one id changed", "cut to 100 ids", "an id past the vocabulary"])
def test_an_entry_that_does_not_verify_is_recomputed(cache, gpt2, capsys, kind):
    ids = encode_cached(gpt2, TEXT)
    path, header, stored = _entry(cache)
    assert np.array_equal(stored, ids)
    damaged, fix_checksum = _damage(kind, stored)
    _rewrite(path, header, damaged, fix_checksum)
    again = encode_cached(gpt2, TEXT)
    err = capsys.readouterr().err
    assert np.array_equal(again, ids) and again.dtype == np.int64
    assert err.startswith("fastppl: warning: token cache entry") and err.count("\n") == 1
    assert np.array_equal(_entry(cache)[2], ids)   # rewritten
    assert encode_cached(gpt2, TEXT) is not None and capsys.readouterr().err == ""


@pytest.mark.parametrize("damage", [b"", b"not a cache entry", b'{"format": "fastppl tokens 1"}\n',
                                    b"[1, 2]\n\x00\x00", b"\xff\xfe\n"])
def test_garbage_entries_cost_only_time(cache, gpt2, capsys, damage):
    ids = encode_cached(gpt2, TEXT)
    path = _entry(cache)[0]
    path.write_bytes(damage)
    assert np.array_equal(encode_cached(gpt2, TEXT), ids)
    assert capsys.readouterr().err.count("\n") == 1


def test_unwritable_or_unreadable_cache_costs_only_time(tmp_path, gpt2, monkeypatch, capsys):
    not_a_directory = tmp_path / "file"
    not_a_directory.write_text("x")
    monkeypatch.setenv("FASTPPL_CACHE_DIR", str(not_a_directory))
    assert np.array_equal(encode_cached(gpt2, TEXT), gpt2.encode(TEXT))
    root = tmp_path / "cache"
    monkeypatch.setenv("FASTPPL_CACHE_DIR", str(root))
    ids = encode_cached(gpt2, TEXT)
    path = _entry(root)[0]
    path.unlink()
    path.mkdir()   # a directory where the entry should be: neither read nor replaced
    assert np.array_equal(encode_cached(gpt2, TEXT), ids)
    assert "Traceback" not in capsys.readouterr().err


def test_big_entries_are_memory_mapped(cache, gpt2, monkeypatch):
    text = TEXT * 250   # ~340,000 ids: past MMAP_BYTES as int32
    ids = encode_cached(gpt2, text)
    assert _entry(cache)[0].stat().st_size >= token_cache.MMAP_BYTES
    mapped = []
    real_memmap = np.memmap
    monkeypatch.setattr(np, "memmap", lambda *a, **k: mapped.append(1) or real_memmap(*a, **k))
    monkeypatch.setattr(tokenize.Tokenizer, "encode", lambda self, t: pytest.fail("tokenised again"))
    monkeypatch.setattr(tokenize.Tokenizer, "encode_many", lambda self, t: pytest.fail("tokenised again"))
    assert np.array_equal(encode_cached(gpt2, text), ids) and mapped


@pytest.mark.slow
def test_cached_run_gives_the_same_result_as_before_and_after_damage(cache, tmp_path, tokenizer_dir, capsys):
    """The report's sums come from verified ids only: an edited entry changes nothing but the time."""
    data = tmp_path / "long.txt"
    data.write_text(TEXT)
    args = ["eval", "--model", "random:gpt2-tiny", "--tokenizer", str(tokenizer_dir), "--data", str(data),
            "--ctx", "128", "--device", "cpu", "--quiet", "--json", str(tmp_path / "r.json")]
    assert main(args) == 0
    first = json.loads((tmp_path / "r.json").read_text())
    assert first["tokenization"] == "exact, long texts in parallel pieces"
    path, header, stored = _entry(cache)
    _rewrite(path, header, stored[:100])
    capsys.readouterr()
    assert main(args) == 0
    second = json.loads((tmp_path / "r.json").read_text())
    assert (second["nll_sum"], second["tokens_scored"]) == (first["nll_sum"], first["tokens_scored"])
    assert capsys.readouterr().err.count("fastppl: warning: token cache entry") == 1
    assert second["tokenization"] == "exact, long texts in parallel pieces"   # the damaged entry was tokenized again
    assert main(args) == 0
    third = json.loads((tmp_path / "r.json").read_text())
    assert third["tokenization"] == "from the token cache (an earlier run's ids)"
    assert (third["nll_sum"], third["tokens_scored"]) == (first["nll_sum"], first["tokens_scored"])


def test_ids_outside_the_models_vocabulary_are_one_line():
    check_ids_in_vocabulary(np.array([0, 5, 9]), 10, "tok")
    for bad in ([0, 10], [-1, 3]):
        with pytest.raises(FastpplError, match=r"outside the model's vocabulary of 10; pass the model's own"):
            check_ids_in_vocabulary(np.array(bad), 10, "tok")


# ------------------------------------------------------------------------------------ bad input
def _eval(tokenizer_dir, data, tmp_path):
    return main(["eval", "--model", "random:gpt2-tiny", "--tokenizer", str(tokenizer_dir), "--data", str(data),
                 "--ctx", "64", "--device", "cpu", "--quiet", "--json", str(tmp_path / "r.json")])


def _one_line_error(capsys, rc: int, *words: str) -> None:
    captured = capsys.readouterr()
    assert rc == 2 and captured.out == ""
    assert captured.err.startswith("fastppl: error: ") and captured.err.count("\n") == 1, captured.err
    assert all(w in captured.err for w in words), captured.err


def test_dev_zero_is_one_line(tokenizer_dir, tmp_path, capsys):
    _one_line_error(capsys, _eval(tokenizer_dir, "/dev/zero", tmp_path), "/dev/zero", "is a device")
    assert not (tmp_path / "r.json").exists()


def test_a_file_too_large_for_memory_is_one_line(tokenizer_dir, tmp_path, capsys, monkeypatch):
    data = tmp_path / "big.txt"
    data.write_text("word " * 10_000)
    monkeypatch.setattr(corpus, "available_memory_bytes", lambda: 8 * 20_000)   # a 20,000-byte limit
    _one_line_error(capsys, _eval(tokenizer_dir, data, tmp_path), "big.txt", "too large", "split it")


def test_a_failure_inside_the_tokenizer_is_one_line(gpt2, monkeypatch):
    class RustPanic(BaseException):   # pyo3 raises a panic of the Rust side as a BaseException
        pass

    def panic(backend, text):
        raise RustPanic("capacity overflow")
    monkeypatch.setattr(tokenize, "encode_in_pieces", panic)
    with pytest.raises(FastpplError, match="cannot encode a text of 3 characters .capacity overflow.; split it"):
        gpt2.encode("abc")


def test_many_documents_are_encoded_together_as_one_by_one(cache, gpt2, shakespeare, monkeypatch):
    """Short texts go through encode_batch in groups, long ones in pieces, cached ones from the cache: each text's
    ids are those of its own encode."""
    from fastppl.data import pieces
    from fastppl.data.tokenize import encode_documents
    monkeypatch.setattr(pieces, "PIECE_CHARS", 4096)
    monkeypatch.setattr(pieces, "GROUP_PIECES", 2)   # groups of about 8,192 characters: several
    full = shakespeare.read_text()
    texts = ["", "x", " ", full[:100], full[:5000], TEXT, full[1000:40_000], "😀 東京\r\n" * 50, full[:9000]]
    expected = [gpt2.backend.encode(t, add_special_tokens=False).ids for t in texts]
    encode_cached(gpt2, TEXT)   # one of them cached already
    calls = []
    real = pieces.encode_short_texts
    monkeypatch.setattr(tokenize, "encode_short_texts", lambda b, t: calls.append(len(t)) or real(b, t))
    for _ in range(2):   # the second time, the cached ones come from the cache
        encoded = encode_documents(gpt2, texts)
        assert [e.tolist() for e in encoded] == expected and all(e.dtype == np.int64 for e in encoded)
    # one call for the short texts the cache lacked: 6 (all but TEXT), then 5 (full[:5000] was cached meanwhile)
    assert calls == [6, 5]
