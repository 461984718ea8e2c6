"""Issue 3 (session 18): does cuBLASLt offer faster kernels for GPT-2's four products when its heuristic is asked
for another SM count (CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET, kept at run time too)? For each target, every one-pass
candidate is timed in interleaved rounds (fastppl.accel.cublaslt.time_candidates, 7 rounds of 5 calls); the table
gives each target's best against the default target's best. Kernel names of the overall best. Prints a table last;
writes $OUT/cublaslt_sm_targets.json."""
import json
import os

import torch

from fastppl.accel import cublaslt as lt

M, C = 65536, 768
dev = torch.device("cuda")
torch.manual_seed(0)
sms = torch.cuda.get_device_properties(dev).multi_processor_count
targets = [0, sms - 4, sms - 12, sms - 18, 2 * sms // 3, sms // 2]
bf16 = dict(device=dev, dtype=torch.bfloat16)
x, h, stream = torch.randn(M, C, **bf16), torch.randn(M, 4 * C, **bf16), torch.randn(M, C, **bf16)
w = {n: torch.randn(o, i, **bf16) * 0.02 for n, (o, i) in
     {"up": (4 * C, C), "qkv": (3 * C, C), "proj": (C, C), "down": (C, 4 * C)}.items()}
b = {"up": torch.randn(4 * C, **bf16), "qkv": torch.randn(3 * C, **bf16)}
products = {
    "up": (4 * C, C, lt.EPILOGUE_GELU_BIAS, 0.0, lambda p, i: p.run(x, w["up"], b["up"], index=i)),
    "qkv": (3 * C, C, lt.EPILOGUE_BIAS, 0.0, lambda p, i: p.run(x, w["qkv"], b["qkv"], index=i)),
    "proj": (C, C, lt.EPILOGUE_DEFAULT, 1.0, lambda p, i: p.run(x, w["proj"], out=stream, index=i)),
    "down": (C, 4 * C, lt.EPILOGUE_DEFAULT, 1.0, lambda p, i: p.run(h, w["down"], out=stream, index=i)),
}
results = {"device": torch.cuda.get_device_name(), "sms": sms, "products": {}}
for name, (n_out, n_in, epilogue, beta, run) in products.items():
    plans = {t: lt.LinearPlan(M, n_out, n_in, torch.bfloat16, epilogue, beta, sm_count_target=t) for t in targets}
    flat = [(t, i) for t, plan in plans.items() for i in plan.one_pass_candidates()]
    times = lt.time_candidates(lambda k: run(plans[flat[k][0]], flat[k][1]), list(range(len(flat))), rounds=7,
                               calls=5)
    by_target = {}
    for k, ms in times.items():
        t, i = flat[k]
        if t not in by_target or ms < by_target[t][1]:
            by_target[t] = (i, ms, plans[t].describe(i))
    best_t = min(by_target, key=lambda t: by_target[t][1])
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        run(plans[best_t], by_target[best_t][0]); torch.cuda.synchronize()
    kernel = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA][:1]
    results["products"][name] = {"by_target": {str(t): v for t, v in by_target.items()}, "best_target": best_t,
                                 "kernel": kernel, "candidates": {str(t): len(p.candidates) for t, p in plans.items()}}
os.makedirs(os.environ.get("OUT", "."), exist_ok=True)
with open(os.path.join(os.environ.get("OUT", "."), "cublaslt_sm_targets.json"), "w") as f:
    json.dump(results, f, indent=1)
print(f"{results['device']} ({sms} SMs): best one-pass candidate per SM count target, ms (65,536 rows, bf16)")
print(f"{'product':8s} " + " ".join(f"{t:>13d}" for t in targets) + "  best kernel")
for name, r in results["products"].items():
    print(f"{name:8s} " + " ".join(f"{r['by_target'][str(t)][1]:8.4f} ({r['by_target'][str(t)][0]})" for t in targets)
          + f"  {r['kernel']}")
