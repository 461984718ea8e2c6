"""`fastppl eval`: its arguments, the EvalConfig they map onto, the output checks, and the run."""
from __future__ import annotations

import argparse
import os
from pathlib import Path

from ..config import MIN_BOOTSTRAP, PROTOCOL_WINDOWS
from ..errors import FastpplError, check_input_file, no_such
from .args import (DEVICE_HELP, FLAG_OFF, MODEL_HELP, TOKENIZER_HELP, at_least, batch_size, check_model_given,
                   memory_size_argument, seed)

DESCRIPTION = ("NLL, perplexity and bits per byte of a model over a corpus. "
               "Example: fastppl eval --model gpt2 --data tinyshakespeare --split val")


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("eval", help="NLL, perplexity and bits per byte of a model over a corpus",
                       description=DESCRIPTION)
    _add_input_arguments(p.add_argument_group("model and corpus"))
    _add_scoring_arguments(p.add_argument_group("scoring"))
    _add_output_arguments(p.add_argument_group("outputs"))
    p.set_defaults(run=run_eval)
    return p


def _add_input_arguments(p) -> None:
    p.add_argument("--model", required=True, action="append",
                   help=MODEL_HELP[:-len("; required")] + "; repeatable: several models make a table of models × "
                        "corpora, scored in one process (see --corpus); required")
    p.add_argument("--data", action="append",
                   help="text file, .jsonl (one document per line), .npy (token ids of one document), "
                        "directory (one document per file), hf:NAME[:CONFIG]:SPLIT (a Hugging Face dataset), "
                        "or built-in 'tinyshakespeare'; repeatable: the sources of one corpus, scored as one; "
                        "this or --corpus is required (default: none)")
    p.add_argument("--corpus", action="append",
                   help="what --data takes, as one corpus of a table: each --corpus is scored on its own, by every "
                        "--model, and is a column of the table (default: none: --data is the one corpus)")
    p.add_argument("--tokenizer", help=TOKENIZER_HELP)
    p.add_argument("--split", default="all", choices=["train", "val", "all"],
                   help="nanoGPT split of a single text: train = the first 90%% of its characters, val = the "
                        "last 10%%, all = the whole text (default: %(default)s)")
    p.add_argument("--text-field", help="field of a .jsonl line or hf: dataset row holding the text (default: text; "
                                        "page with --protocol lm-eval-wikitext)")
    p.add_argument("--id-field", help="field of a .jsonl line or hf: dataset row holding the document's id, which "
                                      "--per-doc writes (default: id where a record has one, else the line or row)")
    p.add_argument("--group-by", metavar="FIELD",
                   help="field of a .jsonl line or hf: dataset row whose values group the documents: tokens, NLL, "
                        "perplexity and bits per byte per group, and their micro and macro averages (default: none)")
    p.add_argument("--data-dir", help="directory holding local copies of built-in corpora and of --protocol gptq's "
                                      "wikitext2 (wiki.test.raw) and c4 (its validation shard) (default: "
                                      "$FASTPPL_DATA_DIR if set, else fastppl's cache, downloaded into on first use)")
    p.add_argument("--errors", default="strict", choices=["strict", "replace"],
                   help="undecodable UTF-8 bytes: strict = an error, replace = U+FFFD (default: %(default)s)")
    p.add_argument("--reference-model", metavar="MODEL",
                   help="also run this model (same tokenizer and vocabulary) on the same tokens and report the "
                        "divergence of --model from it: KL divergence, same top-1 rate, delta p, perplexity ratio "
                        "(see docs/divergence.md) (default: none)")
    p.add_argument("--reference-seed", type=seed, help="seed of a random:PRESET reference (default: --seed)")
    p.add_argument("--layer-error", action="store_true",
                   help="with --reference-model of the same architecture: compare the two models' hidden states "
                        "after each block, and the KLD with the reference's blocks up to each one (runs both "
                        "models layer-major, the blocks about n_layer / 2 times more; see docs/divergence.md)"
                        + FLAG_OFF)
    p.add_argument("--reference-device", help="where the reference model runs, e.g. cuda:1 beside --device cuda:0 "
                                              "(default: --device)")


