"""The statistics of a divergence run (eval --reference-model), from every scored token's values (the columns of
fastppl.engine.divergence), as llama.cpp's --kl-divergence reports them and more; their summary lines and figure.

Every statistic is exact over the scored tokens: the per-token values of all ranks are merged before any is
computed (fastppl.distributed), percentiles included. Means come with their standard error, the standard
deviation of the tokens' values over sqrt(n - 1) of the population (the sample's over sqrt(n))."""
from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np

# llama.cpp's --kl-divergence prints these percentiles of KLD and of Δp (tools/perplexity/perplexity.cpp)
KLD_PERCENTILES = (0.1, 1.0, 5.0, 10.0, 50.0, 90.0, 95.0, 99.0, 99.9)
DELTA_P_PERCENTILES = (0.1, 1.0, 5.0, 10.0, 25.0, 50.0, 75.0, 90.0, 95.0, 99.0, 99.9)
REVERSE_KLD_PERCENTILES = (50.0, 99.0)
HISTOGRAM_BINS = 60
# why a run's top-k overlaps are null: only the chunked path, which holds each row's logits, computes them
TOP_K_NOT_COMPUTED = ("not computed: the fused divergence kernel keeps no top-k lists; FASTPPL_FUSED_DIVERGENCE=0 "
                      "runs the chunked path, which computes them")
# KLD by the reference's confidence: buckets of its top-1 probability, [0, 0.1), ..., [0.9, 1]
CONFIDENCE_EDGES = tuple(i / 10 for i in range(11))


def _mean_and_error(values: np.ndarray) -> tuple[float, float]:
    """The mean and its standard error (NaN for fewer than two values)."""
    mean = float(values.mean())
    if len(values) < 2:
        return mean, math.nan
    return mean, float(values.std(ddof=1) / math.sqrt(len(values)))


def _percentiles(values: np.ndarray, percents: Sequence[float]) -> dict[str, float]:
    """{"p90": ..., "p99.9": ...}: numpy's linear interpolation between the closest ranks."""
    found = np.percentile(values, percents)
    return {f"p{p:g}": float(v) for p, v in zip(percents, found)}


def _spread(name: str, values: np.ndarray, percents: Sequence[float]) -> dict[str, float]:
    """{name_mean, name_mean_error, name_p..., name_median, name_min, name_max}."""
    mean, error = _mean_and_error(values)
    return {f"{name}_mean": mean, f"{name}_mean_error": error,
            **{f"{name}_{p}": v for p, v in _percentiles(values, percents).items()},
            f"{name}_median": float(np.median(values)), f"{name}_min": float(values.min()),
            f"{name}_max": float(values.max())}


def divergence_statistics(columns: np.ndarray) -> dict:
    """columns: (n, len(COLUMNS)) the scored tokens' per-token values (fastppl.engine.divergence.COLUMNS), n >= 1.
    Returns the report's divergence fields (every value a float, computed in float64); a column the run did not
    compute (NaN throughout: the top-k overlaps of the fused kernel) gives None."""
    from ..engine.divergence import COLUMNS, TOP_K   # here: a summary's lines need no torch
    c = {name: columns[:, i].astype(np.float64) for i, name in enumerate(COLUMNS)}
    return {"tokens": int(len(columns)), **_perplexities(c["nll"], c["reference_nll"]),
            **_spread("kld", c["kld"], KLD_PERCENTILES),
            **_spread("reverse_kld", c["reverse_kld"], REVERSE_KLD_PERCENTILES),
            **_shares(c, TOP_K), **_delta_p(c["delta_p"]),
            "entropy_mean": float(c["entropy"].mean()), "reference_entropy_mean": float(c["reference_entropy"].mean()),
            "target_rank_median": float(np.median(c["target_rank"])),
            "kld_by_confidence": kld_by_confidence(c["kld"], c["reference_top1_p"])}


