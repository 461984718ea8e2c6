"""Command line: parse args -> EvalConfig -> run -> report. User errors exit 2 with one line."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Optional, Sequence

from ..errors import FastpplError


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (no usage block), exit code 2 as for every other bad input."""

    def error(self, message: str):
        self.exit(2, f"fastppl: error: {message}; see {self.prog} --help\n")


def _batch_size(value: str):
    if value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer or auto, got {value!r}") from None


def _at_least(minimum: int):
    """An argparse type: an integer of at least minimum."""
    def parse(value: str) -> int:
        try:
            number = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {value!r}") from None
        if number < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {number}")
        return number
    return parse


def _seed(value: str) -> int:
    """torch seeds with a 64-bit integer; a larger one fails deep inside torch."""
    number = _at_least(-2**63)(value)
    if number >= 2**64:
        raise argparse.ArgumentTypeError(f"must be below 2**64, got {number}")
    return number


def _add_eval_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="HF checkpoint directory, hub id, or random:gpt2[-medium|-large|-xl|-tiny]")
    p.add_argument("--data", required=True, action="append",
                   help="text file, .jsonl (one document per line), .npy (token ids of one document), "
                        "directory (one document per file), hf:NAME[:CONFIG]:SPLIT (a Hugging Face dataset), "
                        "or built-in 'tinyshakespeare'; repeatable")
    p.add_argument("--tokenizer", help="tokenizer directory or hub id (default: the model's)")
    p.add_argument("--split", default="all", choices=["train", "val", "all"],
                   help="nanoGPT split of a single text: first 90%% / last 10%% of the characters")
    p.add_argument("--text-field", help="field of a .jsonl line or hf: dataset row holding the text (default: text)")
    p.add_argument("--data-dir", help="directory holding local copies of built-in corpora (or FASTPPL_DATA_DIR)")
    p.add_argument("--errors", default="strict", choices=["strict", "replace"], help="undecodable UTF-8 bytes")
    p.add_argument("--window", default="chunked", choices=["chunked", "sliding"],
                   help="chunked: every token scored once, disjoint windows from BOS (default); "
                        "sliding: the HF guide's strided windows (see README, 'What is measured')")
    p.add_argument("--ctx", type=int, help="tokens per window (default: the model's maximum)")
    p.add_argument("--stride", type=int, help="sliding: tokens between window starts (default ctx/2)")
    p.add_argument("--bos", action="store_true", help="sliding: prefix BOS so that the first token is scored")
    p.add_argument("--batch-size", type=_batch_size, default="auto",
                   help="rows per forward pass (a row holds one window, or several short ones when packed), or "
                        "auto: the largest that fits on a GPU with headroom, 8 on the CPU (the result does not "
                        "depend on it)")
    p.add_argument("--device", default="auto", help="auto (CUDA if visible, else cpu), cpu, cuda or cuda:N")
    p.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16", "fp16"],
                   help="weights and activations; the loss is always fp32 (auto: bf16 on CUDA, fp32 on cpu)")
    p.add_argument("--backend", default="auto", choices=["auto", "native", "hf"],
                   help="native GPT-2 or transformers' AutoModelForCausalLM (auto: native where it is exact)")
    p.add_argument("--compile", default="auto", choices=["auto", "on", "off"],
                   help="torch.compile the scorer (auto: on CUDA, only for runs long enough to repay it)")
    p.add_argument("--tune-products", default="auto", choices=["auto", "on", "off"],
                   help="time cuBLASLt's candidate kernels for each product shape once and keep the fastest "
                        "(CUDA, 16-bit, eager; picks are stored in the cache; auto: time them for runs long "
                        "enough to repay it, else use stored picks only)")
    p.add_argument("--loss", default="auto", choices=["auto", "chunked", "fused"],
                   help="per-token loss: chunked projection, or the fused Triton kernel (CUDA); auto = fused on CUDA")
    p.add_argument("--loss-chunk-rows", type=int, default=8192,
                   help="chunked loss: rows of the output projection computed at once (memory: rows x vocab x 4 bytes)")
    p.add_argument("--kv-cache", default="auto", choices=["auto", "on", "off"],
                   help="sliding, rotary models: reuse cached keys/values (faster, carries context from before "
                        "the window; see README); auto = off")
    p.add_argument("--seed", type=_seed, default=0, help="seed of random:<preset> weights")
    p.add_argument("--json", help="write the full report here")
    p.add_argument("--per-token", help="write per-token NLL here (.npy float32, NaN where unscored)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--batching", default="auto", choices=["auto", "packed", "bucketed", "padded"],
                   help="packed: several documents per row with a document mask; bucketed: rows of a few lengths; "
                        "padded: every window its own row of ctx (auto: one document padded; several packed where variable-length "
                        "flash attention runs and the run does not compile, else bucketed)")
    p.add_argument("--per-doc", help="write one JSON line per scored document here (id, tokens, bytes, words, nll_sum)")
    p.add_argument("--resume", metavar="DIR", help="checkpoint into DIR, and resume from the checkpoint found there")
    p.add_argument("--checkpoint-seconds", type=float, help="with --resume: checkpoint at least this often (default 60)")
    p.add_argument("--checkpoint-batches", type=int, help="with --resume: also checkpoint every this many batches")
    p.add_argument("--plot", help="draw the loss by window position here (.png, .svg or .pdf; needs matplotlib)")


