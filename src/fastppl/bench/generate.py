"""fastppl bench --generate: decode speed of fastppl against transformers `generate`, in one process, on the
same weights and the same prompts.

Peers (greedy; B random prompts of P tokens, seeded; exactly N new tokens per row, no end-of-text stop):
  fastppl      fastppl.generate: static KV cache; on CUDA the fused Triton decode step (batch <= 2) or
               the decode step compiled with CUDA graphs (torch.compile mode="reduce-overhead"), each
               replayed as CUDA graphs; eager on the CPU. The row's note says which ran
  hf-static    transformers generate(cache_implementation="static"). On CUDA transformers compiles its
               decode forward itself (torch.compile, mode "reduce-overhead"), as its docs recommend; on the
               CPU it does not compile
  hf-dynamic   transformers generate with its default dynamic cache, eager

Every peer runs once untimed per batch size (compilation, CUDA graph capture), then `repeats` timed runs;
medians are reported. All peers are timed the same way:

    t0 ............ t_first ....................................... t_end
    call starts     first new token exists (one synchronize)        new tokens are host lists
    time to first token = t_first - t0        decode tokens/s = B * (N - 1) / (t_end - t_first)

(fastppl: t_first - t0 is generate's own time_to_first_token; transformers: a stopping criterion that
synchronises on its first call only and stops nothing.)

Agreement: every transformers peer's tokens against fastppl's, position by position, and the mean share of
each row that is a common prefix. In fp32 they are equal (tested on the CPU); in bf16 the two models round
differently, a near-tie can flip, and a row then continues from different text: reported, not asserted.
"""
from __future__ import annotations

import gc
import statistics
import time
from typing import Callable, Optional, Sequence

import torch
import torch.nn as nn

from ..engine.precision import resolve_device, resolve_dtype
from ..errors import FastpplError
from .timers import refuse_long_cpu_bench, synchronize

GENERATE_PEERS = ("fastppl", "hf-static", "hf-dynamic")
# decode speed targets, on an H200 with random:gpt2: (batch size, min tokens/s, min x hf-static)
TARGETS = {1: (3000.0, 5.0), 64: (None, 3.0)}


