"""fastppl compare: differences against the first run, refusing incomparable runs, bad input files,
per-document results, and the comparison figure."""
import importlib.util
import json
import math
import struct

import pytest

from fastppl.cli import main
from fastppl.report.compare import differences, load_per_doc

needs_matplotlib = pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None,
                                      reason="matplotlib is not installed")


def make_result(nll=3.0, bits_per_byte=1.2, tokens_per_second=1000.0, tokens=36059, data="tinyshakespeare",
                split="val", model="gpt2", dtype="bfloat16", device_name="NVIDIA H200", ctx=4):
    return {
        "nll": nll, "ppl": math.exp(nll), "tokens_scored": tokens, "tokens_total": tokens, "bytes": 111540,
        "bits_per_byte": bits_per_byte, "tokens_per_second": tokens_per_second, "window": "chunked", "ctx": ctx,
        "stride": None, "dtype": dtype, "nll_by_position": [nll + 1.0, nll, None, nll - 0.5][:ctx],
        "nll_by_position_std": [1.0, 0.5, None, 0.4][:ctx],
        "config": {"model": model, "data": [data], "split": split},
        "environment": {"device_name": device_name},
    }


def write(path, obj):
    path.write_text(json.dumps(obj))
    return str(path)


def write_docs(path, docs):
    path.write_text("".join(json.dumps(d) + "\n" for d in docs))
    return str(path)


