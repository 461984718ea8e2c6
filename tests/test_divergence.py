"""eval --reference-model against a brute-force reference: for every scored token, both models run on exactly the
tokens its window reads, a full float64 softmax over the vocabulary, and the statistics computed from their textbook
definitions; in every window mode and batching, each statistic within 1e-5 relative of fastppl's fp32 run (and every
token's values near those of the models run in float64 throughout). A model against itself diverges by exactly 0.
Plus the refusals, --per-token's columns, the summary, the figure, two ranks and the benchmark."""
import json
import math

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from fastppl.cli import main
from fastppl.config import EvalConfig
from fastppl.engine.divergence import COLUMNS
from fastppl.pipeline import evaluate
from fixtures.window_references import hf_guide_pairs, lm_eval_rolling_pairs

TEXT_CHARS = 700       # about 200 tokens: windows that do not divide evenly into the batches below
BOS = 50256
DOCS = ["The quick brown fox jumps over the lazy dog, and then the dog wakes up and chases the fox.", "A",
        "Call me Ishmael. Some years ago, never mind how long precisely, having little or no money in my purse.",
        "It is a truth universally acknowledged, that a single man in possession of a good fortune must be in want "
        "of a wife."]


@pytest.fixture(autouse=True)
def one_thread():
    """Thousands of tiny products: with several threads on a busy machine each waits on the others (200x slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def related_models(monkeypatch):
    """random:<preset> weights well above the 0.02 init (predictions far from uniform, so that an error shows),
    each seed's the same base plus its own perturbation: two seeds are two related models, as a model and its
    quantised or fine-tuned copy are."""
    import fastppl.models.loading as loading
    plain = loading.random_native

    def related(preset, seed=0, device="cpu"):
        model = plain(preset, 0, device)
        base, own = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1000 + seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" not in name and "ln" not in name:
                    p.copy_(torch.randn(p.shape, generator=base) * 0.1 + torch.randn(p.shape, generator=own) * 0.03)
        return model

    monkeypatch.setattr(loading, "random_native", related)
    return related


@pytest.fixture(scope="module")
def text(shakespeare) -> str:
    return shakespeare.read_text()[:TEXT_CHARS]


@pytest.fixture(scope="module")
def text_path(tmp_path_factory, text):
    path = tmp_path_factory.mktemp("divergence") / "slice.txt"
    path.write_text(text)
    return path


@pytest.fixture(scope="module")
def token_ids(tokenizer_dir, text) -> list[int]:
    return AutoTokenizer.from_pretrained(str(tokenizer_dir))(text)["input_ids"]


def _evaluate(tokenizer_dir, data, preset="gpt2-tiny", reference_seed=1, **kwargs) -> dict:
    settings = dict(device="cpu", dtype="fp32", quiet=True, per_token="unused.npy") | kwargs
    return evaluate(EvalConfig(model=f"random:{preset}", reference_model=f"random:{preset}",
                               reference_seed=reference_seed, data=[str(d) for d in data],
                               tokenizer=str(tokenizer_dir), **settings))


# ------------------------------------------------------------------------------------------------ brute force

def _float64_log_softmax(model, reads: list[list[int]]) -> torch.Tensor:
    """(len(reads), V) float64 log-probabilities of the token after each read: the model's forward over exactly
    that read, in its own dtype, then the last position's hidden state projected onto the vocabulary and normalised
    in float64 (every read's projection in one product, with the weights converted to float64 once)."""
    hidden = torch.stack([model(torch.tensor([read]))[0, -1] for read in reads]).double()      # (n, C)
    bias = model.lm_head.bias.double() if getattr(model.lm_head, "bias", None) is not None else None
    return torch.log_softmax(torch.nn.functional.linear(hidden, model.lm_head.weight.double(), bias), -1)  # (n, V)


def _brute_force_columns(models, stream: list[int], pairs, rows: int = 64) -> dict[int, list[float]]:
    """{stream index of the target: its COLUMNS}, each target predicted from stream[context_start:target] by a
    forward pass of both models over exactly those tokens and a full float64 softmax (`rows` targets at a time)."""
    model, reference = models
    columns = {}
    with torch.no_grad():
        for first in range(0, len(pairs), rows):
            block = pairs[first:first + rows]
            reads = [stream[start:target] for start, target in block]
            log_p, reference_log_p = (_float64_log_softmax(m, reads) for m in (model, reference))    # (n, V) each
            tokens = torch.tensor([[stream[target]] for _, target in block])                       # (n, 1)
            nll, reference_nll = (-x.gather(1, tokens)[:, 0] for x in (log_p, reference_log_p))
            kld = (reference_log_p.exp() * (reference_log_p - log_p)).sum(-1)
            same = (log_p.argmax(-1) == reference_log_p.argmax(-1)).double()
            delta_p = (-nll).exp() - (-reference_nll).exp()
            for i, (_, target) in enumerate(block):
                columns[target] = [float(nll[i]), float(reference_nll[i]), float(kld[i]), float(same[i]),
                                   float(delta_p[i])]
    return columns


def _percentile(values: np.ndarray, percent: float) -> float:
    """The linear interpolation between closest ranks, written out."""
    ordered = np.sort(values)
    rank = percent / 100 * (len(ordered) - 1)
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return float(ordered[low] + (rank - low) * (ordered[high] - ordered[low]))


def _mean_and_error(values: np.ndarray) -> tuple[float, float]:
    """llama.cpp's: the mean, and sqrt((mean of squares - square of mean) / (n - 1))."""
    n = len(values)
    mean = sum(values) / n
    return mean, math.sqrt((sum(values * values) / n - mean * mean) / (n - 1))


def _brute_force_statistics(columns: np.ndarray) -> dict:
    nll, reference_nll, kld, same, delta_p = columns.T
    expected = {"tokens": len(kld), "ppl": math.exp(nll.sum() / len(nll)),
                "reference_ppl": math.exp(reference_nll.sum() / len(nll)), "kld_max": kld.max(), "kld_min": kld.min(),
                "kld_median": _percentile(kld, 50), "delta_p_min": delta_p.min(), "delta_p_max": delta_p.max(),
                "delta_p_rms": math.sqrt(sum(delta_p * delta_p) / len(delta_p))}
    expected["nll"], expected["reference_nll"] = nll.sum() / len(nll), reference_nll.sum() / len(nll)
    for mean, error, values in (("kld_mean", "kld_mean_error", kld), ("same_top1", "same_top1_error", same),
                                ("delta_p_mean", "delta_p_mean_error", delta_p),
                                ("ln_ppl_ratio", "ln_ppl_ratio_error", nll - reference_nll)):
        expected[mean], expected[error] = _mean_and_error(values)
    expected["ppl_ratio"] = expected["ppl"] / expected["reference_ppl"]
    expected["ppl_ratio_error"] = expected["ppl_ratio"] * expected["ln_ppl_ratio_error"]
    for p in (50, 90, 95, 99, 99.9):
        expected[f"kld_p{p:g}"] = _percentile(kld, p)
    for p in (0.1, 1, 5, 10, 25, 50, 75, 90, 95, 99, 99.9):
        expected[f"delta_p_p{p:g}"] = _percentile(delta_p, p)
    return expected


def _models(related_models, preset, dtype=torch.float32):
    return [related_models(preset, seed).to(dtype).eval() for seed in (0, 1)]


def _stream_and_pairs(ids: list[int], window: str, ctx: int, stride, bos: bool):
    """The document's stream, its (context_start, target) pairs, and the token index of stream index j."""
    if window == "chunked":
        return [BOS] + ids, lm_eval_rolling_pairs(len(ids), ctx), 1
    stream = [BOS] + ids if bos else ids
    return stream, hf_guide_pairs(len(stream), ctx, stride), 1 if bos else 0


def _assert_statistics(result: dict, expected: dict) -> None:
    d = result["divergence"]
    largest_p = float(np.exp(-np.nanmin(result.per_token[:, :2])))   # the likeliest target of either model
    for name, value in expected.items():
        # fastppl's batched fp32 forward and the brute force's one-read-at-a-time fp32 forward sum in other orders
        # (other BLAS kernels, other CPUs), so an NLL near 11 may differ by ~10 of its ulps (~1e-5 absolute): the
        # statistics are held to FP32_REL, and those that are differences of NLLs (KLD, ln PPL ratio), which may
        # nearly cancel, to 1e-5 absolute. Δp is a difference of two probabilities p = exp(-nll), each within
        # ~1e-5 relative, so it is held to 2e-5 of the larger p
        floor = 2e-5 * largest_p if name.startswith("delta_p") else 1e-5
        assert d[name] == pytest.approx(value, rel=FP32_REL, abs=floor), name
    assert result["ppl"] == pytest.approx(expected["ppl"], rel=FP32_REL)


# fp32 NLLs, KLDs and their sums from forward passes batched differently: 1e-5 relative, ~10 ulps of fp32 (an
# error of batching or windows moves them by orders of magnitude more)
FP32_REL = 1e-5

CASES = [   # window, ctx, stride, bos, batch size, preset
    ("chunked", 32, None, False, 3, "gpt2-tiny"),
    ("sliding", 32, 12, False, 4, "gpt2-tiny"),
    ("sliding", 24, 24, True, 5, "gpt2-tiny"),
    ("chunked", 40, None, False, 2, "llama-tiny"),
]


@pytest.mark.slow   # float64 brute force over every window
@pytest.mark.parametrize("window, ctx, stride, bos, batch_size, preset", CASES)
def test_every_statistic_equals_the_float64_brute_force(related_models, tokenizer_dir, text_path, token_ids,
                                                        window, ctx, stride, bos, batch_size, preset):
    result = _evaluate(tokenizer_dir, [text_path], preset, window=window, ctx=ctx, stride=stride, bos=bos,
                       batch_size=batch_size)
    stream, pairs, offset = _stream_and_pairs(token_ids, window, ctx, stride, bos)
    expected_columns, float64_columns = (np.full((len(token_ids), len(COLUMNS)), np.nan) for _ in range(2))
    for dtype, into in ((torch.float32, expected_columns), (torch.float64, float64_columns)):
        for target, columns in _brute_force_columns(_models(related_models, preset, dtype), stream, pairs).items():
            into[target - offset] = columns
    per_token = result.per_token
    assert per_token.shape == expected_columns.shape and per_token.dtype == np.float32
    np.testing.assert_array_equal(np.isnan(per_token), np.isnan(expected_columns))   # the same tokens scored
    np.testing.assert_allclose(per_token, expected_columns, rtol=FP32_REL, atol=1e-7)
    # and the fp32 forward passes themselves: every value near that of float64 models
    np.testing.assert_allclose(per_token, float64_columns, rtol=2e-5, atol=1e-8)
    expected = _brute_force_statistics(expected_columns[~np.isnan(expected_columns[:, 0])])
    assert 0.05 < expected["kld_mean"] < 5 and 0 < expected["same_top1"] < 1   # a divergence worth measuring
    _assert_statistics(result, expected)


@pytest.mark.slow   # float64 brute force over every window
@pytest.mark.parametrize("batching", ["packed", "bucketed"])
def test_documents_packed_or_bucketed_equal_the_brute_force(related_models, tokenizer_dir, tmp_path, batching):
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    result = _evaluate(tokenizer_dir, [docs], ctx=16, batching=batching, batch_size=3)
    assert result["batching"] == batching
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    models = _models(related_models, "gpt2-tiny")
    expected_columns = []
    for doc in DOCS:
        ids = tokenizer(doc)["input_ids"]
        by_target = _brute_force_columns(models, [BOS] + ids, lm_eval_rolling_pairs(len(ids), 16))
        expected_columns += [by_target[j + 1] for j in range(len(ids))]
    expected_columns = np.array(expected_columns)
    np.testing.assert_allclose(result.per_token, expected_columns, rtol=FP32_REL, atol=1e-7)
    _assert_statistics(result, _brute_force_statistics(expected_columns))


@pytest.mark.slow
def test_kld_by_position_is_the_mean_at_each_position(related_models, tokenizer_dir, text_path, token_ids):
    result = _evaluate(tokenizer_dir, [text_path], ctx=32, batch_size=3)
    pairs = lm_eval_rolling_pairs(len(token_ids), 32)
    kld = result.per_token[:, COLUMNS.index("kld")].astype(np.float64)
    positions = np.array([target - start - 1 for start, target in pairs])   # tokens read before the target, - 1
    expected = [kld[positions == p].mean() for p in range(32)]
    assert result["divergence"]["kld_by_position"] == pytest.approx(expected, rel=1e-9)
    histogram = result["divergence"]["kld_histogram"]
    assert sum(histogram["counts"]) + histogram["at_most_zero"] == len(token_ids)


@pytest.mark.parametrize("window, stride", [("chunked", None), pytest.param("sliding", 10, marks=pytest.mark.slow)])
def test_a_model_against_itself_diverges_by_exactly_zero(related_models, tokenizer_dir, text_path, window, stride):
    result = _evaluate(tokenizer_dir, [text_path], reference_seed=0, ctx=32, batch_size=3, window=window,
                       stride=stride)
    d = result["divergence"]
    assert d["kld_mean"] == 0.0 and d["kld_max"] == 0.0 and d["kld_min"] == 0.0
    assert d["same_top1"] == 1.0 and d["delta_p_rms"] == 0.0 and d["ppl_ratio"] == 1.0 and d["ln_ppl_ratio"] == 0.0
    assert d["kld_histogram"] == {"edges": [], "counts": [], "at_most_zero": d["tokens"]}


@pytest.mark.slow
def test_transformers_backend_gives_the_native_divergence(related_models, tokenizer_dir, tmp_path):
    """--backend hf: both models through transformers (whose forward keeps no packed documents apart, so several
    documents run bucketed), the same statistics as the native models."""
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    native, hf = (_evaluate(tokenizer_dir, [docs], ctx=16, batch_size=3, backend=backend)
                  for backend in ("native", "hf"))
    assert hf["backend"].startswith("transformers") and hf["batching"] == "bucketed"
    for name, value in native["divergence"].items():
        if isinstance(value, float) and not name.startswith("delta_p"):
            assert hf["divergence"][name] == pytest.approx(value, rel=1e-5, abs=1e-9), name


@pytest.mark.slow
def test_batch_size_does_not_change_the_divergence(related_models, tokenizer_dir, text_path):
    one, many = (_evaluate(tokenizer_dir, [text_path], ctx=32, batch_size=b)["divergence"] for b in (1, 7))
    for name, value in one.items():
        if isinstance(value, float):
            assert many[name] == pytest.approx(value, rel=1e-6, abs=1e-12), name


# ------------------------------------------------------------------------------------------------ the command

def _cli(tokenizer_dir, data, *extra) -> int:
    return main(["eval", "--model", "random:gpt2-tiny", "--tokenizer", str(tokenizer_dir), "--data", str(data),
                 "--device", "cpu", "--ctx", "32", "--quiet", *extra])


@pytest.mark.slow
def test_command_writes_columns_json_summary_and_figure(tmp_path, tokenizer_dir, text_path, capsys):
    pytest.importorskip("matplotlib")
    out = {name: tmp_path / name for name in ("r.json", "t.npy", "kld.png")}
    assert _cli(tokenizer_dir, text_path, "--reference-model", "random:gpt2-tiny", "--reference-seed", "3",
                "--json", str(out["r.json"]), "--per-token", str(out["t.npy"]), "--plot", str(out["kld.png"])) == 0
    stdout = capsys.readouterr().out
    for line in ("reference   random:gpt2-tiny", "kld         mean", "same top-1", "delta p     mean"):
        assert line in stdout
    result = json.loads(out["r.json"].read_text())
    columns = np.load(out["t.npy"])
    assert columns.shape == (result["tokens_total"], len(COLUMNS))
    assert result["divergence"]["reference_seed"] == 3 and result["config"]["reference_model"] == "random:gpt2-tiny"
    assert np.nansum(columns[:, 0].astype(np.float64)) == pytest.approx(result["nll_sum"], rel=1e-9)
    assert out["kld.png"].read_bytes()[:4] == b"\x89PNG"


def test_nproc_refuses_a_reference_device_before_starting_torchrun(tmp_path, tokenizer_dir, text_path, capsys,
                                                                    monkeypatch):
    import fastppl.distributed as distributed
    monkeypatch.setattr(distributed, "relaunch_under_torchrun", lambda *a: pytest.fail("torchrun was started"))
    assert _cli(tokenizer_dir, text_path, "--reference-model", "random:gpt2-tiny", "--reference-device", "cpu",
                "--nproc", "2") == 2
    assert capsys.readouterr().err == ("fastppl: error: --reference-device runs in one process only; drop it or run "
                                       "without --nproc / torchrun\n")


@pytest.mark.parametrize("extra, message", [
    (["--reference-model", "random:llama-tiny"],
     "--reference-model random:llama-tiny has a vocabulary of 50,304 ids but --model random:gpt2-tiny has 50,257; "
     "compare two models of one tokenizer and vocabulary"),
    (["--reference-model", " "],
     "--reference-model is empty; give a checkpoint directory, a hub id or random:<preset>"),
    (["--reference-seed", "2"],
     "--reference-seed applies with --reference-model only; add --reference-model or drop it"),
    (["--reference-device", "cpu"],
     "--reference-device applies with --reference-model only; add --reference-model or drop it"),
    (["--reference-model", "random:gpt2-tiny", "--reference-device", "tpu"],
     "unknown --reference-device 'tpu'; use auto, cpu, cuda or cuda:N"),
    (["--reference-model", "random:gpt2-tiny", "--loss", "fused"],
     "--loss fused does not work with --reference-model (both models' divergence runs its own chunked kernel over "
     "every position); drop --loss fused"),
    (["--reference-model", "random:gpt2-tiny", "--kv-cache", "on", "--window", "sliding"],
     "--kv-cache on does not work with --reference-model (both models read the planned windows whole, and cached "
     "windows read only their new tokens); drop --kv-cache on"),
])
def test_refusals_are_one_line(tmp_path, tokenizer_dir, text_path, capsys, monkeypatch, extra, message):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "r.json"
    assert _cli(tokenizer_dir, text_path, "--json", str(out), *extra) == 2
    captured = capsys.readouterr()
    assert captured.err == f"fastppl: error: {message}\n" and captured.out == ""
    assert not out.exists() and not (tmp_path / "ckpt").exists()


# ------------------------------------------------------------------------------------------------ two processes

@pytest.mark.slow
def test_two_ranks_equal_one_process(tmp_path, tokenizer_dir, text_path):
    """Each rank scores its share of the batches; the per-token values are merged before any statistic, so two
    gloo processes on the CPU give rank 0 the one process' report and columns, bit for bit."""
    from test_distributed import run_cli_jobs_on_two_ranks
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    common = ["--model", "random:gpt2-tiny", "--reference-model", "random:gpt2-tiny", "--reference-seed", "1",
              "--tokenizer", str(tokenizer_dir), "--device", "cpu", "--quiet"]
    cases = {"chunked": ["--data", str(text_path), "--ctx", "32", "--batch-size", "3"],
             "sliding": ["--data", str(text_path), "--window", "sliding", "--ctx", "32", "--stride", "12"],
             "docs": ["--data", str(docs), "--ctx", "16", "--batch-size", "2"]}
    outputs = lambda where, name: ["--json", str(where / f"{name}.json"), "--per-token", str(where / f"{name}.npy")]  # noqa: E731
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir()
    two.mkdir()
    for name, argv in cases.items():
        assert main(["eval", *common, *argv, *outputs(one, name)]) == 0
    run_cli_jobs_on_two_ranks([(["eval", *common, *argv, *outputs(two, name)], 0) for name, argv in cases.items()],
                              tmp_path, timeout=300)
    for name in cases:
        a, b = (json.loads((where / f"{name}.json").read_text()) for where in (one, two))
        assert b["world_size"] == 2 and a["divergence"]["tokens"] == a["tokens_scored"]
        assert b["divergence"] == a["divergence"], name   # percentiles, histogram and KLD by position included
        np.testing.assert_array_equal(np.load(one / f"{name}.npy"), np.load(two / f"{name}.npy"))


@pytest.mark.slow   # a process of its own
def test_the_benchmark_runs_tiny_on_the_cpu(tmp_path, tokenizer_dir, text_path):
    """benchmarks/divergence.py: the three variants on the same tokens, their table, and the peer's stored
    log-probabilities (2 bytes per vocabulary entry per scored token) giving the one pass' mean KLD to fp16's
    precision."""
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, str(root / "benchmarks" / "divergence.py"), "--model", "gpt2-tiny",
                           "--device", "cpu", "--ctx", "32", "--data", str(text_path), "--split", "all",
                           "--tokenizer", str(tokenizer_dir), "--logits-dir", str(tmp_path)],
                          env={**__import__("os").environ, "PYTHONPATH": str(root / "src"), "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [[cell.strip() for cell in line.split("|")[1:-1]] for line in done.stdout.splitlines()
             if line.startswith("| ") and "---" not in line]
    header, rows = lines[0], {cells[0]: dict(zip(lines[0], cells)) for cells in lines[1:]}
    assert header[:4] == ["variant", "tokens", "tokens/s", "x single-model eval"]
    single, together, peer = (rows[name] for name in ("fastppl eval (model alone)", "fastppl eval --reference-model",
                                                      "stored logits (two runs, fp16 on disk)"))
    assert single["tokens"] == together["tokens"] == peer["tokens"]                 # the same tokens scored
    # fp16 log-probabilities: 3 digits
    assert float(peer["mean KLD"]) == pytest.approx(float(together["mean KLD"]), rel=1e-3)
    n_tokens = int(peer["tokens"].replace(",", ""))
    assert float(peer["stored GiB"]) == pytest.approx(n_tokens * 50257 * 2 / 2**30, abs=0.006)
    assert not list(tmp_path.iterdir())                                     # the peer's file removed


