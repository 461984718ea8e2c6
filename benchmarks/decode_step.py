"""One decode step of fastppl's greedy generation: ms a step, tokens/s and time to first token at each batch size,
through fastppl.generate.generate alone (whichever step it picks: on CUDA the fused Triton step for greedy GPT-2 at
batch 1 and 2, else the compiled step; eager on the CPU).

    PYTHONPATH=src python benchmarks/decode_step.py                        # GPT-2 124M, batch 1 and 64, CUDA
    PYTHONPATH=src python benchmarks/decode_step.py --batch-sizes 1,2,4,8 --eager
    PYTHONPATH=src python benchmarks/decode_step.py --device cpu --model gpt2-tiny --batch-sizes 1,2 --new-tokens 8

Random prompts, no end-of-text stop, so every row decodes --new-tokens tokens. Each batch size runs once untimed
(compilation, CUDA graph capture, Triton's first use), then --runs timed calls; the table gives their median.
generate's own timing leaves out its first decode steps, which compile. --eager adds the uncompiled step at each
batch for reference. For the ratio to `transformers`' static-cache generate in the same process, run
`fastppl bench --generate --batch-sizes 1,64`."""
from __future__ import annotations

import argparse
import statistics

import torch

from fastppl.engine.precision import resolve_device, resolve_dtype
from fastppl.generate import generate
from fastppl.models.loading import random_native


def time_generate(model, prompts, new_tokens: int, compile, runs: int) -> dict:
    """Median over `runs` timed calls (after an untimed one) of generate's own decode and first-token timings."""
    generate(model, prompts, new_tokens, eos_id=None, compile=compile)
    results = [generate(model, prompts, new_tokens, eos_id=None, compile=compile) for _ in range(runs)]
    step_ms = statistics.median(1e3 * r.decode_seconds / max(r.decode_steps - r.decode_warmup_steps, 1)
                                for r in results)
    return dict(ms_per_step=step_ms, tokens_per_second=len(prompts) / step_ms * 1e3,   # every row's token counted
                first_token_ms=1e3 * statistics.median(r.time_to_first_token for r in results),
                step=results[0].decode_step or ("compiled" if results[0].compiled else "eager"))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt2", help="a random: preset (gpt2, llama-1b, gpt2-tiny, ...)")
    parser.add_argument("--batch-sizes", default="1,64", help="comma-separated rows a step")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--device", default="auto", help="auto, cuda, cuda:N or cpu")
    parser.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp16", "fp32"],
                        help="auto: bf16 on CUDA, fp32 on the CPU")
    parser.add_argument("--runs", type=int, default=3, help="timed calls a batch size (their median)")
    parser.add_argument("--eager", action="store_true", help="also time the uncompiled step (compile=False)")
    args = parser.parse_args(argv)

    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    model = random_native(args.model, 0, device).to(dtype).eval()
    label = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    rows = []
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        generator = torch.Generator().manual_seed(batch)
        prompts = torch.randint(0, model.vocab_size, (batch, args.prompt_tokens), generator=generator).tolist()
        settings = [("default", None)] + ([("eager", False)] if args.eager and device.type == "cuda" else [])
        for name, compile in settings:
            rows.append(dict(batch=batch, variant=name,
                             **time_generate(model, prompts, args.new_tokens, compile, args.runs)))
    if args.eager and device.type != "cuda":
        print("--eager: on the CPU the default step is the eager one already")

    print(f"{label}, torch {torch.__version__}, random:{args.model}, {str(dtype).removeprefix('torch.')}, prompt "
          f"{args.prompt_tokens}, {args.new_tokens} new tokens, greedy, median of {args.runs} runs")
    print("| batch | variant | decode step | ms a step | tokens/s | first token ms |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['batch']} | {r['variant']} | {r['step']} | {r['ms_per_step']:.3f} | "
              f"{r['tokens_per_second']:,.0f} | {r['first_token_ms']:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
