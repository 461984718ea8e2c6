"""Many documents: packed = bucketed = padded = one document at a time; per-document sums; lm-eval metrics;
empty, one-token, long, Unicode and CRLF documents; document sets (directories, hf: datasets)."""
import functools
import json
import math
import re
import sys
import types

import pytest

from fastppl import EvalConfig, evaluate, pipeline
from fastppl.cli import main
from fastppl.data.corpus import load_documents
from fastppl.data.corpus import parse_hf_source
from fastppl.errors import FastpplError
from fastppl.data.tokenize import load_tokenizer
from fastppl.report.metrics import lm_eval_word_count

CTX = 128   # buckets 64, 96, 128
TEXTS = {   # file name -> text; the directory is read in this (sorted) order
    "00-empty.txt": "",
    "01-one-token.txt": "x",
    "02-short.txt": "Hello world.",
    "03-cjk.txt": "日本語のテキストです。中文文本，还有一些标点。",
    "04-emoji.txt": "Emoji 😀👍🏽 and a family 👨‍👩‍👧 in one line.",
    "05-combining.txt": "cafe\u0301 nai\u0308ve man\u0303ana, Z\u0351\u0334a\u0352lgo",
    "06-crlf.txt": "line one\r\nline two\r\n\r\nline four\r\n",
    "07-spaces.txt": "  leading and trailing whitespace \t\n",
}


_load_tokenizer_once = functools.lru_cache(load_tokenizer)


@pytest.fixture(autouse=True)
def _tokenizer_loaded_once(monkeypatch):
    # loading the tokenizer takes most of a tiny evaluation; these tests run dozens of them
    monkeypatch.setattr(pipeline, "load_tokenizer", _load_tokenizer_once)


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory, shakespeare):
    directory = tmp_path_factory.mktemp("docs")
    text = shakespeare.read_text()
    texts = dict(TEXTS)
    texts["08-medium.txt"] = text[1000:1400]            # about 100 tokens: close to ctx
    texts["09-long.txt"] = text[5000:5700]              # longer than ctx: several windows
    texts["10-longer.txt"] = text[9000:10500]
    for name, body in texts.items():
        (directory / name).write_bytes(body.encode("utf-8"))   # bytes: no newline translation
    return directory


def run(tokenizer_dir, data, **overrides):
    settings = dict(model="random:gpt2-tiny", tokenizer=str(tokenizer_dir), data=[str(d) for d in data],
                    ctx=CTX, device="cpu", quiet=True, batch_size=3, per_doc="(returned, not written)")
    settings.update(overrides)
    return evaluate(EvalConfig(**settings))


def by_id(result):
    return {d["id"]: d for d in result.per_doc}


@pytest.mark.slow   # every batching against one run per document
@pytest.mark.parametrize("window", [{"window": "chunked"}, {"window": "sliding", "stride": 40}])
def test_batching_modes_match_one_document_at_a_time(tokenizer_dir, corpus_dir, window):
    results = {mode: run(tokenizer_dir, [corpus_dir], batching=mode, **window)
               for mode in ("packed", "bucketed", "padded")}
    padded = results["padded"]
    for mode, result in results.items():
        assert result["batching"] == mode
        assert result["tokens_scored"] == padded["tokens_scored"] and result["bytes"] == padded["bytes"]
        assert result["nll_sum"] == pytest.approx(padded["nll_sum"], rel=1e-6)
        # per-document sums add up to the corpus sum (two float64 summation orders)
        assert sum(d["nll_sum"] for d in result.per_doc) == pytest.approx(result["nll_sum"], rel=1e-9)
    assert results["packed"]["padding_waste"] <= results["bucketed"]["padding_waste"]
    assert results["packed"]["padding_waste"] < padded["padding_waste"]
    assert results["packed"]["batches"] < padded["batches"]
    # the CPU keeps packed documents apart with an SDPA mask; other modes need no document attention
    assert results["packed"]["document_attention"] == "sdpa-mask" and padded["document_attention"] is None

    # one document at a time: each file its own corpus
    for path in sorted(corpus_dir.iterdir()):
        if path.stat().st_size == 0:
            continue
        documents = {mode: by_id(result).get(str(path)) for mode, result in results.items()}
        if window["window"] == "sliding" and path.name.startswith("01-"):
            assert documents["padded"] is None   # one token, no BOS: nothing to score, skipped
            continue
        if path.name.startswith("01-"):
            # a one-token corpus is refused on its own (fewer than 2 tokens); in the set it is scored after BOS
            assert documents["padded"]["tokens"] == 1 and documents["packed"]["nll_sum"] == pytest.approx(
                documents["padded"]["nll_sum"], rel=1e-6)
            continue
        alone = run(tokenizer_dir, [path], batching="padded", **window)
        assert alone["tokens_scored"] == documents["packed"]["tokens"] == documents["padded"]["tokens"]
        for document in documents.values():
            assert document["nll_sum"] == pytest.approx(alone["nll_sum"], rel=1e-6), path.name
            assert document["bytes"] == alone["bytes"]


