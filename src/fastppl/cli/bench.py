"""`fastppl bench`: fastppl against its peers (dense rows), its batching modes (--corpus docs), its scaling over
processes (--nproc), or its decode speed (--generate), each on seeded random weights."""
from __future__ import annotations

import argparse
import sys

from ..errors import FastpplError
from .args import DEVICE_HELP, FLAG_OFF, PRESETS_HELP, at_least

# bench options that only one of its two kinds reads, with their defaults: given to the other, they were ignored
SCORING_ONLY = {"--tokens": ("tokens", 1_048_576), "--naive-tokens": ("naive_tokens", None),
                "--loss": ("loss", "auto"), "--variants": ("variants", False), "--nproc": ("nproc", None),
                "--tokenizer": ("tokenizer", None), "--corpus": ("corpus", "dense"),
                "--documents": ("documents", 10_000), "--compile": ("compile", "auto"), "--rounds": ("rounds", 1),
                "--tune-products": ("tune_products", "off")}
GENERATE_ONLY = {"--batch-sizes": ("batch_sizes", "1,64"), "--new-tokens": ("new_tokens", 256),
                 "--prompt-tokens": ("prompt_tokens", 32)}

# scoring options that only some of bench's three scoring kinds read: the peers' bench (dense), --corpus docs and
# --nproc. Given to another kind, they were ignored.
SCORING_KINDS = {"--tokens": ("dense", "nproc"), "--naive-tokens": ("dense",), "--variants": ("dense",),
                 "--peers": ("dense",), "--rounds": ("dense",), "--compile": ("dense", "docs"),
                 "--documents": ("docs",), "--tokenizer": ("nproc",), "--tune-products": ("dense",)}
KIND_NAMES = {"dense": "the peers' bench (--corpus dense)", "docs": "--corpus docs", "nproc": "--nproc"}


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("bench", help="fastppl against its peers on the same weights and tokens",
                       description="fastppl against its peers on the same seeded random weights and tokens: "
                                   "scoring (the default), --corpus docs, --nproc or --generate.")
    p.add_argument("--model", default="random:gpt2",
                   help=f"random:PRESET, seeded random weights of a built-in shape ({PRESETS_HELP}); with --nproc "
                        "also a checkpoint directory or hub id (default: %(default)s)")
    p.add_argument("--device", default="auto", help=DEVICE_HELP)
    p.add_argument("--peers", help="comma-separated subset of naive,autocast,hf-bf16,hf-compiled,fastppl; with "
                                   "--generate of fastppl,hf-static,hf-dynamic (default: all; scoring a Llama "
                                   "preset, all but naive and autocast)")
    p.add_argument("--json", help="write the report here (default: not written)")
    p.add_argument("--quiet", action="store_true", help="no progress lines (default: off: progress on stderr)")
    _add_scoring_arguments(p.add_argument_group("scoring (without --generate)"))
    _add_generate_arguments(p.add_argument_group("decoding (--generate)"))
    p.set_defaults(run=run_bench)
    return p


def _add_scoring_arguments(p) -> None:
    p.add_argument("--tokens", type=at_least(1), default=SCORING_ONLY["--tokens"][1],
                   help="tokens through each peer, or through each --nproc run, in whole batches (default: "
                        "%(default)s)")
    p.add_argument("--naive-tokens", type=at_least(1), help="tokens through the (slow) naive loop (default: --tokens)")
    p.add_argument("--seq", "--ctx", type=at_least(2),
                   help="row length; --corpus docs: the ctx of its windows (default: 1024 for GPT-2 presets, 2048 "
                        "for Llama presets; 1024 with --corpus docs or --nproc)")
    p.add_argument("--batch-size", type=at_least(1),
                   help="rows per batch (default: 64 for GPT-2 presets, 8 for Llama presets; 64 with --corpus docs "
                        "or --nproc)")
    p.add_argument("--loss", default=SCORING_ONLY["--loss"][1], choices=["auto", "chunked", "fused"],
                   help="fastppl's per-token loss, as eval's --loss (default: %(default)s: fused where CUDA and "
                        "Triton are available, else chunked)")
    p.add_argument("--variants", action="store_true", help="also time the other loss and compile choices" + FLAG_OFF)
    p.add_argument("--corpus", default=SCORING_ONLY["--corpus"][1], choices=["dense", "docs"],
                   help="dense: random full rows, fastppl against HF peers; docs: synthetic documents through "
                        "packed, bucketed, padded and an lm-eval-style baseline (default: %(default)s)")
    p.add_argument("--documents", type=at_least(1), default=SCORING_ONLY["--documents"][1],
                   help="--corpus docs: documents (default: %(default)s)")
    p.add_argument("--nproc", metavar="N[,N...]",
                   help="instead of the peers: fastppl eval tokens/s on 1 and N processes (GPUs) of this machine, "
                        "speed-up and scaling efficiency; a list such as 1,2,4,8 runs each (default: off)")
    p.add_argument("--tokenizer", help="with --nproc: the tokenizer whose vocabulary the random ids are drawn from "
                                       "(default: the model's own; gpt2's for random:PRESET)")
    p.add_argument("--compile", default=SCORING_ONLY["--compile"][1], choices=["auto", "on", "off"],
                   help="compile fastppl's scorer (default: %(default)s: as eval would for this many tokens)")
    p.add_argument("--tune-products", default=SCORING_ONLY["--tune-products"][1], choices=["on", "off"],
                   help="time cuBLASLt's candidate kernels for fastppl's products, as eval --tune-products on "
                        "(default: %(default)s)")
    p.add_argument("--rounds", type=at_least(1), default=SCORING_ONLY["--rounds"][1],
                   help="run every peer this many times, one round after another; the table gives medians and the "
                        "rounds' range (default: %(default)s; 3 for a figure to quote)")


