"""--protocol presets without a model: what each one reads and scores equals the brute-force restatement of the
original program's loop (tests/fixtures/protocol_references.py) pair for pair, on small local files of the
datasets' shapes (a wikitext .raw text, a c4 validation shard, wikitext pages as .jsonl); the corpus preparation
(wikitext rows, c4's rules, the detokenizer, the datasets route) and the errors."""
import gzip
import json
import sys
import types

import pytest
from transformers import AutoTokenizer

from fastppl.config import EvalConfig
from fastppl.data.hf_datasets import dataset_revision
from fastppl.data.protocols import PROTOCOLS, read_protocol_corpus, wikitext_detokenize, wikitext_raw_rows
from fastppl.data.streams import plan_corpus, scored_bytes_by_document
from fastppl.data.tokenize import load_tokenizer
from fastppl.data.windows import block_windows
from fastppl.errors import FastpplError
from fixtures.protocol_references import (gptq_pairs, hf_guide_text_pairs, llama_cpp_pairs, lm_eval_wikitext_pairs,
                                          wikitext_detokenizer)


def make_bos_tokenizer(directory, tokenizer_dir):
    """GPT-2's tokenizer made to add <|endoftext|> before every text by default, as Llama's adds <s>."""
    from tokenizers import Tokenizer, processors
    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    tokenizer.post_processor = processors.TemplateProcessing(single="<|endoftext|> $A",
                                                             special_tokens=[("<|endoftext|>", 50256)])
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"}))
    return directory


def wikitext_raw(shakespeare_text: str, n_lines: int = 60) -> str:
    """A text shaped like wikitext-2-raw-v1's wiki.test.raw: " = Title = " headings, blank lines " \\n",
    paragraphs with wikitext's spaced tokens (" @-@ ", " , ", " ( ... ) ", " 's")."""
    lines = [line for line in shakespeare_text.splitlines() if len(line) > 20][:n_lines]
    out = [" \n", " = Robert 's Play = \n", " \n"]
    for i, line in enumerate(lines):
        if i % 12 == 0:
            out += [" = = Act @-@ " + str(i) + " = = \n", " \n"]
        words = line.replace(",", " ,").replace(".", " .").replace("'", " '")
        out += [f" {words} ( {i} @,@ 000 N ) , \" quoted \" 1 @.@ 5 \u00b0 ; see : it . \n", " \n"]
    return "".join(out)


@pytest.fixture(scope="module")
def bos_tokenizer_dir(tmp_path_factory, tokenizer_dir):
    return make_bos_tokenizer(tmp_path_factory.mktemp("bos-tokenizer"), tokenizer_dir)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory, shakespeare):
    """wiki.test.raw and a c4 validation shard (1,200 short documents, gzipped) as their datasets ship them."""
    directory = tmp_path_factory.mktemp("protocol-data")
    text = shakespeare.read_text()
    (directory / "wiki.test.raw").write_text(wikitext_raw(text))
    lines = [line for line in text.splitlines() if line.strip()]
    shard = "".join(json.dumps({"text": lines[i], "timestamp": "2019-04-25T12:57:54Z", "url": f"https://x/{i}"}) + "\n"
                    for i in range(1200))
    (directory / "c4-validation.00000-of-00008.json.gz").write_bytes(gzip.compress(shard.encode()))
    return directory


def fastppl_pairs(plan) -> list[tuple[tuple, int]]:
    """What fastppl's windows read and score, as (ids read before the target, target id) pairs in order."""
    pairs = []
    for ref in plan.refs:
        ids, w = plan.streams[ref.doc].ids, ref.window
        pairs += [(tuple(int(i) for i in ids[w.start:w.start + p + 1]), int(ids[w.start + p + 1]))
                  for p in range(w.score_from, w.length)]
    return pairs


def plan_of(name, sources, tokenizer_path, ctx, stride=None, data_dir=None):
    protocol = PROTOCOLS[name]
    documents, protocol, datasets = read_protocol_corpus(protocol, [str(s) for s in sources], "all",
                                                         protocol.text_field, data_dir and str(data_dir), "strict")
    tokenizer = load_tokenizer(str(tokenizer_path))
    if protocol.specials_as_text:   # as the pipeline reads the text
        tokenizer = tokenizer.with_specials_as_text()
    tokens = [tokenizer.encode(d.text) for d in documents]
    plan = plan_corpus(tokens, tokenizer, protocol.window, stride, False, ctx, protocol)
    return plan, documents, tokens, tokenizer, datasets


