"""Two models on the same tokens: `fastppl eval --reference-model` (one pass, both models resident, no logits
stored) against the workflow of llama.cpp's `llama-perplexity --kl-divergence-base` then `--kl-divergence`,
re-created with the same models and windows (a first run writes every scored token's log-probabilities to disk as
fp16, a second run reads them back and computes the divergence), and a single-model `fastppl eval` of the model for
scale (on CUDA also the divergence's chunked path, FASTPPL_FUSED_DIVERGENCE=0, beside its fused kernel).

    PYTHONPATH=src python benchmarks/divergence.py                       # GPT-2 124M shape, TinyShakespeare val
    PYTHONPATH=src python benchmarks/divergence.py --model llama-1b --ctx 2048
    PYTHONPATH=src python benchmarks/divergence.py --model gpt2-tiny --device cpu --ctx 32 --data small.txt

The model is random:PRESET with seed 0, the reference the same shape with --reference-seed (other weights: the
work, memory and time are those of any two models of the shape). Each variant reports tokens/s over its scoring
(both runs for the peer, the disk writes and reads included), its peak memory, its mean KLD and what it stored;
every variant runs once untimed before any is timed, so that none pays the process' warm-up.
The peer runs each model eagerly on fastppl's padded batches of the same windows, with fastppl's models. The
tokenizer and corpus default to ../shared/data beside the checkout (or FASTPPL_SHARED_DATA), as the tests'."""
from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from fastppl.bench.timers import peak_bytes, reset_peak, synchronize
from fastppl.config import EvalConfig
from fastppl.data.batching import batch_from_plan
from fastppl.data.corpus import load_documents
from fastppl.data.packing import plan_batches
from fastppl.data.streams import plan_corpus
from fastppl.data.tokenize import encode_cached, load_tokenizer
from fastppl.engine.precision import resolve_device, resolve_dtype
from fastppl.models import load_model
from fastppl.pipeline import evaluate

ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("FASTPPL_SHARED_DATA", ROOT.parent / "shared" / "data"))


def fastppl_run(args, reference: bool, fused: bool = True) -> dict:
    """One `fastppl eval` in this process: the model alone, or with the reference (fused=False: its chunked path,
    as FASTPPL_FUSED_DIVERGENCE=0 runs it)."""
    switch = os.environ.pop("FASTPPL_FUSED_DIVERGENCE", None)
    if not fused:
        os.environ["FASTPPL_FUSED_DIVERGENCE"] = "0"
    try:
        result = _evaluate(args, reference)
    finally:
        os.environ.pop("FASTPPL_FUSED_DIVERGENCE", None)
        if switch is not None:
            os.environ["FASTPPL_FUSED_DIVERGENCE"] = switch
    divergence = result.divergence or {}
    peak = result.timings.peak_memory_bytes or result.timings.peak_host_memory_bytes
    return {"tokens": result.metrics.tokens_scored, "tokens_per_second": result.timings.tokens_per_second,
            "peak_bytes": peak, "kld_mean": divergence.get("kld_mean"), "stored_bytes": 0,
            "batch_size": result.how_it_ran.batch_size, "weights_bytes": (2 if reference else 1) * weights_bytes(args)}


def _evaluate(args, reference: bool):
    return evaluate(EvalConfig(
        model=f"random:{args.model}", data=[args.data], tokenizer=args.tokenizer, split=args.split, ctx=args.ctx,
        device=args.device, dtype=args.dtype, batch_size=args.batch_size, quiet=True,
        reference_model=f"random:{args.model}" if reference else None,
        reference_seed=args.reference_seed if reference else None))


def weights_bytes(args) -> int:
    """Bytes of one model's weights in the run's dtype (built on the meta device: no memory, no time)."""
    from fastppl.models.gpt2 import GPT2, PRESETS
    from fastppl.models.llama import Llama, PRESETS as LLAMA_PRESETS
    with torch.device("meta"):
        model = GPT2(PRESETS[args.model]) if args.model in PRESETS else Llama(LLAMA_PRESETS[args.model])
    itemsize = resolve_dtype(args.dtype, resolve_device(args.device)).itemsize
    return sum(p.numel() for p in model.parameters()) * itemsize


