"""Sliding-window scoring with the loss on the scored positions only (engine.score.scored_rows_of) against
the loss on every position, same run, same GPU: GPT-2 124M random weights, bf16, TinyShakespeare (all).
Prints one line per variant: best scoring tok/s of 3 runs, nll_sum (must be equal bit for bit, on vs off)."""
import os
from pathlib import Path

import fastppl.engine.score as score_module
from fastppl.config import EvalConfig
from fastppl.pipeline import evaluate

data = Path(os.environ.get("FASTPPL_SHARED_DATA", "../shared/data"))
base = dict(model="random:gpt2", data=[str(data / "tinyshakespeare.txt")], tokenizer=str(data / "gpt2-tokenizer"),
            split="all", device="cuda", dtype="bf16", quiet=True, window="sliding", ctx=1024, batch_size=32)
rows = []
for stride in (512, 256):
    for compile_mode, gather in (("off", True), ("off", False), ("on", False)):
        score_module.GATHER_BELOW = 0.97 if gather else 0.0
        best, result = None, None
        for _ in range(3):
            result = evaluate(EvalConfig(**base, stride=stride, loss="fused", compile=compile_mode))
            best = result["scoring_seconds"] if best is None else min(best, result["scoring_seconds"])
        rows.append((stride, compile_mode, gather, result["tokens_scored"] / best, result["nll_sum"]))
        print(rows[-1], flush=True)
print(f"{'stride':>6} {'compile':>7} {'gather':>6} {'tok/s':>12} {'nll_sum':>22}")
for stride, compile_mode, gather, tps, nll_sum in rows:
    print(f"{stride:>6} {compile_mode:>7} {str(gather):>6} {tps:>12,.0f} {nll_sum:>22.10f}")
