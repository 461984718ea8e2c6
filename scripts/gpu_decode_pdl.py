"""Programmatic dependent launch for the decode steps (H200; PYTHONPATH=src). GPT-2 124M, bf16, prompt 32, 256 new
tokens, greedy; generate's own decode timing, median of 3 after a warm-up call.

1. The fused step (batch 1 and 2): its 63 kernels a token each wait on the one before (~4.7 us a kernel at batch
   1, 0.294 ms a step, where streaming the 250 MB of weights would take ~60 us). With dependent launch a kernel
   starts and issues its weight loads while the previous one finishes, and waits only before it reads what that
   one wrote. Expected: 1-2 us less at each of the 62 kernel boundaries, so 0.294 -> 0.18-0.23 ms a step
   (issue 5's batch-1 target, >= 5x transformers' static cache, needs <= ~0.27).
2. The compiled step at batch 64 with Inductor's own dependent launch (torch._inductor.config.triton.enable_pdl):
   only Inductor's Triton kernels (~100 of ~750 us a step) take part; cuBLAS and cuDNN do not. Expected: -2 to -5 %.

Tokens of both settings must be equal (the same kernels, the same arithmetic); the script exits 1 otherwise."""
import json
import os
import sys

import torch

from fastppl.generate import DecodeOptions, Sampling, generate
from fastppl.models.loading import random_native

dev = torch.device("cuda")
model = random_native("gpt2", 0, dev).to(torch.bfloat16).eval()
NEW = 256
rows, failures = [], []


def timed(batch, decode):
    prompts = torch.randint(0, 50257, (batch, 32), generator=torch.Generator().manual_seed(batch)).tolist()
    generate(model, prompts, NEW, Sampling(), eos_id=None, decode=decode)           # compile, capture
    runs = [generate(model, prompts, NEW, Sampling(), eos_id=None, decode=decode) for _ in range(3)]
    rate = sorted(r.decode_tokens_per_second for r in runs)[1]
    return 1000 * batch / rate, rate, runs[0].tokens, runs[0].decode_step


for batch in (1, 2):
    results = {}
    for _ in range(2):   # interleaved rounds, the last one kept
        for dependent in (False, True):
            results[dependent] = timed(batch, DecodeOptions(dependent_launch=dependent))
    same = results[True][2] == results[False][2]
    if not same:
        failures.append(f"fused batch {batch}: tokens differ with dependent launch")
    for dependent, (ms, rate, _, step) in results.items():
        rows.append(dict(step="fused", batch=batch, dependent_launch=dependent, ms_per_step=ms, tokens_per_second=rate,
                         decode_step=step, same_tokens=same))
        print(f"fused batch {batch} dependent launch {dependent}: {ms:.3f} ms/step, {rate:,.0f} tokens/s, "
              f"same tokens {same}", flush=True)

import torch._dynamo
import torch._inductor.config as inductor_config
if hasattr(inductor_config.triton, "enable_pdl"):
    results = {}
    for flag in (False, True):
        torch._dynamo.reset()
        inductor_config.triton.enable_pdl = flag
        results[flag] = timed(64, DecodeOptions())
    same = results[True][2] == results[False][2]
    for flag, (ms, rate, _, step) in results.items():
        rows.append(dict(step="compiled", batch=64, dependent_launch=flag, ms_per_step=ms, tokens_per_second=rate,
                         decode_step=step, same_tokens=same))
else:
    print("torch._inductor.config.triton.enable_pdl: not in this torch")

if os.environ.get("OUT"):
    json.dump(rows, open(os.path.join(os.environ["OUT"], "decode_pdl.json"), "w"), indent=1)
print("| step | batch | dependent launch | ms/step | tokens/s | same tokens |\n| --- | --- | --- | --- | --- | --- |")
for r in rows:
    print(f"| {r['step']} | {r['batch']} | {'on' if r['dependent_launch'] else 'off'} | {r['ms_per_step']:.3f} | "
          f"{r['tokens_per_second']:,.0f} | {r['same_tokens']} |")
print(rows[1]["decode_step"] if len(rows) > 1 else "")
if failures:
    print("FAILED:", "; ".join(failures))
    sys.exit(1)