def _add_scoring_arguments(p) -> None:
    p.add_argument("--protocol", choices=list(PROTOCOL_WINDOWS),
                   help="a published tool's protocol, reproduced exactly: its corpus preparation, windows, BOS rule, "
                        "tail and normaliser, stated in the report (see README: protocols; --data wikitext2 and c4 "
                        "are gptq's corpora) (default: none: --window decides)")
    p.add_argument("--window", default="chunked", choices=["chunked", "sliding"],
                   help="chunked: every token scored once, disjoint windows from BOS; sliding: the HF guide's "
                        "strided windows (see docs/windows-and-metrics.md) (default: %(default)s; a --protocol "
                        "sets its own)")
    p.add_argument("--ctx", type=int, help="tokens per window (default: the model's maximum)")
    p.add_argument("--stride", type=int, help="sliding: tokens between window starts (default: ctx/2)")
    p.add_argument("--bos", action="store_true",
                   help="sliding: prefix BOS so that the first token is scored" + FLAG_OFF)
    p.add_argument("--batch-size", type=batch_size, default="auto",
                   help="rows per forward pass (a row holds one window, or several short ones when packed), or "
                        "auto: the largest that fits on a GPU with headroom (at most 256), 8 off CUDA; the result "
                        "does not depend on it (default: %(default)s)")
    p.add_argument("--batching", default="auto", choices=["auto", "packed", "bucketed", "padded"],
                   help="packed: several documents per row with a document mask (native backend); bucketed: rows "
                        "of a few lengths; padded: every window its own row of ctx (default: %(default)s: one "
                        "document padded; several packed where variable-length flash attention runs and the run "
                        "does not compile, else bucketed)")
    p.add_argument("--device", default="auto", help=DEVICE_HELP)
    p.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16", "fp16"],
                   help="weights and activations; the loss is always fp32 (default: %(default)s: bf16 on CUDA, "
                        "fp32 on cpu)")
    p.add_argument("--backend", default="auto", choices=["auto", "native", "hf"],
                   help="native: fastppl's own GPT-2 and Llama-family (Llama, Qwen2, Qwen3, Mistral) models; hf: "
                        "transformers' AutoModelForCausalLM (default: %(default)s: native where it implements the "
                        "checkpoint's architecture and settings, else hf)")
    p.add_argument("--compile", default="auto", choices=["auto", "on", "off"],
                   help="torch.compile the scorer (default: %(default)s: on CUDA, for runs long enough to repay "
                        "compiling)")
    p.add_argument("--tune-products", default="off", choices=["on", "off"],
                   help="time cuBLASLt's candidate kernels for each product shape once and keep the fastest "
                        "(native models on CUDA, 16-bit, eager; picks are stored in fastppl's cache and reused): "
                        "1-2 %% of the scoring time (default: %(default)s)")
    p.add_argument("--loss", default="auto", choices=["auto", "chunked", "fused"],
                   help="per-token loss: chunked projection, or the fused Triton kernel (CUDA) (default: "
                        "%(default)s: fused where CUDA and Triton are available, else chunked)")
    p.add_argument("--loss-chunk-rows", type=int, default=8192,
                   help="chunked loss: rows of the output projection computed at once; memory: rows x vocab x 4 "
                        "bytes (default: %(default)s)")
    p.add_argument("--kv-cache", default="auto", choices=["auto", "on", "off"],
                   help="sliding windows on native rotary models (Llama, Qwen2, Qwen3, Mistral): on reuses cached "
                        "keys/values (faster, but carries context from before the window; see "
                        "docs/llama-and-generation.md) (default: %(default)s, which is off)")
    p.add_argument("--placement", default="auto", choices=["auto", "resident", "streamed"],
                   help="where the weights rest: resident on the device, or streamed (in host memory, brought to "
                        "the device a block at a time, the windows scored layer-major in waves); auto: resident "
                        "where the model fits, else streamed (default: %(default)s)")
    p.add_argument("--max-gpu-memory", metavar="SIZE", type=memory_size_argument,
                   help="device memory the run may hold, e.g. 8GiB: the streamed waves' size, and whether auto "
                        "streams (default: the device's memory)")
    p.add_argument("--seed", type=seed, default=0, help="seed of random:PRESET weights (default: %(default)s)")
    p.add_argument("--nproc", type=int, help="processes (GPUs) on this machine: re-runs the command under torchrun "
                                             "(default: one process)")