def _perplexities(nll: np.ndarray, reference_nll: np.ndarray) -> dict:
    """Both models' perplexity, their ratio and difference, and the correlation of the tokens' NLL, as llama.cpp's
    "Perplexity statistics": PPL ± PPL · se(NLL); ln(PPL(B)/PPL(A)) ± sqrt(se_B² + se_A² - 2 cov), with
    cov = (Σ ab / n - mean a · mean b) / (n - 1), which is the standard error of the tokens' NLL differences (how
    it is computed); the ratio ± the ratio times that; the difference ± sqrt(se(PPL_B)² + se(PPL_A)² - 2 PPL_B
    PPL_A cov); Cor(ln PPL(B), ln PPL(A)) = cov / (se_B se_A), Pearson's r of the tokens' NLL. Its error (llama.cpp
    gives none) is Fisher's: (1 - r²) / sqrt(n - 3)."""
    n = len(nll)
    (nll_mean, nll_error), (reference_mean, reference_error) = _mean_and_error(nll), _mean_and_error(reference_nll)
    log_ratio, log_ratio_error = _mean_and_error(nll - reference_nll)
    ratio, ppl, reference_ppl = math.exp(log_ratio), math.exp(nll_mean), math.exp(reference_mean)
    covariance = float(np.mean((nll - nll_mean) * (reference_nll - reference_mean))) / (n - 1) if n > 1 else math.nan
    with np.errstate(invalid="ignore", divide="ignore"):
        correlation = float(np.float64(covariance) / (nll_error * reference_error))
    ppl_error, reference_ppl_error = ppl * nll_error, reference_ppl * reference_error
    difference_variance = ppl_error ** 2 + reference_ppl_error ** 2 - 2 * ppl * reference_ppl * covariance
    return {"ppl": ppl, "ppl_error": ppl_error,
            "reference_ppl": reference_ppl, "reference_ppl_error": reference_ppl_error,
            "nll": nll_mean, "reference_nll": reference_mean,
            "ppl_ratio": ratio, "ppl_ratio_error": ratio * log_ratio_error,
            "ln_ppl_ratio": log_ratio, "ln_ppl_ratio_error": log_ratio_error,
            "ppl_difference": ppl - reference_ppl, "ppl_difference_error": math.sqrt(max(difference_variance, 0.0)),
            "ln_ppl_correlation": correlation,
            "ln_ppl_correlation_error": (1 - correlation ** 2) / math.sqrt(n - 3) if n > 3 else math.nan}


def _shares(c: dict, top_k: Sequence[int]) -> dict:
    """Same top-1 (llama.cpp's "Same top p", whose error sqrt(p (1 - p) / (n - 1)) is the standard error of the
    tokens' 0/1 values), the top-k overlaps, and the share of targets that are the model's top-1."""
    out = {}
    for name in ("same_top1", *(f"top{k}_overlap" for k in top_k)):
        if np.isnan(c[name]).all():
            out[name], out[f"{name}_error"] = None, None
        else:
            out[name], out[f"{name}_error"] = _mean_and_error(c[name])
    if any(out[f"top{k}_overlap"] is None for k in top_k):
        out["top_k_overlap_not_computed"] = TOP_K_NOT_COMPUTED
    out["target_top1"] = float(np.mean(c["target_rank"] == 0))
    return out


def _delta_p(delta_p: np.ndarray) -> dict:
    """Δp's mean ± error, percentiles, min and max, and its RMS ± llama.cpp's error: 0.5 / RMS · se(Δp²); an RMS
    of 0 (every Δp 0: a model against itself) is exact, its error 0 rather than 0 / 0."""
    rms = float(np.sqrt(np.mean(delta_p * delta_p)))
    _, square_error = _mean_and_error(delta_p * delta_p)
    return {**_spread("delta_p", delta_p, DELTA_P_PERCENTILES),
            "delta_p_rms": rms, "delta_p_rms_error": 0.5 / rms * square_error if rms > 0 else 0.0}