@pytest.mark.slow
def test_changing_one_document_moves_no_other(tokenizer_dir, corpus_dir, tmp_path):
    for path in corpus_dir.iterdir():
        (tmp_path / path.name).write_bytes(path.read_bytes())
    before = by_id(run(tokenizer_dir, [tmp_path], batching="packed"))
    changed = tmp_path / "02-short.txt"
    changed.write_text("Something else entirely, and longer than before.")
    after = by_id(run(tokenizer_dir, [tmp_path], batching="packed"))
    for doc_id, document in before.items():
        if doc_id == str(changed):
            assert abs(after[doc_id]["nll_sum"] - document["nll_sum"]) > 1.0
        else:   # the rows are laid out anew, so only float rounding may move
            assert after[doc_id]["nll_sum"] == pytest.approx(document["nll_sum"], rel=1e-6), doc_id


@pytest.mark.slow
def test_empty_and_one_token_documents(tokenizer_dir, corpus_dir, capsys):
    result = run(tokenizer_dir, [corpus_dir])
    assert result["documents"] == len(TEXTS) + 3 and result["documents_skipped"] == 1
    assert result["batching"] == "bucketed"                # auto: several documents (measured fastest)
    documents = by_id(result)
    assert str(corpus_dir / "00-empty.txt") not in documents
    one = documents[str(corpus_dir / "01-one-token.txt")]
    assert one["tokens"] == 1 and one["bytes"] == 1 and one["words"] == 1   # conditioned on BOS alone
    long = documents[str(corpus_dir / "10-longer.txt")]
    assert long["tokens"] > 2 * CTX

    rc = main(["eval", "--model", "random:gpt2-tiny", "--tokenizer", str(tokenizer_dir), "--data", str(corpus_dir),
               "--ctx", str(CTX), "--device", "cpu", "--quiet"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "(1 skipped: no token to score)" in out and "padding waste" in out and "word ppl" in out


@pytest.mark.slow
def test_unicode_crlf_bytes_words_and_metrics(tokenizer_dir, corpus_dir):
    result = run(tokenizer_dir, [corpus_dir])
    documents = by_id(result)
    for name, text in TEXTS.items():
        if not text:
            continue
        document = documents[str(corpus_dir / name)]
        assert document["bytes"] == len(text.encode("utf-8"))           # CRLF stays two bytes
        assert document["words"] == len(re.split(r"\s+", text))
    crlf = documents[str(corpus_dir / "06-crlf.txt")]
    assert crlf["words"] == 7                                         # 6 words and a trailing ''
    words = sum(d["words"] for d in documents.values())
    n_bytes = sum(d["bytes"] for d in documents.values())
    assert result["words"] == words and result["bytes"] == n_bytes
    assert result["tokens_scored"] == sum(d["tokens"] for d in documents.values())
    assert result["word_perplexity"] == pytest.approx(math.exp(result["nll_sum"] / words), rel=1e-12)
    assert result["byte_perplexity"] == pytest.approx(math.exp(result["nll_sum"] / n_bytes), rel=1e-12)
    assert result["bits_per_byte"] == pytest.approx(result["nll_sum"] / math.log(2) / n_bytes, rel=1e-12)


def test_perplexities_past_float64s_range_are_inf_not_an_error(tmp_path):
    """A broken model's mean NLL above ~709.78 nats: exp overflows. The run reports inf (null in the JSON)."""
    from fastppl.report.metrics import per_unit_metrics, perplexity
    from fastppl.report.files import write_json
    assert perplexity(709.0) == pytest.approx(math.exp(709.0)) and perplexity(710.0) == math.inf
    metrics = per_unit_metrics(2400.0, 0, 3)
    assert metrics["word_perplexity"] == math.inf and math.isnan(metrics["byte_perplexity"])
    write_json(str(tmp_path / "r.json"), {"ppl": perplexity(800.0), **metrics})
    assert json.loads((tmp_path / "r.json").read_text()) == {"ppl": None, "words": 3, "word_perplexity": None,
                                                             "byte_perplexity": None}


def test_lm_eval_word_count_rule():
    assert lm_eval_word_count("a b") == 2
    assert lm_eval_word_count("a  \n\tb") == 2
    assert lm_eval_word_count(" a b ") == 4          # re.split leaves '' at both ends, and lm-eval counts them
    assert lm_eval_word_count("") == 1
    assert lm_eval_word_count("日本語\u3000テキスト") == 2   # U+3000 is whitespace to re
    assert lm_eval_word_count("a\r\nb") == 2


@pytest.mark.parametrize("alphabet", ["ab \t\n\r\x0b\x1c\x1f", "ab \t\n\x1c\x85\u3000\u00a0\u2028é"],
                         ids=["ascii", "unicode"])
def test_lm_eval_word_count_is_re_split_on_any_text(monkeypatch, alphabet):
    """Counted in chunks of 7 characters (runs of whitespace across a chunk's end count once), or by str.split."""
    import random
    import re
    import fastppl.report.metrics as metrics
    monkeypatch.setattr(metrics, "_CHUNK_CHARS", 7)
    rng = random.Random(0)
    for _ in range(3000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 40)))
        assert lm_eval_word_count(text) == len(re.split(r"\s+", text)), repr(text)