def _add_output_arguments(p) -> None:
    p.add_argument("--json", help="write the full report here (of a table: its rows and every cell's report) "
                                  "(default: not written)")
    p.add_argument("--markdown", metavar="FILE", help="write the results as a Markdown table here: one row per "
                                                      "model and corpus (default: not written)")
    p.add_argument("--csv", metavar="FILE", help="write the same table as CSV here (default: not written)")
    p.add_argument("--per-token", help="write per-token NLL here (.npy float32, NaN where unscored; with "
                                       "--reference-model one row per token of columns nll, reference_nll, kld, "
                                       "same_top1, delta_p) (default: not written)")
    p.add_argument("--per-doc", help="write one JSON line per scored document here (id, tokens, bytes, words, "
                                     "nll_sum) (default: not written)")
    p.add_argument("--plot", help="draw the loss by window position here (.png, .svg or .pdf; needs matplotlib); "
                                  "with --reference-model the KLD histogram and KLD by position; of a table of "
                                  "several models, their KLD and ΔPPL by their files' bits per weight, a line per "
                                  "corpus (see docs/divergence.md) (default: not drawn)")
    p.add_argument("--bootstrap", type=at_least(0), default=0, metavar="N",
                   help=f"a 95%% interval of nll, perplexity and bits per byte from N resamples (at least "
                        f"{MIN_BOOTSTRAP}) of the documents, or of the windows of a single document (default: 0: none)")
    p.add_argument("--bootstrap-seed", type=at_least(0), default=0,
                   help="seed of the bootstrap's resamples (default: %(default)s)")
    p.add_argument("--quiet", action="store_true", help="no progress bar (default: off: progress on stderr)")
    p.add_argument("--resume", metavar="DIR", help="checkpoint into DIR, and resume from the checkpoint found there "
                                                   "(default: no checkpoints)")
    p.add_argument("--checkpoint-seconds", type=float, help="with --resume: checkpoint at least this often "
                                                            "(default: 60)")
    p.add_argument("--checkpoint-batches", type=int, help="with --resume: also checkpoint every this many batches "
                                                          "(default: by time only)")


def config_from_args(args: argparse.Namespace, **cell):
    """The EvalConfig of the arguments (of the first model and corpus; `cell` overrides model, data or
    reference_model for one cell of a table): its construction checks every option and combination of them; here
    the model and tokenizer names are checked too (they are read first, from the model's name)."""
    from ..config import EvalConfig
    if args.data and args.corpus:
        raise FastpplError("--data and --corpus are both given; --data names the sources of one corpus, each "
                           "--corpus one corpus of a table: use one of them")
    if not args.data and not args.corpus:
        raise FastpplError("the corpus is missing; give --data (one corpus) or --corpus (each a corpus of a table)")
    given = dict(
        model=args.model[0], data=args.data or args.corpus[:1], tokenizer=args.tokenizer, split=args.split,
        text_field=args.text_field, id_field=args.id_field, group_by=args.group_by, data_dir=args.data_dir,
        bootstrap=args.bootstrap, bootstrap_seed=args.bootstrap_seed, errors=args.errors, window=args.window,
        protocol=args.protocol,
        ctx=args.ctx, stride=args.stride, bos=args.bos, batch_size=args.batch_size, device=args.device,
        dtype=args.dtype, backend=args.backend, compile=args.compile, loss=args.loss, kv_cache=args.kv_cache,
        loss_chunk_rows=args.loss_chunk_rows, tune_products=args.tune_products,
        seed=args.seed, per_token=args.per_token, quiet=args.quiet,
        batching=args.batching, per_doc=args.per_doc, resume=args.resume,
        checkpoint_seconds=args.checkpoint_seconds, checkpoint_batches=args.checkpoint_batches,
        reference_model=args.reference_model, reference_seed=args.reference_seed,
        reference_device=args.reference_device, placement=args.placement, max_gpu_memory=args.max_gpu_memory,
        layer_error=args.layer_error,
    )
    config = EvalConfig(**{**given, **cell})
    if cell:   # one cell of a table: the names were checked with the first
        return config
    for model in args.model:
        check_model_given(model, "--model")
    if args.reference_model is not None:
        check_model_given(args.reference_model, "--reference-model")
    return config


