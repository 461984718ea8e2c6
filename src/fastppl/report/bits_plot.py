"""The figure quantizers draw from a table (`fastppl eval --model A --model B ... --corpus X ... --plot FILE`): each
model's KLD from the reference and its ΔPPL against the base, over the bits per weight of its file
(fastppl.models.bits), one point per model, one line per corpus.

A point is drawn where the table has the number: the KLD panel holds the models that ran against a
--reference-model (the reference's own cells are no divergence, so it has no KLD point), the ΔPPL panel every
model whose ΔPPL the table gives (the base at 0). Without --reference-model only the ΔPPL panel is drawn, against
the first --model, as the table's ΔPPL column is."""
from __future__ import annotations

import math

from ..errors import FastpplError
from .plot import FIGURE_SIZE, PANEL_WIDTH, _new_figure, save_figure
from .table import short_names

# (row key, the axis' label) of each panel, in the order they are drawn
PANELS = (("kld_mean", "mean KL(reference ‖ model) per token (nats)"), ("delta_ppl", "ΔPPL against the base"))


def check_table_plot(models: list[str], has_other_than_base: bool) -> None:
    """Before any work: every model has a file to take its bits per weight from, and there is something to draw."""
    for model in models:
        if model.startswith("random:"):
            raise FastpplError(f"--plot draws each model at its file's bits per weight, and {model} has no file; give "
                               "checkpoint directories or GGUF files, or leave out --plot")
    if not has_other_than_base:
        raise FastpplError("--plot draws each model against the base (--reference-model, else the first --model), "
                           "and this table has no other model; add a --model or a --reference-model")


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def plot_series(table: dict) -> dict[str, dict[str, list[tuple[float, float, str]]]]:
    """{panel key: {corpus: [(bits per weight, value, model), ...] by bits per weight}}: the table's rows that have
    both numbers; the KLD panel only with a reference."""
    panels = [key for key, _ in PANELS if key != "kld_mean" or table.get("reference_model")]
    series: dict[str, dict[str, list]] = {key: {corpus: [] for corpus in table["corpora"]} for key in panels}
    for row in table["rows"]:
        for key in panels:
            if row["status"] == "ok" and _finite(row.get("bits_per_weight")) and _finite(row.get(key)):
                series[key][row["corpus"]].append((row["bits_per_weight"], row[key], row["model"]))
    for by_corpus in series.values():
        for points in by_corpus.values():
            points.sort()
    return series


def bits_per_weight_figure(table: dict):
    series = plot_series(table)
    names = dict(zip(table["models"], short_names(table["models"])))
    width = FIGURE_SIZE[0] if len(series) == 1 else PANEL_WIDTH * len(series)
    figure, axes = _new_figure(width, len(series))
    for panel, (key, label) in zip(axes, [p for p in PANELS if p[0] in series]):
        for i, (corpus, points) in enumerate(series[key].items()):
            if not points:
                continue
            bits, values, models = zip(*points)
            panel.plot(bits, values, color=f"C{i % 10}", marker="o", label=corpus)
            for x, y, model in points:
                panel.annotate(names.get(model, model), (x, y), textcoords="offset points", xytext=(4, 4),
                               fontsize="x-small")
        drawn = [value for points in series[key].values() for _, value, _ in points]
        if key == "kld_mean" and drawn and min(drawn) > 0:
            panel.set_yscale("log")   # a quantization ladder's KLD spans decades
        panel.set_xlabel("bits per weight of the model's file")
        panel.set_ylabel(label)
        panel.grid(True, which="both", alpha=0.25)
        panel.legend(fontsize="small", title="corpus", title_fontsize="small")
    base = names.get(table["base"], table["base"])
    against = f"reference {base}" if table.get("reference_model") else f"base {base} (no --reference-model: ΔPPL only)"
    figure.suptitle(f"{'KLD and ΔPPL' if len(series) > 1 else 'ΔPPL'} by bits per weight · {against}",
                    fontsize="medium")
    return figure


def write_bits_per_weight_plot(path: str, table: dict) -> None:
    save_figure(bits_per_weight_figure(table), path)
