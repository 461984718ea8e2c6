"""fastppl.pipeline end to end on random:gpt2-tiny: batch-size invariance, the per-token array, jsonl
documents, the metrics' arithmetic and the JSON report's fields."""
import json
import math
import runpy
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

import fastppl
from fastppl.cli import main
from fastppl.config import EvalConfig
from fastppl.models import load_model
from fastppl.pipeline import evaluate
from fixtures.printed import assert_prints_like

MODEL = "random:gpt2-tiny"
CTX = 32


@pytest.fixture(scope="module")
def text(shakespeare) -> str:
    # a slice of the corpus (about 800 tokens), with some non-ASCII so bytes != characters
    return shakespeare.read_text()[:3000] + "\nCafé, naïve — «fin».\n"


@pytest.fixture(scope="module")
def text_path(tmp_path_factory, text):
    path = tmp_path_factory.mktemp("pipeline") / "slice.txt"
    path.write_text(text)
    return path


@pytest.fixture(scope="module")
def hf_tokenizer(tokenizer_dir):
    return AutoTokenizer.from_pretrained(str(tokenizer_dir))


def _run(tokenizer_dir, data, **kwargs):
    kwargs.setdefault("ctx", CTX)
    return evaluate(EvalConfig(model=MODEL, data=[str(d) for d in data], tokenizer=str(tokenizer_dir), device="cpu",
                               dtype="fp32", quiet=True, **kwargs))


def _native_nll(ids: list[int]) -> np.ndarray:
    """NLL of ids[1:] given the ids before each, from one forward pass of the same random model."""
    model = load_model(MODEL, "native", torch.float32, seed=0)
    with torch.no_grad():
        logits = model.lm_head(model(torch.tensor([ids[:-1]])))[0]
    return -torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0].numpy()


@pytest.mark.slow   # nine runs
@pytest.mark.parametrize("window, stride, bos", [("chunked", None, False), ("sliding", 20, False),
                                                 ("sliding", 13, True)])
