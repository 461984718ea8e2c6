"""The dense scorer on device-resident full rows: fastppl's forward + per-token loss as `fastppl eval` builds it
(fastppl.accel.apply), eager and compiled, with each loss, with and without the GPT-2 fusions and tuned cuBLASLt
products, timed in interleaved rounds in one process.

    PYTHONPATH=src python benchmarks/scorer.py                                  # GPT-2 124M, 64 x 1024, CUDA
    PYTHONPATH=src python benchmarks/scorer.py --model llama-1b --batch 8 --seq 2048
    PYTHONPATH=src python benchmarks/scorer.py --device cpu --model gpt2-tiny --batch 2 --seq 64

Variants (--variants, comma-separated):
  eager             the resolved loss (fused on CUDA), GPT-2's MLP epilogue and residual norms on CUDA: what eval runs
  eager-plain       the same loss with no fusions (CUDA)
  compiled          the resolved loss under torch.compile (CUDA; eval compiles only long runs, accel/compile.py)
  chunked-eager     the chunked loss, eager, with the fusions (CUDA; on the CPU `eager` is this)
  chunked-compiled  the chunked loss under torch.compile (CUDA)
  tuned             `eager` with cuBLASLt's fastest one-pass candidate per product (--tune-products on; CUDA, 16-bit)
Variants that do not apply to the device are skipped with a message. The table gives ms a batch (median of the
rounds, and their range), tokens/s, the peak memory (weights included) and each variant's mean NLL against the
first one's. `fastppl bench` times the same scorer against `transformers` on host batches."""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import statistics
import time

import torch

from fastppl.accel.apply import Acceleration, apply_fusions, choose_tuning, score_fn_for, tuned_products
from fastppl.engine.loss import resolve_loss
from fastppl.engine.precision import resolve_device, resolve_dtype
from fastppl.models.loading import random_native
from fastppl.bench.timers import synchronize

VARIANTS = ("eager", "eager-plain", "compiled", "chunked-eager", "chunked-compiled", "tuned")


def plan_variants(names, model, device, dtype, log) -> dict:
    """{name: (Acceleration, fusions wanted, TuningChoice or None)} for the variants that apply here."""
    default_loss = resolve_loss("auto", device)
    cuda = device.type == "cuda"
    plans = {}
    for name in names:
        loss = "chunked" if name.startswith("chunked") else default_loss
        compiled = name.endswith("compiled")
        why = None
        if not cuda and name != "eager":
            why = ("on the CPU only `eager` runs: there are no fusions or fused loss to vary there, and compiling "
                   "takes minutes")
        tuning = None
        if name == "tuned" and why is None:
            tuning = choose_tuning("on", model, device, dtype, compiled=False)
            if tuning.mode == "off":
                why = tuning.reason
        if why is not None:
            log(f"skipped {name}: {why}")
            continue
        reason = "on (benchmark)" if compiled else "off (benchmark)"
        plans[name] = (Acceleration(loss, compiled, reason, "padded", "full rows"), name != "eager-plain", tuning)
    return plans


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt2",
                        help="a random: preset (gpt2, gpt2-medium, llama-1b, gpt2-tiny, ...)")
    parser.add_argument("--batch", type=int, default=64, help="rows a batch")
    parser.add_argument("--seq", type=int, default=1024, help="positions a row")
    parser.add_argument("--device", default="auto", help="auto, cuda, cuda:N or cpu")
    parser.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp16", "fp32"],
                        help="weights (auto: bf16 on CUDA, fp32 on the CPU); the loss is fp32 either way")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
    parser.add_argument("--batches", type=int, default=20, help="timed batches a variant and round")
    parser.add_argument("--warmup", type=int, default=2, help="untimed batches before each timed run")
    parser.add_argument("--chunk-rows", type=int, default=8192, help="rows per chunk of the chunked loss")
    args = parser.parse_args(argv)
    names = args.variants.split(",")
    unknown = sorted(set(names) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variant(s) {', '.join(unknown)}; use {', '.join(VARIANTS)}")

    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    model = random_native(args.model, 0, device).to(dtype).eval()
    B, T = args.batch, args.seq
    ids = torch.randint(0, model.vocab_size, (B, T + 1), device=device,
                        generator=torch.Generator(device=device).manual_seed(0))
    batch = (ids[:, :T].contiguous(), ids[:, 1:].contiguous(), torch.ones(B, T, dtype=torch.bool, device=device))
    plans = plan_variants(names, model, device, dtype, print)

    times = {name: [] for name in plans}
    peaks, nlls, notes, score_fns = {}, {}, {}, {}
    with torch.inference_mode():
        for round_index in range(args.rounds):
            for name, (acceleration, fusions, tuning) in plans.items():
                # apply_fusions fuses only for an eager scorer: eager-plain asks as if compiled, to get none
                applied = apply_fusions(model, device, acceleration if fusions else
                                        dataclasses.replace(acceleration, compiled=True))
                if name not in score_fns:
                    score_fns[name] = score_fn_for(model, acceleration, args.chunk_rows)
                    notes[name] = (f"{acceleration.loss} loss, {'compiled' if acceleration.compiled else 'eager'}, "
                                   f"MLP {applied.mlp_epilogue.split(' (')[0]}, norms "
                                   f"{'fused' if applied.residual_norms != 'plain' else 'plain'}")
                score = score_fns[name]
                products = tuned_products(model, tuning) if tuning is not None else contextlib.nullcontext()
                with products:
                    if round_index == 0 and device.type == "cuda":
                        torch.cuda.empty_cache()
                        torch.cuda.reset_peak_memory_stats(device)
                    for _ in range(args.warmup):
                        nll = score(*batch)
                    synchronize(device)
                    started = time.perf_counter()
                    for _ in range(args.batches):
                        nll = score(*batch)
                    synchronize(device)
                    times[name].append((time.perf_counter() - started) / args.batches * 1e3)
                    if round_index == 0:
                        peaks[name] = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
                        nlls[name] = nll.double().mean().item()
        apply_fusions(model, device, Acceleration("chunked", True, "", "padded", ""))   # undoes every fusion

    label = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"{label}, torch {torch.__version__}, random:{args.model}, {B} x {T}, {str(dtype).removeprefix('torch.')}, "
          f"median of {args.rounds} interleaved rounds of {args.batches} batches")
    print("| variant | what runs | ms a batch (rounds' range) | tokens/s | peak GiB | mean NLL vs first |")
    print("| --- | --- | --- | --- | --- | --- |")
    first = next(iter(nlls.values()), None)
    for name in plans:
        ms = statistics.median(times[name])
        peak = "n/a" if peaks[name] is None else f"{peaks[name]:.2f}"
        print(f"| {name} | {notes[name]} | {ms:.2f} ({min(times[name]):.2f}-{max(times[name]):.2f}) | "
              f"{B * T / ms * 1e3:,.0f} | {peak} | {(nlls[name] - first) / first:+.1e} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
