"""What the GPU scripts share (imported as `gpu_common`: a script run as `python3 scripts/x.py` has scripts/ on
its path): a CUDA-event timer, interleaved rounds of a setting each, and GPT-2 124M's dense scorer as `fastppl eval`
runs it on CUDA."""
import time

import torch


def median_cuda_ms(fn, reps: int = 10) -> float:
    """Median of `reps` timed calls of fn in ms (CUDA events), after one untimed call."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); fn(); e.record(); torch.cuda.synchronize()
        times.append(s.elapsed_time(e))
    return sorted(times)[len(times) // 2]


def interleaved_rounds_ms(run, settings: dict, rounds: int = 3, calls: int = 20, warm_up: int = 20) -> dict:
    """{name: [ms per call of run, one entry a round]}: after warm_up calls, `rounds` rounds in which each setting
    (name -> a function that puts it in place) is applied, run once untimed, then timed over `calls` calls. Rounds
    interleave the settings, so that the machine's drift (clock, power cap) falls on all of them alike."""
    times = {name: [] for name in settings}
    for _ in range(warm_up):
        run()
    for _ in range(rounds):
        for name, apply in settings.items():
            apply()
            run()
            torch.cuda.synchronize()
            started = time.perf_counter()
            for _ in range(calls):
                run()
            torch.cuda.synchronize()
            times[name].append((time.perf_counter() - started) / calls * 1e3)
    return times


def dense_gpt2_scorer(batch: int = 64, seq: int = 1024, fused_norms: bool = True):
    """(model, score, (inputs, targets, mask)): random-weight GPT-2 124M in bf16 with the fused loss and the MLP
    epilogue (and the residual norms unless fused_norms=False), one batch of random full rows."""
    from fastppl.accel.fused_mlp import fuse_mlp_epilogue
    from fastppl.accel.fused_norm import fuse_residual_norms
    from fastppl.engine.score import make_score_fn
    from fastppl.models.loading import random_gpt2
    dev = torch.device("cuda")
    ids = torch.randint(0, 50257, (batch, seq + 1), device=dev)
    inputs, targets = ids[:, :seq].contiguous(), ids[:, 1:].contiguous()
    mask = torch.ones(batch, seq, dtype=torch.bool, device=dev)
    model = random_gpt2("gpt2", 0, dev).to(torch.bfloat16).eval()
    fuse_mlp_epilogue(model)
    if fused_norms:
        fuse_residual_norms(model)
    return model, make_score_fn(model, loss="fused"), (inputs, targets, mask)
