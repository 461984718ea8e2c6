"""Issue 3 (session 18): the fused loss with its vocabulary split over several programs per row block
(engine.fused_loss.vocabulary_segments) against one program per row block, alone at the scorer's shapes, and in
the dense scorer (GPT-2 64 x 1024, tuned products) with VOCABULARY_SEGMENTS 1 against the shipped value.
Predicted: GPT-2's 512 row blocks fill 3.88 waves of 132 SMs (3 % of the loss idle in the last wave); nine segments
leave ~0.3 % idle for ~1 % of extra pipeline fills, so the loss -2 % and the scorer -0.4 %.
Prints a table last; writes $OUT/loss_segments.json."""
import json
import os

import torch
import torch.nn.functional as F

from gpu_common import dense_gpt2_scorer, interleaved_rounds_ms
from fastppl.accel import cublaslt
from fastppl.accel.cublaslt import time_candidates
from fastppl.engine import fused_loss

dev = torch.device("cuda")
torch.manual_seed(0)
results = {"device": torch.cuda.get_device_name(), "loss": {}}
for shape, (N, C, V, choices) in {"gpt2 64x1024": (65536, 768, 50257, (1, 4, 8, 9, 12, 16)),
                                  "gpt2 256x1024": (262144, 768, 50257, (1, 9)),
                                  "llama-1b 8x2048": (16384, 2048, 128256, (1, 9))}.items():
    h = torch.randn(N, C, device=dev, dtype=torch.bfloat16)
    w = (torch.randn(V, C, device=dev) * 0.05).to(torch.bfloat16)
    t = torch.randint(0, V, (N,), device=dev)
    check = torch.cat([torch.arange(0, 512), torch.arange(N - 512, N)]).to(dev)
    ref = F.cross_entropy(F.linear(h[check].double(), w.double()), t[check], reduction="none")
    errors = {s: (fused_loss.fused_token_nll(h, w, t, segments=s)[check].double() - ref).abs().max().item()
              for s in choices}
    times = time_candidates(lambda s: fused_loss.fused_token_nll(h, w, t, segments=s), list(choices), rounds=7,
                            calls=3)
    results["loss"][shape] = {s: {"ms": times[s], "max_abs_error": errors[s]} for s in choices}

model, score, batch = dense_gpt2_scorer(64, 1024)
cublaslt.route_linears(model)
with torch.inference_mode():
    cublaslt.start_tuning(None)
    shipped = fused_loss.VOCABULARY_SEGMENTS

    def segments(n):
        return lambda: setattr(fused_loss, "VOCABULARY_SEGMENTS", n)

    results["scorer_ms"] = interleaved_rounds_ms(lambda: score(*batch), {"1 segment": segments(1),
                                                                         f"{shipped} segments": segments(shipped)},
                                                 rounds=5, calls=20)
    fused_loss.VOCABULARY_SEGMENTS = shipped
os.makedirs(os.environ.get("OUT", "."), exist_ok=True)
with open(os.path.join(os.environ.get("OUT", "."), "loss_segments.json"), "w") as f:
    json.dump(results, f, indent=1)
print(f"{results['device']}: the fused loss by vocabulary segments, ms (7 interleaved rounds of 3 calls, median)")
for shape, by in results["loss"].items():
    print(f"{shape:16s} " + "  ".join(f"{s}: {r['ms']:.3f} ({r['max_abs_error']:.1e})" for s, r in by.items()))
for name, t in results["scorer_ms"].items():
    print(f"scorer, {name:12s} median {sorted(t)[2]:7.3f} ms a batch  rounds {' '.join(f'{v:.3f}' for v in t)}")
