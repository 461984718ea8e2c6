"""A table of models × corpora (fastppl.table) as text, Markdown or CSV: one line per (model, corpus) cell."""
from __future__ import annotations

import csv
import io
import math
from pathlib import Path

from .divergence import TOP_K_NOT_COMPUTED
from .tables import format_table, one_line

TABLE_FORMAT = "fastppl-table/1"   # the "format" of a table's --json (fastppl.table), which fastppl compare reads

# (header, row key, format); a missing or non-finite value prints as n/a, or empty in CSV
COLUMNS = (
    ("model", "model", "s"), ("corpus", "corpus", "s"), ("tokens", "tokens_scored", ","),
    ("PPL", "ppl", ".4f"), ("ΔPPL", "delta_ppl", "+.4f"), ("ΔPPL %", "delta_ppl_relative", "+.3%"),
    ("bits/byte", "bits_per_byte", ".6f"), ("KLD mean", "kld_mean", ".6f"), ("KLD median", "kld_median", ".6f"),
    ("KLD p99", "kld_p99", ".6f"), ("KLD max", "kld_max", ".4f"), ("rev. KLD", "reverse_kld_mean", ".6f"),
    ("same top-1", "same_top1", ".3%"), ("top-5 overlap", "top5_overlap", ".3%"), ("Δp RMS", "delta_p_rms", ".3%"),
    ("PPL ratio", "ppl_ratio", ".6f"), ("bits/weight", "bits_per_weight", ".3f"),
)
# a divergence's statistics that a table's rows carry (fastppl.table.table_rows), by their report names
DIVERGENCE_FIELDS = ("kld_mean", "kld_mean_error", "kld_median", "kld_p90", "kld_p99", "kld_p99.9", "kld_max",
                     "reverse_kld_mean", "same_top1", "same_top1_error", "top5_overlap", "top10_overlap",
                     "delta_p_mean", "delta_p_rms", "delta_p_rms_error", "ppl_ratio", "ppl_ratio_error",
                     "ln_ppl_ratio", "ln_ppl_ratio_error", "ln_ppl_correlation")
CSV_COLUMNS = ("model", "corpus", "status", "tokens_scored", "nll", "ppl", "base_ppl", "delta_ppl",
               "delta_ppl_relative", "bits_per_byte", *DIVERGENCE_FIELDS, "bits_per_weight", "error")


def short_names(specs: list[str]) -> list[str]:
    """A local path by its file or directory name, unless two names clash; anything else as given."""
    names = [Path(s).name if Path(s).expanduser().exists() and Path(s).name else s for s in specs]
    return names if len(set(names)) == len(names) else list(specs)


def _cell(value, spec: str) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "n/a"
    return format(value, spec) if spec != "s" else str(value)


def table_text(table: dict, markdown: bool = False) -> str:
    """The rows as a table (text or Markdown), then what the Δ and KLD columns are against, and each failed cell."""
    rows, failed = [], []
    names = dict(zip(table["models"], short_names(table["models"])))
    for row in table["rows"]:
        if row["status"] != "ok":
            failed.append(row)
            rows.append([names[row["model"]], row["corpus"], *["failed"] + [""] * (len(COLUMNS) - 3)])
            continue
        is_base = row.get("is_base", False)
        shown = {**row, "model": names[row["model"]]}
        rows.append([_cell(shown.get(key), spec) if not (is_base and key in DIVERGENCE_FIELDS) else "base"
                     for _, key, spec in COLUMNS])
    right = [spec != "s" for _, _, spec in COLUMNS]
    lines = [format_table([header for header, _, _ in COLUMNS], rows, markdown, right), ""]
    base = dict(zip(table["models"], short_names(table["models"]))).get(table["base"], table["base"])
    against = f"ΔPPL against {one_line(base)} on the same corpus"
    if table.get("reference_model"):
        against += "; KLD (nats/token), same top-1, top-5 overlap, Δp and PPL ratio against it, on the same windows"
    lines.append(against + "; n/a where the base's tokens differ or its cell failed.")
    if any(row.get("kld_mean") is not None and row.get("top5_overlap") is None for row in table["rows"]):
        lines.append(f"top-5 overlap n/a: {TOP_K_NOT_COMPUTED}.")
    if failed:
        lines.append("")
        lines += [f"- failed: {one_line(names[row['model']])} on {one_line(row['corpus'])}: {one_line(row['error'])}"
                  for row in failed]
    return "\n".join(lines)


def table_csv(table: dict) -> str:
    out = io.StringIO()
    # every text quoted: a name may hold a comma, a quote, a newline or a lone carriage return, which the minimal
    # quoting of Python 3.11 leaves bare; numbers as repr writes them
    writer = csv.writer(out, lineterminator="\n", quoting=csv.QUOTE_NONNUMERIC)
    writer.writerow(CSV_COLUMNS)
    for row in table["rows"]:
        writer.writerow(["" if row.get(k) is None else row[k] for k in CSV_COLUMNS])
    return out.getvalue()
