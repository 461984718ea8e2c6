"""The statistics of a divergence run (eval --reference-model), from every scored token's values (the columns of
fastppl.engine.divergence), as llama.cpp's --kl-divergence reports them and more; their summary lines and figure.

Every statistic is exact over the scored tokens: the per-token values of all ranks are merged before any is
computed (fastppl.distributed), percentiles included. Means come with their standard error, the standard
deviation of the tokens' values over sqrt(n - 1) of the population (the sample's over sqrt(n))."""
from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np

KLD_PERCENTILES = (50.0, 90.0, 95.0, 99.0, 99.9)
DELTA_P_PERCENTILES = (0.1, 1.0, 5.0, 10.0, 25.0, 50.0, 75.0, 90.0, 95.0, 99.0, 99.9)
HISTOGRAM_BINS = 60


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


def divergence_statistics(columns: np.ndarray) -> dict:
    """columns: (n, 5) the scored tokens' (nll, reference_nll, kld, same_top1, delta_p), n >= 1. Returns the
    report's divergence fields (every value a float, computed in float64)."""
    nll, reference_nll, kld, same_top1, delta_p = columns.astype(np.float64).T
    kld_mean, kld_error = _mean_and_error(kld)
    same_mean, same_error = _mean_and_error(same_top1)
    delta_p_mean, delta_p_error = _mean_and_error(delta_p)
    # ln(PPL(model) / PPL(reference)) is the mean of the tokens' NLL differences: its error is theirs, and the
    # ratio's follows from exp's derivative (the ratio times the log's error)
    log_ratio, log_ratio_error = _mean_and_error(nll - reference_nll)
    ratio = math.exp(log_ratio)
    return {
        "tokens": int(len(kld)),
        "ppl": math.exp(nll.mean()), "reference_ppl": math.exp(reference_nll.mean()),
        "nll": float(nll.mean()), "reference_nll": float(reference_nll.mean()),
        "ppl_ratio": ratio, "ppl_ratio_error": ratio * log_ratio_error,
        "ln_ppl_ratio": log_ratio, "ln_ppl_ratio_error": log_ratio_error,
        "kld_mean": kld_mean, "kld_mean_error": kld_error,
        **{f"kld_{name}": value for name, value in _percentiles(kld, KLD_PERCENTILES).items()},
        "kld_median": float(np.median(kld)), "kld_min": float(kld.min()), "kld_max": float(kld.max()),
        "same_top1": same_mean, "same_top1_error": same_error,
        "delta_p_mean": delta_p_mean, "delta_p_mean_error": delta_p_error,
        "delta_p_rms": float(np.sqrt(np.mean(delta_p * delta_p))),
        **{f"delta_p_{name}": value for name, value in _percentiles(delta_p, DELTA_P_PERCENTILES).items()},
        "delta_p_min": float(delta_p.min()), "delta_p_max": float(delta_p.max()),
    }


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
    return [
        f"reference   {d['reference_model']}  ppl {d['reference_ppl']:.4f}  ppl ratio {d['ppl_ratio']:.6f} "
        f"± {d['ppl_ratio_error']:.6f}  ln(ppl/ref ppl) {d['ln_ppl_ratio']:.6f} ± {d['ln_ppl_ratio_error']:.6f}",
        f"kld         mean {d['kld_mean']:.6g} ± {d['kld_mean_error']:.2g}  median {kld('median')}  p90 {kld('p90')}  "
        f"p95 {kld('p95')}  p99 {kld('p99')}  p99.9 {kld('p99.9')}  max {kld('max')}",
        f"same top-1  {100 * d['same_top1']:.3f} ± {100 * d['same_top1_error']:.3f} %",
        f"delta p     mean {100 * d['delta_p_mean']:.4g} ± {100 * d['delta_p_mean_error']:.2g} %  "
        f"rms {100 * d['delta_p_rms']:.4g} %  p1 {100 * d['delta_p_p1']:.4g} %  median {100 * d['delta_p_p50']:.4g} %  "
        f"p99 {100 * d['delta_p_p99']:.4g} %",
    ]


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
