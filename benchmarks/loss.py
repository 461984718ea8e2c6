"""The per-token loss alone: fastppl's fused Triton kernel (output projection + cross-entropy, no logits in memory)
against its chunked loss (eager and compiled) and plain F.cross_entropy over full logits, at the scorer's shapes.

    PYTHONPATH=src python benchmarks/loss.py                          # GPT-2 and Llama-1B shapes, CUDA, bf16
    PYTHONPATH=src python benchmarks/loss.py --shapes llama-1b --segments 1,9
    PYTHONPATH=src python benchmarks/loss.py --device cpu --shapes tiny

Shapes are (rows, width, vocabulary): gpt2 = 64 x 1024 rows x 768 x 50,257, llama-1b = 8 x 2048 rows x 2,048 x
128,256, tiny = 256 x 64 x 1,000, or --shape N,C,V. Each variant is timed in interleaved rounds (median), with its
largest relative error against a float64 reference on a sample of rows and its peak memory. The fused kernel needs
CUDA and Triton; on the CPU it and the compiled variant are skipped with a message."""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from fastppl.engine.loss import chunked_token_nll, fused_loss_available
from fastppl.engine.precision import DTYPE_BY_NAME, resolve_device
from fastppl.bench.timers import synchronize

SHAPES = {"gpt2": (65_536, 768, 50_257), "llama-1b": (16_384, 2_048, 128_256), "tiny": (256, 64, 1_000)}


def time_ms(fn, device: torch.device, reps: int) -> float:
    """Median ms of `reps` calls of fn, after one untimed call (CUDA events on a GPU, a wall clock on the CPU)."""
    fn()
    synchronize(device)
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(device)
            times.append(start.elapsed_time(end))
        else:
            started = time.perf_counter()
            fn()
            times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


def full_logits_nll(hidden, weight, targets):
    """What a model's forward + F.cross_entropy does: every logit written, upcast to fp32, then the loss."""
    return F.cross_entropy(F.linear(hidden, weight).float(), targets, reduction="none")


def variants(args, device: torch.device, log) -> tuple[dict, object]:
    """({name: fn(hidden, weight, targets) -> (N,) fp32 NLL}, the fused kernel's default segment count function
    or None)."""
    segments_of = None
    found = {"F.cross_entropy, full logits": full_logits_nll,
             f"chunked ({args.chunk_rows} rows), eager":
                 lambda h, w, t: chunked_token_nll(h, w, t, None, args.chunk_rows)}
    if device.type == "cuda" and not args.no_compile:
        compiled = torch.compile(chunked_token_nll, dynamic=False)
        found[f"chunked ({args.chunk_rows} rows), compiled"] = lambda h, w, t: compiled(h, w, t, None, args.chunk_rows)
    elif device.type != "cuda":
        log("skipped: the compiled chunked loss (timed on CUDA only)")
    if fused_loss_available(device):
        from fastppl.engine.fused_loss import fused_token_nll, vocabulary_segments
        for segments in args.segments or [None]:
            name = "fused (Triton)" if segments is None else f"fused (Triton), {segments} segment(s)"
            found[name] = lambda h, w, t, s=segments: fused_token_nll(h, w, t, segments=s)
        segments_of = vocabulary_segments
    else:
        log("skipped: the fused loss (it needs a CUDA device and Triton)")
    return found, segments_of


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="gpt2,llama-1b", help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument("--shape", help="N,C,V: rows, width, vocabulary (instead of --shapes)")
    parser.add_argument("--device", default="auto", help="auto, cuda, cuda:N or cpu")
    parser.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp16", "fp32"],
                        help="of the hidden states and weights (auto: bf16 on CUDA, fp32 on the CPU)")
    parser.add_argument("--chunk-rows", type=int, default=8192, help="rows per chunk of the chunked loss")
    parser.add_argument("--segments", help="also time the fused kernel at these vocabulary segment counts, e.g. 1,9")
    parser.add_argument("--no-compile", action="store_true", help="leave out the compiled chunked loss")
    parser.add_argument("--no-full-logits", action="store_true",
                        help="leave out F.cross_entropy over full logits (it holds N x V fp32 logits)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (the median is shown)")
    parser.add_argument("--reps", type=int, default=10, help="timed calls per variant and round (their median)")
    parser.add_argument("--check-rows", type=int, default=1024, help="rows checked against float64")
    args = parser.parse_args(argv)
    args.segments = [int(s) for s in args.segments.split(",")] if args.segments else None

    device = resolve_device(args.device)
    dtype = (torch.bfloat16 if device.type == "cuda" else torch.float32) if args.dtype == "auto" \
        else DTYPE_BY_NAME[args.dtype]
    shapes = {"custom": tuple(int(x) for x in args.shape.split(","))} if args.shape else \
        {name: SHAPES[name] for name in args.shapes.split(",")}
    found, segments_of = variants(args, device, print)
    if args.no_full_logits:
        found.pop("F.cross_entropy, full logits")

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"{name}, torch {torch.__version__}, {str(dtype).removeprefix('torch.')}, median of {args.rounds} "
          f"interleaved rounds of {args.reps} calls")
    print("| shape (N x C x V) | loss | ms | TFLOP/s | max rel. error vs fp64 | peak GiB (inputs included) |")
    print("| --- | --- | --- | --- | --- | --- |")
    generator = torch.Generator(device=device).manual_seed(0)
    for shape_name, (N, C, V) in shapes.items():
        hidden = torch.randn(N, C, device=device, dtype=dtype, generator=generator)
        weight = (torch.randn(V, C, device=device, dtype=dtype, generator=generator) * 0.05)
        targets = torch.randint(0, V, (N,), device=device, generator=generator)
        check = torch.linspace(0, N - 1, min(args.check_rows, N), device=device).long()
        with torch.inference_mode():
            reference = F.cross_entropy(F.linear(hidden[check].double(), weight.double()), targets[check],
                                        reduction="none")
            errors, peaks, times = {}, {}, {k: [] for k in found}
            for loss_name, fn in found.items():
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats(device)
                nll = fn(hidden, weight, targets)
                errors[loss_name] = ((nll[check].double() - reference).abs() / reference.abs()).max().item()
                peaks[loss_name] = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
                del nll
            for _ in range(args.rounds):
                for loss_name, fn in found.items():
                    times[loss_name].append(time_ms(lambda: fn(hidden, weight, targets), device, args.reps))
        for loss_name in found:
            ms = statistics.median(times[loss_name])
            label = loss_name
            if loss_name == "fused (Triton)" and segments_of is not None:
                label += f", {segments_of(V, 128 if dtype == torch.float32 else 256)} segment(s)"
            peak = "n/a" if peaks[loss_name] is None else f"{peaks[loss_name]:.2f}"
            print(f"| {shape_name} {N:,} x {C:,} x {V:,} | {label} | {ms:.2f} | {2 * N * C * V / ms / 1e9:.3g} | "
                  f"{errors[loss_name]:.1e} | {peak} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
