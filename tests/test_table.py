"""Several models × corpora in one process (fastppl.table): each cell equal to its separate run, each corpus read
and tokenized once, each model loaded once, a failed cell named while the others are kept, the table's files,
and fastppl compare reading them."""
import csv
import json
import shutil

import pytest
import torch

import fastppl.pipeline as pipeline
import fastppl.reference as reference
from fastppl.cli import main
from fastppl.config import EvalConfig
from fastppl.models import load_model
from fastppl.models.loading import native_to_hf
from fastppl.pipeline import evaluate

CTX = 32


@pytest.fixture(scope="module")
def models(tmp_path_factory, tokenizer_dir):
    """Two saved checkpoints of one tiny shape (other seeds), each with its own copy of one tokenizer."""
    root = tmp_path_factory.mktemp("table-models")
    paths = []
    for seed in (0, 1):
        path = root / f"m{seed}"
        native_to_hf(load_model("random:gpt2-tiny", "native", torch.float32, seed=seed)).save_pretrained(path)
        for tokenizer_file in tokenizer_dir.iterdir():
            shutil.copy(tokenizer_file, path / tokenizer_file.name)
        paths.append(str(path))
    return paths


@pytest.fixture(scope="module")
def corpora(tmp_path_factory, shakespeare):
    root, text = tmp_path_factory.mktemp("table-corpora"), shakespeare.read_text()
    (root / "head.txt").write_text(text[:1200])
    (root / "tail.txt").write_text(text[-1000:])
    return [str(root / "head.txt"), str(root / "tail.txt")]


def _table(models, corpora, tmp_path, *extra):
    arguments = ["eval", *(a for m in models for a in ("--model", m)), *(a for c in corpora for a in ("--corpus", c)),
                 "--ctx", str(CTX), "--device", "cpu", "--quiet", "--json", str(tmp_path / "table.json"), *extra]
    return main(arguments)


def test_each_cell_is_its_separate_run_with_the_divergence_from_the_base(models, corpora, tmp_path, capsys):
    assert _table(models, corpora, tmp_path, "--reference-model", models[0]) == 0
    table = json.loads((tmp_path / "table.json").read_text())
    assert table["base"] == models[0] and [(c["model"], c["corpus"]) for c in table["cells"]] == [
        (m, c) for m in models for c in ("head.txt", "tail.txt")]
    for cell, row in zip(table["cells"], table["rows"]):
        data = [c for c in corpora if c.endswith(cell["corpus"])]
        is_base = cell["model"] == models[0]
        alone = evaluate(EvalConfig(model=cell["model"], data=data, ctx=CTX, device="cpu", quiet=True,
                                    reference_model=None if is_base else models[0])).to_dict()
        report = cell["report"]
        assert report["nll_sum"] == alone["nll_sum"] and report["tokens_scored"] == alone["tokens_scored"]
        assert report["tokenization"] == alone["tokenization"] and report["batch_size"] == alone["batch_size"]
        assert (report.get("divergence") is None) == is_base
        if not is_base:
            assert report["divergence"]["kld_mean"] == alone["divergence"]["kld_mean"] > 0
            assert row["kld_p99"] == alone["divergence"]["kld_p99"]
        base = next(c["report"] for c in table["cells"] if c["model"] == models[0] and c["corpus"] == cell["corpus"])
        # against the reference on the cell's own windows; its figure there is the base cell's run
        base_ppl = base["ppl"] if is_base else report["divergence"]["reference_ppl"]
        assert base_ppl == pytest.approx(base["ppl"], rel=1e-6)
        assert row["delta_ppl"] == pytest.approx(report["ppl"] - base_ppl, rel=1e-12)
    printed = capsys.readouterr().out
    assert "m1" in printed and "KLD mean" in printed and "base" in printed


def test_each_corpus_is_read_and_tokenized_once_and_each_model_loaded_once(models, corpora, tmp_path,
                                                                             monkeypatch):
    calls = {"load_model": [], "read_corpus": 0, "encode_texts": 0}

    def counted(name, real):
        def wrapper(*args, **kwargs):
            if name == "load_model":
                calls[name].append(args[0])
            else:
                calls[name] += 1
            return real(*args, **kwargs)
        return wrapper
    for module, name in ((pipeline, "load_model"), (reference, "load_model"), (pipeline, "read_corpus"),
                         (pipeline, "encode_texts")):
        monkeypatch.setattr(module, name, counted(name, getattr(module, name)))
    other = str(tmp_path / "other")
    shutil.copytree(models[1], other)   # its own tokenizer files, equal to the base's (one fingerprint)
    assert _table([models[0], other], corpora, tmp_path, "--reference-model", models[0]) == 0
    assert sorted(calls["load_model"]) == sorted([models[0], other, models[0]])   # the reference's own slot
    assert calls["read_corpus"] == 2 and calls["encode_texts"] == 2


def _broken_copy(model, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(model, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-64])   # cut inside a tensor
    return str(broken)