def test_a_chunk_holds_at_most_its_stated_working_set():
    """chunked_divergence's allocations, traced by the profiler on the CPU: one chunk of GPT-2's vocabulary peaks at
    WORKING_SET_TENSORS (rows, V) fp32 tensors (both models' logits and a block of rows' exp and float64 copy).
    With whole-chunk sums, torch.sum(dtype=float64)'s float64 copy of its input made it 5.2."""
    from torch.profiler import ProfilerActivity, profile
    from fastppl.engine.divergence import WORKING_SET_TENSORS, chunked_divergence
    rows, width, vocabulary = 64, 16, 50257
    generator = torch.Generator().manual_seed(0)
    hidden, reference_hidden = (torch.randn(rows, width, generator=generator) for _ in range(2))
    weight, reference_weight = (torch.randn(vocabulary, width, generator=generator) for _ in range(2))
    targets = torch.randint(0, vocabulary, (rows,), generator=generator)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
        chunked_divergence(hidden, weight, reference_hidden, reference_weight, targets, chunk_rows=rows)
    events = sorted((e for e in profiler.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    live = peak = 0
    for event in events:   # allocations count positive, frees negative
        live += event.nbytes()
        peak = max(peak, live)
    logits_bytes = rows * vocabulary * 4
    assert peak / logits_bytes == pytest.approx(WORKING_SET_TENSORS, abs=0.05)


# ------------------------------------------------------------------------------------------------ on a GPU

needs_a_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@pytest.mark.gpu
@needs_a_gpu
@pytest.mark.parametrize("window, stride", [("chunked", None), ("sliding", 12)])
def test_on_the_gpu_the_divergence_gives_the_cpu_statistics(related_models, tokenizer_dir, text_path, window, stride):
    """fp32 on CUDA against fp32 on the CPU: the same statistics up to the two devices' products (1e-5 relative)."""
    on_cpu, on_gpu = (_evaluate(tokenizer_dir, [text_path], ctx=32, batch_size=3, window=window, stride=stride,
                                device=device) for device in ("cpu", "cuda"))
    assert on_gpu["loss"] == "chunked projection, divergence in torch"
    for name, value in on_cpu["divergence"].items():
        if isinstance(value, float) and not name.startswith("delta_p"):
            assert on_gpu["divergence"][name] == pytest.approx(value, rel=1e-5, abs=1e-9), name
    itself = _evaluate(tokenizer_dir, [text_path], reference_seed=0, ctx=32, device="cuda", dtype="bf16")
    assert itself["divergence"]["kld_max"] == 0.0 and itself["divergence"]["same_top1"] == 1.0


@pytest.mark.gpu
@needs_a_gpu
def test_on_the_gpu_peak_memory_is_two_models_and_one_run(tokenizer_dir, shakespeare):
    """GPT-2 124M shapes in bf16, 16 rows of 1024: the divergence run's peak above both models' weights is at most
    what it must hold beside them, each part measured on this GPU rather than assumed: a single-model run's
    activations (its peak above its weights: the forward, the loss, the allocator's and the libraries' own), both
    models' final hidden states of a batch (bf16), and one chunk's divergence working set (chunked_divergence on one
    chunk alone, which must stay within WORKING_SET_TENSORS fp32 logit tensors); plus a quarter of the activations
    for what the two runs place differently (allocator rounding, the per-token divergence table). A (B, T, V)
    tensor (3.3 GB here) or chunks of 2 ** 26 logits (1.5 GB) break it; a bound in bytes would hold on one card
    only."""
    from fastppl.engine.divergence import CHUNK_LOGITS, WORKING_SET_TENSORS, chunked_divergence
    from fastppl.models.loading import random_gpt2
    model = random_gpt2("gpt2", 0)
    weights = sum(p.numel() for p in model.parameters()) * 2   # bf16
    rows, vocabulary, width = CHUNK_LOGITS // model.vocab_size, model.vocab_size, model.config.n_embd
    hidden_states = 2 * 16 * 1024 * width * 2
    common = dict(model="random:gpt2", data=[str(shakespeare)], split="val", tokenizer=str(tokenizer_dir),
                  device="cuda", dtype="bf16", ctx=1024, batch_size=16, quiet=True)
    single = evaluate(EvalConfig(**common))
    both = evaluate(EvalConfig(**common, reference_model="random:gpt2", reference_seed=1))

    def chunk_working_set() -> int:
        weight = torch.randn(vocabulary, width, device="cuda", dtype=torch.bfloat16)
        hidden = torch.randn(rows, width, device="cuda", dtype=torch.bfloat16)
        targets = torch.randint(0, vocabulary, (rows,), device="cuda")
        chunked_divergence(hidden, weight, hidden, weight, targets, chunk_rows=rows)   # cuBLAS's first-call state
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        chunked_divergence(hidden, weight, hidden, weight, targets, chunk_rows=rows)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base

    chunk = chunk_working_set()
    activations = single["peak_memory_bytes"] - weights
    above = both["peak_memory_bytes"] - 2 * weights
    parts = (f"peak above both weights {above / 1e9:.3f} GB; activations {activations / 1e9:.3f}, hidden states "
             f"{hidden_states / 1e9:.3f}, chunk {chunk / 1e9:.3f} GB ({rows} rows)")
    assert chunk <= (WORKING_SET_TENSORS + 0.1) * rows * vocabulary * 4, parts
    assert above <= 1.25 * activations + hidden_states + chunk, parts


@pytest.mark.gpu
@needs_a_gpu
def test_a_reference_on_a_device_of_its_own_gives_the_same_divergence(related_models, tokenizer_dir, tmp_path):
    """--reference-device: the reference's forward on its device (here the CPU beside the GPU, as a second GPU
    would be), its hidden states brought to the model's; the same statistics as both on the GPU, packed rows
    included."""
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    together, apart = (_evaluate(tokenizer_dir, [docs], ctx=16, batching="packed", batch_size=3, device="cuda",
                                 reference_device=where) for where in (None, "cpu"))
    for name, value in together["divergence"].items():
        if isinstance(value, float) and not name.startswith("delta_p"):
            assert apart["divergence"][name] == pytest.approx(value, rel=1e-5, abs=1e-9), name
