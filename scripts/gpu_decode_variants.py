"""Decode-step variants (GPT-2 124M, bf16, H200): ms per step, tokens/s, kernels per step and compile time,
at batch 1 and 64 (prompt 32, 256 new tokens), each variant compiled afresh per batch size (as the bench does).

Checks first, and exits non-zero if one fails:
  - fp32, eager, batch of 4 prompts of different lengths: every variant's greedy tokens equal the default's
    (the default equals transformers, tests/test_generate.py);
  - fp32, compiled (CUDA graphs): the default's tokens equal the eager ones.
bf16 compiled tokens are compared with the old default (scatter cache write): the share of equal tokens is
reported, not checked (bf16 ties and rounding differ between kernels).

    PYTHONPATH=src python3 scripts/gpu_decode_variants.py        # ~200 s; variants past the budget are skipped
DECODE_BUDGET_S (180) sets the budget, DECODE_ONLY a comma-separated list of variant names to run.
"""
import json
import os
import sys
import time

import torch
import torch._dynamo
import torch._inductor.config as inductor_config

import fastppl.generate as gen
from fastppl.generate import DecodeOptions, Sampling, generate
from fastppl.accel.fused_mlp import fuse_mlp_epilogue, unfuse_mlp_epilogue
from fastppl.models.kv_cache import KVCache
from fastppl.models.loading import random_native

INDEXED_UPDATE = KVCache.update


def scatter_update(self, slots, k, v):
    """The cache write before index_copy_ / index_put_ (scatter_ with an expanded index), for comparison."""
    if slots.dim() == 1:
        slots = slots.expand(k.shape[0], -1)
    index = slots[:, None, :, None].expand_as(k)
    self.k.scatter_(2, index, k)
    self.v.scatter_(2, index, v)
    return self.k, self.v

BUDGET_S = float(os.environ.get("DECODE_BUDGET_S", 180))
started = time.perf_counter()
# DECODE_DEVICE=cpu DECODE_PRESET=gpt2-tiny: a smoke test of the script itself, without a GPU
dev = torch.device(os.environ.get("DECODE_DEVICE", "cuda"))
PRESET = os.environ.get("DECODE_PRESET", "gpt2")
NEW_TOKENS = int(os.environ.get("DECODE_NEW_TOKENS", 256))
# (name, FASTPPL_DECODE options, Inductor config): the most telling first, the slow compile (max-autotune) last
VARIANTS = [
    ("scatter_ (old default)", "cache_write=per_row", {"_old_scatter": True}),
    ("index_copy (default)", "", {}),
    ("bucket 64", "attend_bucket=64", {}),
    ("additive mask", "additive_mask=1", {}),
    ("matmul attention", "attention=matmul", {}),
    ("reduction attention", "attention=reduction", {}),
    ("additive + bucket 64", "additive_mask=1,attend_bucket=64", {}),
    ("per_row index_put_", "cache_write=per_row", {}),
    ("no cudagraph trees", "", {"triton.cudagraph_trees": False}),
    ("MLP epilogue", "", {"_fused_mlp": True}),
    ("max_autotune_gemm", "", {"max_autotune_gemm": True}),
]
if os.environ.get("DECODE_ONLY"):   # e.g. DECODE_ONLY="index_copy (default),max_autotune_gemm"
    by_name = {v[0]: v for v in VARIANTS}   # in the order given
    VARIANTS = [by_name[name] for name in os.environ["DECODE_ONLY"].split(",") if name in by_name]


def elapsed() -> float:
    return time.perf_counter() - started


def fresh_compile() -> None:
    torch._dynamo.reset()
    gen._compiled_decode.clear()


def set_inductor(options: dict) -> dict:
    """Set Inductor config entries ("triton.cudagraph_trees" names a nested one); returns the old values."""
    saved = {}
    for key, value in options.items():
        if key == "_old_scatter":   # not Inductor's: the cache write of before
            KVCache.update = scatter_update if value else INDEXED_UPDATE
            saved[key] = False
            continue
        if key == "_fused_mlp":     # not Inductor's: GPT-2's MLP with the cuBLASLt bias + GELU epilogue
            for m in (globals().get("model32"), globals().get("model")):
                if m is not None:
                    (fuse_mlp_epilogue if value else unfuse_mlp_epilogue)(m)
            saved[key] = False
            continue
        *parents, attr = key.split(".")
        obj = inductor_config
        for part in parents:
            obj = getattr(obj, part)
        saved[key] = getattr(obj, attr)
        setattr(obj, attr, value)
    return saved


def one_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]


failures = []
mixed = [[(1000 + 7 * b + i) % 50000 for i in range(n)] for b, n in enumerate((32, 20, 7, 1))]

# --- fp32 checks -------------------------------------------------------------------------------------
model32 = random_native(PRESET, 0, dev).float().eval()
reference = generate(model32, mixed, 32, Sampling(), eos_id=None, compile=False, decode=DecodeOptions()).tokens
for name, options, inductor in VARIANTS:
    saved = {}
    try:
        saved = set_inductor(inductor)
        got = generate(model32, mixed, 32, Sampling(), eos_id=None, compile=False,
                       decode=DecodeOptions.parse(options)).tokens
        ok = got == reference
    except Exception as e:   # noqa: BLE001 - one variant must not stop the others
        ok = False
        print(f"fp32 eager check {name}: error {one_line(e)}", flush=True)
    finally:
        set_inductor(saved)
    print(f"fp32 eager check {name!r}: {'ok' if ok else 'FAILED'}", flush=True)
    if not ok:
        failures.append(f"fp32 eager {name}")
