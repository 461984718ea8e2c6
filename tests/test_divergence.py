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


# thousands of tiny products: with several threads on a busy machine each waits on the others (200x slower)
pytestmark = pytest.mark.usefixtures("one_thread")


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
            p, reference_p = log_p.exp(), reference_log_p.exp()
            kld = (reference_p * (reference_log_p - log_p)).sum(-1)
            reverse_kld = (p * (log_p - reference_log_p)).sum(-1)
            entropy, reference_entropy = (-(x.exp() * x).sum(-1) for x in (log_p, reference_log_p))
            same = (log_p.argmax(-1) == reference_log_p.argmax(-1)).double()
            delta_p = (-nll).exp() - (-reference_nll).exp()
            target_log_p = log_p.gather(1, tokens)
            ids = torch.arange(log_p.shape[1])
            rank = ((log_p > target_log_p) | ((log_p == target_log_p) & (ids < tokens))).sum(-1).double()
            top, reference_top = log_p.topk(10).indices, reference_log_p.topk(10).indices
            overlaps = [[len(set(top[i, :k].tolist()) & set(reference_top[i, :k].tolist())) / k for k in (5, 10)]
                        for i in range(len(block))]
            for i, (_, target) in enumerate(block):
                columns[target] = [float(nll[i]), float(reference_nll[i]), float(kld[i]), float(same[i]),
                                   float(delta_p[i]), float(reverse_kld[i]), float(entropy[i]),
                                   float(reference_entropy[i]), float(rank[i]), float(reference_p[i].max()),
                                   *overlaps[i]]
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
    """Every statistic from its definition: llama.cpp's perplexity.cpp (tools/perplexity) where it has one."""
    c = dict(zip(COLUMNS, columns.T))
    nll, reference_nll, kld, delta_p = c["nll"], c["reference_nll"], c["kld"], c["delta_p"]
    n = len(kld)
    expected = {"tokens": n, "ppl": math.exp(nll.sum() / n), "reference_ppl": math.exp(reference_nll.sum() / n),
                "target_top1": float(np.mean(c["target_rank"] == 0)),
                "entropy_mean": c["entropy"].sum() / n, "reference_entropy_mean": c["reference_entropy"].sum() / n,
                "delta_p_rms": math.sqrt(sum(delta_p * delta_p) / n)}
    expected["nll"], expected["reference_nll"] = nll.sum() / n, reference_nll.sum() / n
    for mean, error, values in (("same_top1", "same_top1_error", c["same_top1"]),
                                ("top5_overlap", "top5_overlap_error", c["top5_overlap"]),
                                ("top10_overlap", "top10_overlap_error", c["top10_overlap"]),
                                ("ln_ppl_ratio", "ln_ppl_ratio_error", nll - reference_nll)):
        expected[mean], expected[error] = _mean_and_error(values)
    for name, percents in (("kld", (0.1, 1, 5, 10, 50, 90, 95, 99, 99.9)),
                           ("reverse_kld", (50, 99)), ("delta_p", (0.1, 1, 5, 10, 25, 50, 75, 90, 95, 99, 99.9))):
        values = c[name]
        expected[f"{name}_mean"], expected[f"{name}_mean_error"] = _mean_and_error(values)
        expected[f"{name}_min"], expected[f"{name}_max"] = values.min(), values.max()
        ordered = np.sort(values)   # llama.cpp's median: the middle value, or the mean of the middle two
        expected[f"{name}_median"] = (ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2)
        for p in percents:
            expected[f"{name}_p{p:g}"] = _percentile(values, p)
    # llama.cpp: se of each ln PPL, their covariance (Σab/n - mean a mean b) / (n - 1), the ratio's error from both
    (_, se), (_, reference_se) = _mean_and_error(nll), _mean_and_error(reference_nll)
    covariance = (sum(nll * reference_nll) / n - nll.mean() * reference_nll.mean()) / (n - 1)
    expected["ln_ppl_ratio_error"] = math.sqrt(se * se + reference_se * reference_se - 2 * covariance)
    expected["ppl_error"] = expected["ppl"] * se
    expected["reference_ppl_error"] = expected["reference_ppl"] * reference_se
    expected["ppl_ratio"] = expected["ppl"] / expected["reference_ppl"]
    expected["ppl_ratio_error"] = expected["ppl_ratio"] * expected["ln_ppl_ratio_error"]
    expected["ppl_difference"] = expected["ppl"] - expected["reference_ppl"]
    expected["ppl_difference_error"] = math.sqrt(expected["ppl_error"] ** 2 + expected["reference_ppl_error"] ** 2
                                                 - 2 * expected["ppl"] * expected["reference_ppl"] * covariance)
    r = covariance / (se * reference_se)
    expected["ln_ppl_correlation"], expected["ln_ppl_correlation_error"] = r, (1 - r * r) / math.sqrt(n - 3)
    _, square_error = _mean_and_error(delta_p * delta_p)
    expected["delta_p_rms_error"] = 0.5 / expected["delta_p_rms"] * square_error
    expected["target_rank_median"] = float(np.median(c["target_rank"]))
    edges = [i / 10 for i in range(11)]
    expected["kld_by_confidence"] = []
    for low, high in zip(edges, edges[1:]):
        inside = kld[(c["reference_top1_p"] >= low) & ((c["reference_top1_p"] < high) | (high == 1.0))]
        expected["kld_by_confidence"].append({"low": low, "high": high, "tokens": len(inside),
                                              "kld_mean": inside.mean() if len(inside) else None,
                                              "kld_share": inside.sum() / kld.sum()})
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
        if name == "kld_by_confidence":
            assert [b["tokens"] for b in d[name]] == [b["tokens"] for b in value]
            for got, want in zip(d[name], value):
                assert (got["kld_mean"] is None) == (want["kld_mean"] is None)
                if want["kld_mean"] is not None:
                    assert got["kld_mean"] == pytest.approx(want["kld_mean"], rel=FP32_REL, abs=1e-5)
                    assert got["kld_share"] == pytest.approx(want["kld_share"], rel=FP32_REL, abs=1e-5)
            continue
        # fastppl's batched fp32 forward and the brute force's one-read-at-a-time fp32 forward sum in other orders
        # (other BLAS kernels, other CPUs), so an NLL near 11 may differ by ~10 of its ulps (~1e-5 absolute): the
        # statistics are held to FP32_REL, and those that are differences of NLLs (KLD, ln PPL ratio), which may
        # nearly cancel, to 1e-5 absolute. Δp is a difference of two probabilities p = exp(-nll), each within
        # ~1e-5 relative, so it is held to 2e-5 of the larger p; the median rank to 1 (fp32 near-ties)
        floor = 2e-5 * largest_p if name.startswith("delta_p") else 1 if name == "target_rank_median" else 1e-5
        assert d[name] == pytest.approx(value, rel=FP32_REL, abs=floor), name
    assert result["ppl"] == pytest.approx(expected["ppl"], rel=FP32_REL)
    assert d["per_token_columns"] == list(COLUMNS)