def raw_rows(path) -> list[str]:
    """The rows `datasets`' wikitext builder yields for a .raw file: it iterates the open file."""
    with open(path, encoding="utf-8") as f:
        return [row if row.strip() else "" for row in f]


def test_block_windows_worked_example():
    assert [(w.start, w.length, w.score_from) for w in block_windows(7, 3)] == [(0, 2, 0), (3, 2, 0)]
    assert [(w.start, w.score_from) for w in block_windows(20, 4, score_from=2, max_blocks=3)] == [
        (0, 2), (4, 2), (8, 2)]


def test_wikitext_rows_are_the_datasets_builders(data_dir):
    path = data_dir / "wiki.test.raw"
    assert wikitext_raw_rows(path.read_text()) == raw_rows(path)
    assert wikitext_raw_rows("a\r\n \nb") == ["a\n", "", "b"]


@pytest.mark.parametrize("tokenizer", ["gpt2", "bos"])
@pytest.mark.parametrize("ctx", [16, pytest.param(37, marks=pytest.mark.slow)])
def test_gptq_wikitext2_equals_its_loop(tokenizer_dir, bos_tokenizer_dir, data_dir, tokenizer, ctx):
    path = tokenizer_dir if tokenizer == "gpt2" else bos_tokenizer_dir
    plan, documents, tokens, fast_tokenizer, datasets = plan_of("gptq", ["wikitext2"], path, ctx, data_dir=data_dir)
    expected = gptq_pairs(raw_rows(data_dir / "wiki.test.raw"), AutoTokenizer.from_pretrained(str(path)), ctx)
    assert fastppl_pairs(plan) == expected and len(expected) > 10 * ctx
    assert datasets == [{"id": "wikitext", "config": "wikitext-2-raw-v1", "split": "test", "data_files": None,
                         "revision": None, "read_from": str(data_dir / "wiki.test.raw"),
                         "rows": len(raw_rows(data_dir / "wiki.test.raw"))}]
    # bytes: the text's, less each block's first token and the tail (a BOS the tokenizer adds is no text)
    n_blocks, offset = len(plan.refs), 1 if tokenizer == "bos" else 0
    unscored = [k for k in range(len(tokens[0])) if (k + offset) % ctx == 0 or k + offset >= n_blocks * ctx]
    expected_bytes = len(documents[0].text.encode()) - sum(fast_tokenizer.token_n_bytes(tokens[0], k) for k in unscored)
    assert scored_bytes_by_document(documents, tokens, plan, fast_tokenizer)[0] == expected_bytes


@pytest.mark.slow
def test_gptq_c4_takes_1100_documents_and_256_blocks(tokenizer_dir, data_dir):
    ctx = 4   # 1,100 short documents hold more than 256 blocks of 4 tokens: the block limit applies
    plan, documents, *_ = plan_of("gptq", ["c4"], tokenizer_dir, ctx, data_dir=data_dir)
    with gzip.open(data_dir / "c4-validation.00000-of-00008.json.gz", "rt") as f:
        rows = [json.loads(line)["text"] for line in f]
    expected = gptq_pairs(rows[:1100], AutoTokenizer.from_pretrained(str(tokenizer_dir)), ctx, join=" ",
                          max_tokens=256 * ctx)
    assert len(plan.refs) == 256 and fastppl_pairs(plan) == expected
    assert documents[0].text == " ".join(rows[:1100]) and rows[1100] not in documents[0].text


@pytest.mark.parametrize("tokenizer", ["gpt2", "bos"])
@pytest.mark.parametrize("n_ctx", [16, pytest.param(17, marks=pytest.mark.slow)])
def test_llama_cpp_equals_its_loop(tmp_path, tokenizer_dir, bos_tokenizer_dir, shakespeare, tokenizer, n_ctx):
    path = tokenizer_dir if tokenizer == "gpt2" else bos_tokenizer_dir
    text_path = tmp_path / "wiki.test.raw"
    text = shakespeare.read_text()
    text_path.write_text(text[:700] + " <|endoftext|> " + text[700:1500])   # llama.cpp reads "<|endoftext|>" as text
    plan, *_ = plan_of("llama.cpp", [text_path], path, n_ctx)
    expected = llama_cpp_pairs(text_path.read_text(), AutoTokenizer.from_pretrained(str(path)), n_ctx)
    assert fastppl_pairs(plan) == expected and len(expected) > 5 * n_ctx
    if tokenizer == "bos":   # every block read from BOS: the replacement took place
        assert all(pair[0][0] == 50256 for pair in expected)


