"""GPU checks and timings in one process (run on the H200 with PYTHONPATH=src). Prints a short table last.

1. fused loss vs a float64 reference, fresh random inputs, several shapes, with and without bias,
   output poisoned first so unwritten rows show up as NaN;
2. loss timings at the scorer's shape (65,536 rows, d 768, V 50,257): chunked eager / compiled vs fused."""

import torch
import torch.nn.functional as F

from fastppl.engine.fused_loss import fused_token_nll
from fastppl.engine.loss import chunked_token_nll
from gpu_common import median_cuda_ms

torch.manual_seed(0)
dev = torch.device("cuda")
rows = []

def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()

print("== fused loss correctness (vs float64 reference on the same bf16 inputs)")
worst = 0.0
for N, C, V, bias, dtype in [(1000, 768, 50257, False, torch.bfloat16), (4097, 64, 1000, True, torch.bfloat16),
                             (333, 128, 50304, False, torch.float16), (2048, 768, 50257, False, torch.float32),
                             (130, 2048, 128256, False, torch.bfloat16)]:
    h = torch.randn(N, C, device=dev, dtype=dtype)
    w = (torch.randn(V, C, device=dev, dtype=dtype) * 0.05)
    b = torch.randn(V, device=dev, dtype=dtype) if bias else None
    t = torch.randint(0, V, (N,), device=dev)
    ref = F.cross_entropy(F.linear(h.double(), w.double(), None if b is None else b.double()), t, reduction="none")
    out = fused_token_nll(h, w, t, b)
    chunk = chunked_token_nll(h, w, t, b, 4096)
    e_fused, e_chunk = rel_err(out, ref), rel_err(chunk, ref)
    nan = torch.isnan(out).any().item()
    worst = max(worst, e_fused)
    print(f"N {N} C {C} V {V} bias {bias} {str(dtype)[6:]}: fused rel err {e_fused:.2e}  chunked {e_chunk:.2e}  nan {nan}")
    assert not nan and e_fused < (1e-5 if dtype == torch.float32 else 2e-3), "fused loss is wrong"
rows.append(("fused loss worst rel err vs fp64", f"{worst:.2e}"))

print("== loss timings at 65,536 x 768 x 50,257 bf16")
N, C, V = 65536, 768, 50257
h = torch.randn(N, C, device=dev, dtype=torch.bfloat16)
w = torch.randn(V, C, device=dev, dtype=torch.bfloat16) * 0.05
t = torch.randint(0, V, (N,), device=dev)

flops = 2 * N * C * V
chunked_compiled = torch.compile(lambda h, w, t: chunked_token_nll(h, w, t, None, 8192))
for name, fn in [("chunked eager", lambda: chunked_token_nll(h, w, t, None, 8192)),
                 ("chunked compiled", lambda: chunked_compiled(h, w, t)),
                 ("fused 128x256x64 w8 s3 (default)", lambda: fused_token_nll(h, w, t)),
                 ("fused 128x256x64 w8 s2", lambda: fused_token_nll(h, w, t, num_stages=2)),
                 ("fused 128x128x64 w8 s4", lambda: fused_token_nll(h, w, t, block_n=128, num_stages=4)),
                 ("fused 128x128x64 w4 s4", lambda: fused_token_nll(h, w, t, block_n=128, num_warps=4, num_stages=4)),
                 ("fused 256x128x64 w8 s3", lambda: fused_token_nll(h, w, t, block_m=256, block_n=128)),
                 ("fused 128x256x32 w8 s4", lambda: fused_token_nll(h, w, t, block_k=32, num_stages=4)),
                 ("fused 64x256x64 w4 s3", lambda: fused_token_nll(h, w, t, block_m=64, num_warps=4))]:
    try:
        ms = median_cuda_ms(fn)
        rows.append((name, f"{ms:.2f} ms  {flops / ms / 1e9:.0f} TFLOP/s"))
    except Exception as ex:  # a config that does not fit shared memory
        rows.append((name, f"failed: {str(ex).splitlines()[0][:60]}"))
    print(rows[-1])

print("\n== summary")
for name, value in rows:
    print(f"{name:<36} {value}")
