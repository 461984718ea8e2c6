"""Where the GPT-2 124M scorer's time goes, and what the candidate changes move (H200, PYTHONPATH=src).
Each variant scores the same random tokens with the same weights; NLL differences against the plain
eager scorer are printed beside the times (median of 10 timed batches after 3 warm-ups)."""
import torch

from fastppl.accel.compile import compile_score_fn
from fastppl.accel.fused_mlp import fuse_mlp_epilogue
from fastppl.engine.score import make_score_fn
from fastppl.models.loading import random_gpt2

dev = torch.device("cuda")
T = 1024
rows = []


def timed(fn, *args, reps=10):
    for _ in range(3):
        out = fn(*args)
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); out = fn(*args); e.record(); torch.cuda.synchronize()
        times.append(s.elapsed_time(e))
    return sorted(times)[reps // 2], out


for B in (64, 256):
    g = torch.Generator(device=dev).manual_seed(B)
    ids = torch.randint(0, 50257, (B, T + 1), device=dev, generator=g)
    inputs, targets = ids[:, :T].contiguous(), ids[:, 1:].contiguous()
    mask = torch.ones(B, T, dtype=torch.bool, device=dev)
    model = random_gpt2("gpt2", 0, dev).to(torch.bfloat16).eval()
    fused_model = random_gpt2("gpt2", 0, dev).to(torch.bfloat16).eval()
    assert fuse_mlp_epilogue(fused_model) == 12
    variants = [
        ("trunk eager", lambda: model(inputs)),
        ("trunk eager, fused MLP epilogue", lambda: fused_model(inputs)),
        ("scorer eager, fused loss", make_score_fn(model, loss="fused")),
        ("scorer eager, fused loss + MLP epilogue", make_score_fn(fused_model, loss="fused")),
        ("scorer compiled, fused loss", compile_score_fn(make_score_fn(model, loss="fused"))),
    ]
    reference = None
    with torch.inference_mode():
        for name, fn in variants:
            args = () if name.startswith("trunk") else (inputs, targets, mask)
            ms, out = timed(fn, *args)
            note = ""
            if not name.startswith("trunk"):
                total = out.double().sum().item()
                reference = reference if reference is not None else total
                note = f"nll {total / (B * T):.6f} rel {total / reference - 1:+.1e}"
            rows.append((B, name, ms, B * T / ms * 1e3, note))
            print(rows[-1], flush=True)
    del model, fused_model
    torch._dynamo.reset()
    torch.cuda.empty_cache()

print(f"\n{'B':>4} {'variant':<42} {'ms':>8} {'tok/s':>12}  note")
for B, name, ms, rate, note in rows:
    print(f"{B:>4} {name:<42} {ms:8.2f} {rate:12,.0f}  {note}")