@pytest.mark.slow
def test_llama_cpp_reads_the_file_as_its_f_option_does(tmp_path):
    """common/arg.cpp's -f: one final "\n" dropped (not a second one, not a "\r"); other protocols keep it."""
    for text, read in (("a b\n\n", "a b\n"), ("a b\r\n", "a b\r"), ("a b", "a b")):
        (tmp_path / "text.txt").write_bytes(text.encode())
        for name, expected in (("llama.cpp", read), ("hf-guide", text)):
            documents, *_ = read_protocol_corpus(PROTOCOLS[name], [str(tmp_path / "text.txt")], "all", "text", None,
                                                 "strict")
            assert [d.text for d in documents] == [expected], (name, text)


def test_lm_eval_wikitext_equals_its_task(tmp_path, tokenizer_dir, shakespeare):
    raw = wikitext_raw(shakespeare.read_text())
    pages = [raw[:len(raw) // 3], raw[len(raw) // 3:], ""]
    path = tmp_path / "pages.jsonl"
    path.write_text("".join(json.dumps({"page": page}) + "\n" for page in pages))
    plan, documents, *_ = plan_of("lm-eval-wikitext", [path], tokenizer_dir, 24)
    expected = lm_eval_wikitext_pairs(pages, AutoTokenizer.from_pretrained(str(tokenizer_dir)), 24)
    assert fastppl_pairs(plan) == expected
    assert [d.counted_text for d in documents] == pages    # words and bytes are the original page's


def test_hf_guide_equals_the_guide(tmp_path, bos_tokenizer_dir, shakespeare):
    rows = [line + "\n" for line in shakespeare.read_text().splitlines()[:80]]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"text": row}) + "\n" for row in rows))
    plan, *_ = plan_of("hf-guide", [path], bos_tokenizer_dir, 24, stride=10)
    expected = hf_guide_text_pairs(rows, AutoTokenizer.from_pretrained(str(bos_tokenizer_dir)), 24, 10)
    assert fastppl_pairs(plan) == expected and expected[0][0] == (50256,)


def test_the_detokenizer_is_lm_evals(shakespeare):
    text = wikitext_raw(shakespeare.read_text()) + " it 's 5 ° hot / ' 3 / { a } [ b ] = = = = x = = = = \n"
    assert wikitext_detokenize(text) == wikitext_detokenizer(text) != text


def test_named_corpora_through_datasets(monkeypatch, tokenizer_dir):
    revision = "0123456789abcdef0123456789abcdef01234567"
    calls = []

    def load_dataset(name, config=None, split=None, **kwargs):
        calls.append((name, config, split, kwargs))
        rows = [f"row {i}" for i in range(1200)]
        info = types.SimpleNamespace(download_checksums={f"hf://datasets/{name}@{revision}/file.json.gz": {}})
        return _FakeDataset(rows, info)

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    monkeypatch.delenv("FASTPPL_DATA_DIR", raising=False)
    documents, protocol, datasets = read_protocol_corpus(PROTOCOLS["gptq"], ["c4"], "all", "text", None, "strict")
    assert calls == [("allenai/c4", None, "validation",
                      {"data_files": {"validation": "en/c4-validation.00000-of-00008.json.gz"}})]
    assert documents[0].text == " ".join(f"row {i}" for i in range(1100)) and protocol.max_blocks == 256
    assert datasets[0]["revision"] == revision and datasets[0]["read_from"] == "datasets"
    assert datasets[0]["rows"] == 1100
    read_protocol_corpus(PROTOCOLS["gptq"], ["wikitext2"], "all", "text", None, "strict")
    assert calls[-1] == ("wikitext", "wikitext-2-raw-v1", "test", {})


class _FakeDataset:
    def __init__(self, rows, info):
        self.column_names, self.info, self.cache_files, self._rows = ["text"], info, [], rows

    def __getitem__(self, field):
        return list(self._rows)


def test_dataset_revision_from_the_cache_folder():
    cached = types.SimpleNamespace(info=types.SimpleNamespace(download_checksums=None),
                                   cache_files=[{"filename": "/c/wikitext/wikitext-2-raw-v1/0.0.0/" + "ab" * 20
                                                 + "/t.arrow"}])
    assert dataset_revision(cached) == "ab" * 20
    assert dataset_revision(types.SimpleNamespace()) is None