@pytest.mark.slow
def test_per_doc_file_and_json(tokenizer_dir, corpus_dir, tmp_path):
    per_doc, report = tmp_path / "docs.jsonl", tmp_path / "r.json"
    rc = main(["eval", "--model", "random:gpt2-tiny", "--tokenizer", str(tokenizer_dir), "--data", str(corpus_dir),
               "--ctx", str(CTX), "--device", "cpu", "--quiet", "--per-doc", str(per_doc), "--json", str(report),
               "--batch-size", "2"])
    assert rc == 0
    result = json.loads(report.read_text())
    assert result["per_doc_path"] == str(per_doc)
    lines = [json.loads(line) for line in per_doc.read_text(encoding="utf-8").splitlines()]
    assert [d["id"] for d in lines] == [str(p) for p in sorted(corpus_dir.iterdir()) if p.stat().st_size]
    assert all(set(d) == {"id", "tokens", "bytes", "words", "nll_sum"} for d in lines)
    assert sum(d["nll_sum"] for d in lines) == pytest.approx(result["nll_sum"], rel=1e-9)
    assert sum(d["tokens"] for d in lines) == result["tokens_scored"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["docs.jsonl", "r.json"]   # no temporary files left


@pytest.mark.slow
def test_hf_backend_batches_by_buckets_and_refuses_packing(tokenizer_dir, corpus_dir):
    native = run(tokenizer_dir, [corpus_dir], batching="padded")
    hf = run(tokenizer_dir, [corpus_dir], backend="hf")
    assert hf["batching"] == "bucketed"                    # auto: HF models take no document_ids
    assert hf["nll_sum"] == pytest.approx(native["nll_sum"], rel=1e-5)
    with pytest.raises(FastpplError, match='batching="packed" needs'):
        run(tokenizer_dir, [corpus_dir], backend="hf", batching="packed")


@pytest.mark.slow
def test_several_data_arguments_and_jsonl_with_unicode_line_separators(tokenizer_dir, corpus_dir, tmp_path):
    jsonl = tmp_path / "d.jsonl"
    records = [{"text": "first\u2028still the first document\u0085"}, {"text": ""}, {"text": "third"}]
    jsonl.write_text("\r\n".join(json.dumps(r, ensure_ascii=False) for r in records) + "\r\n", encoding="utf-8")
    documents = load_documents(str(jsonl))
    assert [d.text for d in documents] == [r["text"] for r in records]
    result = run(tokenizer_dir, [corpus_dir, jsonl])
    assert result["documents"] == len(TEXTS) + 3 + 3 and result["documents_skipped"] == 2


def test_directory_documents_sorted_recursive_without_hidden(tmp_path):
    (tmp_path / "b.txt").write_text("bee")
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "z.txt").write_text("zed")
    (tmp_path / ".hidden.txt").write_text("no")
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "x").write_text("no")
    documents = load_documents(str(tmp_path))
    assert [d.text for d in documents] == ["zed", "bee"]
    with pytest.raises(FastpplError, match="--split"):
        load_documents(str(tmp_path), split="val")
    (tmp_path / "bad.txt").write_bytes(b"\xff")
    with pytest.raises(FastpplError, match="not valid UTF-8"):
        load_documents(str(tmp_path))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FastpplError, match="holds no files"):
        load_documents(str(empty))


