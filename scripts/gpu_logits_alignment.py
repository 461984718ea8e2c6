"""The compiled decode step (fused=0) with the logits as one (B, V) product or split at a multiple of 64 ids
(fastppl.generate.LOGITS_ALIGNMENT), GPT-2 124M bf16, prompt 32, 256 new tokens, H200; fp32 tokens of both
equal the eager step's first. ALIGN_BATCHES (1,8,64) chooses the batch sizes.

    PYTHONPATH=src python3 scripts/gpu_logits_alignment.py
"""
import json
import os
import sys

import torch

import fastppl.generate as G
from fastppl.generate import DecodeOptions, Sampling, generate
from fastppl.models.loading import random_native

dev = torch.device("cuda")
compiled = DecodeOptions(fused=False)
failures, rows = [], []
model32 = random_native("gpt2", 0, dev).float().eval()
prompts = [[(1000 + 7 * b + i) % 50000 for i in range(1 + (31 * b) % 32)] for b in range(8)]
eager = generate(model32, prompts, 24, Sampling(), compile=False).tokens
for alignment in (0, 64):
    G.LOGITS_ALIGNMENT = alignment
    ok = generate(model32, prompts, 24, Sampling(), decode=compiled).tokens == eager
    print(f"fp32 compiled tokens = eager, alignment {alignment}: {ok}", flush=True)
    failures += [] if ok else [f"fp32 tokens alignment {alignment}"]
del model32
model = random_native("gpt2", 0, dev).to(torch.bfloat16).eval()
for batch in [int(b) for b in os.environ.get("ALIGN_BATCHES", "1,8,64").split(",")]:
    prompts = torch.randint(0, 50257, (batch, 32), generator=torch.Generator().manual_seed(batch)).tolist()
    tokens = {}
    for alignment in (0, 64, 0, 64):   # interleaved, twice, so that drift does not favour one
        G.LOGITS_ALIGNMENT = alignment
        generate(model, prompts, 256, Sampling(), decode=compiled)
        runs = sorted((generate(model, prompts, 256, Sampling(), decode=compiled) for _ in range(3)),
                      key=lambda r: r.decode_tokens_per_second)
        tokens[alignment] = runs[1].tokens
        rows.append(dict(batch=batch, alignment=alignment, ms_per_step=1e3 * batch / runs[1].decode_tokens_per_second,
                         tokens_per_second=runs[1].decode_tokens_per_second))
        print(json.dumps(rows[-1]), flush=True)
    same = sum(a == b for x, y in zip(tokens[0], tokens[64]) for a, b in zip(x, y)) / sum(len(x) for x in tokens[0])
    print(f"batch {batch}: bf16 tokens equal between the two: {same:.3f}", flush=True)
G.LOGITS_ALIGNMENT = 64
json.dump(dict(rows=rows, failures=failures), open(os.path.join(os.environ.get("OUT", "."), "alignment.json"), "w"))
print(f"\n{'batch':>6}{'alignment':>10}{'ms/step':>9}{'tokens/s':>11}")
for r in rows:
    print(f"{r['batch']:>6}{r['alignment']:>10}{r['ms_per_step']:>9.3f}{r['tokens_per_second']:>11,.0f}")
print(f"failures: {failures or 'none'}")
sys.exit(1 if failures else 0)