def _check_model_given(model: str, tokenizer: Optional[str]) -> None:
    # else the tokenizer, loaded first from the model's name, would report these obscurely
    if not model.strip():
        raise FastpplError("--model is empty; give a checkpoint directory, a hub id or random:<preset>")
    if tokenizer is not None and not tokenizer.strip():   # else it would read as no --tokenizer, silently
        raise FastpplError("--tokenizer is empty; give a tokenizer directory or hub id, or leave it out")
    from ..models.loading import check_random_preset, local_checkpoint_dir
    check_random_preset(model)
    local_checkpoint_dir(model)


def _config_from_args(args: argparse.Namespace):
    _check_model_given(args.model, args.tokenizer)
    if args.resume is not None and not args.resume.strip():   # else it would read as no --resume, silently
        raise FastpplError("--resume: empty path; give a directory for the checkpoint or leave --resume out")
    if args.resume is None and (args.checkpoint_seconds is not None or args.checkpoint_batches is not None):
        raise FastpplError("--checkpoint-seconds and --checkpoint-batches apply with --resume only; add --resume DIR")
    if args.text_field is not None and not any(s.startswith("hf:") or Path(s).suffix == ".jsonl" for s in args.data):
        raise FastpplError("--text-field applies to .jsonl files and hf: datasets, and no --data is one; drop it")
    from ..config import EvalConfig
    return EvalConfig(
        model=args.model, data=args.data, tokenizer=args.tokenizer, split=args.split,
        text_field="text" if args.text_field is None else args.text_field, data_dir=args.data_dir,
        errors=args.errors, window=args.window,
        ctx=args.ctx, stride=args.stride, bos=args.bos, batch_size=args.batch_size, device=args.device,
        dtype=args.dtype, backend=args.backend, compile=args.compile, loss=args.loss, kv_cache=args.kv_cache,
        loss_chunk_rows=args.loss_chunk_rows, tune_products=args.tune_products,
        seed=args.seed, per_token=args.per_token, quiet=args.quiet,
        batching=args.batching, per_doc=args.per_doc, resume=args.resume,
        checkpoint_seconds=60.0 if args.checkpoint_seconds is None else args.checkpoint_seconds,
        checkpoint_batches=args.checkpoint_batches,
    )


def _check_eval_outputs(args: argparse.Namespace) -> None:
    from ..report.files import check_distinct_outputs, check_writable, files_in
    outputs = {"--json": args.json, "--per-token": args.per_token, "--per-doc": args.per_doc, "--plot": args.plot}
    # the corpus, and the files the model, tokenizer and built-in corpora are read from
    inputs = [*args.data, *files_in(args.model), *files_in(args.tokenizer), *files_in(args.data_dir)]
    check_distinct_outputs(outputs, inputs=inputs, output_dirs={"--resume": args.resume})
    for flag, path in outputs.items():
        if path and flag != "--plot":
            check_writable(path, flag)
    if args.plot:
        from ..report.plot import check_plot_path
        check_plot_path(args.plot)