def test_directory_file_names_not_in_utf8_and_links_to_nothing(tmp_path):
    import os
    (tmp_path / "a.txt").write_text("first")
    os.symlink(tmp_path / "gone.txt", tmp_path / "link.txt")
    with pytest.raises(FastpplError, match="link.txt: a link to nothing"):   # was skipped in silence
        load_documents(str(tmp_path))
    (tmp_path / "link.txt").unlink()
    with open(os.path.join(os.fsencode(tmp_path), b"b\xff.txt"), "w") as f:
        f.write("second")
    ids = [d.id for d in load_documents(str(tmp_path))]
    assert ids == [str(tmp_path / "a.txt"), str(tmp_path) + "/b\\xff.txt"]
    json.loads(json.dumps(ids, ensure_ascii=False).encode("utf-8"))   # no lone surrogate: valid UTF-8 JSON
    single = os.fsdecode(os.path.join(os.fsencode(tmp_path), b"b\xff.txt"))   # the file given on its own
    assert [d.id for d in load_documents(single)] == [ids[1]]


def test_parse_hf_source():
    assert parse_hf_source("hf:wikitext:wikitext-2-raw-v1:test") == ("wikitext", "wikitext-2-raw-v1", "test")
    assert parse_hf_source("hf:EleutherAI/lambada_openai:test") == ("EleutherAI/lambada_openai", None, "test")
    assert parse_hf_source("hf:org/name:cfg:train[:10%]") == ("org/name", "cfg", "train[:10%]")
    for bad in ("hf:name", "hf:a:b:c:d", "hf::test", "hf:name:"):
        with pytest.raises(FastpplError, match="hf:NAME:SPLIT"):
            parse_hf_source(bad)


def test_hf_dataset_needs_the_datasets_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)     # import datasets -> ImportError
    with pytest.raises(FastpplError, match="needs the `datasets` package"):
        load_documents("hf:wikitext:wikitext-2-raw-v1:test")


class _FakeDataset:
    column_names = ["page", "title"]

    def __init__(self, pages):
        self.pages = pages

    def __getitem__(self, column):
        return list(self.pages) if column == "page" else ["t"] * len(self.pages)