RANK = COLUMNS.index("target_rank")


def _assert_columns_close(per_token: np.ndarray, expected: np.ndarray, rtol: float, atol: float) -> None:
    """Every column within the tolerance, but the target's rank within 1: an id whose logit is within the fp32
    product's rounding of the target's (1e-6) may fall on either side of it."""
    others = [i for i in range(len(COLUMNS)) if i != RANK]
    np.testing.assert_allclose(per_token[:, others], expected[:, others], rtol=rtol, atol=atol)
    np.testing.assert_allclose(per_token[:, RANK], expected[:, RANK], rtol=0, atol=1)


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
    _assert_columns_close(per_token, expected_columns, rtol=FP32_REL, atol=1e-7)
    # and the fp32 forward passes themselves: every value near that of float64 models
    _assert_columns_close(per_token, float64_columns, rtol=2e-5, atol=1e-8)
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
    _assert_columns_close(result.per_token, expected_columns, rtol=FP32_REL, atol=1e-7)
    _assert_statistics(result, _brute_force_statistics(expected_columns))


@pytest.mark.slow   # float64 brute force over every window
def test_each_group_has_the_brute_force_statistics_of_its_documents(related_models, tokenizer_dir, tmp_path):
    """--group-by: each group's statistics are the brute force's over its own documents' tokens. A group of a few
    dozen tokens averages out little of the fp32 NLLs' rounding (~5e-8 nats each), which the difference of the two
    models' mean NLLs (~0.05) holds: those to 1e-5."""
    docs = tmp_path / "docs.jsonl"
    groups = ["fable", "novel", "novel", "fable"]
    docs.write_text("".join(json.dumps({"text": d, "kind": g}) + "\n" for d, g in zip(DOCS, groups)))
    result = _evaluate(tokenizer_dir, [docs], ctx=16, batch_size=3, group_by="kind")
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    models = _models(related_models, "gpt2-tiny")
    by_group = {}
    for doc, group in zip(DOCS, groups):
        ids = tokenizer(doc)["input_ids"]
        by_target = _brute_force_columns(models, [BOS] + ids, lm_eval_rolling_pairs(len(ids), 16))
        by_group.setdefault(group, []).extend(by_target[j + 1] for j in range(len(ids)))
    assert sorted(result["divergence"]["groups"]) == ["fable", "novel"]
    for group, columns in by_group.items():
        expected = _brute_force_statistics(np.array(columns))
        _assert_same_statistics(result["divergence"]["groups"][group], expected, rel=FP32_REL, differences_rel=1e-5)


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
    assert d["delta_p_rms_error"] == 0.0   # exact, not 0 / 0 (printed "± nan")
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