def check_outputs(args: argparse.Namespace) -> None:
    from ..report.files import check_distinct_outputs, check_writable, files_in
    outputs = {"--json": args.json, "--per-token": args.per_token, "--per-doc": args.per_doc, "--plot": args.plot,
               "--markdown": args.markdown, "--csv": args.csv}
    # the corpus, and the files the models, tokenizer and built-in corpora are read from
    inputs = [*(args.data or args.corpus), *(f for m in args.model for f in files_in(m)), *files_in(args.tokenizer),
              *files_in(args.data_dir), *files_in(args.reference_model)]
    check_distinct_outputs(outputs, inputs=inputs, output_dirs={"--resume": args.resume})
    for flag, path in outputs.items():
        if path and flag != "--plot":
            check_writable(path, flag)
    if args.plot:
        from ..report.plot import check_plot_path
        check_plot_path(args.plot)


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity: a container's or taskset's share), not the host's."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def check_nproc(nproc, device_name: str) -> None:
    """A rank per GPU, or per core on the CPU (gloo ranks beyond the cores only wait on each other): refused
    before torchrun starts any, where the ranks would fail one by one."""
    if nproc is None:
        return
    if nproc < 1:
        raise FastpplError(f"--nproc must be at least 1, got {nproc}")
    cores = usable_cores()
    if nproc > cores:
        raise FastpplError(f"--nproc {nproc:,} is more processes than the {cores} CPU cores this process may use; "
                           "use one per GPU (or at most one per core)")
    if nproc == 1 or device_name == "cpu":
        return
    import torch

    from ..engine.precision import resolve_device
    device = resolve_device(device_name)
    if device.type != "cuda":
        return
    if device.index is not None:
        raise FastpplError(f"--device {device_name} names one GPU, but each of the {nproc} processes needs its own; "
                           "pass --device cuda (rank r uses cuda:r)")
    n_gpus = torch.cuda.device_count()
    if nproc > n_gpus:
        raise FastpplError(f"--nproc {nproc:,} is more processes than the {n_gpus} visible GPU(s); use at most "
                           f"{n_gpus}, one per GPU")


def run_eval(args: argparse.Namespace) -> int:
    check_nproc(args.nproc, args.device)
    if is_table(args):
        return run_table(args)
    if args.nproc is not None and args.nproc != 1:
        return _check_and_relaunch(args)
    from ..distributed import init_distributed, is_main_process, stop_all_on_failure
    from ..pipeline import evaluate
    from ..report.files import all_or_nothing, write_json, write_jsonl, write_npy
    from ..report.result import seconds_since_process_start
    from ..report.summary import summary

    @stop_all_on_failure   # under torchrun, rank 0's output check stops the other ranks too
    def check_outputs_once() -> None:
        init_distributed(args.device)   # None on one process; evaluate() joins the same job
        if is_main_process():
            check_outputs(args)

    config = config_from_args(args)
    check_outputs_once()
    start_up = seconds_since_process_start()
    result = evaluate(config)
    if start_up is not None:   # the interpreter's start and the imports, before evaluate's stages
        result.timings.stage_seconds["start_up"] = start_up
    if not is_main_process():
        return 0   # only rank 0 prints and writes
    report = result.to_dict()
    with all_or_nothing():
        if args.per_token:
            write_npy(args.per_token, result.per_token)
        if args.per_doc:
            write_jsonl(args.per_doc, result.per_doc)
        if args.json:
            write_json(args.json, report)
        if args.plot and result.divergence is not None:
            from ..report.divergence import write_divergence_plot
            write_divergence_plot(args.plot, report)
        elif args.plot:
            from ..report.plot import write_loss_by_position
            write_loss_by_position(args.plot, report)
        write_tables(args, [report])
    print(summary(report))
    return 0


def is_table(args: argparse.Namespace) -> bool:
    return len(args.model) > 1 or len(args.corpus or ()) > 1


