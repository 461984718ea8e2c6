"""Loss by position: the device's per-position sums against the per-token dump, and the figure."""
import importlib.util
import json
import struct
import sys

import numpy as np
import pytest

from fastppl.cli import main
from fastppl.data.corpus import load_documents
from fastppl.data.tokenize import load_tokenizer
from fastppl.data.windows import chunked_windows, sliding_windows

needs_matplotlib = pytest.mark.skipif(
    importlib.util.find_spec("matplotlib") is None, reason="matplotlib is not installed")


def window_positions(token_counts, window, ctx, stride=None, bos=False):
    """(n_tokens,) window position at which each corpus token is scored, -1 if it is not; read off the
    windows' contract: window position p predicts stream index start + p + 1."""
    positions = np.full(sum(token_counts), -1, dtype=np.int64)
    offset = 0
    for n in token_counts:
        has_bos = window == "chunked" or bos
        windows = chunked_windows(n, ctx) if window == "chunked" else sliding_windows(n + has_bos, ctx, stride)
        for w in windows:
            for p in range(w.score_from, w.length):
                target = w.start + p + 1                    # stream index
                positions[offset + target - has_bos] = p    # corpus index
        offset += n
    return positions


def png_size(path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def _jsonl_corpus(tmp_path):
    lines = ["To be, or not to be, that is the question:", "Whether 'tis nobler in the mind to suffer " * 6,
             "The slings and arrows of outrageous fortune, " * 11, "Or to take arms.", "Against a sea " * 30]
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in lines))
    return path


@pytest.mark.parametrize("window_args", [
    ["--window", "chunked", "--batch-size", "3"],
    pytest.param(["--window", "sliding", "--stride", "8", "--batch-size", "5"], marks=pytest.mark.slow),
], ids=["chunked-jsonl", "sliding-stride8"])
def test_position_sums_equal_the_per_token_dump(tmp_path, tokenizer_dir, window_args):
    data = _jsonl_corpus(tmp_path)
    ctx = 32
    out, dump = tmp_path / "r.json", tmp_path / "t.npy"
    rc = main(["eval", "--model", "random:gpt2-tiny", "--tokenizer", str(tokenizer_dir), "--data", str(data),
               "--ctx", str(ctx), "--device", "cpu", "--quiet", "--json", str(out), "--per-token", str(dump),
               *window_args])
    assert rc == 0
    result = json.loads(out.read_text())
    per_token = np.load(dump).astype(np.float64)

    tokenizer = load_tokenizer(str(tokenizer_dir))
    counts = [len(tokenizer.encode(d.text)) for d in load_documents(str(data))]
    window = window_args[1]
    positions = window_positions(counts, window, ctx, stride=8 if window == "sliding" else None)
    assert np.array_equal(positions >= 0, ~np.isnan(per_token))   # scored exactly where the dump says

    mean, std = result["nll_by_position"], result["nll_by_position_std"]
    assert len(mean) == len(std) == ctx
    for p in range(ctx):
        at_p = per_token[positions == p]
        if at_p.size == 0:
            assert mean[p] is None and std[p] is None
            continue
        assert mean[p] == pytest.approx(at_p.mean(), rel=1e-12, abs=1e-12)
        assert std[p] == pytest.approx(at_p.std(), rel=1e-6, abs=1e-9)   # E[x^2] - E[x]^2 cancels a little
    if window == "sliding":
        assert mean[ctx - 1] is None   # a sliding window reads at most ctx - 1 inputs


@pytest.mark.slow
@needs_matplotlib
def test_eval_plot_writes_a_png_of_the_expected_size(tmp_path, tokenizer_dir):
    text = tmp_path / "t.txt"
    text.write_text("Now is the winter of our discontent made glorious summer by this sun of York.\n" * 8)
    plot = tmp_path / "loss.png"
    rc = main(["eval", "--model", "random:gpt2-tiny", "--tokenizer", str(tokenizer_dir), "--data", str(text),
               "--ctx", "48", "--window", "sliding", "--device", "cpu", "--quiet", "--plot", str(plot)])
    assert rc == 0
    assert png_size(plot) == (800, 450)
    import matplotlib.image
    assert matplotlib.image.imread(str(plot)).shape[:2] == (450, 800)   # decodes, not just a header
    assert {p.name for p in tmp_path.iterdir()} == {"t.txt", "loss.png"}    # no temporary file left beside it


def test_plot_title_names_the_run():
    from fastppl.report.plot import run_title
    result = {"config": {"model": "/ckpt/tiny-gpt2", "data": ["../data/tinyshakespeare.txt"], "split": "val"},
              "window": "sliding", "ctx": 1024, "stride": 512, "dtype": "bfloat16"}
    assert run_title(result) == "tiny-gpt2 · tinyshakespeare.txt (val) · sliding ctx 1024 stride 512 · bfloat16"


def _empty_model_dir(tmp_path):
    """A model directory with no checkpoint in it: loading it would fail, after the output checks."""
    directory = tmp_path / "model-without-weights"
    directory.mkdir(exist_ok=True)
    return directory


@needs_matplotlib
@pytest.mark.parametrize("bad, message", [
    ("out.jpg", "ending in .png"), ("missing-dir/out.png", "does not exist"),
])
def test_bad_plot_path_fails_before_the_work(tmp_path, capsys, bad, message):
    rc = main(["eval", "--model", str(_empty_model_dir(tmp_path)), "--data", "nowhere.txt",
               "--plot", str(tmp_path / bad)])
    assert rc == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_without_matplotlib_plot_is_a_clean_error(tmp_path, capsys, monkeypatch):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")] + ["matplotlib"]:
        monkeypatch.setitem(sys.modules, name, None)   # None in sys.modules makes the import raise ImportError
    out, plot = tmp_path / "r.json", tmp_path / "p.png"
    # a model that would fail to load shows that the check comes before any work
    rc = main(["eval", "--model", str(_empty_model_dir(tmp_path)), "--data", "nowhere.txt", "--json", str(out),
               "--plot", str(plot)])
    assert rc == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("fastppl: error: --plot needs matplotlib") and "pip install matplotlib" in err
    assert len(err.splitlines()) == 1 and not out.exists() and not plot.exists()

    run = tmp_path / "a.json"
    run.write_text(json.dumps({"nll": 1.0, "ppl": 2.7, "tokens_scored": 5, "config": {"model": "m", "data": ["d"]}}))
    assert main(["compare", str(run), "--plot", str(plot)]) == 2
    assert "pip install matplotlib" in capsys.readouterr().err and not plot.exists()