def _assert_same_statistics(d: dict, expected: dict, rel: float, differences_rel: float = 0.0) -> None:
    """Every float statistic within rel (Δp's to 1e-6 of the probabilities, the rank's median within 1, the two
    models' NLL differences within differences_rel where that is larger), and every confidence bucket's count;
    statistics the run did not compute (None) are left out."""
    for name, value in expected.items():
        if isinstance(value, float) and d[name] is not None:
            floor = 1e-6 if name.startswith("delta_p") else 1 if name == "target_rank_median" else 1e-9
            within = max(rel, differences_rel) if name.startswith(("ln_ppl_ratio", "ppl_difference")) else rel
            assert d[name] == pytest.approx(value, rel=within, abs=floor), name
    assert [b["tokens"] for b in d["kld_by_confidence"]] == [b["tokens"] for b in expected["kld_by_confidence"]]


@pytest.mark.slow   # the kernel in Triton's interpreter
def test_the_fused_divergence_kernel_in_a_run_gives_the_chunked_statistics(related_models, tokenizer_dir, text_path,
                                                                           monkeypatch):
    """The scorer of fused_divergence_enabled (CUDA), run here in Triton's interpreter: every statistic within
    1e-5 relative of the chunked path's, the top-k overlaps not computed (None), and the report saying so. Wide
    vocabulary tiles: the interpreter's time goes by the tile (the default tiles took 16 minutes here)."""
    pytest.importorskip("triton")
    import os
    import fastppl.accel.apply as apply
    import fastppl.engine.fused_divergence as fused_divergence
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs TRITON_INTERPRET=1 on a machine without a GPU")
    chunked = _evaluate(tokenizer_dir, [text_path], ctx=32, batch_size=4)
    monkeypatch.setattr(apply, "fused_divergence_enabled", lambda device: True)
    monkeypatch.setenv("FASTPPL_FUSED_DIVERGENCE", "1")   # the kernel in fp32, which auto leaves to the chunked path
    monkeypatch.setattr(fused_divergence, "fused_divergence_op", lambda *args: fused_divergence.fused_divergence(
        *args, block_m=64, block_n=4096, block_k=64))
    fused = _evaluate(tokenizer_dir, [text_path], ctx=32, batch_size=4)
    assert fused["loss"] == "fused divergence kernel (Triton)" and chunked["loss"].startswith("chunked")
    d = fused["divergence"]
    assert d["top5_overlap"] is None and d["top10_overlap"] is None and chunked["divergence"]["top5_overlap"] > 0
    assert "FASTPPL_FUSED_DIVERGENCE=0" in d["top_k_overlap_not_computed"]
    _assert_same_statistics(d, chunked["divergence"], rel=1e-5)


def test_fused_divergence_is_for_cuda_and_can_be_turned_off(monkeypatch):
    from fastppl.accel.apply import fused_divergence_enabled
    assert not fused_divergence_enabled(torch.device("cpu"))
    monkeypatch.setattr("fastppl.accel.apply.fused_loss_available", lambda device: True)
    assert fused_divergence_enabled(torch.device("cuda"))
    monkeypatch.setenv("FASTPPL_FUSED_DIVERGENCE", "0")
    assert not fused_divergence_enabled(torch.device("cuda"))


