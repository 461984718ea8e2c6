"""Figures drawn from fastppl's own results: loss by window position (each position's mean, and the means of
log-spaced buckets of positions that long windows need), and per-document NLL.

matplotlib is an optional extra (`pip install -e ".[plot]"`, or matplotlib alone), imported only when a figure is drawn.
Figures are built as bare `Figure` objects on an Agg canvas, never through pyplot, so that nothing
depends on (or changes) the process' interactive backend, and sizes in pixels are exact:
FIGURE_SIZE inches times DPI, with no tight bounding box to crop them.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Optional, Sequence

from ..errors import FastpplError
from .files import check_writable, write_atomic
from .positions import bucket_means

DPI = 100
FIGURE_SIZE = (8.0, 4.5)            # inches: 800 x 450 pixels at DPI
PANEL_WIDTH = 7.0                   # inches of each panel when a comparison has two (1400 x 450)
FORMATS = {".png": "png", ".svg": "svg", ".pdf": "pdf"}
INSTALL_HINT = "pip install matplotlib"
# past this many positions a window's per-position means are noise around the buckets' curve: drawn faint
MANY_POSITIONS = 512


def require_matplotlib(flag: str = "--plot") -> None:
    """Fail before any work when matplotlib is missing, rather than after a long evaluation."""
    try:
        import matplotlib  # noqa: F401
        from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: F401
    except ImportError:
        raise FastpplError(f"{flag} needs matplotlib, which is not installed; {INSTALL_HINT}") from None


def check_plot_path(path: str, flag: str = "--plot") -> None:
    """Fail before any work if the figure could not be written: its format, its directory, matplotlib."""
    if Path(path).suffix.lower() not in FORMATS:
        raise FastpplError(f"{flag} {path}: give a file name ending in {', '.join(FORMATS)}")
    check_writable(path, flag)
    require_matplotlib(flag)


def _new_figure(width: float = FIGURE_SIZE[0], n_panels: int = 1):
    require_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    figure = Figure(figsize=(width, FIGURE_SIZE[1]), dpi=DPI, layout="constrained")
    FigureCanvasAgg(figure)
    axes = [figure.add_subplot(1, n_panels, i + 1) for i in range(n_panels)]
    return figure, axes


def save_figure(figure, path: str) -> None:
    """Write atomically (a temporary file renamed into place): no partial image is ever left."""
    fmt = FORMATS[Path(path).suffix.lower()]
    write_atomic(path, lambda f: figure.savefig(f, format=fmt, dpi=DPI), binary=True)


def model_label(spec: str) -> str:
    """A local checkpoint path shows as its directory name; hub ids and random:<preset> as they are."""
    return Path(spec).name if spec.startswith((".", "/", "~")) else spec


def corpus_label(result: dict) -> str:
    """File names (not paths) of the --data sources, and the split."""
    cfg = result.get("config", {})
    names = [Path(d).name for d in cfg.get("data", [])] or ["?"]
    split = cfg.get("split", "all")
    return ", ".join(names) + ("" if split == "all" else f" ({split})")


def window_label(result: dict) -> str:
    stride = result.get("stride")
    return f"{result.get('window', '?')} ctx {result.get('ctx', '?')}" + (f" stride {stride}" if stride else "")


def run_title(result: dict) -> str:
    model = model_label(result.get("config", {}).get("model", "?"))
    return f"{model} · {corpus_label(result)} · {window_label(result)} · {result.get('dtype', '?')}"


def _series(values: Optional[Sequence]) -> list[float]:
    """JSON's None (an unscored position) -> NaN, which matplotlib leaves as a gap in the line."""
    return [math.nan if v is None else float(v) for v in (values or [])]


