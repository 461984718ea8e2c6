"""`fastppl compare`: runs side by side (from `eval --json` reports) and per-document results (from
`eval --per-doc`), as a table with differences against the first run, and optionally one figure.

Runs are comparable when they scored the same text (the same corpus_sha256; for reports without it, the same
data names, split and number of tokens); otherwise a difference means nothing, so compare refuses them unless
--force. Runs of one text that scored other tokens (another tokenizer) compare by bits per byte, their per-token
columns marked not comparable. Per-document files are comparable when they hold the same
documents with the same token counts."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from ..errors import FastpplError
from ..data.jsonl import describe, json_lines, loads
from .inputs import is_count, is_number, read_text, wrongly_typed
# fastppl.plot imports matplotlib only inside the functions that draw
from .plot import check_plot_path, comparison_figure, corpus_label, model_label, save_figure
from .paired import paired_table, per_token_comparable, plus_minus, same_text
from .table import TABLE_FORMAT
from .tables import format_table

REQUIRED_RUN_FIELDS = ("nll", "ppl", "tokens_scored", "config")
REQUIRED_DOC_FIELDS = ("id", "tokens", "nll_sum")


@dataclass
class Run:
    path: str
    label: str          # shown in the table and the legend: the file's stem, unless two stems clash
    result: dict


@dataclass(frozen=True)
class DocResult:
    id: str
    tokens: int
    nll_sum: float
    bytes: Optional[int] = None

    @property
    def nll(self) -> float:
        return self.nll_sum / self.tokens

    @property
    def bits_per_byte(self) -> float:
        return self.nll_sum / math.log(2) / self.bytes if self.bytes else math.nan


def _labels(paths: Sequence[str]) -> list[str]:
    stems = [Path(p).stem for p in paths]
    return stems if len(set(stems)) == len(stems) else list(paths)


def load_run(path: str, label: Optional[str] = None) -> Run:
    result = _read_report(path)
    if not isinstance(result, dict):
        raise FastpplError(f"{path}: not a fastppl eval report (a JSON object is expected)")
    return _checked_run(path, label or Path(path).stem, result)


def _read_report(path: str):
    text = read_text(path, "JSON report written by fastppl eval --json")
    try:
        return loads(text)
    except json.JSONDecodeError as e:
        # one object per line: a per-document file given where reports go
        per_doc = " (one per line: a per-document file? pass it after --per-doc)" if e.msg == "Extra data" else ""
        raise FastpplError(f"{path}:{e.lineno}: {describe(e)}{per_doc}; pass a fastppl eval --json report") from None


def _checked_run(path: str, label: str, result: dict) -> Run:
    missing = [f for f in REQUIRED_RUN_FIELDS if f not in result]
    if missing or not isinstance(result["config"], dict):
        raise FastpplError(f"{path}: not a fastppl eval report (no {missing[0] if missing else 'config'!r} field); "
                           "pass a file written by fastppl eval --json")
    wrong = wrongly_typed(result)
    if wrong:
        raise FastpplError(f"{path}: not a fastppl eval report ({wrong!r} has the wrong type); pass a file written "
                           "by fastppl eval --json")
    return Run(path, label, result)


def load_runs(paths: Sequence[str]) -> list[Run]:
    """Each report's run; a table's (eval with several models or corpora) cells as runs of their own, labelled
    by model and corpus (a failed cell has no run)."""
    runs = []
    for path, label in zip(paths, _labels(paths)):
        result = _read_report(path)
        if isinstance(result, dict) and result.get("format") == TABLE_FORMAT:
            cells = result.get("cells")
            if not isinstance(cells, list) or not all(isinstance(c, dict) for c in cells):
                raise FastpplError(f"{path}: a fastppl table without its cells; pass a file written by fastppl eval "
                                   "--json")
            prefix = f"{label}: " if len(paths) > 1 else ""   # two tables (before and after) hold the same cells
            runs += [_checked_run(path, f"{prefix}{model_label(str(c.get('model')))} @ {c.get('corpus')}",
                                  c["report"]) for c in cells if isinstance(c.get("report"), dict)]
        elif not isinstance(result, dict):
            raise FastpplError(f"{path}: not a fastppl eval report (a JSON object is expected)")
        else:
            runs.append(_checked_run(path, label, result))
    return runs


def by_corpus(runs: Sequence[Run]) -> list[list[Run]]:
    """The runs grouped by the text they scored (first seen first): only runs of one text compare."""
    groups: dict = {}
    for run in runs:
        groups.setdefault(run.result.get("corpus_sha256") or corpus_key(run.result), []).append(run)
    return list(groups.values())


def corpus_key(result: dict) -> tuple:
    """For reports without corpus_sha256 (fastppl before it)."""
    cfg = result["config"]
    # names, not full paths: the same file reached from two working directories is the same corpus
    return tuple(Path(d).name for d in cfg.get("data", [])), cfg.get("split", "all")



def check_comparable(runs: Sequence[Run], force: bool) -> None:
    if force or len(runs) < 2:
        return
    first = runs[0]
    for run in runs[1:]:
        digests = (first.result.get("corpus_sha256"), run.result.get("corpus_sha256"))
        if None not in digests:   # reports since the digest: the text itself decides, not the file names
            if digests[0] != digests[1]:
                raise FastpplError(
                    f"runs are not comparable: {first.label} and {run.label} scored different text "
                    f"({corpus_label(first.result)}, {corpus_label(run.result)}: corpus_sha256 differs); "
                    "pass --force to compare them anyway")
            continue   # the same text: other token counts (another tokenizer) compare by bits per byte
        if corpus_key(run.result) != corpus_key(first.result):
            raise FastpplError(
                f"runs are not comparable: {first.label} scored {corpus_label(first.result)} but {run.label} scored "
                f"{corpus_label(run.result)}; pass --force to compare them anyway"
            )
        if run.result["tokens_scored"] != first.result["tokens_scored"]:
            raise FastpplError(
                f"runs are not comparable: {first.label} scored {first.result['tokens_scored']:,} tokens but "
                f"{run.label} scored {run.result['tokens_scored']:,} (another tokenizer, window mode or --bos?); "
                "pass --force to compare them anyway"
            )


def _or_nan(value) -> float:
    return math.nan if value is None else value


def differences(first: dict, other: dict) -> dict:
    """other against first: absolute NLL and bits/byte, relative perplexity, speed ratio."""
    def ratio(a, b):
        known = a is not None and b is not None and not (math.isnan(a) or math.isnan(b)) and a != 0
        return b / a if known else math.nan
    return {
        "nll": other["nll"] - first["nll"],
        "ppl_relative": ratio(first["ppl"], other["ppl"]) - 1,
        "bits_per_byte": _or_nan(other.get("bits_per_byte")) - _or_nan(first.get("bits_per_byte")),
        "speedup": ratio(first.get("tokens_per_second"), other.get("tokens_per_second")),
    }


def _number(x, spec: str) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def window_label(result: dict) -> str:
    """"chunked 1024" or "sliding 1024/512 bos": what tells runs of one model and corpus apart."""
    window, ctx, stride = result.get("window", "?"), result.get("ctx", "?"), result.get("stride")
    bos = " bos" if window == "sliding" and result.get("config", {}).get("bos") else ""
    return f"{window} {ctx}" + (f"/{stride}" if stride else "") + bos


def runs_table(runs: Sequence[Run], markdown: bool = False) -> str:
    headers = ["run", "model", "corpus", "window", "tokens", "NLL", "ΔNLL", "PPL", "ΔPPL", "bits/byte",
               "Δbits/byte", "tokens/s", "speed", "device", "dtype"]
    right = [False, False, False, False, True, True, True, True, True, True, True, True, True, False, False]
    rows = []
    first = runs[0].result
    not_comparable = False
    for i, run in enumerate(runs):
        r = run.result
        d = differences(first, r) if i else None
        per_token = d is None or per_token_comparable(first, r)
        not_comparable |= not per_token
        rows.append([
            run.label, model_label(r["config"].get("model", "?")), corpus_label(r), window_label(r),
            _number(r["tokens_scored"], ","), _number(r["nll"], ".6f") + plus_minus(r.get("nll_stderr")),
            ("" if not d else _number(d["nll"], "+.6f") if per_token else "n/c"), _number(r["ppl"], ".4f"),
            ("" if not d else _number(d["ppl_relative"], "+.3%") if per_token else "n/c"),
            _number(r.get("bits_per_byte"), ".6f"),
            _number(d["bits_per_byte"], "+.6f") if d else "", _number(r.get("tokens_per_second"), ",.0f"),
            ("×" + _number(d["speedup"], ".2f")) if d else "",
            r.get("environment", {}).get("device_name", "?"), r.get("dtype", "?"),
        ])
    table = format_table(headers, rows, markdown, right)
    if len(runs) > 1:
        table += f"\n\nΔ: against the first run ({runs[0].label}); ΔPPL is relative, speed is the ratio of tokens/s."
    if not_comparable:
        table += ("\nn/c: not comparable: these runs scored other tokens of the same text (another tokenizer or "
                  "windows); NLL and perplexity are per token, so compare them by bits/byte.")
    return table


def load_per_doc(path: str) -> list[DocResult]:
    """One JSON object per line with at least id, tokens and nll_sum (and optionally bytes, words)."""
    documents, seen = [], set()
    text = read_text(path, "per-document .jsonl written by fastppl eval --per-doc")
    for number, record in json_lines(text, path, "pass a fastppl --per-doc file"):
        if not isinstance(record, dict):
            raise FastpplError(f"{path}:{number}: not a JSON object; pass a fastppl --per-doc file")
        missing = [f for f in REQUIRED_DOC_FIELDS if f not in record]
        if missing:
            raise FastpplError(f"{path}:{number}: no {missing[0]!r} field; pass a fastppl --per-doc file")
        tokens, nll_sum, n_bytes = record["tokens"], record["nll_sum"], record.get("bytes")
        if not is_count(tokens):
            raise FastpplError(f"{path}:{number}: 'tokens' must be a non-negative integer, got {tokens!r:.40}")
        if not (is_number(nll_sum) and math.isfinite(nll_sum)):
            raise FastpplError(f"{path}:{number}: 'nll_sum' must be a finite number, got {nll_sum!r:.40}")
        if n_bytes is not None and not is_count(n_bytes):
            raise FastpplError(f"{path}:{number}: 'bytes' must be a non-negative integer, got {n_bytes!r:.40}")
        doc_id = str(record["id"])
        if doc_id in seen:
            raise FastpplError(f"{path}:{number}: document id {doc_id!r} appears twice; ids must be unique")
        seen.add(doc_id)
        documents.append(DocResult(doc_id, tokens, float(nll_sum), n_bytes if isinstance(n_bytes, int) else None))
    if not documents:
        raise FastpplError(f"{path}: holds no documents")
    return documents


def check_per_doc_is_the_runs(run: Run, path: str, docs: Sequence[DocResult]) -> None:
    """A per-document file shown under a run's label must sum to that run's totals."""
    tokens, nll_sum = sum(d.tokens for d in docs), math.fsum(d.nll_sum for d in docs)
    expected_tokens = run.result["tokens_scored"]
    expected_nll = run.result.get("nll_sum", nll_sum)   # a report of an older fastppl may lack it
    # per-document and total sums are separate float64 sums of the same values: equal to well within 1e-9
    if tokens != expected_tokens or not math.isclose(nll_sum, expected_nll, rel_tol=1e-9, abs_tol=1e-9):
        raise FastpplError(
            f"{path}: is not the per-document file of {run.path} (its documents sum to {tokens:,} tokens and "
            f"NLL {nll_sum:.6f}, the report to {expected_tokens:,} and {expected_nll:.6f}); pass each run's own "
            "--per-doc file in order, or --force")


def check_docs_comparable(doc_sets: Sequence[list[DocResult]], labels: Sequence[str], force: bool,
                          one_text: bool = False) -> None:
    """The same documents, with the same token counts unless one_text (the runs' reports share corpus_sha256:
    other token counts are another tokenizer's)."""
    if force or len(doc_sets) < 2:
        return
    first = {d.id: d.tokens for d in doc_sets[0]}
    for docs, label in zip(doc_sets[1:], labels[1:]):
        other = {d.id: d.tokens for d in docs}
        if other.keys() != first.keys():
            only = sorted(first.keys() ^ other.keys())
            raise FastpplError(
                f"per-document results are not comparable: {labels[0]} and {label} hold different documents "
                f"({len(only):,} differ, e.g. {only[0]!r}); pass --force to compare them anyway"
            )
        changed = [i for i in first if first[i] != other[i]]
        if changed and not one_text:
            raise FastpplError(
                f"per-document results are not comparable: {len(changed):,} document(s) have other token counts "
                f"in {label} than in {labels[0]} (e.g. {changed[0]!r}: {first[changed[0]]} vs {other[changed[0]]}); "
                "pass --force to compare them anyway"
            )


def scored_documents(docs: Sequence[DocResult], min_tokens: int) -> list[DocResult]:
    """Documents long enough for their per-token NLL to mean something (and at least one token)."""
    return [d for d in docs if d.tokens >= max(min_tokens, 1)]


def per_doc_report(doc_sets: Sequence[list[DocResult]], labels: Sequence[str], markdown: bool = False,
                   worst: int = 5, min_tokens: int = 10) -> str:
    sections = []
    kept_sets = [scored_documents(docs, min_tokens) for docs in doc_sets]
    summary_rows = []
    for docs, kept, label in zip(doc_sets, kept_sets, labels):
        nll = np.array([d.nll for d in kept]) if kept else np.zeros(0)
        summary_rows.append([
            label, f"{len(docs):,}", f"{len(docs) - len(kept):,}",
            *(_number(float(f(nll)), ".4f") if len(nll) else "n/a"
              for f in (np.mean, np.median, lambda x: np.percentile(x, 90), np.max)),
        ])
    sections.append(f"per-document NLL (nats/token; documents of fewer than {min_tokens} tokens are left out)\n"
                    + format_table(["per-doc", "documents", "left out", "mean", "median", "p90", "max"],
                                   summary_rows, markdown, [False] + [True] * 6))
    for kept, label in zip(kept_sets, labels):
        ranked = sorted(kept, key=lambda d: -d.nll)[:worst]
        rows = [[d.id, f"{d.tokens:,}", f"{d.nll:.4f}", _number(d.bits_per_byte, ".4f")] for d in ranked]
        sections.append(f"worst documents of {label}\n"
                        + format_table(["id", "tokens", "NLL/token", "bits/byte"], rows, markdown,
                                       [False, True, True, True]))
    if len(doc_sets) > 1:
        base = {d.id: d for d in kept_sets[0]}
        for kept, label in zip(kept_sets[1:], labels[1:]):
            # other token counts (another tokenizer on the same text): per token means nothing, per byte does
            by_byte = any(d.id in base and d.tokens != base[d.id].tokens for d in kept)
            value = (lambda d: d.bits_per_byte) if by_byte else (lambda d: d.nll)  # noqa: E731
            # increases only: a document whose NLL fell is not one to look at here
            pairs = [(base[d.id], d) for d in kept if d.id in base and value(d) > value(base[d.id])]
            pairs.sort(key=lambda p: -(value(p[1]) - value(p[0])))
            rows = [[b.id, f"{b.tokens:,}", f"{value(a):.4f}", f"{value(b):.4f}", f"{value(b) - value(a):+.4f}"]
                    for a, b in pairs[:worst]]
            title = (f"largest per-document increases of {label} against {labels[0]}"
                     + (" in bits/byte (other tokens of the same text)" if by_byte else ""))
            sections.append(title + "\n" + (format_table(["id", "tokens", labels[0], label, "Δ"], rows, markdown,
                                                         [False, True, True, True, True])
                                            if rows else "none: no document's NLL per token rose"))
    return "\n\n".join(sections)


def _per_doc_path_of(run: Run) -> Optional[str]:
    """The run's "per_doc_path", as written (relative to where eval ran) or relative to the report."""
    recorded = run.result.get("per_doc_path")
    if not recorded:
        return None
    for candidate in (Path(recorded), Path(run.path).parent / recorded):
        if candidate.is_file():
            return str(candidate)
    raise FastpplError(f"{run.path}: its per_doc_path {recorded} does not exist; pass --per-doc PATH")


def _runs_sections(runs: Sequence[Run], markdown: bool) -> str:
    paired = paired_table(runs, markdown)
    return runs_table(runs, markdown) + (f"\n\n{paired}" if paired else "")


def _is_table(path: str) -> bool:
    result = _read_report(path)
    return isinstance(result, dict) and result.get("format") == TABLE_FORMAT


def compare(run_paths: Sequence[str], per_doc_paths: Sequence[str] = (), plot: Optional[str] = None,
            markdown: bool = False, force: bool = False, worst: int = 5, min_doc_tokens: int = 10) -> str:
    """The text that `fastppl compare` prints; writes the figure to plot when given."""
    if not run_paths and not per_doc_paths:
        raise FastpplError("nothing to compare; pass eval --json reports and/or --per-doc files")
    if worst < 0 or min_doc_tokens < 0:
        raise FastpplError("--worst and --min-doc-tokens must be at least 0")
    if plot:
        check_plot_path(plot)
    runs = load_runs(run_paths)
    if any(_is_table(p) for p in run_paths):   # a table's cells: one comparison per corpus
        if plot or per_doc_paths:
            raise FastpplError("--plot and --per-doc compare single runs; a table's cells have no per-document files "
                               "or figure: pass the tables alone")
        return "\n\n".join(_runs_sections(group, markdown) for group in by_corpus(runs))
    check_comparable(runs, force)
    lacking = [r.path for r in runs if not r.result.get("nll_by_position")]
    if plot and lacking:
        raise FastpplError(f"{lacking[0]}: has no nll_by_position to draw (an older fastppl wrote it); "
                           "run eval again, or drop --plot")

    if per_doc_paths:   # given as many as runs, the files are the runs' own, in order, under their labels
        paired_runs = runs if len(runs) == len(per_doc_paths) else []
        doc_labels = [r.label for r in paired_runs] or _labels(per_doc_paths)
    else:
        with_docs = [(r, _per_doc_path_of(r)) for r in runs]
        with_docs = [(r, p) for r, p in with_docs if p]
        per_doc_paths, paired_runs = [p for _, p in with_docs], [r for r, _ in with_docs]
        doc_labels = [r.label for r in paired_runs]
    doc_sets = [load_per_doc(p) for p in per_doc_paths]
    if not force:
        for run, path, docs in zip(paired_runs, per_doc_paths, doc_sets):
            check_per_doc_is_the_runs(run, path, docs)
    one_text = len(paired_runs) == len(doc_sets) and all(same_text(paired_runs[0].result, r.result)
                                                         for r in paired_runs[1:])
    check_docs_comparable(doc_sets, doc_labels, force, one_text)

    sections = [_runs_sections(runs, markdown)] if runs else []
    if doc_sets:
        sections.append(per_doc_report(doc_sets, doc_labels, markdown, worst, min_doc_tokens))

    if plot:
        per_doc_nll = [[d.nll for d in scored_documents(docs, min_doc_tokens)] for docs in doc_sets]
        if runs and all(len(nll) <= 1 for nll in per_doc_nll):   # a histogram of one value each says nothing
            per_doc_nll = []
        figure = comparison_figure([r.result for r in runs], [r.label for r in runs],
                                   per_doc_nll or None, doc_labels)
        save_figure(figure, plot)
    return "\n\n".join(sections)
