"""fastppl bench --nproc N[,M,...]: tokens/s of data-parallel `fastppl eval` on 1 and N processes of one
machine, with the speed-up and the scaling efficiency.

    fastppl bench --nproc 8 --model random:gpt2 --tokens 10000000 --seq 1024

What runs (each run its own processes, started the way a user starts them):
  corpus   seeded, uniformly random token ids of the tokenizer's vocabulary, written once to a .npy (a
           pre-tokenised corpus that `fastppl eval --data` reads): --tokens ids rounded up to whole
           batches of full --seq windows for every process count (corpus_tokens), so that the ranks
           of every run have equal shares;
  warm-up  on CUDA, one untimed short run with the loss and compile choices of the timed runs (eval's
           auto choices for the whole corpus, passed to every run), so that the Triton and Inductor
           disk caches are full before the first timed run and no timed run pays for compiling kernels
           that the later ones only load;
  1        `python -m fastppl eval --data corpus.npy --ctx SEQ --batch-size B ...`;
  N        the same under `torchrun --standalone --nproc-per-node N` (the command `eval --nproc N` runs).

Every run has the same explicit batch size, so the planned batches are the same and the N ranks score
exactly the batches one process scores (fastppl.distributed.shard_plans): per-token values are equal even
with bf16 kernels, and the float64 nll_sum differs from the 1-process one only by summation order.

From each run's report:
    tokens/s    = tokens_scored / scoring_seconds   (the clock times the whole job: the ranks start
                                                     together after a barrier, it stops after the reduce)
    speedup     = tokens/s(N) / tokens/s(1)
    efficiency  = speedup / N
    nll_sum_relative_difference = |nll_sum(N) - nll_sum(1)| / |nll_sum(1)|, checked against 1e-12.
A difference above that fails the command (exit 1) after the table and --json are written."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np

from ..errors import FastpplError

NLL_SUM_TOLERANCE = 1e-12      # relative, float64: only the order of the additions differs
WARMUP_BATCHES = 2


def parse_process_counts(text: str) -> list[int]:
    """--nproc "8" -> [1, 8]; "1,2,4,8" -> [1, 2, 4, 8]: the 1-process run is always first, as the baseline."""
    counts = set()
    for part in text.split(","):
        try:
            count = int(part)
        except ValueError:
            raise FastpplError(f"--nproc {text!r}: give a process count or a comma-separated list, "
                               "e.g. 1,2,4,8") from None
        if count < 1:
            raise FastpplError(f"--nproc {text!r}: process counts must be at least 1")
        counts.add(count)
    return sorted(counts | {1})


def corpus_tokens(n_tokens: int, seq_len: int, batch_size: int, process_counts: Sequence[int]) -> int:
    """n_tokens rounded up to a whole number of full batches for every process count, so that each rank
    of every run scores the same number of full batches: the efficiency then measures parallel scoring,
    not the last batch that one rank scores alone (up to one batch in a rank's share otherwise)."""
    unit = seq_len * batch_size * math.lcm(*process_counts)
    return max(1, -(-n_tokens // unit)) * unit


def write_random_corpus(path: Path, n_tokens: int, vocab_size: int, seed: int) -> None:
    """n_tokens uniformly random ids in [0, vocab_size), seeded, as a .npy corpus."""
    ids = np.random.default_rng(seed).integers(0, vocab_size, size=n_tokens, dtype=np.int64)
    np.save(path, ids.astype(np.int32 if vocab_size < 2**31 else np.int64))


def child_environment() -> dict:
    # NVLink multicast (NVLS) buys nothing for one small all-reduce per run and, on shared hosts, a job
    # that uses it can take the GPUs out of service: keep it off in every process we start
    return {**os.environ, "NCCL_NVLS_ENABLE": "0"}


def run_eval(nproc: int, eval_argv: Sequence[str], name: str) -> tuple[dict, float]:
    """Run `fastppl <eval_argv>` on nproc processes; returns (its --json report, seconds from start to exit).
    A failed run stops the bench with that run's error line, or with its whole output where it printed none."""
    from ..distributed import torchrun_command
    command = ([sys.executable, "-m", "fastppl", *eval_argv] if nproc == 1
               else torchrun_command(nproc, eval_argv))
    json_path = eval_argv[eval_argv.index("--json") + 1]
    started = time.perf_counter()
    done = subprocess.run(command, env=child_environment(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        errors = [line for line in done.stderr.splitlines() if line.startswith("fastppl: error: ")]
        if not errors:   # an unexpected failure: its output is the evidence (a user error is said once, below)
            sys.stderr.write(done.stdout + done.stderr)
        reason = errors[0][len("fastppl: error: "):] if errors else f"exit status {done.returncode}, output above"
        raise FastpplError(f"the {name} run failed: {reason}")
    with open(json_path) as f:
        return json.load(f), seconds


def usable_counts(counts: list[int], device_type: str, n_gpus: int,
                  log: Callable[[str], None]) -> tuple[list[int], list[int]]:
    """(counts to run, counts skipped): on CUDA each process needs a GPU of its own."""
    if device_type != "cuda":
        return counts, []
    skipped = [n for n in counts if n > n_gpus]
    for n in skipped:
        log(f"skipping --nproc {n}: only {n_gpus} GPU(s) are visible")
    return [n for n in counts if n <= n_gpus], skipped


def run_row(report: dict, nproc: int, process_seconds: float, baseline: Optional[dict]) -> dict:
    tokens_per_second = report["tokens_scored"] / report["scoring_seconds"]
    row = {
        "nproc": nproc, "world_size": report.get("world_size", 1), "tokens_scored": report["tokens_scored"],
        "scoring_seconds": report["scoring_seconds"], "tokens_per_second": tokens_per_second,
        "wall_seconds": report["wall_seconds"], "process_seconds": process_seconds,
        "stage_seconds": report["stage_seconds"], "nll_sum": report["nll_sum"], "nll": report["nll"],
        "batches": report["batches"], "batch_size": report["batch_size"], "loss": report["loss"],
        "compile": report["compile"], "peak_memory_bytes": report["peak_memory_bytes"],
    }
    base = baseline or row
    row["speedup"] = tokens_per_second / base["tokens_per_second"]
    row["efficiency"] = row["speedup"] / nproc
    row["nll_sum_relative_difference"] = abs(row["nll_sum"] - base["nll_sum"]) / abs(base["nll_sum"])
    row["nll_sum_equal"] = row["nll_sum_relative_difference"] <= NLL_SUM_TOLERANCE
    return row


def _model_family(spec: str) -> str:
    """accel.compile.model_family of the model eval will build, read from the preset or config.json without
    building it: its family's spec's compile family, "gpt2" where there is none."""
    import json
    from ..models.loading import RANDOM_PREFIX
    from ..models.registry import spec_for_model_type, spec_of_preset
    if spec.startswith(RANDOM_PREFIX):
        family = spec_of_preset(spec[len(RANDOM_PREFIX):])
    else:
        try:
            model_type = json.loads((Path(spec).expanduser() / "config.json").read_text()).get("model_type")
        except (OSError, ValueError, AttributeError):
            model_type = None   # a hub id, or a directory eval will report on
        family = spec_for_model_type(model_type)
    return family.compile_family if family is not None else "gpt2"


def _timed_runs(counts: list[int], eval_argv: Callable[[Path, Path], list[str]], n_written: int, vocab_size: int,
                seq_len: int, batch_size: int, seed: int, device,
                log: Callable[[str], None]) -> tuple[list, Optional[float], dict]:
    """(a row per process count, the untimed warm-up's seconds, the environment the runs report): fastppl eval
    over one random corpus, written once, on each process count in turn."""
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="fastppl-bench-nproc-") as scratch:
        directory = Path(scratch)
        corpus = directory / "corpus.npy"
        write_random_corpus(corpus, n_written, vocab_size, seed)
        log(f"corpus: {n_written:,} random token ids (seed {seed}): {n_written // seq_len:,} windows of {seq_len} "
            f"in {n_written // seq_len // batch_size:,} batches of {batch_size}")
        warmup_seconds = None
        if device.type == "cuda":
            warmup = directory / "warmup.npy"
            write_random_corpus(warmup, WARMUP_BATCHES * batch_size * seq_len, vocab_size, seed + 1)
            _report, warmup_seconds = run_eval(1, eval_argv(warmup, directory / "warmup.json"), "warm-up")
            log(f"warm-up (untimed): {warmup_seconds:.1f} s")
        for nproc in counts:
            name = f"{nproc}-process"
            report, seconds = run_eval(nproc, eval_argv(corpus, directory / f"run-{nproc}.json"), name)
            row = run_row(report, nproc, seconds, rows[0] if rows else None)
            rows.append(row)
            log(f"{name:<11} {row['tokens_per_second']:>14,.0f} tok/s  scoring {row['scoring_seconds']:.3f} s  "
                f"speed-up {row['speedup']:.2f}  efficiency {100 * row['efficiency']:.1f} %  "
                f"nll_sum rel. diff {row['nll_sum_relative_difference']:.1e}  (process {seconds:.1f} s)")
        environment = report["environment"]
    return rows, warmup_seconds, environment


def run_parallel_bench(
    process_counts: list[int], model: str = "random:gpt2", n_tokens: int = 1_048_576, seq_len: int = 1024,
    batch_size: int = 64, device_name: str = "auto", tokenizer: Optional[str] = None, loss: str = "auto",
    seed: int = 0, log: Callable[[str], None] = print,
) -> dict:
    import torch
    from ..accel.compile import use_compile
    from ..data.tokenize import load_tokenizer
    from ..distributed import launch_env
    from ..engine.loss import resolve_loss
    from ..engine.precision import resolve_device
    from ..data.tokenize import default_tokenizer_name

    if launch_env() is not None:
        raise FastpplError("bench --nproc starts its own processes; run it without torchrun")
    if n_tokens < 1 or seq_len < 2 or batch_size < 1:
        raise FastpplError("--tokens and --batch-size must be at least 1, and --seq at least 2")
    device = resolve_device(device_name)
    if device.type == "cuda" and device.index is not None and max(process_counts) > 1:
        raise FastpplError(f"--device {device_name} names one GPU, but each process needs its own; "
                           "pass --device cuda (rank r uses cuda:r)")
    n_gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    counts, skipped = usable_counts(process_counts, device.type, n_gpus, log)
    tokenizer_name = tokenizer or default_tokenizer_name(model)
    vocab_size = load_tokenizer(tokenizer_name).vocab_size   # ids the tokenizer can decode, for bytes

    n_written = corpus_tokens(n_tokens, seq_len, batch_size, counts)
    # eval's auto choices for the whole corpus, made once and passed to every run: the short warm-up run
    # then compiles what the timed runs will (eval alone would not compile a run that short)
    loss = resolve_loss(loss, device)
    compile_on, _reason = use_compile("auto", device, n_written, loss, _model_family(model))

    def eval_argv(corpus: Path, json_path: Path) -> list[str]:
        return ["eval", "--model", model, "--tokenizer", tokenizer_name, "--data", str(corpus), "--ctx", str(seq_len),
                "--batch-size", str(batch_size), "--device", device_name, "--loss", loss,
                "--compile", "on" if compile_on else "off", "--seed", str(seed), "--quiet", "--json", str(json_path)]

    rows, warmup_seconds, environment = _timed_runs(counts, eval_argv, n_written, vocab_size, seq_len, batch_size,
                                                    seed, device, log)
    return {
        "model": model, "tokenizer": tokenizer_name, "tokens": n_written, "seq_len": seq_len,
        "batch_size": batch_size, "loss": loss, "compile": compile_on, "seed": seed, "device": device.type,
        "device_name": environment["device_name"], "gpus_visible": n_gpus, "torch": torch.__version__,
        "process_counts": counts, "skipped_process_counts": skipped,
        "warmup_seconds": warmup_seconds, "nll_sum_tolerance": NLL_SUM_TOLERANCE,
        "nll_sum_equal": all(r["nll_sum_equal"] for r in rows),
        "max_nll_sum_relative_difference": max(r["nll_sum_relative_difference"] for r in rows),
        "runs": rows, "date": time.strftime("%Y-%m-%d"),
    }


def format_scaling_table(report: dict) -> str:
    lines = [f"fastppl bench --nproc  {report['model']}  {report['tokens']:,} tokens  seq {report['seq_len']}  "
             f"batch {report['batch_size']}  {report['device_name']}  torch {report['torch']}",
             f"{'processes':>9}{'tokens/s':>14}{'scoring s':>11}{'speed-up':>10}{'efficiency':>12}"
             f"{'nll_sum rel. diff':>19}"]
    for r in report["runs"]:
        lines.append(f"{r['nproc']:>9}{r['tokens_per_second']:>14,.0f}{r['scoring_seconds']:>11.3f}{r['speedup']:>10.2f}"
                     f"{100 * r['efficiency']:>11.1f}%{r['nll_sum_relative_difference']:>19.1e}")
    if report["skipped_process_counts"]:
        lines.append(f"skipped (more processes than the {report['gpus_visible']} visible GPUs): "
                     f"{', '.join(map(str, report['skipped_process_counts']))}")
    return "\n".join(lines)


def run_from_args(args) -> int:
    """The CLI's `bench --nproc`: run, print the table, write --json; exit 1 if a run's nll_sum differs."""
    from ..report.files import check_writable, write_json
    if args.json:
        check_writable(args.json, "--json")
    log = (lambda line: None) if args.quiet else (lambda line: print(line, file=sys.stderr, flush=True))
    report = run_parallel_bench(parse_process_counts(args.nproc), args.model, args.tokens, args.seq, args.batch_size,
                                args.device, args.tokenizer, args.loss, log=log)
    if args.json:
        write_json(args.json, report)
    print(format_scaling_table(report))
    if not report["nll_sum_equal"]:
        print(f"fastppl: error: nll_sum differs from the 1-process run by "
              f"{report['max_nll_sum_relative_difference']:.1e} relative, above {NLL_SUM_TOLERANCE:g}", file=sys.stderr)
        return 1
    return 0