def test_a_failed_cell_is_named_and_the_others_are_kept(models, corpora, tmp_path, capsys):
    broken = _broken_copy(models[1], tmp_path)
    code = _table([models[0], broken, models[1]], corpora, tmp_path, "--markdown", str(tmp_path / "t.md"),
                  "--csv", str(tmp_path / "t.csv"))
    assert code == 2
    table = json.loads((tmp_path / "table.json").read_text())
    status = [(r["model"], r["status"]) for r in table["rows"]]
    assert status == [(models[0], "ok")] * 2 + [(broken, "failed")] * 2 + [(models[1], "ok")] * 2
    failed = [c for c in table["cells"] if "error" in c]
    assert len(failed) == 2 and all("model.safetensors" in c["error"] for c in failed)
    out, err = capsys.readouterr()
    assert "- failed: broken on head.txt:" in out and "fastppl: error: cell " + broken in err
    assert "Traceback" not in err
    rows = list(csv.DictReader((tmp_path / "t.csv").read_text().splitlines()))
    assert [r["status"] for r in rows] == ["ok", "ok", "failed", "failed", "ok", "ok"]
    assert float(rows[0]["ppl"]) == table["rows"][0]["ppl"]   # CSV keeps every digit
    assert (tmp_path / "t.md").read_text().startswith("| model | corpus | tokens | PPL |")


@pytest.mark.parametrize("extra, message", [
    (["--data", "x.txt"], "--data and --corpus are both given"),
    (["--per-token", "t.npy"], "--per-token writes one run's output"),
    (["--nproc", "2"], "--nproc runs one model on one corpus"),
    (["--model", "MODEL0"], "a --model is given twice"),
    (["--corpus", "CORPUS0"], "a --corpus is given twice"),
    (["--corpus", "no-such.txt"], "no-such.txt: no such file"),
])
def test_a_table_refuses_in_one_line_before_loading_anything(models, corpora, tmp_path, capsys, monkeypatch, extra,
                                                             message):
    monkeypatch.setattr(pipeline, "evaluate", lambda *a, **k: pytest.fail("a refused table ran"))
    extra = [models[0] if a == "MODEL0" else corpora[0] if a == "CORPUS0" else a for a in extra]
    assert _table(models, corpora, tmp_path, *extra) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("fastppl: error: ") and message in err and "\n" not in err
    assert not (tmp_path / "table.json").exists()


def test_one_run_writes_its_one_row_as_markdown_and_csv(models, corpora, tmp_path, capsys):
    assert main(["eval", "--model", models[0], "--data", corpora[0], "--ctx", str(CTX), "--device", "cpu", "--quiet",
                 "--markdown", str(tmp_path / "t.md"), "--csv", str(tmp_path / "t.csv")]) == 0
    lines = (tmp_path / "t.md").read_text().splitlines()
    assert lines[0].startswith("| model | corpus |") and lines[2].startswith("| m0 | head.txt |") and len(lines) == 5
    assert len(list(csv.DictReader((tmp_path / "t.csv").read_text().splitlines()))) == 1
    assert "perplexity" in capsys.readouterr().out   # the run's own summary on stdout


def test_compare_reads_a_table_one_corpus_at_a_time(models, corpora, tmp_path, capsys):
    assert _table(models, corpora, tmp_path) == 0
    capsys.readouterr()
    assert main(["compare", str(tmp_path / "table.json")]) == 0
    out = capsys.readouterr().out
    sections = out.split("Δ: against the first run")
    assert len(sections) == 3   # one comparison per corpus
    assert "m0 @ head.txt" in sections[0] and "m1 @ head.txt" in sections[0] and "tail.txt" not in sections[0]
    assert main(["compare", str(tmp_path / "table.json"), "--plot", str(tmp_path / "p.png")]) == 2
    assert "--plot and --per-doc compare single runs" in capsys.readouterr().err


def test_an_interrupted_table_keeps_the_cells_it_finished(models, corpora, tmp_path, capsys, monkeypatch):
    real, runs = pipeline.evaluate, []

    def interrupted_at_the_third(config, reuse=None):
        runs.append(config.model)
        if len(runs) == 3:
            raise KeyboardInterrupt
        return real(config, reuse)
    monkeypatch.setattr(pipeline, "evaluate", interrupted_at_the_third)
    assert _table(models, corpora, tmp_path) == 130
    table = json.loads((tmp_path / "table.json").read_text())
    assert [r["status"] for r in table["rows"]] == ["ok", "ok", "failed", "failed"]
    assert table["cells"][3]["error"] == "not run: interrupted" and len(runs) == 3
    assert "fastppl: interrupted" in capsys.readouterr().err


def test_the_reference_runs_first_and_its_own_cells_take_no_reference_options(models, corpora, tmp_path):
    # given last and as ./path: still the reference's own cells (plain runs, first), with --reference-device given
    relative = "./" + str(shutil.os.path.relpath(models[0]))
    assert _table([models[1], relative], corpora[:1], tmp_path, "--reference-model", models[0],
                  "--reference-device", "cpu") == 0
    table = json.loads((tmp_path / "table.json").read_text())
    assert table["models"] == [models[0], models[1]]
    assert "divergence" not in table["cells"][0]["report"] and table["cells"][1]["report"]["divergence"]


