"""The fused Triton decode step (fastppl.accel.fused_decode) against the compiled one (torch.compile, CUDA
graphs), GPT-2 124M, H200; then tilings of the fused step's products.

Checks first, and exits non-zero if one fails: fp32, GPT-2 124M, 1 and MAX_BATCH prompts of different lengths,
32 new tokens: the fused step's greedy tokens equal the eager step's. Then, bf16, prompt 32, 256 new tokens, per
batch size: ms per step and tokens/s (generate's own timing, after its warm-up steps; second call, so the
graph exists), kernels per step, and the share of tokens equal to the compiled step's (bf16 rounding differs).

    PYTHONPATH=src python3 scripts/gpu_fused_decode.py      # FUSED_BUDGET_S (200) bounds the tiling sweep

FUSED_BATCHES (1,2,4,8) and FUSED_SWEEP_BATCHES (1) choose the batch sizes; FUSED_PROFILE=B prints GPU time per
kernel of the fused step at batch B; FUSED_BENCH=1,64 runs `fastppl bench --generate` at those batch sizes.
"""
import json
import os
import sys
import time

import torch

import fastppl.accel.fused_decode as fd
from fastppl.generate import DecodeOptions, Sampling, generate
from fastppl.models.loading import random_native

started = time.perf_counter()
BUDGET_S = float(os.environ.get("FUSED_BUDGET_S", 200))
OUT = os.environ.get("OUT", ".")
dev = torch.device("cuda")
NEW = 256
rows, failures = [], []


def elapsed() -> float:
    return time.perf_counter() - started


model32 = random_native("gpt2", 0, dev).float().eval()
for batch in (1, fd.MAX_BATCH):
    mixed = [[(1000 + 7 * b + i) % 50000 for i in range(1 + (31 * b) % 32)] for b in range(batch)]
    eager = generate(model32, mixed, 32, Sampling(), compile=False).tokens
    fused = generate(model32, mixed, 32, Sampling())
    ok = fused.decode_step.startswith("fused") and fused.tokens == eager
    print(f"fp32 fused vs eager tokens, batch {batch}: {'ok' if ok else 'FAILED'} ({fused.decode_step}; "
          f"{elapsed():.0f} s)", flush=True)
    if not ok:
        failures.append(f"fp32 fused tokens batch {batch}")
del model32
torch.cuda.empty_cache()

model = random_native("gpt2", 0, dev).to(torch.bfloat16).eval()


def kernels_per_step(prompts, decode) -> float:
    from torch.profiler import ProfilerActivity, profile
    counts = []
    for new in (9, 41):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            generate(model, prompts, new, Sampling(), decode=decode)
        counts.append(sum(e.count for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA))
    return (counts[1] - counts[0]) / 32


def time_variant(name, batch, decode, reference=None, count_kernels=False):
    generator = torch.Generator().manual_seed(batch)
    prompts = torch.randint(0, 50257, (batch, 32), generator=generator).tolist()
    t0 = time.perf_counter()
    generate(model, prompts, NEW, Sampling(), decode=decode)   # warm-up: compiles and captures
    warm = time.perf_counter() - t0
    runs = [generate(model, prompts, NEW, Sampling(), decode=decode) for _ in range(3)]
    rates = sorted(r.decode_tokens_per_second for r in runs)
    rate = rates[1]
    row = dict(name=name, batch=batch, ms_per_step=1000 * batch / rate, tokens_per_second=rate,
               first_call_seconds=warm, decode_step=runs[0].decode_step)
    if reference is not None:
        a = [t for r in runs[0].tokens for t in r]
        b = [t for r in reference for t in r]
        row["same_tokens_as_compiled"] = sum(x == y for x, y in zip(a, b)) / len(b)
    if count_kernels:
        row["kernels_per_step"] = kernels_per_step(prompts, decode)
    rows.append(row)
    print(json.dumps(row), flush=True)
    return runs[0].tokens