def write_tables(args: argparse.Namespace, reports: list) -> None:
    """--markdown and --csv of a single run: its table of one row."""
    if args.markdown or args.csv:
        from ..report.table import short_names
        from ..table import Cell, table_report
        corpus = ", ".join(short_names(args.data or args.corpus))
        cells = [Cell(args.model[0], corpus, None, report, is_base=not args.reference_model) for report in reports]
        base = args.reference_model or args.model[0]
        write_table_files(args, table_report(cells, base, reports[0]["wall_seconds"], args.reference_model))


def _check_and_relaunch(args: argparse.Namespace) -> int:
    """--nproc N: a bad option, output path or --data path fails here, once, not in every rank under torchrun's
    traceback; then the command runs again under torchrun."""
    from ..config import check_one_process
    check_one_process(config_from_args(args))
    check_outputs(args)
    check_data_paths(args)
    return _relaunch(args)


def check_data_paths(args: argparse.Namespace) -> None:
    """Each local --data or --corpus path exists, and is a directory or a regular file (checked before a run that
    would otherwise fail later, or once per cell of a table)."""
    from ..data.corpus import BUILTINS
    from ..data.protocols import CORPORA
    for spec in args.data or args.corpus:
        if spec in BUILTINS or spec in CORPORA or spec.startswith("hf:"):
            continue
        flag = "--data" if args.data else "--corpus"
        path = Path(spec).expanduser()
        if not path.exists():
            raise FastpplError(f"{spec}: {no_such(spec)}; check the {flag} path")
        if not path.is_dir():
            check_input_file(spec, f"{flag} takes a .txt, .jsonl or .npy file, or a directory of documents")


def _relaunch(args: argparse.Namespace) -> int:
    """The seam where the command is run again under torchrun (tests replace it)."""
    from ..distributed import relaunch_under_torchrun
    return relaunch_under_torchrun(args.nproc, args.argv)


# what writes one run's files: a table's cells would each need their own
ONE_RUN_OUTPUTS = {"--per-token": "per_token", "--per-doc": "per_doc", "--resume": "resume"}


def run_table(args: argparse.Namespace) -> int:
    """Several --model or --corpus: a table of models × corpora in one process (fastppl.table)."""
    from ..table import base_model, exit_code, plan_cells, run_cells, table_report
    from ..report.files import all_or_nothing, write_json
    from ..report.table import table_text
    given = [flag for flag, dest in ONE_RUN_OUTPUTS.items() if getattr(args, dest)]
    if given:
        raise FastpplError(f"{given[0]} writes one run's output; a table of several models or corpora writes "
                           "--json (every cell's full report), --markdown and --csv; run the cell alone for it")
    if args.nproc is not None and args.nproc != 1:
        raise FastpplError("--nproc runs one model on one corpus; run a table of several models or corpora in one "
                           "process, or each cell with --nproc on its own")
    config = config_from_args(args)
    # every cell's options checked before anything is read
    cells = plan_cells(config, args.model, args.corpus, lambda **cell: config_from_args(args, **cell))
    check_outputs(args)
    if args.plot:
        from ..report.bits_plot import check_table_plot
        check_table_plot(args.model, any(not c.is_base for c in cells))
    check_data_paths(args)
    seconds = run_cells(cells, args.quiet)
    table = table_report(cells, base_model(config, args.model), seconds, config.reference_model)
    if any(c.report is not None for c in cells):   # the cells that finished are kept, even when others failed
        with all_or_nothing():
            if args.json:
                write_json(args.json, table)
            if args.plot:
                from ..report.bits_plot import write_bits_per_weight_plot
                write_bits_per_weight_plot(args.plot, table)
            write_table_files(args, table)
    print(table_text(table))
    return exit_code(cells)


def write_table_files(args: argparse.Namespace, table: dict) -> None:
    from ..report.files import write_atomic
    from ..report.table import table_csv, table_text
    if args.markdown:
        write_atomic(args.markdown, lambda f: f.write(table_text(table, markdown=True) + "\n"))
    if args.csv:
        write_atomic(args.csv, lambda f: f.write(table_csv(table)))
