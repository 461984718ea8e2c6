"""`fastppl compare`: eval reports (and per-document results) side by side, with differences against the first."""
from __future__ import annotations

import argparse

from .args import FLAG_OFF


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("compare", help="runs side by side, with differences against the first",
                       description="Runs side by side, with differences against the first: eval --json reports "
                                   "and/or eval --per-doc files.")
    p.add_argument("runs", nargs="*", metavar="RUN.json",
                   help="reports written by eval --json (default: none; then give --per-doc)")
    p.add_argument("--per-doc", nargs="+", metavar="DOCS.jsonl",
                   help="per-document results written by eval --per-doc (default: the files named by the reports' "
                        "per_doc_path, where they have one)")
    p.add_argument("--plot", help="overlay the runs' loss by position (and per-document NLL) here (.png, .svg or "
                                  ".pdf; needs matplotlib) (default: not drawn)")
    p.add_argument("--markdown", action="store_true", help="print Markdown tables (default: off: plain text)")
    p.add_argument("--force", action="store_true",
                   help="compare runs of different corpora or token counts, and per-document results of different "
                        "documents" + FLAG_OFF)
    p.add_argument("--worst", type=int, default=5, help="worst documents to name per run (default: %(default)s)")
    p.add_argument("--min-doc-tokens", type=int, default=10,
                   help="leave shorter documents out of the per-document statistics (default: %(default)s)")
    p.set_defaults(run=run_compare)
    return p


def run_compare(args: argparse.Namespace) -> int:
    from ..report.compare import compare
    from ..report.files import check_distinct_outputs
    check_distinct_outputs({"--plot": args.plot}, inputs=[*args.runs, *(args.per_doc or ())])
    print(compare(args.runs, args.per_doc or (), args.plot, args.markdown, args.force, args.worst,
                  args.min_doc_tokens))
    return 0
