"""Decode step under Inductor options (GPT-2 124M, bf16, H200): ms per step and kernels per step, at
batch 1 and 64, each option compiled afresh in this process. Greedy outputs must equal the default's."""
import json
import os
import sys
import time

import torch
import torch._dynamo
import torch._inductor.config as inductor_config

import fastppl.generate as gen
from fastppl.generate import Sampling, generate
from fastppl.models.loading import random_native

dev = torch.device("cuda")
model = random_native("gpt2", 0, dev).to(torch.bfloat16).eval()
VARIANTS = {
    "default": {},
    "coordinate_descent": {"coordinate_descent_tuning": True},
    "max_autotune_gemm": {"max_autotune_gemm": True, "coordinate_descent_tuning": True},
}
rows, reference = [], {}
for name, options in VARIANTS.items():
    saved = {k: getattr(inductor_config, k) for k in options}
    for k, v in options.items():
        setattr(inductor_config, k, v)
    torch._dynamo.reset()
    gen._compiled_decode = None
    for batch in (1, 64):
        prompts = [[(1000 + 7 * b + i) % 50000 for i in range(32)] for b in range(batch)]
        t0 = time.perf_counter()
        generate(model, prompts, 64, Sampling(), eos_id=None, compile=True)
        compile_s = time.perf_counter() - t0
        g = generate(model, prompts, 256, Sampling(), eos_id=None, compile=True)
        steps = g.decode_steps - g.decode_warmup_steps
        ms = 1e3 * g.decode_seconds / steps
        tokens = [list(t) for t in g.tokens] if hasattr(g, "tokens") else None
        same = None
        if tokens is not None:
            if (batch) not in reference:
                reference[batch] = tokens
            same = tokens == reference[batch]
        rows.append(dict(variant=name, batch=batch, ms_per_step=ms, tokens_per_s=g.decode_tokens_per_second,
                         first_compile_s=compile_s, same_tokens=same))
        print(rows[-1], flush=True)
    for k, v in saved.items():
        setattr(inductor_config, k, v)
out = os.environ.get("OUT", "/tmp")
with open(os.path.join(out, "decode_variants.json"), "w") as f:
    json.dump(rows, f, indent=1)
print("| variant | batch | ms/step | tok/s | compile s | same tokens |")
for r in rows:
    print(f"| {r['variant']} | {r['batch']} | {r['ms_per_step']:.3f} | {r['tokens_per_s']:,.0f} | {r['first_compile_s']:.1f} | {r['same_tokens']} |")