try:
    fresh_compile()
    generate(model32, mixed, 32, Sampling(), eos_id=None, compile=True, decode=DecodeOptions())
    got = generate(model32, mixed, 32, Sampling(), eos_id=None, compile=True, decode=DecodeOptions()).tokens
    ok = got == reference
except Exception as e:   # noqa: BLE001
    ok = False
    print(f"fp32 compiled check: error {one_line(e)}", flush=True)
print(f"fp32 compiled default vs eager: {'ok' if ok else 'FAILED'}  ({elapsed():.0f} s)", flush=True)
if not ok:
    failures.append("fp32 compiled default")
del model32
torch.cuda.empty_cache()


# --- bf16 timing --------------------------------------------------------------------------------------
def kernels_per_step(model, prompts, decode: DecodeOptions) -> float:
    """CUDA kernels per decode step: two profiled runs of different lengths, differenced (drops the prefill)."""
    from torch.profiler import ProfilerActivity, profile
    counts = []
    for new in (9, 41):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            generate(model, prompts, new, Sampling(), eos_id=None, compile=True, decode=decode)
        counts.append(sum(e.count for e in prof.key_averages()
                          if e.device_type == torch.autograd.DeviceType.CUDA))
    return (counts[1] - counts[0]) / 32


model = random_native(PRESET, 0, dev).to(torch.bfloat16).eval()
rows, baseline, compile_costs = [], {}, []
for name, options, inductor in VARIANTS:
    for batch in (1, 64):
        row = dict(variant=name, options=options, inductor=inductor, batch=batch)
        # the last compile predicts the next (the first, cold one overstates the rest); + the timed runs
        needed = 1.3 * compile_costs[-1] + 5 if compile_costs else 30.0
        if "max_autotune_gemm" in inductor:
            needed *= 3
        if elapsed() + needed > BUDGET_S:
            row["skipped"] = f"time budget ({elapsed():.0f} s used, ~{needed:.0f} s needed)"
            rows.append(row)
            print(row, flush=True)
            continue
        saved = {}
        try:
            saved = set_inductor(inductor)
            fresh_compile()
            decode = DecodeOptions.parse(options)
            prompts = [[(1000 + 7 * b + i) % 50000 for i in range(32)] for b in range(batch)]
            t0 = time.perf_counter()
            # the same length as the timed run, so that every attend bucket is compiled and captured here
            generate(model, prompts, NEW_TOKENS, Sampling(), eos_id=None, compile=True, decode=decode)
            row["first_compile_s"] = time.perf_counter() - t0
            compile_costs.append(row["first_compile_s"])
            runs = [generate(model, prompts, NEW_TOKENS, Sampling(), eos_id=None, compile=True, decode=decode)
                    for _ in range(3)]
            g = min(runs, key=lambda r: r.decode_seconds)
            steps = g.decode_steps - g.decode_warmup_steps
            row["ms_per_step"] = 1e3 * g.decode_seconds / steps
            row["tokens_per_s"] = g.decode_tokens_per_second
            if batch not in baseline:
                baseline[batch] = g.tokens
            equal = sum(a == b for x, y in zip(g.tokens, baseline[batch]) for a, b in zip(x, y))
            row["match_share"] = equal / sum(len(t) for t in baseline[batch])
            if batch == 1 and elapsed() < BUDGET_S - 20:
                try:
                    row["kernels_per_step"] = kernels_per_step(model, prompts, decode)
                except Exception as e:   # noqa: BLE001
                    row["kernels_error"] = one_line(e)
        except Exception as e:   # noqa: BLE001
            row["error"] = one_line(e)
        finally:
            set_inductor(saved)
        rows.append(row)
        print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)

out = os.environ.get("OUT", "/tmp")
with open(os.path.join(out, "decode_variants.json"), "w") as f:
    json.dump(dict(rows=rows, failures=failures, seconds=elapsed(), torch=torch.__version__), f, indent=1)
print(f"\nchecks: {'all ok' if not failures else 'FAILED: ' + ', '.join(failures)}; {elapsed():.0f} s in all")
print("| variant | batch | ms/step | tok/s | kernels/step | compile s | bf16 match |")
print("| --- | --- | --- | --- | --- | --- | --- |")
for r in rows:
    if "ms_per_step" not in r:
        print(f"| {r['variant']} | {r['batch']} | {r.get('skipped') or r.get('error')} | | | | |")
        continue
    kernels = f"{r['kernels_per_step']:.0f}" if "kernels_per_step" in r else ""
    print(f"| {r['variant']} | {r['batch']} | {r['ms_per_step']:.3f} | {r['tokens_per_s']:,.0f} | {kernels} | "
          f"{r['first_compile_s']:.1f} | {r['match_share']:.0%} |")
sys.exit(1 if failures else 0)
