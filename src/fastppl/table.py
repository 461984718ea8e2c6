"""Several models × several corpora in one process: `fastppl eval --model A --model B --corpus X --corpus Y`.

Each (model, corpus) cell is the run `fastppl eval --model M --data C` with the same options would be, and its
report is that run's; what the cells share is what they read (fastppl.reuse): each corpus is read and tokenized
once per tokenizer, each model loaded once (every corpus is scored with a model before the next is loaded), the
reference model once. The base of the table (ΔPPL) is --reference-model when given, else the first --model; with
a reference, every other model's cells also carry the divergence from it on the same windows, and the reference's
own cells (when it is also a --model) are plain runs.

A cell that fails is named and the others still run: the table keeps every cell that finished, and the command
exits non-zero."""
from __future__ import annotations

import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from .config import EvalConfig
from .errors import FastpplError, first_line, is_memory_exhausted
from .models.bits import bits_per_weight
from .report.table import DIVERGENCE_FIELDS, TABLE_FORMAT, short_names


@dataclass
class Cell:
    model: str                      # the --model given
    corpus: str                     # the corpus' name in the table
    config: EvalConfig
    report: Optional[dict] = None   # the run's report (EvalResult.to_dict()) once it has run
    error: Optional[str] = None     # why it failed, one line
    bad_input: bool = True          # the failure is the input's (exit 2), not fastppl's (exit 1)
    is_base: bool = False           # the table's base: ΔPPL is against it


def plan_cells(config: EvalConfig, models: list[str], corpora: Optional[list[str]],
               make_config: Callable[..., EvalConfig]) -> list[Cell]:
    """The table's cells in the order they run (model by model), each with its run's config (make_config(model=,
    data=, reference_model=)), built (and so checked) before anything is read. corpora None: the one corpus of
    --data."""
    models = [config.reference_model if is_the_reference(config, m) else m for m in models]
    if len(set(map(_local_or_given, models))) != len(models):
        raise FastpplError("a --model is given twice; name each model once")
    if corpora is not None and len(set(corpora)) != len(corpora):
        raise FastpplError("a --corpus is given twice; name each corpus once")
    sources = [[c] for c in corpora] if corpora is not None else [list(config.data)]
    corpus_names = short_names(corpora) if corpora is not None else [", ".join(short_names(config.data))]
    # the reference's own cells first: the next model's load lets it go before the reference is loaded for the
    # divergence, so that two copies of it are never held at once
    models.sort(key=lambda m: not is_the_reference(config, m))
    cells = []
    for model in models:
        # the reference's own cells are plain runs: its divergence from itself is nothing to measure
        is_reference = is_the_reference(config, model)
        own = dict(reference_model=None, reference_seed=None, reference_device=None) if is_reference else {}
        is_base = is_reference if config.reference_model else model == models[0]
        for data, name in zip(sources, corpus_names):
            cells.append(Cell(model, name, make_config(model=model, data=data, **own), is_base=is_base))
    return cells


def _local_or_given(spec: str) -> str:
    """A local checkpoint or file by its resolved path (./m and m are one model), anything else as given."""
    path = Path(spec).expanduser()
    return str(path.resolve()) if path.exists() else spec


def is_the_reference(config: EvalConfig, model: str) -> bool:
    """Whether --model names the --reference-model itself (the same weights: for random:PRESET, the same seed)."""
    return config.reference_model is not None and \
        _local_or_given(model) == _local_or_given(config.reference_model) and \
        config.reference_seed in (None, config.seed)