def test_batch_size_invariance(tokenizer_dir, text_path, window, stride, bos):
    results = [_run(tokenizer_dir, [text_path], window=window, stride=stride, bos=bos, batch_size=b)
               for b in (1, 5, 11)]
    first = results[0]
    assert first["windows"] > 11 and first["windows"] % 5 and first["windows"] % 11   # ragged last batches
    for b, result in zip((1, 5, 11), results):   # the batch size took effect
        assert result["batch_size"] == b and result["batches"] == -(-result["windows"] // b)
    for other in results[1:]:
        assert other["tokens_scored"] == first["tokens_scored"]
        assert other["nll_sum"] == pytest.approx(first["nll_sum"], rel=1e-6)


@pytest.mark.slow
def test_loss_chunk_rows_do_not_change_the_result(tokenizer_dir, text_path, monkeypatch):
    import fastppl.accel.apply as apply
    chunk_rows = []   # what the scorer was built with: the option must reach it
    build = apply.make_score_fn
    monkeypatch.setattr(apply, "make_score_fn", lambda model, rows, *a, **k: chunk_rows.append(rows)
                        or build(model, rows, *a, **k))
    whole = _run(tokenizer_dir, [text_path], batch_size=4, loss_chunk_rows=8192)
    chunked = _run(tokenizer_dir, [text_path], batch_size=4, loss_chunk_rows=45)
    assert chunk_rows == [8192, 45]
    assert chunked["nll_sum"] == pytest.approx(whole["nll_sum"], rel=1e-6)


def _cli(tmp_path, tokenizer_dir, data, *extra):
    out_json, out_npy = tmp_path / "r.json", tmp_path / "t.npy"
    rc = main(["eval", "--model", MODEL, "--tokenizer", str(tokenizer_dir), "--data", str(data), "--ctx", str(CTX),
               "--device", "cpu", "--dtype", "fp32", "--quiet", "--json", str(out_json), "--per-token", str(out_npy),
               *extra])
    assert rc == 0
    return json.loads(out_json.read_text()), np.load(out_npy)


def test_per_token_chunked(tmp_path, tokenizer_dir, text_path, text, hf_tokenizer):
    result, per_token = _cli(tmp_path, tokenizer_dir, text_path)
    ids = hf_tokenizer(text)["input_ids"]
    assert per_token.dtype == np.float32 and per_token.shape == (len(ids),) == (result["tokens_total"],)
    assert not np.isnan(per_token).any()                     # chunked scores every token
    assert np.nansum(per_token.astype(np.float64)) == pytest.approx(result["nll_sum"], rel=1e-6)
    # aligned: entry k is token k; the first window reads [BOS] t0 .. t_{ctx-2} and scores t0 .. t_{ctx-1}
    bos = hf_tokenizer.eos_token_id
    np.testing.assert_allclose(per_token[:CTX], _native_nll([bos] + ids[:CTX]), rtol=1e-5)


@pytest.mark.slow
def test_per_token_sliding_has_nan_where_unscored(tmp_path, tokenizer_dir, text_path, text, hf_tokenizer):
    ids = hf_tokenizer(text)["input_ids"]
    result, per_token = _cli(tmp_path, tokenizer_dir, text_path, "--window", "sliding", "--stride", "10")
    assert per_token.shape == (len(ids),)
    assert np.isnan(per_token[0]) and not np.isnan(per_token[1:]).any()   # t0 has no context, no --bos
    assert int((~np.isnan(per_token)).sum()) == result["tokens_scored"] == len(ids) - 1
    assert np.nansum(per_token.astype(np.float64)) == pytest.approx(result["nll_sum"], rel=1e-6)
    np.testing.assert_allclose(per_token[1:CTX], _native_nll(ids[:CTX]), rtol=1e-5)
    # stride == ctx: each window's first token is unscored too
    result, per_token = _cli(tmp_path, tokenizer_dir, text_path, "--window", "sliding", "--stride", str(CTX))
    unscored = np.flatnonzero(np.isnan(per_token))
    np.testing.assert_array_equal(unscored, np.arange(0, len(ids), CTX))
    assert result["tokens_scored"] == len(ids) - len(unscored)


@pytest.mark.slow
def test_jsonl_documents_each_get_their_own_bos(tmp_path, tokenizer_dir, hf_tokenizer):
    docs = ["To be, or not to be, that is the question:", "", "Whether 'tis nobler in the mind to suffer",
            "The slings and arrows of outrageous fortune,\nOr to take arms against a sea of troubles"]
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("\n".join(json.dumps({"text": d, "id": i}) for i, d in enumerate(docs)) + "\n\n")
    result, per_token = _cli(tmp_path, tokenizer_dir, jsonl, "--batch-size", "2")
    assert result["documents"] == 4                          # the blank line is not a document
    doc_ids = [hf_tokenizer(d)["input_ids"] for d in docs]
    assert result["tokens_total"] == result["tokens_scored"] == sum(map(len, doc_ids)) == len(per_token)
    # each document is scored on its own, from BOS: exactly a forward pass over [BOS] + its tokens
    bos = hf_tokenizer.eos_token_id
    expected = np.concatenate([_native_nll([bos] + ids) for ids in doc_ids if ids])
    np.testing.assert_allclose(per_token, expected, rtol=1e-5)
    assert result["bytes"] == sum(len(d.encode()) for d in docs)
    # the same as scoring the documents one file at a time
    separate = 0.0
    for i, d in enumerate(docs):
        if d:
            (tmp_path / f"{i}.txt").write_text(d)
            separate += _run(tokenizer_dir, [tmp_path / f"{i}.txt"])["nll_sum"]
    assert result["nll_sum"] == pytest.approx(separate, rel=1e-6)


def test_jsonl_text_field(tmp_path, tokenizer_dir):
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text('{"body": "Now is the winter of our discontent"}\n{"body": "Made glorious summer"}\n')
    result = _run(tokenizer_dir, [jsonl], text_field="body")
    assert result["documents"] == 2 and result["tokens_scored"] > 8


@pytest.mark.slow   # four runs
def test_metrics_arithmetic_and_bytes(tokenizer_dir, text_path, text, hf_tokenizer):
    ids = hf_tokenizer(text)["input_ids"]
    n_bytes = len(text.encode("utf-8"))
    assert n_bytes > len(text)                               # the non-ASCII tail counts in bytes
    for kwargs, unscored in [({}, []),                                       # chunked: everything
                             ({"window": "sliding", "stride": 16}, [0]),     # t0 has no context
                             ({"window": "sliding", "stride": 16, "bos": True}, []),
                             ({"window": "sliding", "stride": CTX}, list(range(0, len(ids), CTX)))]:
        r = _run(tokenizer_dir, [text_path], **kwargs)
        assert r["tokens_scored"] == len(ids) - len(unscored)
        assert r["bytes"] == n_bytes - sum(len(hf_tokenizer.decode([ids[i]]).encode()) for i in unscored), kwargs
        assert r["nll"] == pytest.approx(r["nll_sum"] / r["tokens_scored"], rel=1e-12)
        assert r["ppl"] == pytest.approx(math.exp(r["nll"]), rel=1e-12)
        assert r["bits_per_token"] == pytest.approx(r["nll"] / math.log(2), rel=1e-12)
        assert r["bits_per_byte"] == pytest.approx(r["nll_sum"] / math.log(2) / r["bytes"], rel=1e-12)


@pytest.mark.slow
def test_split_of_a_text_file(tokenizer_dir, text_path, text, hf_tokenizer):
    cut = int(len(text) * 0.9)
    for split, part in (("train", text[:cut]), ("val", text[cut:]), ("all", text)):
        r = _run(tokenizer_dir, [text_path], split=split)
        assert r["tokens_total"] == len(hf_tokenizer(part)["input_ids"])
        assert r["bytes"] == len(part.encode())


def test_json_report_fields(tmp_path, tokenizer_dir, text_path):
    result, _ = _cli(tmp_path, tokenizer_dir, text_path, "--batch-size", "3")
    for field in ("nll", "ppl", "nll_sum", "tokens_scored", "bits_per_token", "bits_per_byte", "bytes",
                  "wall_seconds", "tokens_per_second", "peak_memory_bytes", "peak_host_memory_bytes",
                  "config", "environment"):
        assert field in result, field
    assert result["peak_memory_bytes"] is None            # a GPU figure; the CPU reports host memory
    assert result["peak_host_memory_bytes"] > 10 * 2**20
    assert result["wall_seconds"] > 0 and result["tokens_per_second"] > 0
    assert isinstance(result["tokens_scored"], int) and isinstance(result["bytes"], int)
    config = result["config"]
    assert config["model"] == MODEL and config["ctx"] == CTX and config["batch_size"] == 3
    assert config["window"] == "chunked" and config["dtype"] == "fp32" and config["tokenizer"] == str(tokenizer_dir)
    env = result["environment"]
    assert env["fastppl"] == fastppl.__version__ and env["torch"] == torch.__version__ and env["device"] == "cpu"
    assert result["ctx"] == CTX and result["window"] == "chunked" and result["dtype"] == "float32"
    assert len(result["nll_by_position"]) == CTX


def test_ctx_defaults_to_the_model_maximum(tokenizer_dir, text_path):
    r = _run(tokenizer_dir, [text_path], ctx=None)
    assert r["ctx"] == 256 and r["config"]["ctx"] is None


def test_summary_on_stdout(tmp_path, tokenizer_dir, text_path, capsys):
    assert main(["eval", "--model", MODEL, "--tokenizer", str(tokenizer_dir), "--data", str(text_path),
                 "--ctx", "64", "--device", "cpu", "--quiet"]) == 0
    out, err = capsys.readouterr()
    assert "perplexity" in out and "bits/byte" in out and err == ""


@pytest.mark.slow
def test_auto_batch_size_keeps_a_balanced_batch_only_where_it_runs_fewer_rows(tokenizer_dir, text_path):
    from fastppl.accel.batch_size import balanced_batch_size
    auto = _run(tokenizer_dir, [text_path], batch_size="auto")
    fixed = _run(tokenizer_dir, [text_path], batch_size=8)   # the CPU's memory bound for auto
    n = auto["windows"]
    assert n > 8 and n % 8   # a ragged last batch at 8 rows
    expected = balanced_batch_size(8, n)
    assert expected < 8 and auto["batch_size"] == expected
    assert auto["nll_sum"] == pytest.approx(fixed["nll_sum"], rel=1e-9)


def test_auto_batch_size_is_not_balanced_where_that_runs_no_fewer_rows(tmp_path, tokenizer_dir):
    """20 short documents are 20 windows (balanced: 7 rows a batch, not 8) but pack into a few rows, which one
    batch holds at 7 rows as at 8: balancing would run no fewer slots, so auto keeps 8."""
    from fastppl.accel.batch_size import balanced_batch_size
    corpus = tmp_path / "short.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"Document {i} is short."}) + "\n" for i in range(20)))
    auto = _run(tokenizer_dir, [corpus], batch_size="auto", batching="packed")
    assert auto["windows"] == 20 and balanced_batch_size(8, 20) == 7
    assert auto["batches"] == 1 and auto["batch_size"] == 8


@pytest.mark.slow
def test_the_python_api_example_prints_what_its_page_shows(monkeypatch, capsys, tokenizer_dir):
    root = Path(__file__).resolve().parents[1]
    page = (root / "docs" / "python-api.md").read_text()
    example = root / "docs" / "examples" / "python_api.py"
    assert f"```python\n{example.read_text()}```" in page   # the page shows the script as it is
    printed = page.split("It prints:\n\n```\n", 1)[1].split("```", 1)[0]
    monkeypatch.setenv("FASTPPL_SHARED_DATA", str(tokenizer_dir.parent))
    runpy.run_path(str(example), run_name="__main__")
    assert_prints_like(capsys.readouterr().out, printed)   # its figures to fp32's precision, not the last digit