def test_hf_dataset_through_a_stand_in_datasets_module(monkeypatch):
    calls = []

    def load_dataset(name, config, split):
        calls.append((name, config, split))
        if name == "offline":
            raise ConnectionError("Couldn't reach the Hugging Face Hub\nmore detail")
        return _FakeDataset(["A page.", "", "Another page."])

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    documents = load_documents("hf:EleutherAI/wikitext_document_level:wikitext-2-raw-v1:test", text_field="page")
    assert calls[-1] == ("EleutherAI/wikitext_document_level", "wikitext-2-raw-v1", "test")
    assert [d.text for d in documents] == ["A page.", "", "Another page."]
    assert documents[2].id == "hf:EleutherAI/wikitext_document_level:wikitext-2-raw-v1:test:2"
    with pytest.raises(FastpplError, match="no field 'text'; its fields are page, title"):
        load_documents("hf:x:test")
    with pytest.raises(FastpplError, match="cannot load dataset 'offline'.*Couldn't reach the Hugging Face Hub;"):
        load_documents("hf:offline:test", text_field="page")
    with pytest.raises(FastpplError, match="--split"):
        load_documents("hf:x:test", split="train", text_field="page")


def test_jsonl_ids_and_groups_from_their_fields(tmp_path):
    from fastppl.data.corpus import Fields
    jsonl = tmp_path / "d.jsonl"
    records = [{"id": "a-1", "key": 7, "source": "wiki", "text": "one"},
               {"id": 2, "key": 8, "source": 3, "text": "two"},
               {"key": 9, "source": "wiki", "text": "three"}]      # no id: its line
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in records))
    documents = load_documents(str(jsonl), fields=Fields(group="source"))
    assert [d.id for d in documents] == ["a-1", "2", f"{jsonl}:3"]
    assert [d.group for d in documents] == ["wiki", "3", "wiki"]
    assert [d.id for d in load_documents(str(jsonl), fields=Fields(id="key"))] == ["7", "8", "9"]
    assert all(d.group is None for d in load_documents(str(jsonl)))
    with pytest.raises(FastpplError, match=r"d.jsonl:3: no field 'id'; every record needs one, or pick another "
                                           r"with --id-field"):
        load_documents(str(jsonl), fields=Fields(id="id"))
    with pytest.raises(FastpplError, match=r"d.jsonl:1: no field 'domain'.*--group-by"):
        load_documents(str(jsonl), fields=Fields(group="domain"))
    jsonl.write_text(json.dumps({"id": "x", "source": ["a"], "text": "t"}) + "\n")
    with pytest.raises(FastpplError, match=r"field 'source' is \[\"a\"\], not a string or number"):
        load_documents(str(jsonl), fields=Fields(group="source"))
    jsonl.write_text("".join(json.dumps({"id": "same", "key": "k", "text": t}) + "\n" for t in ("a", "b")))
    # a default id field that repeats does not name the documents: their lines do; a chosen one must be unique
    assert [d.id for d in load_documents(str(jsonl))] == [f"{jsonl}:1", f"{jsonl}:2"]
    with pytest.raises(FastpplError, match="documents 1 and 2 .* share the id 'k'; pass --id-field"):
        load_documents(str(jsonl), fields=Fields(id="key"))


def test_per_doc_ids_come_from_the_jsonl_id_field(tmp_path, tokenizer_dir):
    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text("".join(json.dumps({"id": f"page-{i}", "text": t}) + "\n"
                             for i, t in enumerate(["First page here.", "Second page, longer than the first."])))
    result = run(tokenizer_dir, [jsonl])
    assert [d["id"] for d in result.per_doc] == ["page-0", "page-1"]


def test_hf_dataset_ids_and_groups_from_its_columns(monkeypatch):
    from fastppl.data.corpus import Fields

    class Dataset:
        column_names = ["text", "id", "domain"]
        columns = {"text": ["a", "b", "c"], "id": ["x", "y", "z"], "domain": ["web", "code", "web"]}

        def __getitem__(self, column):
            return self.columns[column]

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=lambda *a, **k: Dataset()))
    documents = load_documents("hf:paloma:test", fields=Fields(group="domain"))
    assert [(d.id, d.group, d.text) for d in documents] == [("x", "web", "a"), ("y", "code", "b"), ("z", "web", "c")]
    with pytest.raises(FastpplError, match="no field 'source'; its fields are text, id, domain; pass --group-by"):
        load_documents("hf:paloma:test", fields=Fields(group="source"))