def run_eval(args: argparse.Namespace) -> int:
    if args.nproc is not None and args.nproc != 1:
        # a bad option, output path or --data path fails here, once, not in every rank under torchrun's traceback
        _config_from_args(args)
        for flag, given in (("--resume", args.resume is not None), ("--kv-cache on", args.kv_cache == "on")):
            if given:   # each rank would refuse it (pipeline.evaluate), after starting torchrun
                raise FastpplError(f"{flag} runs in one process only; drop it or run without --nproc / torchrun")
        _check_eval_outputs(args)
        from ..data.corpus import BUILTINS
        for spec in args.data:
            if spec not in BUILTINS and not spec.startswith("hf:") and not Path(spec).expanduser().exists():
                raise FastpplError(f"{spec}: no such file; check the --data path")
        return _relaunch(args)
    from ..distributed import init_distributed, is_main_process, stop_all_on_failure
    from ..pipeline import evaluate
    from ..report.files import all_or_nothing, write_json, write_jsonl, write_npy
    from ..report.summary import summary

    @stop_all_on_failure   # under torchrun, rank 0's output check stops the other ranks too
    def check_outputs() -> None:
        init_distributed(args.device)   # None on one process; evaluate() joins the same job
        if is_main_process():
            _check_eval_outputs(args)

    config = _config_from_args(args)
    check_outputs()
    result = evaluate(config)
    if not is_main_process():
        return 0   # only rank 0 prints and writes
    per_token = result.pop("_per_token", None)
    per_doc = result.pop("_per_doc", None)
    with all_or_nothing():
        if args.per_token:
            write_npy(args.per_token, per_token)
        if args.per_doc:
            write_jsonl(args.per_doc, per_doc)
        if args.json:
            write_json(args.json, result)
        if args.plot:
            from ..report.plot import write_loss_by_position
            write_loss_by_position(args.plot, result)
    print(summary(result))
    return 0


# bench options that only one of its two kinds reads, with their defaults: given to the other, they were ignored
_BENCH_SCORING_ONLY = {"--tokens": ("tokens", 1_048_576), "--naive-tokens": ("naive_tokens", None),
                       "--loss": ("loss", "auto"), "--variants": ("variants", False), "--nproc": ("nproc", None),
                       "--tokenizer": ("tokenizer", None), "--corpus": ("corpus", "dense"),
                       "--documents": ("documents", 10_000), "--compile": ("compile", "auto"), "--rounds": ("rounds", 1),
                       "--tune-products": ("tune_products", "auto")}
_BENCH_GENERATE_ONLY = {"--batch-sizes": ("batch_sizes", "1,64"), "--new-tokens": ("new_tokens", 256),
                        "--prompt-tokens": ("prompt_tokens", 32)}


def _check_bench_options(args: argparse.Namespace) -> None:
    other = _BENCH_SCORING_ONLY if args.generate else _BENCH_GENERATE_ONLY
    given = [flag for flag, (dest, default) in other.items() if getattr(args, dest) != default]
    if given:
        kind = "scoring (bench without --generate)" if args.generate else "bench --generate"
        raise FastpplError(f"{', '.join(given)} apply to {kind} only; drop them")


# scoring options that only some of bench's three scoring kinds read: the peers' bench (dense), --corpus docs and
# --nproc. Given to another kind, they were ignored.
_BENCH_SCORING_KINDS = {"--tokens": ("dense", "nproc"), "--naive-tokens": ("dense",), "--variants": ("dense",),
                        "--peers": ("dense",), "--rounds": ("dense",), "--compile": ("dense", "docs"),
                        "--documents": ("docs",), "--tokenizer": ("nproc",), "--tune-products": ("dense",)}
_BENCH_KIND_NAMES = {"dense": "the peers' bench (--corpus dense)", "docs": "--corpus docs", "nproc": "--nproc"}


def _check_bench_scoring_kind(args: argparse.Namespace) -> None:
    kind = "nproc" if args.nproc is not None else args.corpus
    read = {**_BENCH_SCORING_ONLY, "--peers": ("peers", None)}   # flag -> (dest, default); --peers is --generate's too
    given = [flag for flag, kinds in _BENCH_SCORING_KINDS.items()
             if kind not in kinds and getattr(args, read[flag][0]) != read[flag][1]]
    if given:
        by_readers: dict[tuple, list[str]] = {}
        for flag in given:
            by_readers.setdefault(_BENCH_SCORING_KINDS[flag], []).append(flag)
        where = "; ".join(f"{', '.join(flags)}: {' and '.join(_BENCH_KIND_NAMES[k] for k in readers)}"
                          for readers, flags in by_readers.items())
        raise FastpplError(f"{', '.join(given)} do not apply to {_BENCH_KIND_NAMES[kind]} ({where}); drop them")