compiled_tokens = {}
BATCHES = [int(b) for b in os.environ.get("FUSED_BATCHES", "1,2,4,8").split(",")]
for batch in BATCHES:
    compiled_tokens[batch] = time_variant("compiled (fused=0)", batch, DecodeOptions(fused=False),
                                          count_kernels=batch == 1)
    time_variant("fused", batch, DecodeOptions(), compiled_tokens[batch], count_kernels=batch == 1)
    print(f"  ({elapsed():.0f} s)", flush=True)

defaults = dict(TILE_ELEMENTS=fd.TILE_ELEMENTS, NUM_WARPS=fd.NUM_WARPS, CHUNK=fd.CHUNK)
sweeps = [dict(TILE_ELEMENTS=t, NUM_WARPS=w) for t, w in [(8192, 2), (8192, 8), (16384, 8), (4096, 2)]]
sweeps += [dict(CHUNK=c) for c in (32, 128, 256)]
for batch in [int(b) for b in os.environ.get("FUSED_SWEEP_BATCHES", "1").split(",") if b.isdigit()]:
    for settings in sweeps:
        if elapsed() > BUDGET_S:
            print(f"budget: skipped batch {batch} {settings}", flush=True)
            continue
        fd._decoders.clear()
        for key, value in settings.items():
            setattr(fd, key, value)
        try:
            label = " ".join(f"{k.lower()}={v}" for k, v in settings.items())
            time_variant(f"fused {label}", batch, DecodeOptions(), compiled_tokens[batch])
            rows[-1]["settings"] = settings
        except Exception as e:  # noqa: BLE001 - one setting must not stop the others
            print(f"{settings}: {type(e).__name__}: {str(e).splitlines()[0][:200]}", flush=True)
        for key, value in defaults.items():
            setattr(fd, key, value)
fd._decoders.clear()

if os.environ.get("FUSED_PROFILE"):   # GPU time per kernel name of the fused step at this batch, defaults
    from torch.profiler import ProfilerActivity, profile
    batch = int(os.environ["FUSED_PROFILE"])
    prompts = [[(1000 + 7 * b + i) % 50000 for i in range(32)] for b in range(batch)]
    generate(model, prompts, 256, Sampling())
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        generate(model, prompts, 257, Sampling())
    kernels = sorted((e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda e: -e.self_device_time_total)
    print(f"fused step, batch {batch}: GPU us per step by kernel (256 steps)")
    for e in kernels[:12]:
        print(f"  {e.key[:60]:60s} {e.count / 256:7.2f} {e.self_device_time_total / 256:8.1f}")
    print(f"  total {sum(e.self_device_time_total for e in kernels) / 256:.1f} us", flush=True)

if os.environ.get("FUSED_BENCH"):   # bench --generate at FUSED_BENCH's batch sizes in this process, defaults
    from fastppl.cli import main
    del model
    torch.cuda.empty_cache()
    main(["bench", "--generate", "--batch-sizes", os.environ["FUSED_BENCH"], "--new-tokens", "128",
          "--json", os.path.join(OUT, "bench_generate.json")])

json.dump(dict(rows=rows, failures=failures, torch=torch.__version__), open(os.path.join(OUT, "fused_decode.json"), "w"),
          indent=1)
print(f"\n{'variant':<30}{'batch':>6}{'ms/step':>9}{'tokens/s':>11}{'kernels':>9}{'same tok':>9}")
for r in rows:
    print(f"{r['name'][:30]:<30}{r['batch']:>6}{r['ms_per_step']:>9.3f}{r['tokens_per_second']:>11,.0f}"
          f"{r.get('kernels_per_step', float('nan')):>9.0f}{r.get('same_tokens_as_compiled', float('nan')):>9.2f}")
print(f"failures: {failures or 'none'}  ({elapsed():.0f} s)")
sys.exit(1 if failures else 0)
