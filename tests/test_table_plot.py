"""--plot of a table: each model's KLD and ΔPPL by its file's bits per weight, a line per corpus. The data handed
to matplotlib (each line's points) equals the table's rows; the refusals are one line, before anything runs."""
import importlib.util
import json
import shutil

import pytest
import torch

import fastppl.pipeline as pipeline
from fastppl.cli import main
from fastppl.models import load_model
from fastppl.models.loading import native_to_hf

pytestmark = pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="matplotlib is not installed")
CTX = 32


def _save(path, seed, dtype, tokenizer_dir):
    native_to_hf(load_model("random:gpt2-tiny", "native", torch.float32, seed=seed)).to(dtype).save_pretrained(path)
    for tokenizer_file in tokenizer_dir.iterdir():
        shutil.copy(tokenizer_file, path / tokenizer_file.name)
    return str(path)


@pytest.fixture(scope="module")
def models(tmp_path_factory, tokenizer_dir):
    """The base in fp32, its bf16 rounding (16 bits a weight, a small divergence), another seed in fp32."""
    root = tmp_path_factory.mktemp("plot-models")
    return [_save(root / "base", 0, torch.float32, tokenizer_dir),
            _save(root / "base-bf16", 0, torch.bfloat16, tokenizer_dir),
            _save(root / "other", 1, torch.float32, tokenizer_dir)]


@pytest.fixture(scope="module")
def corpora(tmp_path_factory, shakespeare):
    root, text = tmp_path_factory.mktemp("plot-corpora"), shakespeare.read_text()
    (root / "head.txt").write_text(text[:900])
    (root / "tail.txt").write_text(text[-700:])
    return [str(root / "head.txt"), str(root / "tail.txt")]


def _table(models, corpora, tmp_path, *extra):
    return main(["eval", *(a for m in models for a in ("--model", m)), *(a for c in corpora for a in ("--corpus", c)),
                 "--ctx", str(CTX), "--device", "cpu", "--quiet", "--json", str(tmp_path / "table.json"), *extra])


def _lines_drawn(monkeypatch):
    """Each figure's panels as {y label: {corpus: (x values, y values)}}, from the Line2D objects matplotlib got."""
    import fastppl.report.bits_plot as bits_plot
    drawn = []

    def keep(figure, path):
        drawn.append({axes.get_ylabel(): {line.get_label(): (list(line.get_xdata()), list(line.get_ydata()))
                                          for line in axes.get_lines()} for axes in figure.axes})
        real_save(figure, path)
    real_save = bits_plot.save_figure
    monkeypatch.setattr(bits_plot, "save_figure", keep)
    return drawn


def _expected(table, key):
    """{corpus: (bits, values)} from the table's rows that have the number, by bits per weight."""
    expected = {}
    for corpus in table["corpora"]:
        points = sorted((r["bits_per_weight"], r[key]) for r in table["rows"]
                        if r["corpus"] == corpus and r.get(key) is not None)
        expected[corpus] = ([b for b, _ in points], [v for _, v in points])
    return expected


def test_the_plot_draws_the_tables_kld_and_delta_ppl_by_bits_per_weight(models, corpora, tmp_path, monkeypatch):
    drawn = _lines_drawn(monkeypatch)
    plot = tmp_path / "bits.png"
    assert _table(models, corpora, tmp_path, "--reference-model", models[0], "--plot", str(plot)) == 0
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = json.loads((tmp_path / "table.json").read_text())
    bits = {r["model"]: r["bits_per_weight"] for r in table["rows"]}
    assert bits == {models[0]: 32.0, models[1]: 16.0, models[2]: 32.0}
    (panels,) = drawn
    kld, delta_ppl = panels.values()
    assert kld == _expected(table, "kld_mean") and delta_ppl == _expected(table, "delta_ppl")
    # the reference has no KLD point; on the ΔPPL panel it is the base, at 0
    assert all(len(xs) == 2 for xs, _ in kld.values()) and all(len(xs) == 3 for xs, _ in delta_ppl.values())
    assert all(0.0 in ys for _, ys in delta_ppl.values())
    assert all(y > 0 for _, ys in kld.values() for y in ys)


def test_without_a_reference_the_plot_is_delta_ppl_against_the_first_model(models, corpora, tmp_path, monkeypatch):
    drawn = _lines_drawn(monkeypatch)
    assert _table(models[:2], corpora, tmp_path, "--plot", str(tmp_path / "bits.svg")) == 0
    table = json.loads((tmp_path / "table.json").read_text())
    (panels,) = drawn
    assert list(panels) == ["ΔPPL against the base"] and panels["ΔPPL against the base"] == _expected(table,
                                                                                                       "delta_ppl")
    assert (tmp_path / "bits.svg").read_text().lstrip().startswith("<?xml")


@pytest.mark.parametrize("models_given, extra, message", [
    (["random:gpt2-tiny", "BASE"], [], "random:gpt2-tiny has no file"),
    (["BASE"], [], "this table has no other model"),
    (["BASE"], ["--reference-model", "BASE"], "this table has no other model"),
    (["BASE", "OTHER"], ["--plot", "bits.gif"], "give a file name ending in .png"),
])
def test_a_plot_that_cannot_be_drawn_is_refused_in_one_line_before_anything_runs(models, corpora, tmp_path, capsys,
                                                                                 monkeypatch, models_given, extra,
                                                                                 message):
    monkeypatch.setattr(pipeline, "evaluate", lambda *a, **k: pytest.fail("a refused table ran"))
    named = {"BASE": models[0], "OTHER": models[2], "bits.gif": str(tmp_path / "bits.gif")}
    extra = [named.get(a, a) for a in extra]
    plot = [] if "--plot" in extra else ["--plot", str(tmp_path / "bits.png")]
    assert _table([named.get(m, m) for m in models_given], corpora, tmp_path, *extra, *plot) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("fastppl: error: ") and message in err and "\n" not in err
    assert not list(tmp_path.glob("bits.*")) and not (tmp_path / "table.json").exists()