def test_a_random_reference_of_another_seed_is_not_the_model_of_the_same_name(corpora, tmp_path, tokenizer_dir):
    assert _table(["random:gpt2-tiny"], corpora, tmp_path, "--reference-model", "random:gpt2-tiny",
                  "--reference-seed", "1", "--tokenizer", str(tokenizer_dir)) == 0
    table = json.loads((tmp_path / "table.json").read_text())
    assert all(c["report"]["divergence"]["kld_mean"] > 0 for c in table["cells"])   # seed 0 against seed 1


def test_an_unexpected_failure_of_one_cell_keeps_the_others(models, corpora, tmp_path, capsys, monkeypatch):
    real = pipeline.evaluate

    def failing_on_the_second_model(config, reuse=None):
        if config.model == models[1]:
            raise ValueError("a bug")
        return real(config, reuse)
    monkeypatch.setattr(pipeline, "evaluate", failing_on_the_second_model)
    assert _table(models, corpora, tmp_path) == 1   # fastppl's own failure, not the input's
    table = json.loads((tmp_path / "table.json").read_text())
    assert [r["status"] for r in table["rows"]] == ["ok", "ok", "failed", "failed"]
    assert table["cells"][2]["error"] == "ValueError: a bug" and "Traceback" in capsys.readouterr().err


def test_a_cells_tokenization_note_is_its_separate_runs(models, tmp_path, shakespeare):
    long_text = tmp_path / "long.txt"
    long_text.write_text(shakespeare.read_text()[:6000])   # above the token cache's threshold
    evaluate(EvalConfig(model=models[0], data=[str(long_text)], ctx=CTX, device="cpu", quiet=True))   # caches it
    assert _table(models, [str(long_text)], tmp_path) == 0
    table = json.loads((tmp_path / "table.json").read_text())
    # the second model's tokenizer (the same fingerprint) gets the ids the first one read from the cache
    assert [c["report"]["tokenization"] for c in table["cells"]] == ["from the token cache (an earlier run's ids)"] * 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_cells_on_the_gpu_are_their_separate_runs(models, tmp_path, shakespeare):
    """Compiled scorers of several models and corpora in one process: each cell's sums bit for bit its separate
    run's (a fallback to eager past Dynamo's recompile limit would change the last bits)."""
    text = shakespeare.read_text()
    corpora = []
    for i in range(3):
        path = tmp_path / f"c{i}.txt"
        path.write_text(text[i * 20_000:(i + 1) * 20_000 - i * 1_000])   # other lengths: other batch shapes
        corpora.append(str(path))
    options = ["--device", "cuda", "--compile", "on", "--batching", "bucketed"]
    assert _table(models, corpora, tmp_path, *options) == 0
    table = json.loads((tmp_path / "table.json").read_text())
    for cell in table["cells"]:
        data = [c for c in corpora if c.endswith(cell["corpus"])]
        alone = evaluate(EvalConfig(model=cell["model"], data=data, ctx=CTX, device="cuda", compile="on",
                                    batching="bucketed", quiet=True)).to_dict()
        assert cell["report"]["compile"].startswith("on") and cell["report"]["nll_sum"] == alone["nll_sum"]


def test_model_names_holding_a_pipe_comma_quote_or_line_break_keep_the_tables_shape():
    import io
    import re

    from fastppl.report.table import COLUMNS, table_csv, table_text
    names = ["a|b", 'c,"d"\ne', "f\rg\\|h"]
    rows = [{"model": name, "corpus": "x, y|z", "status": "ok", "tokens_scored": 10, "nll": 1.5, "ppl": 4.4817,
             "bits_per_byte": 0.25, "base_ppl": 4.4817, "delta_ppl": 0.0, "delta_ppl_relative": 0.0} for name in names]
    table = {"models": names, "rows": rows, "base": names[0], "reference_model": None}
    markdown = table_text(table, markdown=True).split("\n\n")[0].splitlines()
    assert len(markdown) == 2 + len(names)
    for line in markdown:   # a cell's pipe is escaped (its backslash too), so each row has as many cells
        assert len(re.findall(r"(?:\\.|[^\\|])*\|", line)) == len(COLUMNS) + 1, line
    text = table_text(table).splitlines()
    assert len(text) == 2 + len(names) + 2 and all(line.startswith(("a|b", 'c,"d"\\ne', "f\\rg\\|h")) for line in
                                                  text[2:2 + len(names)])
    read = list(csv.DictReader(io.StringIO(table_csv(table), newline="")))
    assert [row["model"] for row in read] == names and {row["corpus"] for row in read} == {"x, y|z"}
    assert float(read[0]["ppl"]) == 4.4817 and read[0]["kld_mean"] == ""