def png_size(path):
    data = open(path, "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("fastppl: error: ") and len(err.splitlines()) == 1, err
    return err


def test_differences_against_the_first_run():
    first, other = make_result(3.0, 1.2, 1000.0), make_result(3.1, 1.25, 1500.0)
    d = differences(first, other)
    assert d["nll"] == pytest.approx(0.1)
    assert d["ppl_relative"] == pytest.approx(math.exp(0.1) - 1)
    assert d["bits_per_byte"] == pytest.approx(0.05)
    assert d["speedup"] == pytest.approx(1.5)


def test_a_report_with_null_where_a_value_was_not_finite_compares(tmp_path, capsys):
    """eval writes null for bits/byte without bytes (token-id input), a rate without time, or a perplexity past
    float64's range: compare shows n/a."""
    a = write(tmp_path / "a.json", make_result(3.0, 1.2, 1000.0))
    b = write(tmp_path / "b.json", {**make_result(3.1), "bits_per_byte": None, "tokens_per_second": None})
    c = write(tmp_path / "c.json", {**make_result(3.0), "nll": 800.0, "ppl": None})
    assert main(["compare", a, b, c]) == 0
    lines = capsys.readouterr().out.splitlines()
    row = next(line for line in lines if line.startswith("b "))
    assert "+0.100000" in row and row.count("n/a") == 4, row   # bits/byte, its difference, tokens/s, speed
    row = next(line for line in lines if line.startswith("c "))
    assert "+797.000000" in row and row.count("n/a") == 2, row   # PPL and its difference


@pytest.mark.slow
@needs_matplotlib
def test_a_null_perplexity_is_drawn_as_n_a(tmp_path, capsys):
    a = write(tmp_path / "a.json", make_result(3.0))
    c = write(tmp_path / "c.json", {**make_result(3.0), "nll": 800.0, "ppl": None})
    assert main(["compare", a, c, "--plot", str(tmp_path / "nll.png")]) == 0
    assert png_size(tmp_path / "nll.png") == (800, 450)


def test_compare_table_shows_the_differences(tmp_path, capsys):
    a = write(tmp_path / "fp32.json", make_result(3.0, 1.2, 1000.0, dtype="float32"))
    b = write(tmp_path / "bf16.json", make_result(3.1, 1.25, 1500.0))
    c = write(tmp_path / "other.json", make_result(2.9, 1.1, 500.0, model="/ckpt/my-model"))
    assert main(["compare", a, b, c]) == 0
    out = capsys.readouterr().out
    fp32, bf16, other = (line for line in out.splitlines() if line.startswith(("fp32 ", "bf16 ", "other ")))
    assert "3.000000" in fp32 and "+" not in fp32 and "float32" in fp32 and "NVIDIA H200" in fp32
    assert "+0.100000" in bf16 and f"+{math.exp(0.1) - 1:.3%}" in bf16 and "+0.050000" in bf16 and "×1.50" in bf16
    assert "-0.100000" in other and "×0.50" in other and "my-model" in other and "/ckpt" not in other
    assert "36,059" in fp32 and "tinyshakespeare (val)" in fp32

    assert main(["compare", a, b, "--markdown"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("| run | model | corpus | window | tokens | NLL | ΔNLL |")
    assert lines[1].startswith("| --- |")
    assert lines[3].startswith("| bf16 |") and "| +0.100000 |" in lines[3] and "| chunked 4 |" in lines[3]
    sliding = write(tmp_path / "sliding.json", dict(make_result(), window="sliding", stride=2,
                                                    config=dict(make_result()["config"], bos=True)))
    assert main(["compare", a, sliding, "--markdown", "--force"]) == 0
    assert "| sliding 4/2 bos |" in capsys.readouterr().out


@pytest.mark.parametrize("change, reason", [
    ({"data": "other.txt"}, "scored tinyshakespeare (val) but b scored other.txt (val)"),
    ({"split": "train"}, "but b scored tinyshakespeare (train)"),
    ({"tokens": 36058}, "scored 36,059 tokens but b scored 36,058"),
    ({"data": ["a.txt", "c.txt"]}, "but b scored a.txt, c.txt"),   # against a.txt, b.txt: the second file differs
])
def test_incomparable_runs_are_refused_unless_forced(tmp_path, capsys, change, reason):
    first = make_result()
    if isinstance(change.get("data"), list):
        first["config"]["data"] = ["a.txt", "b.txt"]
        change = dict(change)
        second = make_result()
        second["config"]["data"] = change.pop("data")
    else:
        second = make_result(**change)
    a = write(tmp_path / "a.json", first)
    b = write(tmp_path / "b.json", second)
    assert main(["compare", a, b]) == 2
    err = one_line_error(capsys)
    assert "not comparable" in err and reason in err and "--force" in err
    assert main(["compare", a, b, "--force"]) == 0
    assert "b " in capsys.readouterr().out


def test_the_same_corpus_by_another_path_is_comparable(tmp_path, capsys):
    a = write(tmp_path / "a.json", make_result(data="../shared/data/tinyshakespeare.txt"))
    b = write(tmp_path / "b.json", make_result(data="/work/shared/data/tinyshakespeare.txt"))
    assert main(["compare", a, b]) == 0


@pytest.mark.slow
def test_runs_compare_by_the_text_they_scored_not_the_file_names(tmp_path, capsys, tokenizer_dir):
    """tinyshakespeare.txt by path against the built-in `tinyshakespeare` must not be refused as other corpora
    for their different names. The reports' corpus_sha256 decides: a renamed copy of the text is the
    same corpus, other text under the same name is not."""
    text = "Now is the winter of our discontent made glorious summer by this sun of York.\n" * 6
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    files = {"original": tmp_path / "one" / "text.txt", "renamed": tmp_path / "two" / "copy.txt",
             "other": tmp_path / "two" / "text.txt"}
    files["original"].write_text(text)
    files["renamed"].write_text(text)
    files["other"].write_text(text.replace("winter", "summer"))
    reports = {}
    for name, path in files.items():
        reports[name] = str(tmp_path / f"{name}.json")
        assert main(["eval", "--model", "random:gpt2-tiny", "--tokenizer", str(tokenizer_dir), "--data", str(path),
                     "--device", "cpu", "--ctx", "32", "--quiet", "--json", reports[name]]) == 0
    digests = {name: json.loads(open(path).read())["corpus_sha256"] for name, path in reports.items()}
    assert digests["original"] == digests["renamed"] != digests["other"] and len(digests["other"]) == 64
    capsys.readouterr()
    assert main(["compare", reports["original"], reports["renamed"]]) == 0
    capsys.readouterr()
    assert main(["compare", reports["original"], reports["other"]]) == 2   # same name, same token count
    assert "scored different text" in one_line_error(capsys)


def test_bad_run_files_are_one_line_errors(tmp_path, capsys):
    good = write(tmp_path / "good.json", make_result())
    (tmp_path / "broken.json").write_text('{"nll": 3.0,')
    cases = {
        str(tmp_path / "missing.json"): "no such file",
        str(tmp_path / "broken.json"): "not valid JSON",
        write(tmp_path / "list.json", [1, 2]): "not a fastppl eval report",
        write(tmp_path / "other.json", {"accuracy": 0.5}): "no 'nll' field",
        str(tmp_path): "is a directory",
    }
    for path, message in cases.items():
        assert main(["compare", good, path]) == 2
        assert message in one_line_error(capsys)
    assert main(["compare"]) == 2
    assert "nothing to compare" in one_line_error(capsys)


DOCS_A = [
    {"id": "doc:1", "tokens": 100, "bytes": 400, "words": 80, "nll_sum": 300.0},     # 3.0 nats/token
    {"id": "doc:2", "tokens": 50, "bytes": 200, "words": 40, "nll_sum": 250.0},      # 5.0, the worst
    {"id": "doc:3", "tokens": 200, "bytes": 800, "words": 160, "nll_sum": 400.0},    # 2.0
    {"id": "doc:4", "tokens": 3, "bytes": 12, "words": 2, "nll_sum": 30.0},          # 10.0 but too short
    {"id": "doc:5", "tokens": 0, "bytes": 0, "words": 0, "nll_sum": 0.0},            # empty document
]
DOCS_B = [dict(d, nll_sum=d["nll_sum"] * f) for d, f in zip(DOCS_A, (1.0, 0.9, 1.5, 1.0, 1.0))]


def result_of(docs, **changes):
    """A report whose totals are those of its per-document file (compare checks that they are)."""
    tokens, nll_sum = sum(d["tokens"] for d in docs), sum(d["nll_sum"] for d in docs)
    return dict(make_result(nll=nll_sum / tokens, tokens=tokens), nll_sum=nll_sum, **changes)


def test_per_doc_worst_documents_and_largest_increases(tmp_path, capsys):
    a = write_docs(tmp_path / "a.jsonl", DOCS_A)
    b = write_docs(tmp_path / "b.jsonl", DOCS_B)
    assert [d.nll for d in load_per_doc(a) if d.tokens] == [3.0, 5.0, 2.0, 10.0]
    assert main(["compare", "--per-doc", a, b, "--worst", "2"]) == 0
    out = capsys.readouterr().out
    worst_a = out.split("worst documents of a\n")[1].split("\n\n")[0].splitlines()[2:]
    assert [row.split()[0] for row in worst_a] == ["doc:2", "doc:1"]          # doc:4 is shorter than 10 tokens
    assert "5.0000" in worst_a[0] and f"{250 / math.log(2) / 200:.4f}" in worst_a[0]   # NLL/token, bits/byte
    increases = out.split("largest per-document increases of b against a\n")[1].splitlines()[2:]
    assert increases[0].split()[0] == "doc:3" and "+1.0000" in increases[0]   # 2.0 -> 3.0
    assert len(increases) == 1   # doc:1 (unchanged) and doc:2 (5.0 -> 4.5) did not rise: listed before
    assert main(["compare", "--per-doc", a, a]) == 0
    assert capsys.readouterr().out.endswith("\nnone: no document's NLL per token rose\n")
    summary = out.split("per-document NLL")[1].split("\n\n")[0]
    a_row = next(line for line in summary.splitlines() if line.startswith("a "))
    b_row = next(line for line in summary.splitlines() if line.startswith("b "))
    # documents, left out, mean, median, p90 (linear between ranks), max of the kept 3.0, 5.0, 2.0 / 3.0, 4.5, 3.0
    assert a_row.split()[1:] == ["5", "2", f"{(3 + 5 + 2) / 3:.4f}", "3.0000", f"{3 + 0.8 * 2:.4f}", "5.0000"]
    assert b_row.split()[1:] == ["5", "2", f"{(3 + 4.5 + 3) / 3:.4f}", "3.0000", f"{3 + 0.8 * 1.5:.4f}", "4.5000"]


def test_a_document_of_exactly_the_minimum_length_is_kept(tmp_path, capsys):
    docs = [{"id": "ten", "tokens": 10, "bytes": 40, "words": 8, "nll_sum": 40.0},
            {"id": "nine", "tokens": 9, "bytes": 36, "words": 7, "nll_sum": 90.0}]
    a, b = write_docs(tmp_path / "a.jsonl", docs), write_docs(tmp_path / "b.jsonl", docs)
    assert main(["compare", "--per-doc", a, b]) == 0
    out = capsys.readouterr().out
    assert "documents of fewer than 10 tokens are left out" in out
    worst = out.split("worst documents of a\n")[1].split("\n\n")[0].splitlines()[2:]
    assert [row.split()[0] for row in worst] == ["ten"]


def test_per_doc_increases_rank_by_nll_per_token_not_by_total(tmp_path, capsys):
    """A long document a little worse (+0.1 nats/token, +100 in total) ranks below a short one much worse
    (+1.0 nats/token, +20 in total). The per-document files' own labels head their tables."""
    before = [{"id": "long", "tokens": 1000, "bytes": 4000, "words": 800, "nll_sum": 2000.0},
              {"id": "short", "tokens": 20, "bytes": 80, "words": 16, "nll_sum": 40.0}]
    after = [dict(before[0], nll_sum=2100.0), dict(before[1], nll_sum=60.0)]
    a = write(tmp_path / "a.json", result_of(before))
    b = write(tmp_path / "b.json", result_of(after))
    docs_x, docs_y = write_docs(tmp_path / "x.jsonl", before), write_docs(tmp_path / "y.jsonl", after)
    assert main(["compare", a, b, "--per-doc", docs_x, docs_y]) == 0
    out = capsys.readouterr().out
    increases = out.split("largest per-document increases of b against a\n")[1].splitlines()[2:]
    assert [row.split()[0] for row in increases[:2]] == ["short", "long"]
    assert "worst documents of a\n" in out and "worst documents of x" not in out   # the runs' labels


def test_a_per_doc_file_must_be_its_runs(tmp_path, capsys):
    """Shown under a run's label, a per-document file must sum to that run's totals (another run's file, or one of
    another corpus, was shown as if it were the run's), unless --force."""
    a, b = write(tmp_path / "a.json", result_of(DOCS_A)), write(tmp_path / "b.json", result_of(DOCS_B))
    docs_a, docs_b = write_docs(tmp_path / "a.jsonl", DOCS_A), write_docs(tmp_path / "b.jsonl", DOCS_B)
    assert main(["compare", a, b, "--per-doc", docs_b, docs_a]) == 2       # swapped: same tokens, other NLL
    assert f"{docs_b}: is not the per-document file of {a}" in one_line_error(capsys)
    other_corpus = write_docs(tmp_path / "c.jsonl", DOCS_A[:2])
    assert main(["compare", a, "--per-doc", other_corpus]) == 2
    assert "sum to 150 tokens" in one_line_error(capsys)
    assert main(["compare", a, "--per-doc", other_corpus, "--force"]) == 0
    assert main(["compare", a, b, "--per-doc", docs_a, docs_b]) == 0       # each its own


def test_a_per_doc_file_given_as_a_report_says_so(tmp_path, capsys):
    docs = write_docs(tmp_path / "a.jsonl", DOCS_A)
    assert main(["compare", docs]) == 2
    assert "a per-document file? pass it after --per-doc" in one_line_error(capsys)


def test_per_doc_path_from_the_report(tmp_path, capsys):
    write_docs(tmp_path / "a-docs.jsonl", DOCS_A)
    run = write(tmp_path / "a.json", result_of(DOCS_A, per_doc_path="a-docs.jsonl"))   # relative to the report
    assert main(["compare", run, "--min-doc-tokens", "1"]) == 0
    out = capsys.readouterr().out
    assert "worst documents of a" in out and out.split("worst documents of a\n")[1].splitlines()[2].startswith("doc:4")


def test_per_doc_files_must_hold_the_same_documents(tmp_path, capsys):
    a = write_docs(tmp_path / "a.jsonl", DOCS_A)
    b = write_docs(tmp_path / "b.jsonl", DOCS_A[:-1])
    assert main(["compare", "--per-doc", a, b]) == 2
    assert "hold different documents" in one_line_error(capsys)
    c = write_docs(tmp_path / "c.jsonl", [dict(d, tokens=d["tokens"] + 1) for d in DOCS_A])
    assert main(["compare", "--per-doc", a, c]) == 2
    assert "other token counts" in one_line_error(capsys)
    assert main(["compare", "--per-doc", a, c, "--force"]) == 0


@pytest.mark.parametrize("line, message", [
    ("not json", "b.jsonl:2: not valid JSON"),
    ('{"id": "x", "tokens": 5}', "b.jsonl:2: no 'nll_sum' field"),
    ('{"id": "x", "tokens": -1, "nll_sum": 1.0}', "'tokens' must be a non-negative integer"),
    ('{"id": "doc:1", "tokens": 5, "nll_sum": 1.0}', "appears twice"),
    ('{"id": "x", "tokens": 5, "nll_sum": Infinity}', "'nll_sum' must be a finite number"),   # numpy warnings, exit 0
    ('{"id": "x", "tokens": 5, "nll_sum": 1.0, "bytes": -4}', "'bytes' must be a non-negative integer"),
])
def test_bad_per_doc_lines_are_one_line_errors(tmp_path, capsys, line, message):
    a = write_docs(tmp_path / "a.jsonl", DOCS_A)
    b = tmp_path / "b.jsonl"
    b.write_text(json.dumps(DOCS_A[0]) + "\n" + line + "\n")
    assert main(["compare", "--per-doc", a, str(b)]) == 2
    assert message in one_line_error(capsys)


@pytest.mark.slow
@needs_matplotlib
def test_comparison_figures(tmp_path, capsys):
    a = write(tmp_path / "a.json", result_of(DOCS_A))
    b = write(tmp_path / "b.json", result_of(DOCS_B))
    plot = tmp_path / "runs.png"
    assert main(["compare", a, b, "--plot", str(plot)]) == 0
    assert png_size(plot) == (800, 450)

    docs_a, docs_b = write_docs(tmp_path / "a.jsonl", DOCS_A), write_docs(tmp_path / "b.jsonl", DOCS_B)
    assert main(["compare", a, b, "--per-doc", docs_a, docs_b, "--plot", str(plot)]) == 0
    assert png_size(plot) == (1400, 450)   # loss by position and the per-document histogram side by side
    assert main(["compare", "--per-doc", docs_a, "--plot", str(tmp_path / "docs.png")]) == 0
    assert png_size(tmp_path / "docs.png") == (800, 450)

    one_doc = [dict(DOCS_A[0])]   # a histogram of one document per run says nothing: the loss by position only
    single_a = write(tmp_path / "sa.json", result_of(one_doc))
    single_b = write(tmp_path / "sb.json", result_of(one_doc))
    docs_single = write_docs(tmp_path / "single.jsonl", one_doc)
    assert main(["compare", single_a, single_b, "--per-doc", docs_single, docs_single, "--plot", str(plot)]) == 0
    assert png_size(plot) == (800, 450)

    old = write(tmp_path / "old.json", {k: v for k, v in result_of(DOCS_A).items() if not k.startswith("nll_by")})
    assert main(["compare", a, old, "--plot", str(tmp_path / "x.png")]) == 2
    assert "has no nll_by_position" in one_line_error(capsys) and not (tmp_path / "x.png").exists()


@pytest.mark.parametrize("report", [
    {"nll": "x", "ppl": 1, "tokens_scored": 1, "config": {}},
    {"nll": 1.0, "ppl": 1.0, "tokens_scored": "a", "config": {"data": ["a.txt"]}},
    {"nll": 1.0, "ppl": 1.0, "tokens_scored": 1, "config": {"data": 5}},
    # with --force too: a one-line error, never a TypeError or AttributeError
    {**make_result(), "config": {"data": [1, None]}},
    {**make_result(), "tokens_per_second": "fast"},
    {**make_result(), "bits_per_byte": "x"},
    {**make_result(), "environment": {"device_name": 5}},
    {**make_result(), "environment": "x"},
    {**make_result(), "dtype": {}},
    {**make_result(), "per_doc_path": 5},
    {**make_result(), "nll_by_position": [1, "a", None]},
    {**make_result(), "tokens_scored": -3},
])
def test_fields_of_the_wrong_type_are_a_one_line_error(tmp_path, capsys, report):
    from fastppl.cli import main
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(report))
    assert main(["compare", str(path), "--force"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fastppl: error: ") and err.count("\n") == 1 and "wrong type" in err


def test_runs_of_one_text_with_other_tokenizers_compare_by_bits_per_byte(tmp_path, capsys):
    first = {**make_result(), "corpus_sha256": "ab" * 32}
    other = {**make_result(nll=2.5, bits_per_byte=1.1, tokens=30000), "corpus_sha256": "ab" * 32}
    a, b = write(tmp_path / "a.json", first), write(tmp_path / "b.json", other)
    assert main(["compare", a, b]) == 0   # no --force: the same text
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("b "))
    assert row.count("n/c") == 2 and "-0.100000" in row   # ΔNLL and ΔPPL not comparable; Δbits/byte shown
    assert "n/c: not comparable" in out and "compare them by bits/byte" in out
    c = write(tmp_path / "c.json", {**other, "corpus_sha256": "cd" * 32})
    assert main(["compare", a, c]) == 2
    assert "scored different text" in one_line_error(capsys)


def _with_units(result, nll_sums, tokens, n_bytes, kind="document"):
    units = {"kind": kind, "index": list(range(len(tokens))), "nll_sum": nll_sums, "tokens": tokens,
             "bytes": n_bytes}
    return {**result, "corpus_sha256": "ab" * 32,
            "bootstrap": {"level": 0.95, "replicates": 200, "seed": 0, "resampled": units}}


def test_compare_gives_the_paired_difference_with_its_interval(tmp_path, capsys):
    tokens = [100, 250, 80, 400, 120, 60]
    nll_a = [3.0 * t + i for i, t in enumerate(tokens)]
    nll_b = [x - 0.2 * t for x, t in zip(nll_a, tokens)]          # 0.2 nats/token lower on every document
    a = write(tmp_path / "a.json", _with_units(make_result(tokens=sum(tokens)), nll_a, tokens, [4 * t for t in tokens]))
    b = write(tmp_path / "b.json", _with_units(make_result(tokens=sum(tokens)), nll_b, tokens, [4 * t for t in tokens]))
    assert main(["compare", a, b]) == 0
    out = capsys.readouterr().out
    assert "paired differences against a (95% bootstrap interval, seed 0)" in out
    row = next(line for line in out.splitlines() if line.startswith("b ") and "ΔNLL" in line)
    assert "-0.200000" in row and "[-0.200000, -0.200000]" in row and "100.0% of 200 resamples of 6 documents" in row
    # another tokenizer (other token counts per document): the paired difference is in bits per byte
    fewer = [t // 2 for t in tokens]
    c = write(tmp_path / "c.json", _with_units(make_result(tokens=sum(fewer)), nll_b, fewer, [4 * t for t in tokens]))
    assert main(["compare", a, c]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("c ") and "Δbits/byte" in line)
    assert f"{-0.2 / 4 / math.log(2):+.6f}" in row
    # without units to pair, it says how to get them
    d = write(tmp_path / "d.json", {**make_result(tokens=sum(tokens)), "corpus_sha256": "ab" * 32})
    assert main(["compare", a, d]) == 0
    assert "eval --bootstrap N on the same text" in capsys.readouterr().out


@pytest.mark.slow
def test_two_tokenizers_on_one_text_compare_without_force(tmp_path, capsys, tokenizer_dir, shakespeare):
    """GPT-2's tokenizer against one with a tenth of its merges (more, shorter tokens): the same text, other
    tokens. compare takes them without --force and pairs their documents by bits per byte."""
    coarse = tmp_path / "coarse-tokenizer"
    coarse.mkdir()
    spec = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    spec["model"]["merges"] = spec["model"]["merges"][:5000]
    (coarse / "tokenizer.json").write_text(json.dumps(spec))
    text = shakespeare.read_text()
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"id": f"d{i}", "text": text[i * 400:(i + 1) * 400]}) + "\n" for i in range(8)))
    reports = []
    for name, tokenizer in (("gpt2", tokenizer_dir), ("coarse", coarse)):
        reports.append(str(tmp_path / f"{name}.json"))
        assert main(["eval", "--model", "random:gpt2-tiny", "--tokenizer", str(tokenizer), "--data", str(data),
                     "--device", "cpu", "--ctx", "64", "--quiet", "--bootstrap", "100", "--json", reports[-1],
                     "--per-doc", str(tmp_path / f"{name}.jsonl")]) == 0
    results = [json.loads(open(r).read()) for r in reports]
    assert results[0]["corpus_sha256"] == results[1]["corpus_sha256"]
    assert results[0]["tokens_scored"] < results[1]["tokens_scored"] and results[0]["bytes"] == results[1]["bytes"]
    capsys.readouterr()
    assert main(["compare", *reports]) == 0
    out = capsys.readouterr().out
    assert "n/c: not comparable" in out
    row = next(line for line in out.splitlines() if line.startswith("coarse ") and "Δbits/byte" in line)
    expected = results[1]["bits_per_byte"] - results[0]["bits_per_byte"]
    assert f"{expected:+.6f}" in row and "of 100 resamples of 8 documents" in row
    # their per-document files (found through the reports) hold other token counts: compared by bits per byte
    assert "per-document NLL" in out and "largest per-document increases of coarse against gpt2 in bits/byte" in out


def test_a_malformed_bootstrap_field_is_a_one_line_error(tmp_path, capsys):
    good = _with_units(make_result(tokens=300), [300.0, 600.0], [100, 200], [400, 800])
    bad = {**good, "bootstrap": {**good["bootstrap"], "resampled": {**good["bootstrap"]["resampled"], "tokens": [1]}}}
    a, b = write(tmp_path / "a.json", good), write(tmp_path / "b.json", bad)
    assert main(["compare", a, b]) == 2
    expected = "b.json: not a fastppl eval report ('bootstrap.resampled.tokens' has the wrong type)"
    assert expected in one_line_error(capsys)


def test_a_per_doc_file_written_with_raw_unicode_line_separators_reads_as_its_lines(tmp_path):
    """An id holding U+2028 written raw (json.dumps(..., ensure_ascii=False)) stays one record: lines end at \\n."""
    path = tmp_path / "docs.jsonl"
    records = [{"id": "a\u2028b", "tokens": 3, "nll_sum": 6.0}, {"id": "c\x85d", "tokens": 2, "nll_sum": 2.0}]
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    assert [(d.id, d.tokens) for d in load_per_doc(str(path))] == [("a\u2028b", 3), ("c\x85d", 2)]