def kld_by_confidence(kld: np.ndarray, reference_top1_p: np.ndarray) -> list[dict]:
    """The tokens in buckets of the reference's top-1 probability (CONFIDENCE_EDGES, the last one closed): each
    bucket's token count, mean KLD (None where empty) and share of the total KLD. A loss spread evenly keeps the
    mean flat across buckets; one in the tail shows in the confident buckets."""
    bucket = np.clip(np.searchsorted(CONFIDENCE_EDGES, reference_top1_p, side="right") - 1, 0,
                     len(CONFIDENCE_EDGES) - 2)
    total = float(kld.sum())
    rows = []
    for i, (low, high) in enumerate(zip(CONFIDENCE_EDGES, CONFIDENCE_EDGES[1:])):
        inside = kld[bucket == i]
        rows.append({"low": low, "high": high, "tokens": int(inside.size),
                     "kld_mean": float(inside.mean()) if inside.size else None,
                     "kld_share": float(inside.sum()) / total if total > 0 else None})
    return rows


def kld_histogram(kld: np.ndarray, bins: int = HISTOGRAM_BINS) -> dict:
    """Counts of the tokens' KLD in bins of equal width on a log scale, from the smallest positive value to the
    largest; tokens at 0 (equal distributions) or below it (float rounding of near-equal ones) are counted apart."""
    positive = kld[kld > 0]
    if positive.size == 0:
        return {"edges": [], "counts": [], "at_most_zero": int(kld.size)}
    low, high = float(positive.min()), float(positive.max())
    edges = np.geomspace(low, high, bins + 1) if high > low else np.array([low, high])
    counts, edges = np.histogram(positive, bins=edges)
    return {"edges": [float(e) for e in edges], "counts": [int(c) for c in counts],
            "at_most_zero": int(kld.size - positive.size)}


def kld_by_position(position_kld_sum: np.ndarray, position_count: np.ndarray) -> list[Optional[float]]:
    """Mean KLD at each position inside the window (None where no token was scored)."""
    return [float(s / n) if n > 0 else None for s, n in zip(position_kld_sum, position_count)]


def divergence_lines(d: dict) -> list[str]:
    """The summary's lines of a divergence run (printed after the model's own)."""
    def kld(name: str) -> str:
        return f"{d[f'kld_{name}']:.6g}"

    def share(name: str) -> str:
        return "n/a" if d.get(name) is None else f"{100 * d[name]:.3f} ± {100 * d[f'{name}_error']:.3f} %"
    not_computed = f" ({d['top_k_overlap_not_computed']})" if d.get("top_k_overlap_not_computed") else ""
    confident = " ".join(f"{b['low']:.1f}-{b['high']:.1f}: "
                         f"{'n/a' if b['kld_mean'] is None else format(b['kld_mean'], '.4g')}"
                         for b in d["kld_by_confidence"])
    return [
        f"reference   {d['reference_model']}  ppl {d['reference_ppl']:.4f}  ppl ratio {d['ppl_ratio']:.6f} "
        f"± {d['ppl_ratio_error']:.6f}  ln(ppl/ref ppl) {d['ln_ppl_ratio']:.6f} ± {d['ln_ppl_ratio_error']:.6f}  "
        f"cor(ln ppl) {100 * d['ln_ppl_correlation']:.2f} %",
        f"kld         mean {d['kld_mean']:.6g} ± {d['kld_mean_error']:.2g}  median {kld('median')}  p90 {kld('p90')}  "
        f"p95 {kld('p95')}  p99 {kld('p99')}  p99.9 {kld('p99.9')}  max {kld('max')}",
        f"reverse kld mean {d['reverse_kld_mean']:.6g} ± {d['reverse_kld_mean_error']:.2g}  "
        f"p99 {d['reverse_kld_p99']:.6g}  max {d['reverse_kld_max']:.6g}",
        f"kld by the reference's top-1 probability  {confident}",
        f"same top-1  {share('same_top1')}  top-5 overlap {share('top5_overlap')}  "
        f"top-10 overlap {share('top10_overlap')}{not_computed}",
        f"delta p     mean {100 * d['delta_p_mean']:.4g} ± {100 * d['delta_p_mean_error']:.2g} %  "
        f"rms {100 * d['delta_p_rms']:.4g} ± {100 * d['delta_p_rms_error']:.2g} %  p1 {100 * d['delta_p_p1']:.4g} %  "
        f"median {100 * d['delta_p_p50']:.4g} %  p99 {100 * d['delta_p_p99']:.4g} %",
    ] + (layer_error_lines(d["layer_error"]) if d.get("layer_error") else [])