def run_cells(cells: list[Cell], quiet: bool = False) -> float:
    """Every cell run in order in this process, sharing what they read; the seconds it took. An interrupt (^C)
    stops the table: the cells not finished say so, and those finished are kept."""
    from .pipeline import evaluate
    from .reuse import Reuse
    reuse, started = Reuse(), time.perf_counter()
    for number, cell in enumerate(cells, 1):
        if not quiet:
            print(f"fastppl: cell {number}/{len(cells)}: {cell.model} on {cell.corpus}", file=sys.stderr)
        try:
            cell.report = evaluate(cell.config, reuse).to_dict()
        except KeyboardInterrupt:
            for unfinished in cells[number - 1:]:
                unfinished.error, unfinished.bad_input = "not run: interrupted", False
            print("fastppl: interrupted", file=sys.stderr)
            break
        except FastpplError as e:
            cell.error = str(e)
        except Exception as e:   # noqa: BLE001 (the other cells still run, and the finished ones are written)
            cell.error, cell.bad_input = f"{type(e).__name__}: {first_line(e)}", _is_the_inputs(e)
            if not cell.bad_input:
                traceback.print_exc(file=sys.stderr)
        if cell.error is not None:
            print(f"fastppl: error: cell {cell.model} on {cell.corpus}: {cell.error}", file=sys.stderr)
    return time.perf_counter() - started


def _is_the_inputs(error: Exception) -> bool:
    """Out of memory, or a file the user named that could not be read: the input's failure, not fastppl's."""
    return is_memory_exhausted(error) or (isinstance(error, OSError) and error.filename is not None)


def base_model(config: EvalConfig, models: list[str]) -> str:
    return config.reference_model or models[0]


def table_rows(cells: list[Cell]) -> list[dict]:
    """One row per cell: its figures, ΔPPL against the base's on the same corpus (from the reference's side of the
    cell's divergence, on its very windows; else from the base's own cell where it scored the same tokens in the
    same windows), the divergence's KLD and same-top-1 figures, and the bits per weight of the model's file
    (fastppl.models.bits; None for random:PRESET)."""
    base_reports = {c.corpus: c.report for c in cells if c.is_base and c.report is not None}
    bits = {model: bits_per_weight(model) for model in dict.fromkeys(c.model for c in cells if c.report)}
    rows = []
    for cell in cells:
        row = {"model": cell.model, "corpus": cell.corpus, "status": "ok" if cell.report else "failed",
               "is_base": cell.is_base}
        if cell.report is None:
            rows.append({**row, "error": cell.error})
            continue
        report, divergence = cell.report, cell.report.get("divergence") or {}
        row.update(tokens_scored=report["tokens_scored"], nll=report["nll"], ppl=report["ppl"],
                   bits_per_byte=report["bits_per_byte"], bits_per_weight=bits[cell.model])
        base_report = base_reports.get(cell.corpus)
        base_ppl = divergence.get("reference_ppl")
        if base_ppl is None and base_report is not None and same_tokens(base_report, report):
            base_ppl = base_report["ppl"]
        row.update(base_ppl=base_ppl,
                   delta_ppl=None if base_ppl is None else report["ppl"] - base_ppl,
                   delta_ppl_relative=None if base_ppl is None else report["ppl"] / base_ppl - 1)
        if divergence:
            row.update({name: divergence.get(name) for name in DIVERGENCE_FIELDS})
        rows.append(row)
    return rows


def same_tokens(a: dict, b: dict) -> bool:
    """Whether two reports' per-token figures compare: the same text cut into as many tokens (another tokenizer
    all but always cuts it into another number; fastppl compare's rule), scored in the same windows."""
    return all(a.get(key) == b.get(key) for key in ("corpus_sha256", "tokens_scored", "window", "ctx", "stride"))


def table_report(cells: list[Cell], base: str, seconds: float, reference_model: Optional[str]) -> dict:
    """The --json of a table: its rows, and every cell's full report (or its error)."""
    return {
        "format": TABLE_FORMAT, "base": base, "reference_model": reference_model,
        "models": list(dict.fromkeys(c.model for c in cells)),
        "corpora": list(dict.fromkeys(c.corpus for c in cells)),
        "rows": table_rows(cells), "seconds": seconds,
        "cells": [{"model": c.model, "corpus": c.corpus, **({"report": c.report} if c.report is not None
                                                             else {"error": c.error})} for c in cells],
    }


def exit_code(cells: list[Cell]) -> int:
    failed = [c for c in cells if c.report is None]
    if any(c.error == "not run: interrupted" for c in failed):
        return 130   # what a shell reports for ^C
    return 0 if not failed else 2 if all(c.bad_input for c in failed) else 1

