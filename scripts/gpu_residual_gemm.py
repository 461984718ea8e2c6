"""The residual adds of GPT-2's dense scorer moved into cuBLAS, against the add + LayerNorm kernels before them
(H200; PYTHONPATH=src). Before: each sublayer's output projection writes its (B*T, C) result, and a Triton kernel
reads it and the residual stream and writes their sum and its LayerNorm (5 passes over a (B*T, C) tensor). Now
(accel/fused_norm.py): the projection adds its product into the residual stream in place (cuBLAS's beta = 1), the
projection biases come back as one fp32 vector per LayerNorm, and the LayerNorm kernel writes only its output
(4 passes). Expected: ~0.025 ms saved at each of 24 norms, ~0.6 ms of a ~35 ms batch (+1.7 %).

The earlier forward comes from a copy of the file (OLD_FUSED_NORM, e.g. `git show HEAD:src/fastppl/accel/fused_norm.py
> .devcache/old_fused_norm.py`). Prints ms per batch (5 interleaved rounds of 20 batches back to back, median), and
each variant's per-token NLL against the fp32 plain model, on weights whose projection biases are not zero."""
import importlib.util
import json
import os
import time
import types

import torch

from gpu_common import dense_gpt2_scorer
from fastppl.engine.score import make_score_fn
from fastppl.models.loading import random_gpt2

spec = importlib.util.spec_from_file_location("fastppl.accel._old_fused_norm", os.environ["OLD_FUSED_NORM"])
old = importlib.util.module_from_spec(spec)
spec.loader.exec_module(old)

torch.manual_seed(0)
model, score, (inputs, targets, mask) = dense_gpt2_scorer(64, 1024)
reference = random_gpt2("gpt2", 0, torch.device("cuda")).float().eval()
with torch.no_grad():   # random weights have zero biases: give the projections some, as a trained model has
    for block, ref_block in zip(model.blocks, reference.blocks):
        for lin, ref_lin in ((block.attn.proj, ref_block.attn.proj), (block.mlp.proj, ref_block.mlp.proj)):
            lin.bias.normal_(0, 0.05)
            ref_lin.bias.copy_(lin.bias.float())
forwards = {"add + LayerNorm kernels (before)": types.MethodType(old._fused_forward, model),
            "residual in cuBLAS, bias sums in the norms (now)": model.forward}


def with_forward(forward):
    def run():
        model.forward = forward
        return score(inputs, targets, mask)
    return run


variants = {name: with_forward(f) for name, f in forwards.items()}
results = {}
with torch.inference_mode():
    ref_nll = make_score_fn(reference, loss="chunked")(inputs[:8], targets[:8], mask[:8]).double()
    for name, fn in variants.items():
        nll = fn()[:8].double()
        results[name] = dict(max_abs_vs_fp32=(nll - ref_nll).abs().max().item(),
                             mean_rel_vs_fp32=((nll.sum() - ref_nll.sum()) / ref_nll.sum()).item(), rounds=[])
    for fn in variants.values():   # warm
        for _ in range(10):
            fn()
    torch.cuda.synchronize()
    for _ in range(5):
        for name, fn in variants.items():
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(20):
                fn()
            torch.cuda.synchronize()
            results[name]["rounds"].append((time.perf_counter() - t) / 20 * 1e3)
for r in results.values():
    r["ms_per_batch"] = sorted(r["rounds"])[len(r["rounds"]) // 2]
if os.environ.get("OUT"):
    json.dump(results, open(os.path.join(os.environ["OUT"], "residual_gemm.json"), "w"), indent=1)
print("| forward | ms per batch | tokens/s | max abs NLL vs fp32 | mean rel vs fp32 |")
print("| --- | --- | --- | --- | --- |")
for name, r in results.items():
    print(f"| {name} | {r['ms_per_batch']:.2f} | {65536 / r['ms_per_batch'] * 1e3:,.0f} | "
          f"{r['max_abs_vs_fp32']:.2e} | {r['mean_rel_vs_fp32']:+.2e} |")