def run_bench(args: argparse.Namespace) -> int:
    from ..report.files import check_distinct_outputs
    check_distinct_outputs({"--json": args.json})
    if args.peers is not None and not args.peers.strip(","):
        raise FastpplError("--peers is empty; name at least one peer, or leave --peers out for all of them")
    if args.peers is not None:
        names = args.peers.split(",")
        if any(not name.strip() for name in names) or len(set(names)) < len(names):
            raise FastpplError(f"--peers {args.peers!r} has an empty or repeated name; name each peer once")
    _check_bench_options(args)
    if args.generate:
        from ..bench.generate import run_from_args as run_generate_bench
        return run_generate_bench(args)
    _check_bench_scoring_kind(args)
    if args.nproc is not None or args.corpus == "docs":
        # these measure fastppl alone on GPT-2-shaped rows: the dense bench's defaults
        args.seq = args.seq or 1024
        args.batch_size = args.batch_size or 64
    if args.nproc is not None:
        from ..bench.parallel import run_from_args as run_parallel_bench
        return run_parallel_bench(args)
    import sys as _sys
    if args.corpus == "docs":
        return run_bench_docs(args)
    from ..bench.dense import format_table, run_bench_rounds
    from ..report.files import check_writable, write_json
    if args.json:
        check_writable(args.json, "--json")
    log = (lambda line: None) if args.quiet else (lambda line: print(line, file=_sys.stderr, flush=True))
    peers = args.peers.split(",") if args.peers else None
    report = run_bench_rounds(args.rounds, log, model_spec=args.model, n_tokens=args.tokens, seq_len=args.seq,
                              batch_size=args.batch_size, device_name=args.device, peers=peers, loss=args.loss,
                              naive_tokens=args.naive_tokens, variants=args.variants, compile=args.compile,
                              tune_products=args.tune_products)
    if args.json:
        write_json(args.json, report)
    print(format_table(report))
    return 0


def run_bench_docs(args: argparse.Namespace) -> int:
    from ..bench.documents import format_docs_table, run_docs_bench
    from ..report.files import check_writable, write_json
    if args.json:
        check_writable(args.json, "--json")
    log = (lambda line: None) if args.quiet else (lambda line: print(line, file=sys.stderr, flush=True))
    report = run_docs_bench(args.model, args.documents, args.seq, args.batch_size, args.device, args.loss,
                            args.compile, log=log)
    if args.json:
        write_json(args.json, report)
    print(format_docs_table(report))
    if not report["nll_agrees"]:   # the correctness check: a failing check exits non-zero
        print("fastppl: error: the modes' total NLL disagree beyond the tolerance", file=sys.stderr)
        return 1
    return 0


def _relaunch(args: argparse.Namespace) -> int:
    from ..distributed import relaunch_under_torchrun
    if args.nproc < 1:
        raise FastpplError(f"--nproc must be at least 1, got {args.nproc}")
    return relaunch_under_torchrun(args.nproc, args.argv)



def _add_generate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="HF checkpoint directory, hub id, or random:<preset>")
    p.add_argument("--tokenizer", help="tokenizer directory or hub id (default: the model's)")
    p.add_argument("--prompt", action="append", default=[], help="a prompt; repeatable (prompts run as one batch)")
    p.add_argument("--prompts", help="file of prompts, one per line (\\n inside a line is a newline)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, help="sample from the k most likely tokens")
    p.add_argument("--top-p", type=float, help="sample from the smallest set of tokens whose probability reaches p")
    p.add_argument("--seed", type=_seed, help="sampling seed (default 0)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16", "fp16"])
    p.add_argument("--backend", default="auto", choices=["auto", "native"])
    p.add_argument("--compile", default="auto", choices=["auto", "on", "off"],
                   help="decode step under torch.compile + CUDA graphs (auto: on CUDA)")
    p.add_argument("--json", help="write completions and timings here")