PEER_LOGITS = 1 << 30   # 4 GiB of fp32 log-probabilities a batch


def _log_probabilities(model, input_ids: torch.Tensor, score_mask: torch.Tensor) -> torch.Tensor:
    """(n_scored, V) fp32 log-probabilities at the batch's scored positions."""
    hidden = model(input_ids)[score_mask]                                  # (n_scored, C)
    return torch.log_softmax(model.lm_head(hidden).float(), dim=-1)


@torch.inference_mode()
def peer_run(args, batch_size: int) -> dict:
    """The stored-logits workflow: the reference's log-probabilities of every scored token to a file, then the
    model's run reading them back, batch by batch, for KL(reference ‖ model)."""
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    tokenizer = load_tokenizer(args.tokenizer)
    tokens = [encode_cached(tokenizer, d.text) for d in load_documents(args.data, args.split)]
    plan = plan_corpus(tokens, tokenizer, "chunked", None, False, args.ctx)
    reference = load_model(f"random:{args.model}", "native", dtype, args.reference_seed, device)
    # the peer holds a batch's (rows, ctx, V) log-probabilities: fewer rows than fastppl's batch, so that they
    # stay near PEER_LOGITS elements
    batch_size = max(1, min(batch_size, PEER_LOGITS // (args.ctx * reference.lm_head.weight.shape[0])))
    batches = [batch_from_plan(p, plan.refs, plan.stream_ids, plan.target_offsets)
               for p in plan_batches(plan.window_lengths, "padded", args.ctx, batch_size)]
    reset_peak(device)
    kld_sum, started = 0.0, time.perf_counter()
    with tempfile.TemporaryDirectory(dir=args.logits_dir, prefix="fastppl-peer-") as scratch:
        path = Path(scratch) / "reference_log_probabilities.f16"
        with open(path, "wb") as stored:                                   # the base run
            for batch in batches:
                mask = torch.from_numpy(batch.score_mask).to(device)
                log_p = _log_probabilities(reference, torch.from_numpy(batch.input_ids).to(device), mask)
                stored.write(log_p.half().cpu().numpy().tobytes())
        synchronize(device)
        first_run_seconds = time.perf_counter() - started
        stored_bytes = path.stat().st_size
        del reference
        model = load_model(f"random:{args.model}", "native", dtype, 0, device)
        started_second = time.perf_counter()
        with open(path, "rb") as stored:                                   # the model's run, reading them back
            for batch in batches:
                mask = torch.from_numpy(batch.score_mask).to(device)
                log_p = _log_probabilities(model, torch.from_numpy(batch.input_ids).to(device), mask)
                reference_log_p = torch.from_numpy(np.fromfile(stored, np.float16, log_p.numel())).to(device)
                reference_log_p = reference_log_p.view_as(log_p).float()
                kld_sum += float((reference_log_p.exp() * (reference_log_p - log_p)).sum(dtype=torch.float64))
        synchronize(device)
    seconds = first_run_seconds + time.perf_counter() - started_second    # both runs, the model's load aside
    return {"tokens": plan.n_scored, "tokens_per_second": plan.n_scored / seconds, "peak_bytes": peak_bytes(device),
            "kld_mean": kld_sum / plan.n_scored, "stored_bytes": stored_bytes, "batch_size": batch_size,
            "weights_bytes": weights_bytes(args)}


def _gib(n) -> str:
    return "n/a" if n is None else f"{n / 2**30:.2f}"


def table(rows: dict[str, dict], single: dict) -> str:
    """above weights: the peak less the weights resident in the run (both models' in the one pass, one model's in
    each of the peer's runs); its ratio to the single-model run's is the memory a divergence adds."""
    lines = ["| variant | tokens | tokens/s | x single-model eval | peak GiB | above weights GiB | above weights x "
             "single-model eval | mean KLD | stored GiB | batch |", "| --- " * 10 + "|"]
    for name, r in rows.items():
        kld = "" if r["kld_mean"] is None else f"{r['kld_mean']:.6g}"
        above = None if r["peak_bytes"] is None else r["peak_bytes"] - r["weights_bytes"]
        single_above = None if single["peak_bytes"] is None else single["peak_bytes"] - single["weights_bytes"]
        ratio = "n/a" if above is None or not single_above else f"{above / single_above:.3f}"
        lines.append(f"| {name} | {r['tokens']:,} | {r['tokens_per_second']:,.0f} | "
                     f"{r['tokens_per_second'] / single['tokens_per_second']:.3f} | {_gib(r['peak_bytes'])} | "
                     f"{_gib(above)} | {ratio} | {kld} | {_gib(r['stored_bytes'])} | {r['batch_size']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt2", help="random: preset of both models (default: gpt2)")
    parser.add_argument("--reference-seed", type=int, default=1, help="seed of the reference's weights (default: 1)")
    parser.add_argument("--tokenizer", default=str(SHARED_DATA / "gpt2-tokenizer"))
    parser.add_argument("--data", default=str(SHARED_DATA / "tinyshakespeare.txt"))
    parser.add_argument("--split", default="val", choices=["train", "val", "all"])
    parser.add_argument("--ctx", type=int, default=1024)
    parser.add_argument("--device", default="auto", help="auto, cuda, cuda:N or cpu")
    parser.add_argument("--dtype", default="auto", help="auto (bf16 on CUDA), fp32, bf16")
    parser.add_argument("--batch-size", default="auto", help="rows per batch of the fastppl runs (default: auto); "
                                                             "the peer runs the divergence run's")
    parser.add_argument("--logits-dir", help="where the peer writes its log-probabilities (default: the system's "
                                             "temporary folder)")
    parser.add_argument("--no-peer", action="store_true",
                        help="leave the stored-logits peer out (it writes 2 bytes a vocabulary entry a scored token: "
                             "about 100 KB a token for GPT-2, too much for a large corpus)")
    parser.add_argument("--no-chunked", action="store_true",
                        help="on CUDA, leave the chunked divergence (FASTPPL_FUSED_DIVERGENCE=0) out")
    parser.add_argument("--no-warmup", action="store_true",
                        help="time each variant's first run (by default every variant runs once untimed first)")
    args = parser.parse_args(argv)
    args.batch_size = args.batch_size if args.batch_size == "auto" else int(args.batch_size)
    # every variant once before any is timed: the first run of a process pays for CUDA's start, cuBLAS's handles
    # and Triton's compiles (the single model, timed first, ran at a tenth of its speed)
    # on CUDA the divergence runs the fused kernel; its chunked path (FASTPPL_FUSED_DIVERGENCE=0) is timed beside it
    chunked_too = resolve_device(args.device).type == "cuda" and not args.no_chunked
    for _ in range(1 if args.no_warmup else 2):
        single = fastppl_run(args, reference=False)
        together = fastppl_run(args, reference=True)
        chunked = fastppl_run(args, reference=True, fused=False) if chunked_too else None
        peer = None if args.no_peer else peer_run(args, together["batch_size"])
    print(f"random:{args.model} against seed {args.reference_seed}, {Path(args.data).name} ({args.split}), "
          f"ctx {args.ctx}, device {resolve_device(args.device)}\n")
    rows = {"fastppl eval (model alone)": single, "fastppl eval --reference-model": together}
    if chunked is not None:
        rows["fastppl eval --reference-model, FASTPPL_FUSED_DIVERGENCE=0"] = chunked
    if peer is not None:
        rows["stored logits (two runs, fp16 on disk)"] = peer
    print(table(rows, single))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