def _draw_loss_by_position(axes, results: Sequence[dict], labels: Sequence[str], bands: bool) -> None:
    """x is the number of tokens the window has read (position + 1) on a log scale: the loss falls
    fastest over the first few tokens of context, which a linear axis over ctx positions squeezes
    into its first few pixels."""
    for i, (result, label) in enumerate(zip(results, labels)):
        color = f"C{i % 10}"
        mean = _series(result.get("nll_by_position"))
        tokens_read = list(range(1, len(mean) + 1))
        buckets_x, buckets_nll = bucket_means(result.get("nll_by_position_buckets"))
        faint = bool(buckets_x) and len(mean) > MANY_POSITIONS
        if mean:
            axes.plot(tokens_read, mean, color=color, linewidth=0.6 if faint else 1.4, alpha=0.4 if faint else 1.0,
                      label=f"{label}: mean NLL by position")
        if buckets_x:   # each point the mean over its bucket's tokens: its sum over its count
            axes.plot(buckets_x, buckets_nll, color=color, marker="o", markersize=3.5, linewidth=1.2 if faint else 0,
                      label=f"{label}: mean NLL by log-spaced bucket of positions")
        std = _series(result.get("nll_by_position_std"))
        counts = result.get("tokens_by_position") or []
        if bands and len(std) == len(mean):
            # the spread of single tokens' NLL; a token's NLL is never negative, so it stops at 0
            axes.fill_between(tokens_read, [max(m - s, 0.0) for m, s in zip(mean, std)],
                              [m + s for m, s in zip(mean, std)], color=color, alpha=0.12, linewidth=0,
                              label="±1 s.d. of token NLL")
        if bands and len(std) == len(mean) == len(counts):
            # how well the mean itself is known: ±1.96 standard errors (a 95 % interval for large counts)
            half = [1.96 * s / math.sqrt(n) if n else math.nan for s, n in zip(std, counts)]
            axes.fill_between(tokens_read, [m - h for m, h in zip(mean, half)], [m + h for m, h in zip(mean, half)],
                              color=color, alpha=0.35, linewidth=0, label="95 % interval of the mean")
        ppl = result.get("ppl")   # null in a report where it was past float64's range
        axes.axhline(result["nll"], color=color, linestyle="--", linewidth=1.0,
                     label=f"{label}: overall NLL {result['nll']:.4f} (ppl {'n/a' if ppl is None else f'{ppl:,.2f}'})")
    axes.set_xscale("log")
    from matplotlib.ticker import FuncFormatter
    axes.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}"))   # 1, 10, 100 rather than 10^k
    axes.set_xlabel("tokens read in the window (position + 1), log scale")
    axes.set_ylabel("NLL (nats/token)")
    axes.grid(True, which="both", alpha=0.25)
    axes.legend(fontsize="small", loc="best")


def loss_by_position_figure(result: dict):
    """Mean NLL at each window position with bands for the spread of token NLLs and the uncertainty of
    the mean, and the run's overall NLL as a line."""
    if not result.get("nll_by_position") and not result.get("nll_by_position_buckets"):
        raise FastpplError("the result has no nll_by_position; it was written by an older fastppl, run eval again")
    figure, (axes,) = _new_figure()
    _draw_loss_by_position(axes, [result], ["this run"], bands=True)
    axes.set_title(run_title(result), fontsize="medium")
    return figure


def write_loss_by_position(path: str, result: dict) -> None:
    save_figure(loss_by_position_figure(result), path)


def _draw_per_doc_histogram(axes, per_doc_nll: Sequence[Sequence[float]], labels: Sequence[str]) -> None:
    import numpy as np
    values = [np.asarray(v, dtype=np.float64) for v in per_doc_nll]
    everything = np.concatenate(values) if values else np.zeros(0)
    # shared bin edges so that the runs' bars line up; numpy's rule, capped so that bars stay visible
    edges = np.histogram_bin_edges(everything, bins="auto") if everything.size else np.linspace(0, 1, 2)
    if len(edges) > 61:
        edges = np.linspace(edges[0], edges[-1], 61)
    for i, (v, label) in enumerate(zip(values, labels)):
        axes.hist(v, bins=edges, color=f"C{i % 10}", alpha=0.5 if len(values) > 1 else 0.8,
                  label=f"{label}: {len(v):,} documents, median {np.median(v):.3f}" if len(v) else label)
    axes.set_xlabel("per-document NLL (nats/token)")
    axes.set_ylabel("documents")
    axes.grid(True, alpha=0.3)
    axes.legend(fontsize="small", loc="upper right")


def comparison_figure(results: Sequence[dict], labels: Sequence[str],
                      per_doc_nll: Optional[Sequence[Sequence[float]]] = None, per_doc_labels=None):
    """Loss-by-position curves of several runs overlaid; a per-document NLL histogram beside them when
    per-document results are given (or alone, when only they are)."""
    panels = (1 if results else 0) + (1 if per_doc_nll else 0)
    assert panels >= 1
    width = FIGURE_SIZE[0] if panels == 1 else PANEL_WIDTH * panels
    figure, axes = _new_figure(width, panels)
    if results:
        # bands for each run would hide the curves; a comparison of several runs shows their means only
        _draw_loss_by_position(axes[0], results, labels, bands=len(results) == 1)
        same = {corpus_label(r) for r in results}
        axes[0].set_title("loss by position · " + (same.pop() if len(same) == 1 else "several corpora"),
                          fontsize="medium")
    if per_doc_nll:
        _draw_per_doc_histogram(axes[-1], per_doc_nll, per_doc_labels or labels)
        axes[-1].set_title("per-document NLL", fontsize="medium")
    return figure