def test_the_fused_divergence_runs_in_16_bit_and_fp32_takes_the_chunked_path_with_its_reason(monkeypatch):
    from fastppl.accel.apply import CHUNKED_DIVERGENCE, FUSED_DIVERGENCE, divergence_path
    cuda = torch.device("cuda")
    assert divergence_path(torch.device("cpu"), torch.bfloat16) == (False, CHUNKED_DIVERGENCE)
    monkeypatch.setattr("fastppl.accel.apply.fused_loss_available", lambda device: True)
    assert divergence_path(cuda, torch.bfloat16) == divergence_path(cuda, torch.float16) == (True, FUSED_DIVERGENCE)
    fused, loss = divergence_path(cuda, torch.float32)
    assert not fused and loss.startswith(CHUNKED_DIVERGENCE) and "auto: fp32" in loss
    monkeypatch.setenv("FASTPPL_FUSED_DIVERGENCE", "1")
    assert divergence_path(cuda, torch.float32) == (True, FUSED_DIVERGENCE)
    monkeypatch.setenv("FASTPPL_FUSED_DIVERGENCE", "0")
    assert divergence_path(cuda, torch.bfloat16) == (False, CHUNKED_DIVERGENCE)


def test_an_fp32_run_where_the_fused_kernel_could_run_says_why_it_ran_the_chunked_path(tokenizer_dir, text_path,
                                                                                        monkeypatch):
    """The kernel available (as on CUDA) and the run in fp32: the chunked path runs, its reason in the report's loss,
    and the top-k overlaps it computes are in the report."""
    monkeypatch.setattr("fastppl.accel.apply.fused_loss_available", lambda device: True)
    report = _evaluate(tokenizer_dir, [text_path], ctx=32, batch_size=4)
    assert report["loss"].startswith("chunked projection, divergence in torch (auto: fp32")
    assert report["divergence"]["top5_overlap"] > 0 and "top_k_overlap_not_computed" not in report["divergence"]


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
     "--loss fused does not work with --reference-model (both models' divergence runs its own kernel); drop "
     "--loss fused"),
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
@pytest.mark.parametrize("fused", [True, False])
def test_on_the_gpu_the_divergence_gives_the_cpu_statistics(related_models, tokenizer_dir, text_path, window, stride,
                                                            fused, monkeypatch):
    """fp32 on CUDA (the fused kernel with FASTPPL_FUSED_DIVERGENCE=1, or the chunked path) against fp32 on the
    CPU: the same statistics up to the two devices' products (1e-5 relative)."""
    on_cpu = _evaluate(tokenizer_dir, [text_path], ctx=32, batch_size=3, window=window, stride=stride, device="cpu")
    monkeypatch.setenv("FASTPPL_FUSED_DIVERGENCE", "1" if fused else "0")   # the kernel even in fp32, or none
    on_gpu = _evaluate(tokenizer_dir, [text_path], ctx=32, batch_size=3, window=window, stride=stride, device="cuda")
    assert on_gpu["loss"] == ("fused divergence kernel (Triton)" if fused
                              else "chunked projection, divergence in torch")
    _assert_same_statistics(on_gpu["divergence"], on_cpu["divergence"], rel=1e-5)
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


def test_top_k_overlaps_a_run_did_not_compute_are_null_with_the_reason_in_the_report_and_its_lines():
    """The fused kernel's columns leave the top-k overlaps NaN: the statistics say null and why, never NaN, and
    the summary's line and a table's note say so."""
    from fastppl.engine.divergence import COLUMNS
    from fastppl.report.divergence import divergence_lines, divergence_statistics
    from fastppl.report.table import table_text
    columns = np.random.default_rng(0).uniform(0.0, 1.0, (40, len(COLUMNS)))
    for name in ("top5_overlap", "top10_overlap"):
        columns[:, COLUMNS.index(name)] = np.nan
    d = divergence_statistics(columns)
    assert d["top5_overlap"] is None and d["top10_overlap_error"] is None
    assert d["top_k_overlap_not_computed"].startswith("not computed: the fused divergence kernel")
    assert not any(isinstance(v, float) and np.isnan(v) for v in d.values())
    line = next(line for line in divergence_lines({**d, "reference_model": "ref", "kld_by_confidence": []})
                if line.startswith("same top-1"))
    assert "top-5 overlap n/a" in line and "FASTPPL_FUSED_DIVERGENCE=0" in line
    row = {"model": "m", "corpus": "c", "status": "ok", "kld_mean": d["kld_mean"], "top5_overlap": None}
    text = table_text({"models": ["m"], "rows": [row], "base": "ref", "reference_model": "ref"})
    assert "top-5 overlap n/a: not computed: the fused divergence kernel" in text
    columns[:, COLUMNS.index("top5_overlap")] = 0.5
    assert "top_k_overlap_not_computed" in divergence_statistics(columns)   # top-10 still missing
    columns[:, COLUMNS.index("top10_overlap")] = 0.5
    assert "top_k_overlap_not_computed" not in divergence_statistics(columns)