def _add_generate_arguments(p) -> None:
    p.add_argument("--generate", action="store_true",
                   help="decode speed: fastppl generate against transformers generate (static, dynamic cache)"
                        + FLAG_OFF)
    p.add_argument("--batch-sizes", default=GENERATE_ONLY["--batch-sizes"][1],
                   help="comma-separated batch sizes (default: %(default)s)")
    p.add_argument("--new-tokens", type=at_least(1), default=GENERATE_ONLY["--new-tokens"][1],
                   help="new tokens per row (default: %(default)s)")
    p.add_argument("--prompt-tokens", type=at_least(1), default=GENERATE_ONLY["--prompt-tokens"][1],
                   help="random prompt tokens per row (default: %(default)s)")


def _check_options(args: argparse.Namespace) -> None:
    other = SCORING_ONLY if args.generate else GENERATE_ONLY
    given = [flag for flag, (dest, default) in other.items() if getattr(args, dest) != default]
    if given:
        kind = "scoring (bench without --generate)" if args.generate else "bench --generate"
        raise FastpplError(f"{', '.join(given)} apply to {kind} only; drop them")


def _check_scoring_kind(args: argparse.Namespace) -> None:
    kind = "nproc" if args.nproc is not None else args.corpus
    read = {**SCORING_ONLY, "--peers": ("peers", None)}   # flag -> (dest, default); --peers is --generate's too
    given = [flag for flag, kinds in SCORING_KINDS.items()
             if kind not in kinds and getattr(args, read[flag][0]) != read[flag][1]]
    if given:
        by_readers: dict[tuple, list[str]] = {}
        for flag in given:
            by_readers.setdefault(SCORING_KINDS[flag], []).append(flag)
        where = "; ".join(f"{', '.join(flags)}: {' and '.join(KIND_NAMES[k] for k in readers)}"
                          for readers, flags in by_readers.items())
        raise FastpplError(f"{', '.join(given)} do not apply to {KIND_NAMES[kind]} ({where}); drop them")


def _check_peers(peers) -> None:
    if peers is not None and not peers.strip(","):
        raise FastpplError("--peers is empty; name at least one peer, or leave --peers out for all of them")
    if peers is not None:
        names = peers.split(",")
        if any(not name.strip() for name in names) or len(set(names)) < len(names):
            raise FastpplError(f"--peers {peers!r} has an empty or repeated name; name each peer once")


def run_bench(args: argparse.Namespace) -> int:
    from ..report.files import check_distinct_outputs
    check_distinct_outputs({"--json": args.json})
    _check_peers(args.peers)
    _check_options(args)
    if args.generate:
        from ..bench.generate import run_from_args as run_generate_bench
        return run_generate_bench(args)
    _check_scoring_kind(args)
    if args.nproc is not None or args.corpus == "docs":
        # these measure fastppl alone on GPT-2-shaped rows: the dense bench's defaults
        args.seq = args.seq or 1024
        args.batch_size = args.batch_size or 64
    if args.nproc is not None:
        from ..bench.parallel import run_from_args as run_parallel_bench
        return run_parallel_bench(args)
    if args.corpus == "docs":
        return run_bench_docs(args)
    return run_bench_dense(args)


def _log(args: argparse.Namespace):
    return (lambda line: None) if args.quiet else (lambda line: print(line, file=sys.stderr, flush=True))


def run_bench_dense(args: argparse.Namespace) -> int:
    from ..bench.dense import format_table, run_bench_rounds
    from ..report.files import check_writable, write_json
    if args.json:
        check_writable(args.json, "--json")
    peers = args.peers.split(",") if args.peers else None
    report = run_bench_rounds(args.rounds, _log(args), model_spec=args.model, n_tokens=args.tokens,
                              seq_len=args.seq, batch_size=args.batch_size, device_name=args.device, peers=peers,
                              loss=args.loss, naive_tokens=args.naive_tokens, variants=args.variants,
                              compile=args.compile, tune_products=args.tune_products)
    if args.json:
        write_json(args.json, report)
    print(format_table(report))
    return 0


def run_bench_docs(args: argparse.Namespace) -> int:
    from ..bench.documents import format_docs_table, run_docs_bench
    from ..report.files import check_writable, write_json
    if args.json:
        check_writable(args.json, "--json")
    report = run_docs_bench(args.model, args.documents, args.seq, args.batch_size, args.device, args.loss,
                            args.compile, log=_log(args))
    if args.json:
        write_json(args.json, report)
    print(format_docs_table(report))
    if not report["nll_agrees"]:   # the correctness check: a failing check exits non-zero
        print("fastppl: error: the modes' total NLL disagree beyond the tolerance", file=sys.stderr)
        return 1
    return 0
