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
                   help="text file, .jsonl (one document per line), directory (one document per file), "
                        "hf:NAME[:CONFIG]:SPLIT (a Hugging Face dataset), or built-in 'tinyshakespeare'; repeatable")
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
    p.add_argument("--batching", default="auto", choices=["auto", "packed", "bucketed", "padded"],
                   help="packed: several documents per row with a document mask; bucketed: rows of a few lengths; "
                        "padded: every window its own row of ctx (auto: packed for several documents, else padded)")
    p.add_argument("--per-doc", help="write one JSON line per scored document here (id, tokens, bytes, words, nll_sum)")
    p.add_argument("--resume", metavar="DIR", help="checkpoint into DIR, and resume from the checkpoint found there")
    p.add_argument("--checkpoint-seconds", type=float, default=60.0, help="with --resume: checkpoint at least this often")
    p.add_argument("--checkpoint-batches", type=int, help="with --resume: also checkpoint every this many batches")


def _config_from_args(args: argparse.Namespace):
    from .config import EvalConfig
    return EvalConfig(
        model=args.model, data=args.data, tokenizer=args.tokenizer, split=args.split,
        text_field=args.text_field, data_dir=args.data_dir, errors=args.errors, window=args.window,
        ctx=args.ctx, stride=args.stride, bos=args.bos, batch_size=args.batch_size, device=args.device,
        dtype=args.dtype, backend=args.backend, compile=args.compile, loss_chunk_rows=args.loss_chunk_rows,
        seed=args.seed, per_token=args.per_token, quiet=args.quiet,
        batching=args.batching, per_doc=args.per_doc, resume=args.resume,
        checkpoint_seconds=args.checkpoint_seconds, checkpoint_batches=args.checkpoint_batches,
    )


def run_eval(args: argparse.Namespace) -> int:
    from .pipeline import evaluate
    from .report import check_writable, summary, write_json, write_jsonl, write_npy

    for flag, path in (("--json", args.json), ("--per-token", args.per_token), ("--per-doc", args.per_doc)):
        if path:
            check_writable(path, flag)
    result = evaluate(_config_from_args(args))
    per_token = result.pop("_per_token", None)
    per_doc = result.pop("_per_doc", None)
    if args.per_token:
        write_npy(args.per_token, per_token)
    if args.per_doc:
        write_jsonl(args.per_doc, per_doc)
    if args.json:
        write_json(args.json, result)
    print(summary(result))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fastppl", description="Exact perplexity of causal language models, fast.")
    sub = parser.add_subparsers(dest="command", required=True)
    eval_parser = sub.add_parser("eval", help="NLL, perplexity and bits per byte of a model over a corpus")
    _add_eval_arguments(eval_parser)
    eval_parser.set_defaults(run=run_eval)
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
