"""Command line: parse args -> EvalConfig -> run -> report. User errors exit 2 with one line."""
from __future__ import annotations

import argparse
import json
import sys
from typing import Optional, Sequence

from .errors import FastpplError


def _add_eval_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="HF checkpoint directory, hub id, or random:gpt2[-medium|-large|-xl|-tiny]")
    p.add_argument("--data", required=True, action="append",
                   help="text file, .jsonl (one document per line), or built-in 'tinyshakespeare'; repeatable")
    p.add_argument("--tokenizer", help="tokenizer directory or hub id (default: the model's)")
    p.add_argument("--split", default="all", choices=["train", "val", "all"],
                   help="nanoGPT split of a single text: first 90%% / last 10%% of the characters")
    p.add_argument("--text-field", default="text", help="field of a .jsonl line holding the text")
    p.add_argument("--data-dir", help="directory holding local copies of built-in corpora (or FASTPPL_DATA_DIR)")
    p.add_argument("--errors", default="strict", choices=["strict", "replace"], help="undecodable UTF-8 bytes")
    p.add_argument("--window", default="chunked", choices=["chunked", "sliding"])
    p.add_argument("--ctx", type=int, help="tokens per window (default: the model's maximum)")
    p.add_argument("--stride", type=int, help="sliding: tokens between window starts (default ctx/2)")
    p.add_argument("--bos", action="store_true", help="sliding: prefix BOS so that the first token is scored")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16", "fp16"])
    p.add_argument("--backend", default="auto", choices=["auto", "native", "hf"])
    p.add_argument("--compile", default="auto", choices=["auto", "on", "off"])
    p.add_argument("--loss-chunk-rows", type=int, default=8192)
    p.add_argument("--seed", type=int, default=0, help="seed of random:<preset> weights")
    p.add_argument("--json", help="write the full report here")
    p.add_argument("--per-token", help="write per-token NLL here (.npy float32, NaN where unscored)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--plot", help="draw the loss by window position here (.png, .svg or .pdf; needs fastppl[plot])")


def _config_from_args(args: argparse.Namespace):
    from .config import EvalConfig
    return EvalConfig(
        model=args.model, data=args.data, tokenizer=args.tokenizer, split=args.split,
        text_field=args.text_field, data_dir=args.data_dir, errors=args.errors, window=args.window,
        ctx=args.ctx, stride=args.stride, bos=args.bos, batch_size=args.batch_size, device=args.device,
        dtype=args.dtype, backend=args.backend, compile=args.compile, loss_chunk_rows=args.loss_chunk_rows,
        seed=args.seed, per_token=args.per_token, quiet=args.quiet,
    )


def run_eval(args: argparse.Namespace) -> int:
    from .pipeline import evaluate
    from .report import check_writable, summary, write_json, write_npy

    for flag, path in (("--json", args.json), ("--per-token", args.per_token)):
        if path:
            check_writable(path, flag)
    if args.plot:
        from .plot import check_plot_path
        check_plot_path(args.plot)
    result = evaluate(_config_from_args(args))
    per_token = result.pop("_per_token", None)
    if args.per_token:
        write_npy(args.per_token, per_token)
    if args.json:
        write_json(args.json, result)
    if args.plot:
        from .plot import write_loss_by_position
        write_loss_by_position(args.plot, result)
    print(summary(result))
    return 0


def _add_compare_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("runs", nargs="*", metavar="RUN.json", help="reports written by eval --json")
    p.add_argument("--per-doc", nargs="+", metavar="DOCS.jsonl",
                   help="per-document results written by eval --per-doc (default: the reports' per_doc_path)")
    p.add_argument("--plot", help="overlay the runs' loss by position (and per-document NLL) here")
    p.add_argument("--markdown", action="store_true", help="print Markdown tables")
    p.add_argument("--force", action="store_true", help="compare runs of different corpora or token counts")
    p.add_argument("--worst", type=int, default=5, help="worst documents to name per run")
    p.add_argument("--min-doc-tokens", type=int, default=10,
                   help="leave shorter documents out of the per-document statistics")


def run_compare(args: argparse.Namespace) -> int:
    from .compare import compare
    print(compare(args.runs, args.per_doc or (), args.plot, args.markdown, args.force, args.worst,
                  args.min_doc_tokens))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fastppl", description="Exact perplexity of causal language models, fast.")
    sub = parser.add_subparsers(dest="command", required=True)
    eval_parser = sub.add_parser("eval", help="NLL, perplexity and bits per byte of a model over a corpus")
    _add_eval_arguments(eval_parser)
    eval_parser.set_defaults(run=run_eval)
    compare_parser = sub.add_parser("compare", help="runs side by side, with differences against the first")
    _add_compare_arguments(compare_parser)
    compare_parser.set_defaults(run=run_compare)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except FastpplError as e:
        print(f"fastppl: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("fastppl: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