def _allocated(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def _first_token_clock(device: torch.device, batch_size: int):
    """A transformers StoppingCriteria that stops nothing and, on its first call (right after the first new
    token), synchronises once and notes the time. It returns the same all-False tensor every step: no
    kernel of its own after the first call."""
    from transformers import StoppingCriteria

    class FirstTokenClock(StoppingCriteria):
        def __init__(self):
            self.first_token_time: Optional[float] = None
            self.never = torch.zeros(batch_size, dtype=torch.bool, device=device)

        def __call__(self, input_ids, scores, **kwargs):
            if self.first_token_time is None:
                synchronize(device)
                self.first_token_time = time.perf_counter()
            return self.never

    return FirstTokenClock()


def _run_fastppl(model: nn.Module, prompts: list[list[int]], new_tokens: int,
                 device: torch.device) -> tuple[float, float, float, list[list[int]], str, bool]:
    """(time to first token, decode seconds, wall seconds, new tokens, which decode step ran, whether it
    compiled) of one fastppl generate call."""
    from ..generate import Sampling, generate
    synchronize(device)
    started = time.perf_counter()
    result = generate(model, prompts, new_tokens, Sampling(), eos_id=None)   # ends synchronised, on the host
    wall = time.perf_counter() - started
    return (result.time_to_first_token, wall - result.time_to_first_token, wall, result.tokens, result.decode_step,
            result.compiled)


def _run_hf(hf: nn.Module, prompts: torch.Tensor, new_tokens: int, static: bool,
            device: torch.device) -> tuple[float, float, float, list[list[int]], str, bool]:
    """The same for one transformers generate call."""
    from transformers import StoppingCriteriaList
    B, P = prompts.shape
    clock = _first_token_clock(device, B)
    cache = dict(cache_implementation="static") if static else {}
    synchronize(device)
    started = time.perf_counter()
    # as transformers documents it (generate runs under no_grad itself)
    out = hf.generate(
        input_ids=prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new_tokens,
        min_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0,
        stopping_criteria=StoppingCriteriaList([clock]), **cache)
    tokens = out[:, P:].tolist()
    finished = time.perf_counter()
    assert out.shape == (B, P + new_tokens), f"transformers stopped early: {tuple(out.shape)}"
    assert clock.first_token_time is not None
    first = clock.first_token_time - started
    compiled = static and hasattr(hf, "_compiled_call")   # transformers compiled its forward
    note = ("static cache, " if static else "dynamic cache, ") + ("compiled" if compiled else "eager")
    return first, finished - clock.first_token_time, finished - started, tokens, note, compiled


def token_agreement(reference: Sequence[Sequence[int]], other: Sequence[Sequence[int]]) -> tuple[float, float]:
    """(share of positions where other's token equals reference's, mean share of a row that is a common
    prefix). After the first difference a row continues from different text, so the second is the stricter."""
    equal = total = 0
    prefix_shares = []
    for ref_row, other_row in zip(reference, other, strict=True):
        assert len(ref_row) == len(other_row)
        same = [a == b for a, b in zip(ref_row, other_row)]
        equal += sum(same)
        total += len(same)
        prefix = same.index(False) if False in same else len(same)
        prefix_shares.append(prefix / len(same))
    return equal / total, sum(prefix_shares) / len(prefix_shares)


def time_generation(native: nn.Module, hf: Optional[nn.Module], prompts: torch.Tensor, new_tokens: int,
                    peers: Sequence[str], repeats: int = 3,
                    log: Callable[[str], None] = lambda line: None) -> list[dict]:
    """One row per peer for these prompts (B, P) (int64, on the models' device); both models on it already.
    Rows carry `tokens`, the new tokens of the last timed run (B lists of new_tokens ids)."""
    device = prompts.device
    B = prompts.shape[0]
    prompt_lists = prompts.tolist()
    rows = []
    for name in peers:
        if name == "fastppl":
            run = lambda: _run_fastppl(native, prompt_lists, new_tokens, device)  # noqa: E731
        else:
            static = name == "hf-static"
            run = lambda static=static: _run_hf(hf, prompts, new_tokens, static, device)  # noqa: E731
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        resident = _allocated(device)
        warm_started = time.perf_counter()
        run()                                   # compiles, captures graphs, allocates caches
        warmup_seconds = time.perf_counter() - warm_started
        timings = [run() for _ in range(repeats)]
        first = statistics.median(t[0] for t in timings)
        decode = statistics.median(t[1] for t in timings)
        wall = statistics.median(t[2] for t in timings)
        rate = B * (new_tokens - 1) / decode if new_tokens > 1 and decode > 0 else float("nan")
        row = dict(
            name=name, batch_size=B, time_to_first_token_seconds=first, decode_seconds=decode,
            decode_tokens_per_second=rate, wall_seconds=wall, end_to_end_tokens_per_second=B * new_tokens / wall,
            warmup_seconds=warmup_seconds, compiled=timings[-1][5],
            working_memory_bytes=(torch.cuda.max_memory_allocated(device) - resident) if device.type == "cuda"
            else None,
            note=timings[-1][4], tokens=timings[-1][3],
        )
        if name == "fastppl":
            from ..models.kv_cache import remove_kv_cache
            remove_kv_cache(native)     # generate leaves its cache attached; the other peers need not hold it
            # agreement between peers means little if greedy text repeats a few ids (random weights can)
            row["distinct_new_tokens"] = len({t for tokens in row["tokens"] for t in tokens})
        rows.append(row)
        log(f"batch {B:<4} {name:<11} {rate:>12,.0f} decode tok/s  first token {first * 1000:8.1f} ms  "
            f"(warm-up {warmup_seconds:.1f} s)  {row['note']}")
    reference = next((r["tokens"] for r in rows if r["name"] == "fastppl"), None)
    for row in rows:
        if reference is not None and row["name"] != "fastppl":
            row["equal_token_fraction"], row["equal_prefix_fraction"] = token_agreement(reference, row["tokens"])
    return rows


def _check_arguments(model_spec: str, batch_sizes: Sequence[int], new_tokens: int, prompt_tokens: int,
                     peers: Sequence[str]) -> None:
    from ..models.loading import RANDOM_PREFIX
    unknown = [p for p in peers if p not in GENERATE_PEERS]
    if unknown:
        raise FastpplError(f"unknown --peers {', '.join(unknown)} for --generate; use {','.join(GENERATE_PEERS)}")
    if not model_spec.startswith(RANDOM_PREFIX):
        raise FastpplError(f"bench takes a random:<preset> model, got {model_spec!r}")
    if not batch_sizes or any(b < 1 for b in batch_sizes):
        raise FastpplError(f"--batch-sizes must be positive integers, got {list(batch_sizes)}")
    if new_tokens < 2:
        raise FastpplError(f"--new-tokens must be at least 2 (one prefill token, one decode step), got {new_tokens}")
    if prompt_tokens < 1:
        raise FastpplError(f"--prompt-tokens must be at least 1, got {prompt_tokens}")


def run_bench_generate(model_spec: str = "random:gpt2", batch_sizes: Sequence[int] = (1, 64), new_tokens: int = 256,
                       prompt_tokens: int = 32, device_name: str = "auto", peers: Optional[Sequence[str]] = None,
                       repeats: int = 3, seed: int = 0, dtype_name: str = "auto",
                       log: Callable[[str], None] = print) -> dict:
    """The report of `fastppl bench --generate`: rows per batch size and peer, and fastppl's speed-ups."""
    from ..models.loading import RANDOM_PREFIX, native_to_hf, random_native
    peers = list(peers or GENERATE_PEERS)
    _check_arguments(model_spec, batch_sizes, new_tokens, prompt_tokens, peers)
    device = resolve_device(device_name)
    dtype = resolve_dtype(dtype_name, device)
    native = random_native(model_spec[len(RANDOM_PREFIX):], seed, device)
    if prompt_tokens + new_tokens > native.max_positions:
        raise FastpplError(f"--prompt-tokens {prompt_tokens} + --new-tokens {new_tokens} exceed the model's "
                           f"{native.max_positions} positions")
    parameters = sum(p.numel() for p in native.parameters())   # 2 FLOPs each per token, every peer and repeat
    refuse_long_cpu_bench(2 * parameters * sum(batch_sizes) * (prompt_tokens + new_tokens) * len(peers) * repeats,
                          device, "pass smaller --batch-sizes and --new-tokens (e.g. --batch-sizes 1,4 --new-tokens "
                          "16) or a smaller --model (random:gpt2-tiny)")
    hf = None
    if any(p != "fastppl" for p in peers):
        with torch.device(device):              # built (and initialised) where it runs
            hf = native_to_hf(native)
        hf = hf.to(dtype).eval()
        hf.generation_config.eos_token_id = None   # no end-of-text: every row gets exactly N new tokens
    native = native.to(dtype).eval()
    log(f"{model_spec} {str(dtype).replace('torch.', '')} on {device}; prompts {prompt_tokens} tokens, "
        f"{new_tokens} new tokens, peers {','.join(peers)}")

    import transformers

    from ..quiet import quiet_transformers
    rows, ratios = [], []
    with quiet_transformers():            # no generation-config chatter on stderr
        for B in batch_sizes:
            if device.type == "cuda":
                # each batch size compiles afresh: after one shape, Dynamo would otherwise recompile the next
                # with a dynamic batch dimension, and the order of the batch sizes would change the result
                torch._dynamo.reset()
            generator = torch.Generator().manual_seed(seed)   # batch 1's prompt is batch 64's first row
            prompts = torch.randint(0, native.vocab_size, (B, prompt_tokens), generator=generator).to(device)
            batch_rows = time_generation(native, hf, prompts, new_tokens, peers, repeats, log)
            for row in batch_rows:
                del row["tokens"]
            rows += batch_rows
            speed = {r["name"]: r["decode_tokens_per_second"] for r in batch_rows}
            if "fastppl" in speed:
                ratios.append(dict(batch_size=B, **{
                    f"fastppl_over_{name.replace('-', '_')}": speed["fastppl"] / speed[name]
                    for name in speed if name != "fastppl"}))
    return dict(
        benchmark="generate", model=model_spec, dtype=str(dtype).replace("torch.", ""), device=str(device),
        device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        torch=torch.__version__, transformers=transformers.__version__, prompt_tokens=prompt_tokens,
        new_tokens=new_tokens, repeats=repeats, greedy=True,
        hf_attention=getattr(hf.config, "_attn_implementation", None) if hf is not None else None,
        rows=rows, ratios=ratios, targets=_targets(model_spec, device, rows, ratios),
        date=time.strftime("%Y-%m-%d"),
    )


def _targets(model_spec: str, device: torch.device, rows: list[dict], ratios: list[dict]) -> list[dict]:
    """The TARGETS that this run can judge (random:gpt2 on CUDA, the batch sizes they name)."""
    if model_spec != "random:gpt2" or device.type != "cuda":
        return []
    out = []
    for ratio in ratios:
        B = ratio["batch_size"]
        if B not in TARGETS or "fastppl_over_hf_static" not in ratio:
            continue
        min_rate, min_ratio = TARGETS[B]
        rate = next(r["decode_tokens_per_second"] for r in rows if r["name"] == "fastppl" and r["batch_size"] == B)
        met = ratio["fastppl_over_hf_static"] >= min_ratio and (min_rate is None or rate >= min_rate)
        what = (f">= {min_rate:,.0f} tok/s and " if min_rate else "") + f">= {min_ratio:g}x hf-static"
        out.append(dict(batch_size=B, target=what, met=met))
    return out


def format_generate_table(report: dict) -> str:
    lines = [f"fastppl bench --generate  {report['model']}  {report['dtype']}  prompt {report['prompt_tokens']}  "
             f"new {report['new_tokens']}  {report['device_name']}  torch {report['torch']}  "
             f"transformers {report['transformers']}",
             f"{'batch':>5}  {'what':<11}{'decode tok/s':>14}{'first token ms':>16}{'same tokens':>13}"
             f"{'same prefix':>13}  note"]
    for r in report["rows"]:
        same = f"{r['equal_token_fraction']:.3f}" if "equal_token_fraction" in r else ""
        prefix = f"{r['equal_prefix_fraction']:.3f}" if "equal_prefix_fraction" in r else ""
        note = r["note"] + (f"; {r['distinct_new_tokens']} distinct ids generated" if "distinct_new_tokens" in r
                            else "")
        lines.append(f"{r['batch_size']:>5}  {r['name']:<11}{r['decode_tokens_per_second']:>14,.0f}"
                     f"{r['time_to_first_token_seconds'] * 1000:>16.1f}{same:>13}{prefix:>13}  {note}")
    for ratio in report["ratios"]:
        parts = [f"{k[len('fastppl_over_'):].replace('_', '-')} {v:.2f}x" for k, v in ratio.items()
                 if k != "batch_size"]
        if parts:
            lines.append(f"batch {ratio['batch_size']}: fastppl / " + ", fastppl / ".join(parts))
    for target in report["targets"]:
        lines.append(f"target, batch {target['batch_size']}: {target['target']}: "
                     f"{'met' if target['met'] else 'NOT met'}")
    return "\n".join(lines)


def _int_list(text: str, flag: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",")]   # an empty entry ("1,,64") too is refused
    except ValueError:
        raise FastpplError(f"{flag} takes comma-separated integers, got {text!r}") from None


def run_from_args(args) -> int:
    """`fastppl bench --generate` from the bench parser's arguments."""
    import sys
    from ..report.files import check_writable, write_json
    if args.batch_size is not None or args.seq is not None:
        raise FastpplError("--batch-size and --seq are for scoring; with --generate use --batch-sizes, "
                           "--prompt-tokens and --new-tokens")
    if args.json:
        check_writable(args.json, "--json")
    log = (lambda line: None) if args.quiet else (lambda line: print(line, file=sys.stderr, flush=True))
    report = run_bench_generate(
        args.model, _int_list(args.batch_sizes, "--batch-sizes"), args.new_tokens, args.prompt_tokens, args.device,
        args.peers.split(",") if args.peers else None, log=log)
    if args.json:
        write_json(args.json, report)
    print(format_generate_table(report))
    return 0