def run_generate(args: argparse.Namespace) -> int:
    from ..generate import GenerateConfig, Sampling, generation_summary, read_prompts, run_generate as generate
    from ..report.files import check_distinct_outputs, check_writable, files_in, write_json

    inputs = [*([args.prompts] if args.prompts and args.prompts.strip() else []), *files_in(args.model),
              *files_in(args.tokenizer)]
    check_distinct_outputs({"--json": args.json}, inputs=inputs)
    if args.json:
        check_writable(args.json, "--json")
    _check_model_given(args.model, args.tokenizer)
    sampling_only = [flag for flag, value in (("--top-k", args.top_k), ("--top-p", args.top_p), ("--seed", args.seed))
                     if value is not None]
    if sampling_only and args.temperature == 0:
        verb = "apply" if len(sampling_only) > 1 else "applies"
        raise FastpplError(f"{', '.join(sampling_only)} {verb} to sampling, and --temperature 0 decodes greedily; "
                           "set --temperature > 0 or drop them")
    for prompt in args.prompt:
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError:   # argv bytes that are not UTF-8 arrive as surrogates
            raise FastpplError("a --prompt is not valid UTF-8 text; pass it in a UTF-8 file with --prompts") from None
    prompts = list(args.prompt) + (read_prompts(args.prompts) if args.prompts is not None else [])
    config = GenerateConfig(
        model=args.model, prompts=prompts, max_new_tokens=args.max_new_tokens, tokenizer=args.tokenizer,
        sampling=Sampling(args.temperature, args.top_k, args.top_p, 0 if args.seed is None else args.seed),
        device=args.device,
        dtype=args.dtype, backend=args.backend, compile=args.compile,
    )
    result = generate(config)
    if args.json:
        write_json(args.json, result)
    print(generation_summary(result))

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
    from ..report.compare import compare
    from ..report.files import check_distinct_outputs
    check_distinct_outputs({"--plot": args.plot}, inputs=[*args.runs, *(args.per_doc or ())])
    print(compare(args.runs, args.per_doc or (), args.plot, args.markdown, args.force, args.worst,
                  args.min_doc_tokens))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="fastppl", description="Exact perplexity of causal language models, fast.")
    sub = parser.add_subparsers(dest="command", required=True)
    eval_parser = sub.add_parser(
        "eval", help="NLL, perplexity and bits per byte of a model over a corpus",
        description="NLL, perplexity and bits per byte of a model over a corpus. "
                    "Example: fastppl eval --model gpt2 --data tinyshakespeare --split val")
    _add_eval_arguments(eval_parser)
    eval_parser.add_argument("--nproc", type=int,
                             help="processes (GPUs) on this machine: re-runs the command under torchrun")
    eval_parser.set_defaults(run=run_eval)
    bench_parser = sub.add_parser("bench", help="fastppl against its peers on the same weights and tokens")
    bench_parser.add_argument("--model", default="random:gpt2",
                              help="random:<preset>: gpt2[-medium|-large|-xl|-tiny], llama-1b, llama-tiny")
    bench_parser.add_argument("--tokens", type=_at_least(1), default=_BENCH_SCORING_ONLY["--tokens"][1],
                              help="tokens through each peer")
    bench_parser.add_argument("--naive-tokens", type=_at_least(1), help="tokens through the (slow) naive loop")
    bench_parser.add_argument("--seq", "--ctx", type=_at_least(2),
                              help="row length: default 1024 (GPT-2), 2048 (Llama); --corpus docs: ctx")
    bench_parser.add_argument("--batch-size", type=_at_least(1), help="default 64 (GPT-2), 8 (Llama)")
    bench_parser.add_argument("--device", default="auto")
    bench_parser.add_argument("--loss", default="auto", choices=["auto", "chunked", "fused"])
    bench_parser.add_argument("--variants", action="store_true", help="also time the other loss and compile choices")
    bench_parser.add_argument("--peers", help="comma-separated subset of naive,autocast,hf-bf16,hf-compiled,fastppl "
                                              "(--generate: fastppl,hf-static,hf-dynamic)")
    bench_parser.add_argument("--nproc", metavar="N[,N...]",
                              help="instead of the peers: fastppl eval tokens/s on 1 and N processes (GPUs) of this "
                                   "machine, speed-up and scaling efficiency; a list such as 1,2,4,8 runs each")
    bench_parser.add_argument("--tokenizer", help="with --nproc: the tokenizer whose vocabulary the random ids "
                                                   "are drawn from (default: the model's; gpt2 for random:*)")
    bench_parser.add_argument("--generate", action="store_true",
                              help="decode speed: fastppl generate against transformers generate (static, dynamic cache)")
    bench_parser.add_argument("--batch-sizes", default=_BENCH_GENERATE_ONLY["--batch-sizes"][1],
                              help="--generate: comma-separated batch sizes")
    bench_parser.add_argument("--new-tokens", type=_at_least(1), default=_BENCH_GENERATE_ONLY["--new-tokens"][1],
                              help="--generate: new tokens per row")
    bench_parser.add_argument("--prompt-tokens", type=_at_least(1), default=_BENCH_GENERATE_ONLY["--prompt-tokens"][1],
                              help="--generate: random prompt tokens per row")
    bench_parser.add_argument("--json", help="write the report here")
    bench_parser.add_argument("--corpus", default="dense", choices=["dense", "docs"],
                              help="dense: random full rows, fastppl against HF peers; docs: synthetic documents "
                                   "through packed, bucketed, padded and an lm-eval-style baseline")
    bench_parser.add_argument("--documents", type=_at_least(1), default=_BENCH_SCORING_ONLY["--documents"][1],
                              help="--corpus docs: documents")
    bench_parser.add_argument("--compile", default="auto", choices=["auto", "on", "off"],
                              help="compile fastppl's scorer (auto: as eval would for this many tokens)")
    bench_parser.add_argument("--tune-products", default="auto", choices=["auto", "on", "off"],
                              help="time cuBLASLt's candidate kernels for fastppl's products (auto: as eval would "
                                   "for this many tokens)")
    bench_parser.add_argument("--rounds", type=_at_least(1), default=_BENCH_SCORING_ONLY["--rounds"][1],
                              help="run every peer this many times, one round after another; the table gives medians "
                                   "and the rounds' range (3 for a figure to quote)")
    bench_parser.add_argument("--quiet", action="store_true")
    bench_parser.set_defaults(run=run_bench)

    generate_parser = sub.add_parser("generate", help="continue prompts with a native model and a static KV cache")
    _add_generate_arguments(generate_parser)
    generate_parser.set_defaults(run=run_generate)

    compare_parser = sub.add_parser("compare", help="runs side by side, with differences against the first")
    _add_compare_arguments(compare_parser)
    compare_parser.set_defaults(run=run_compare)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)   # for --nproc, which re-runs the command
    if getattr(args, "device", "cpu") != "cpu" and getattr(args, "nproc", None) in (None, 1):   # not torchrun's parent
        from ..accel.warm_up import start_triton_warm_up
        start_triton_warm_up()   # overlaps the `import torch` that the command is about to do
    try:
        return args.run(args)
    except FastpplError as e:
        if not getattr(e, "silent", False):   # a rank's copy of another rank's error: rank 0 prints it
            if "torch" in sys.modules:   # only a run that imported torch can be a rank
                from ..distributed import delay_a_ranks_error
                delay_a_ranks_error()
            print(f"fastppl: error: {e}", file=sys.stderr)
        return getattr(e, "exit_code", 2)   # a peer's crash (PeerFailed) is not bad input
    except KeyboardInterrupt:
        print("fastppl: interrupted", file=sys.stderr)
        return 130
    except (RuntimeError, MemoryError) as e:
        from ..errors import first_line, is_out_of_memory
        if not (isinstance(e, MemoryError) or is_out_of_memory(e) or "can't allocate memory" in str(e)):
            raise   # a real failure, with its traceback
        # what --batch-size auto does not cover (a fixed batch, bench's batch sizes, generate's prompts)
        print(f"fastppl: error: out of memory ({first_line(e, 120)}); use a smaller batch, fewer prompts or a "
              "smaller model", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # the reader of stdout left early (`fastppl eval ... | head -1`); output files are written before printing.
        # stdout goes to /dev/null so that the interpreter's last flush does not fail again on the way out.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141   # 128 + SIGPIPE, what a shell reports for a writer killed by its pipe
    except OSError as e:   # a path the checks above did not foresee (too long, unreadable, ...)
        if e.filename is None:
            raise   # not about a path the user gave: a real failure, with its traceback
        from ..config import cache_dir
        cache = str(cache_dir())
        in_cache = str(e.filename) == cache or str(e.filename).startswith(cache.rstrip(os.sep) + os.sep)
        hint = (f"fastppl's cache is {cache}; point FASTPPL_CACHE_DIR at a writable directory" if in_cache
                else "check the paths given")
        print(f"fastppl: error: {e.strerror or e}: {e.filename}; {hint}", file=sys.stderr)
        return 2


def run() -> None:
    """The `fastppl` command. A process that used CUDA leaves without the interpreter's teardown, which took
    0.6 s on the H200 (docs/BENCHMARKS.md, session 11): by now every output file is written and closed, and
    the driver frees the device. A rank of a process group exits normally, so that the group is torn down."""
    code = main()
    torch = sys.modules.get("torch")
    if (torch is not None and torch.cuda.is_initialized()
            and not (torch.distributed.is_available() and torch.distributed.is_initialized())):
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except OSError:   # the reader of a pipe has gone: nothing more can reach it
            pass
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    run()
