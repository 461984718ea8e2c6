"""Issue 3 (session 18): GPT-2 124M's dense scorer (64 x 1024, bf16, as eval runs it) with every linear product
through cuBLASLt's fastest one-pass candidate (fastppl.accel.cublaslt) against torch's picks, interleaved rounds;
the scorers' NLL bit for bit; and every one-pass candidate of the four products against torch's call, bit for
bit. Predicted from scripts/gpu_cublaslt_algos.py (H100, each product alone): -0.12 ms a layer, so about -1.4 ms of
a ~33.7 ms batch (+4 %). Prints a table last; writes $OUT/tuned_products.json."""
import json
import os
import time

import torch

from gpu_common import dense_gpt2_scorer, interleaved_rounds_ms
from fastppl.accel import cublaslt as lt

dev = torch.device("cuda")
results = {"device": torch.cuda.get_device_name()}
model, score, batch = dense_gpt2_scorer(64, 1024)
lt.route_linears(model)
with torch.inference_mode():
    reference = score(*batch).clone()
    tuners = {}
    limits_shipped = lt.WORKSPACE_LIMITS
    # the heuristic's usual candidates only (each preceded by a memset), then those and the no-workspace ones
    for name, limits in (("tuned, with workspace", (lt.WORKSPACE_BYTES,)), ("tuned, either", (lt.WORKSPACE_BYTES, 0))):
        lt.WORKSPACE_LIMITS = limits
        started = time.perf_counter()
        tuner = tuners[name] = lt.start_tuning(None)
        tuned = score(*batch).clone()
        torch.cuda.synchronize()
        results[name] = {
            "first_batch_s": time.perf_counter() - started, "tuning_s": tuner.tuning_seconds,
            "summary": tuner.summary(), "nll_equal": torch.equal(reference, tuned),
            "picks": {f"{key[:3]} epilogue {key[4]} beta {key[5]}": (plan.workspace_limit, plan.chosen,
                                                                      plan.candidates[plan.chosen].workspace_size)
                      for key, plan in tuner.plans.items() if plan is not None}}
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            score(*batch); torch.cuda.synchronize()
        results[name]["memsets_a_batch"] = sum("memset" in e.name.lower() for e in prof.events()
                                               if e.device_type == torch.autograd.DeviceType.CUDA)
    lt.WORKSPACE_LIMITS = limits_shipped

    def use(active):
        return lambda: setattr(lt, "_tuner", active)

    times = interleaved_rounds_ms(lambda: score(*batch), {"torch's picks": use(None),
                                                          **{name: use(t) for name, t in tuners.items()}},
                                  rounds=5, calls=20)
    results["ms_per_batch"] = times

    # every one-pass candidate against torch's call, bit for bit
    torch.manual_seed(0)
    M, C = 65536, 768
    x, h = torch.randn(M, C, device=dev, dtype=torch.bfloat16), torch.randn(M, 4 * C, device=dev, dtype=torch.bfloat16)
    stream = torch.randn(M, C, device=dev, dtype=torch.bfloat16)
    block = model.blocks[0]
    checks = {
        "up": ((4 * C, C, lt.EPILOGUE_GELU_BIAS, 0.0),
               lambda: torch._addmm_activation(block.mlp.fc.bias, x, block.mlp.fc.weight.t(), use_gelu=True),
               lambda p, i: p.run(x, block.mlp.fc.weight, block.mlp.fc.bias, index=i)),
        "qkv": ((3 * C, C, lt.EPILOGUE_BIAS, 0.0),
                lambda: torch.nn.functional.linear(x, block.attn.qkv.weight, block.attn.qkv.bias),
                lambda p, i: p.run(x, block.attn.qkv.weight, block.attn.qkv.bias, index=i)),
        "proj": ((C, C, lt.EPILOGUE_DEFAULT, 1.0),
                 lambda: stream.clone().addmm_(x, block.attn.proj.weight.t()),
                 lambda p, i: p.run(x, block.attn.proj.weight, out=stream.clone(), index=i)),
        "down": ((C, 4 * C, lt.EPILOGUE_DEFAULT, 1.0),
                 lambda: stream.clone().addmm_(h, block.mlp.proj.weight.t()),
                 lambda p, i: p.run(h, block.mlp.proj.weight, out=stream.clone(), index=i)),
    }
    results["candidates_equal"] = {}
    for name, (shape, torch_call, plan_call) in checks.items():
        expected = torch_call()
        for limit in (lt.WORKSPACE_BYTES, 0):
            plan = lt.LinearPlan(M, *shape[:2], torch.bfloat16, *shape[2:], workspace_limit=limit)
            results["candidates_equal"][f"{name}, workspace {limit}"] = \
                [torch.equal(plan_call(plan, i), expected) for i in plan.one_pass_candidates()]

os.makedirs(os.environ.get("OUT", "."), exist_ok=True)
with open(os.path.join(os.environ.get("OUT", "."), "tuned_products.json"), "w") as f:
    json.dump(results, f, indent=1)
for key, value in results.items():
    if key != "ms_per_batch":
        print(key, json.dumps(value))
print(f"\n{results['device']}: GPT-2 124M dense scorer, 64 x 1024, ms a batch (5 interleaved rounds of 20)")
for name, t in times.items():
    print(f"{name:22s} median {sorted(t)[2]:7.3f}  rounds {' '.join(f'{v:.3f}' for v in t)}  "
          f"{65536 / sorted(t)[2] * 1e3:,.0f} tok/s")
