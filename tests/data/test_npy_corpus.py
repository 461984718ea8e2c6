"""A .npy of token ids as a corpus: the same result as the text it was tokenised from, and one-line errors."""
import numpy as np
import pytest

from fastppl.config import EvalConfig
from fastppl.data.tokenize import load_tokenizer
from fastppl.errors import FastpplError
from fastppl.pipeline import evaluate

TEXT = ("It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of "
        "foolishness, café, naïve, 東京. ") * 5


def _run(tokenizer_dir, data, **kwargs):
    return evaluate(EvalConfig(model="random:gpt2-tiny", data=[str(data)], tokenizer=str(tokenizer_dir),
                               device="cpu", dtype="fp32", ctx=32, batch_size=4, quiet=True, **kwargs))


@pytest.mark.parametrize("window", [
    {"window": "chunked"},
    # the unscored first token's bytes come out of the decoded text
    pytest.param({"window": "sliding", "stride": 16}, marks=pytest.mark.slow),
])
def test_token_ids_score_as_the_text_they_encode(tmp_path, tokenizer_dir, window):
    text_file = tmp_path / "text.txt"
    text_file.write_text(TEXT, encoding="utf-8")
    ids = load_tokenizer(str(tokenizer_dir)).encode(TEXT)
    npy_file = tmp_path / "ids.npy"
    np.save(npy_file, ids.astype(np.int32))
    from_text, from_ids = _run(tokenizer_dir, text_file, **window), _run(tokenizer_dir, npy_file, **window)
    for key in ("nll_sum", "tokens_scored", "tokens_total", "bytes", "words", "windows"):
        assert from_ids[key] == from_text[key], key


@pytest.mark.parametrize("array, message", [
    (np.zeros((2, 3), dtype=np.int64), "1-D array of token ids"),
    (np.zeros(4, dtype=np.float32), "1-D array of token ids"),
    (np.zeros(0, dtype=np.int64), "holds no token ids"),
    (np.array([1, -2, 3]), "negative token id"),
    (np.array([1, 50_257, 3]), "outside the model's vocabulary of 50,257"),
])
def test_bad_token_id_files_are_one_line_errors(tmp_path, tokenizer_dir, array, message):
    path = tmp_path / "ids.npy"
    np.save(path, array)
    with pytest.raises(FastpplError, match=message):
        _run(tokenizer_dir, path)


def test_ids_in_a_padded_vocabulary_but_not_the_tokenizers_are_refused(tmp_path, tokenizer_dir, capsys):
    """llama-tiny pads its vocabulary to 50,304 ids; GPT-2's tokenizer has 50,257: ids between them have no text, so
    their bytes would count 0 and bits per byte come out wrong."""
    from fastppl.cli import main
    path = tmp_path / "ids.npy"
    np.save(path, np.array([50_300, 50_303]))
    assert main(["eval", "--model", "random:llama-tiny", "--tokenizer", str(tokenizer_dir), "--data", str(path),
                 "--ctx", "32", "--device", "cpu", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fastppl: error: ") and err.count("\n") == 1
    assert "token id 50,303 is not a token of tokenizer" in err and "50,257 ids" in err


def test_npy_corpus_path_and_split_errors(tmp_path, tokenizer_dir):
    with pytest.raises(FastpplError, match="no such file"):
        _run(tokenizer_dir, tmp_path / "missing.npy")
    (tmp_path / "junk.npy").write_bytes(b"not numpy")
    with pytest.raises(FastpplError, match="is not a NumPy .npy array of token ids"):
        _run(tokenizer_dir, tmp_path / "junk.npy")
    np.save(tmp_path / "ids.npy", np.arange(100))
    with pytest.raises(FastpplError, match="--split all"):
        evaluate(EvalConfig(model="random:gpt2-tiny", data=[str(tmp_path / "ids.npy")], split="val",
                            tokenizer=str(tokenizer_dir), device="cpu", quiet=True))


def test_uint64_ids_beyond_int64_are_refused(tmp_path, capsys, tokenizer_dir):
    import numpy as np
    from fastppl.cli import main
    path = tmp_path / "u64.npy"
    np.save(path, np.array([2**63 + 5, 5, 6], dtype=np.uint64))
    rc = main(["eval", "--model", "random:gpt2-tiny", "--tokenizer", str(tokenizer_dir), "--data", str(path),
               "--device", "cpu", "--quiet"])
    err = capsys.readouterr().err
    assert rc == 2 and "too large" in err and err.count("\n") == 1