def layer_error_lines(rows: list[dict]) -> list[str]:
    """--layer-error's table: each block's hidden-state error, and the KLD with the reference's blocks through it."""
    def figure(value, spec: str) -> str:
        return "n/a" if value is None else format(value, spec)
    lines = ["error by layer (hidden states after each block; kld: the reference's embeddings and blocks through "
             "this one, the model's after)",
             f"{'block':>7} {'rel l2 mean':>12} {'rel l2 max':>11} {'cos mean':>10} {'cos min':>10} {'kld':>11}"]
    for row in rows:
        kld = figure(row["kld_with_reference_through_layer"], ".5g")
        lines.append(f"{row['layer']:>7} {figure(row['relative_l2_mean'], '.5f'):>12} "
                     f"{figure(row['relative_l2_max'], '.5f'):>11} {figure(row['cosine_mean'], '.6f'):>10} "
                     f"{figure(row['cosine_min'], '.6f'):>10} {kld:>11}")
    return lines


def divergence_figure(result: dict):
    """Two panels: the tokens' KLD as a histogram on log axes, and the mean KLD by position in the window."""
    from .plot import _new_figure, run_title
    d = result["divergence"]
    figure, (histogram, by_position) = _new_figure(2 * 7.0, 2)
    edges, counts = d["kld_histogram"]["edges"], d["kld_histogram"]["counts"]
    if counts:
        histogram.stairs(counts, edges, fill=True, alpha=0.7,
                         label=f"{d['tokens']:,} tokens; {d['kld_histogram']['at_most_zero']:,} at or below 0")
        histogram.set_xscale("log")
        histogram.set_yscale("log")
    for name, style in (("mean", "-"), ("p99", "--")):
        histogram.axvline(d[f"kld_{name}"], color="C3", linestyle=style, label=f"{name} {d[f'kld_{name}']:.4g}")
    histogram.set_xlabel("KL(reference ‖ model) per token (nats), log scale")
    histogram.set_ylabel("tokens (log scale)")
    histogram.legend(fontsize="small")
    histogram.set_title("KLD distribution", fontsize="medium")
    mean = [math.nan if v is None else v for v in d["kld_by_position"]]
    by_position.plot(range(1, len(mean) + 1), mean, color="C0", linewidth=1.4)
    by_position.axhline(d["kld_mean"], color="C0", linestyle="--", linewidth=1.0, label=f"mean {d['kld_mean']:.4g}")
    by_position.set_xscale("log")
    by_position.set_xlabel("tokens read in the window (position + 1), log scale")
    by_position.set_ylabel("mean KLD (nats)")
    by_position.legend(fontsize="small")
    by_position.set_title("KLD by window position", fontsize="medium")
    for axes in (histogram, by_position):
        axes.grid(True, which="both", alpha=0.25)
    figure.suptitle(f"{run_title(result)} · reference {d['reference_model']}", fontsize="medium")
    return figure


def write_divergence_plot(path: str, result: dict) -> None:
    from .plot import save_figure
    save_figure(divergence_figure(result), path)