@pytest.mark.parametrize("kwargs, message", [
    ({"protocol": "gptq", "window": "sliding"}, 'window="sliding" does not go with protocol="gptq"'),
    ({"protocol": "gptq", "bos": True}, 'bos does not go with protocol="gptq"'),
    ({"protocol": "llama.cpp", "stride": 4}, 'stride does not go with protocol="llama.cpp"'),
    ({"protocol": "hf-guide", "kv_cache": "on"}, 'kv_cache="on" does not go with protocol="hf-guide"'),
    ({"protocol": "gpt-q"}, "unknown protocol 'gpt-q'"),
])
def test_options_a_protocol_fixes_are_refused(kwargs, message):
    with pytest.raises(FastpplError, match=message):
        EvalConfig(model="m", data=["d"], **kwargs)
    assert EvalConfig(model="m", data=["d"], protocol="hf-guide", stride=3).window == "sliding"


def test_corpus_errors(tmp_path, tokenizer_dir, data_dir):
    short = tmp_path / "short.txt"
    short.write_text("To be, or not to be, that is the question.")
    with pytest.raises(FastpplError, match=r"needs at least 2 x --ctx = 32 tokens, and the text has \d+"):
        plan_of("llama.cpp", [short], tokenizer_dir, 16)
    pages = tmp_path / "two.jsonl"
    pages.write_text('{"text": "a b"}\n{"text": "c d"}\n')
    with pytest.raises(FastpplError, match="scores one text"):
        plan_of("llama.cpp", [pages], tokenizer_dir, 16)
    with pytest.raises(FastpplError, match='is a corpus of protocol="gptq" or hf-guide'):
        EvalConfig(model="m", data=["wikitext2"], protocol="lm-eval-rolling")
    (tmp_path / "c4-validation.00000-of-00008.json.gz").write_bytes(b"cut short")
    with pytest.raises(FastpplError, match="is not a whole gzip file"):
        plan_of("gptq", ["c4"], tokenizer_dir, 16, data_dir=tmp_path)
    (tmp_path / "c4-validation.00000-of-00008.json.gz").write_bytes(gzip.compress(b'{"text": "a\\u0000"}\n\0'))
    with pytest.raises(FastpplError, match="holds a NUL byte once decompressed"):
        plan_of("gptq", ["c4"], tokenizer_dir, 16, data_dir=tmp_path)
    with pytest.raises(FastpplError, match="no wiki.test.raw in"):
        plan_of("gptq", ["wikitext2"], tokenizer_dir, 16, data_dir=tmp_path)
    with pytest.raises(FastpplError, match='data c4 is a corpus of protocol="gptq", read alone'):
        EvalConfig(model="m", data=["c4"], protocol="hf-guide")
    with pytest.raises(FastpplError, match='data c4 is a corpus of protocol="gptq"; add protocol="gptq"'):
        EvalConfig(model="m", data=["c4"])


@pytest.mark.slow
def test_presets_of_todays_windows_are_those_windows(tmp_path, tokenizer_dir, shakespeare):
    """lm-eval-rolling is --window chunked, and hf-guide on one text with GPT-2's tokenizer (no BOS added) is
    --window sliding: the same streams and windows."""
    path = tmp_path / "slice.txt"
    path.write_text(shakespeare.read_text()[:2000])
    tokenizer = load_tokenizer(str(tokenizer_dir))
    tokens = [tokenizer.encode(path.read_text())]
    for name, window, stride in (("lm-eval-rolling", "chunked", None), ("hf-guide", "sliding", 7)):
        preset, *_ = plan_of(name, [path], tokenizer_dir, 20, stride=stride)
        plain = plan_corpus(tokens, tokenizer, window, stride, False, 20)
        assert preset.refs == plain.refs and fastppl_pairs(preset) == fastppl_pairs(plain)


def test_a_gzipped_shard_is_read_though_its_compressed_bytes_hold_nul(tmp_path):
    """gzip's header holds NUL bytes: the binary-file refusal applies to the text once decompressed, not to the
    compressed file."""
    shard = "".join(json.dumps({"text": f"line {i}"}) + "\n" for i in range(3))
    (tmp_path / "c4-validation.00000-of-00008.json.gz").write_bytes(gzip.compress(shard.encode()))
    documents, _, datasets = read_protocol_corpus(PROTOCOLS["gptq"], ["c4"], "all", "text", str(tmp_path), "strict")
    assert [d.text for d in documents] == ["line 0 line 1 line 2"]   # gptq joins c4's rows with " "
    assert datasets[0]["rows"] == 3
