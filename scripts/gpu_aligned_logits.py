"""The compiled decode step with the vocabulary product padded to a multiple of 64 ids (FASTPPL_DECODE
aligned_logits=1, generate.aligned_lm_head) against the plain one (alignment-1 cuBLAS kernel for GPT-2's 50,257
ids), same run, same GPU: GPT-2 124M random weights, prompt 32, 256 new tokens, greedy, fused=0 (the compiled
step at every batch). Interleaved runs, median ms per step of 3, after one untimed run of each.

Checks first (exit 1 on failure): fp32, 4 prompts of different lengths, compiled: both give the eager tokens.
bf16: the share of equal tokens between the two is printed, not checked (argmax ties).

    PYTHONPATH=src python3 scripts/gpu_aligned_logits.py        # ~120 s
"""
import json
import os
import statistics
import sys

import torch

from fastppl.generate import DecodeOptions, Sampling, generate
from fastppl.models.loading import random_native

dev = torch.device("cuda")
PLAIN, ALIGNED = DecodeOptions(fused=False, aligned_logits=False), DecodeOptions(fused=False, aligned_logits=True)

model = random_native("gpt2", 0, dev).float().eval()
prompts = [torch.randint(0, 50257, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (9, 2, 5, 13)]
eager = generate(model, prompts, 24, eos_id=None, compile=False).tokens
for name, options in (("plain", PLAIN), ("aligned", ALIGNED)):
    got = generate(model, prompts, 24, eos_id=None, compile=True, decode=options).tokens
    print(f"check fp32 compiled {name}: {'equal' if got == eager else 'DIFFERENT'} to eager", flush=True)
    if got != eager:
        sys.exit(1)

model = model.to(torch.bfloat16)
rows = []
for batch in (1, 8, 64, 128):
    prompt = torch.randint(0, 50257, (batch, 32), generator=torch.Generator().manual_seed(batch)).tolist()
    times = {"plain": [], "aligned": []}
    tokens = {}
    for options in (PLAIN, ALIGNED):   # untimed: compile and capture
        generate(model, prompt, 256, Sampling(), eos_id=None, compile=True, decode=options)
    for _ in range(3):
        for name, options in (("plain", PLAIN), ("aligned", ALIGNED)):
            g = generate(model, prompt, 256, Sampling(), eos_id=None, compile=True, decode=options)
            times[name].append(1000 * g.decode_seconds / (g.decode_steps - g.decode_warmup_steps))
            tokens[name] = g.tokens
    same = sum(a == b for ra, rb in zip(tokens["plain"], tokens["aligned"]) for a, b in zip(ra, rb))
    total = sum(len(r) for r in tokens["plain"])
    rows.append(dict(batch=batch, plain_ms=statistics.median(times["plain"]),
                     aligned_ms=statistics.median(times["aligned"]), equal_tokens=same / total,
                     plain_all=times["plain"], aligned_all=times["aligned"]))
    print(rows[-1], flush=True)
if os.environ.get("OUT"):
    json.dump(rows, open(os.path.join(os.environ["OUT"], "aligned_logits.json"), "w"), indent=1)
print(f"{'batch':>5} {'plain ms/step':>14} {'aligned ms/step':>16} {'aligned/plain':>14} {'equal tokens bf16':>18}")
for r in rows:
    print(f"{r['batch']:>5} {r['plain_ms']:>14.3f} {r['aligned_ms']:>16.3f} {r['aligned_ms'] / r['plain_ms']:>14.3f} "
          f"{100 * r['equal_tokens']:>17.1f}%")
