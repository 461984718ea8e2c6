"""fastppl bench: fastppl against its peers on the same weights and tokens, in one process.

Models: any random:<preset>, GPT-2 or Llama (the peers are the transformers model of the same weights,
GPT2LMHeadModel or LlamaForCausalLM, through fastppl.models.loading.native_to_hf).
Peers (all Hugging Face transformers, the same random weights; Llama's default leaves out the slow two):
  naive       the transformers model in fp32, batch 1, loss via labels=, .item() after every step
  autocast    fp32 weights under bf16 autocast, batch 16, labels=
  hf-bf16     bf16 weights, SDPA attention, batch B, labels= (fp32 weights on the CPU, as its note says)
  hf-compiled the same under torch.compile
  fastppl     fastppl's scorer as `eval` runs it (bf16 weights, fp32 loss; on CUDA the fused loss, MLP epilogue
              and residual norms)
and a bf16 matmul ceiling. FLOPs are counted per scored token as forward matmul FLOPs (flops_per_token):
  2 * (L * (d * (q + 2 kv) + q * d + mlp) + d * V) + 2 * L * q * (T + 1)
with q = heads x head dim, kv = KV heads x head dim, mlp = the MLP's weights (GPT-2: 2 * d * 4d; Llama's
SwiGLU: 3 * d * intermediate); the last term is causal QK^T and AV, (T + 1) / 2 keys on average. For GPT-2
(q = kv = d) this is 2 * (12 * L * d^2 + d * V) + 2 * L * d * (T + 1)."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import torch

from ..data.batching import Batch
from ..engine.precision import resolve_device
from ..errors import FastpplError
from .timers import matmul_ceiling, peak_bytes, refuse_long_cpu_bench, reset_peak, synchronize


@dataclass
class BenchRow:
    name: str
    tokens: int
    seconds: float
    nll: float
    peak_bytes: Optional[int]
    note: str = ""
    compile: Optional[str] = None   # fastppl's row: compiled or not, and why (accel.compile.use_compile)
    products: Optional[str] = None  # fastppl's row: whose cuBLAS kernels ran (accel.cublaslt)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else float("nan")


# (seq, batch, peers) when not given, by compile family (fastppl.models.spec.ModelSpec.compile_family): Llama-1B's
# naive and autocast loops take minutes
DEFAULTS = {"gpt2": (1024, 64, ["naive", "autocast", "hf-bf16", "hf-compiled", "fastppl"]),
            "llama": (2048, 8, ["hf-bf16", "hf-compiled", "fastppl"])}
PEERS = ("naive", "autocast", "hf-bf16", "hf-compiled", "fastppl")


def flops_per_token(config, seq_len: int) -> float:
    """Forward matmul FLOPs per scored token of a native config at window length seq_len (the sizes from its
    family's spec)."""
    from ..models.registry import spec_of_config
    shape = spec_of_config(config).shape(config)
    L, d, V = shape.n_layer, shape.width, shape.vocab_size
    q, kv = shape.q_width, shape.kv_width
    mlp = shape.mlp_matrices * d * shape.mlp_inner                 # GPT-2: fc, proj; SwiGLU: gate, up, down
    per_layer = d * (q + 2 * kv) + q * d + mlp                     # qkv, output projection, MLP
    return 2 * (L * per_layer + d * V) + 2 * L * q * (seq_len + 1)


def _hf_peer(native, dtype: torch.dtype, device: torch.device):
    """The transformers model of native's weights (native stays where it is), with SDPA attention."""
    from ..models.loading import native_to_hf
    with torch.device(device):      # built and initialised on the device: seconds less for a 1B model
        hf = native_to_hf(native)
    if getattr(hf.config, "_attn_implementation", "sdpa") != "sdpa":
        hf.set_attn_implementation("sdpa")
    return hf.to(dtype=dtype).eval()


def _time_labels_peer(model, rows: np.ndarray, batch_size: int, device, autocast: bool,
                      item_per_step: bool, warmup_batches: int = 1) -> tuple[float, float, int]:
    """HF loss via labels= (mean over T-1 shifted targets per row): returns (seconds, nll, tokens)."""
    T = rows.shape[1] - 1
    data = torch.from_numpy(rows[:, :T])
    n_rows = (len(data) // batch_size) * batch_size
    context = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if autocast else torch.no_grad

    def step(batch):
        with torch.inference_mode(), context():
            return model(input_ids=batch, labels=batch).loss

    for i in range(warmup_batches):
        step(data[:batch_size].to(device)).item()
    synchronize(device)
    started = time.perf_counter()
    total = torch.zeros((), dtype=torch.float64, device=device)
    host_total = 0.0
    for begin in range(0, n_rows, batch_size):
        loss = step(data[begin:begin + batch_size].to(device, non_blocking=True))
        if item_per_step:
            host_total += loss.item()            # the naive loop's per-step sync
        else:
            total += loss.double()
    synchronize(device)
    seconds = time.perf_counter() - started
    n_batches = n_rows // batch_size
    nll = (host_total if item_per_step else total.item()) / n_batches
    return seconds, nll, n_rows * (T - 1)


def _time_fastppl(model, rows: np.ndarray, batch_size: int, device, acceleration,
                  tuning=None) -> tuple[float, float, int, float, str]:
    """(seconds, mean NLL, tokens, warm-up seconds, whose products ran) of fastppl's scorer with the transforms
    `fastppl eval` applies for this acceleration (fastppl.accel.apply); tuning: a TuningChoice, or None for
    torch's products."""
    from ..accel.apply import apply_fusions, score_fn_for, tuned_products
    from ..accel.cublaslt import TuningChoice
    from ..engine.score import DeviceSums, score_batches
    T = rows.shape[1] - 1
    score_fn = score_fn_for(model, apply_fusions(model, device, acceleration))
    n_rows = (len(rows) // batch_size) * batch_size
    ones = np.ones((batch_size, T), dtype=bool)
    index = np.full((batch_size, T), -1, dtype=np.int64)
    batches = [Batch(np.ascontiguousarray(rows[b:b + batch_size, :T]), np.ascontiguousarray(rows[b:b + batch_size, 1:]),
                     ones, index, batch_size * T, batch_size) for b in range(0, n_rows, batch_size)]
    with tuned_products(model, tuning or TuningChoice("off", "")) as products:
        compile_started = time.perf_counter()
        # warm-up: compiles, loads the Triton kernels, runs cuBLAS heuristics (and times tuned candidates)
        score_batches(score_fn, batches[:2], DeviceSums.zeros(T, device), device)
        synchronize(device)
        compile_seconds = time.perf_counter() - compile_started
        sums = DeviceSums.zeros(T, device)
        started = time.perf_counter()
        score_batches(score_fn, batches, sums, device)
        nll_sum = sums.nll_sum.item()
        seconds = time.perf_counter() - started
        products_used = products()
    return seconds, nll_sum / (n_rows * T), n_rows * T, compile_seconds, products_used


def run_bench(model_spec: str = "random:gpt2", n_tokens: int = 1_048_576, seq_len: Optional[int] = None,
              batch_size: Optional[int] = None, device_name: str = "auto", peers: Optional[list[str]] = None,
              loss: str = "auto", naive_tokens: Optional[int] = None, log: Callable[[str], None] = print,
              variants: bool = False, compile: str = "auto", tune_products: str = "off") -> dict:
    """variants: also time fastppl with the other loss and compile choices (for docs/BENCHMARKS.md).
    compile: fastppl's row compiles its scorer or not (auto: as `fastppl eval` would for this many tokens).
    tune_products: fastppl's row times cuBLASLt's candidates (on) or not (fastppl.accel.apply.choose_tuning).
    seq_len, batch_size and peers default by architecture (DEFAULTS)."""
    from ..engine.loss import resolve_loss
    from ..models.loading import RANDOM_PREFIX, random_native
    from ..models.registry import spec_of
    device = resolve_device(device_name)
    if not model_spec.startswith(RANDOM_PREFIX):
        raise FastpplError(f"bench takes a random:<preset> model, got {model_spec!r}")
    # drawn on the device (milliseconds, not seconds, for 1B weights), kept on the CPU in fp32 as the
    # master copy, so that each peer's peak memory holds its own weights only
    unknown = [p for p in peers or () if p not in PEERS]   # before the weights: a gpt2-xl takes many seconds
    if unknown:
        raise FastpplError(f"unknown --peers {', '.join(unknown)}; use a subset of {','.join(PEERS)}")
    loss = resolve_loss(loss, device)   # refused before the weights are drawn and any timing
    native = random_native(model_spec[len(RANDOM_PREFIX):], 0, device).to("cpu")
    default_seq, default_batch, default_peers = DEFAULTS[spec_of(native).compile_family]
    seq_len, batch_size, peers = seq_len or default_seq, batch_size or default_batch, peers or default_peers
    if seq_len > native.max_positions:
        raise FastpplError(f"--seq {seq_len} exceeds the model's {native.max_positions} positions")
    n_rows = max(batch_size, n_tokens // seq_len // batch_size * batch_size)
    if n_rows * seq_len != n_tokens:
        log(f"--tokens {n_tokens:,} runs as {n_rows * seq_len:,}: whole batches of {batch_size} rows of {seq_len}")
    rows = np.random.default_rng(0).integers(0, native.vocab_size, size=(n_rows, seq_len + 1), dtype=np.int64)
    ceiling = matmul_ceiling(device)
    peer_tokens = (len(rows) * len([p for p in peers if p != "naive"]) + ("naive" in peers) *
                   max(1, (naive_tokens or n_tokens) // seq_len)) * seq_len
    refuse_long_cpu_bench(peer_tokens * flops_per_token(native.config, seq_len), device,
                          "pass fewer --tokens (e.g. --tokens 8192 --seq 128 --batch-size 8), a smaller --model "
                          "(random:gpt2-tiny) or fewer --peers", ceiling)
    log(f"matmul ceiling: {ceiling / 1e12:.3g} TFLOP/s ({'bf16 8192^3' if device.type == 'cuda' else 'fp32 512^3'})")
    results: list[BenchRow] = []

    def record(row: BenchRow) -> None:
        results.append(row)
        log(f"{row.name:<14} {row.tokens_per_second:>12,.0f} tok/s  nll {row.nll:.4f}  {row.note}")

    _time_hf_peers(native, rows, rows[: max(1, (naive_tokens or n_tokens) // seq_len)], batch_size, device, peers,
                   record)
    if "fastppl" in peers:
        _time_fastppl_rows(native, rows, batch_size, device, loss, compile, tune_products, variants, record)
    return _bench_report(model_spec, native, seq_len, batch_size, device, ceiling, results)


def _time_hf_peers(native, rows: np.ndarray, naive_rows: np.ndarray, batch_size: int, device: torch.device,
                   peers: list[str], record: Callable[[BenchRow], None]) -> None:
    """The transformers peers of the same weights: naive and autocast from fp32 weights, then bf16 and compiled."""
    on_cuda = device.type == "cuda"
    if any(p in peers for p in ("naive", "autocast")):
        hf32 = _hf_peer(native, torch.float32, device)
        if "naive" in peers:
            reset_peak(device)
            s, nll, tok = _time_labels_peer(hf32, naive_rows, 1, device, autocast=False, item_per_step=True)
            record(BenchRow("naive", tok, s, nll, peak_bytes(device), "fp32, batch 1, .item() per step"))
        if "autocast" in peers:
            reset_peak(device)
            autocast_rows = min(16, len(rows))
            s, nll, tok = _time_labels_peer(hf32, rows, autocast_rows, device, autocast=True, item_per_step=False)
            record(BenchRow("autocast", tok, s, nll, peak_bytes(device),
                            f"fp32 weights, bf16 autocast, batch {autocast_rows}"))
        del hf32
    if any(p in peers for p in ("hf-bf16", "hf-compiled")):
        hf16 = _hf_peer(native, torch.bfloat16 if on_cuda else torch.float32, device)
        if "hf-bf16" in peers:
            reset_peak(device)
            s, nll, tok = _time_labels_peer(hf16, rows, batch_size, device, autocast=False, item_per_step=False)
            # the CPU runs it in fp32 (as it runs fastppl's row), which its row's name would not tell
            precision = "bf16" if on_cuda else "fp32 weights on the CPU (bf16 on CUDA only),"
            record(BenchRow("hf-bf16", tok, s, nll, peak_bytes(device),
                            f"{precision} SDPA, batch {batch_size}, labels="))
        if "hf-compiled" in peers:
            reset_peak(device)
            compiled = torch.compile(hf16)
            s, nll, tok = _time_labels_peer(compiled, rows, batch_size, device, autocast=False, item_per_step=False)
            record(BenchRow("hf-compiled", tok, s, nll, peak_bytes(device), "the same, torch.compile"))
            del compiled
            torch._dynamo.reset()   # its compiled graphs could keep hf16's weights alive into fastppl's peak
        del hf16


def _time_fastppl_rows(native, rows: np.ndarray, batch_size: int, device: torch.device, loss: str, compile: str,
                       tune_products: str, variants: bool, record: Callable[[BenchRow], None]) -> None:
    """fastppl as `fastppl eval` runs a run of this size (fastppl.accel.apply), then, with variants, the other
    loss and compile choices on the same weights."""
    from ..accel.apply import choose_acceleration, choose_tuning
    from ..engine.loss import fused_loss_available
    on_cuda = device.type == "cuda"
    n_positions = len(rows) * (rows.shape[1] - 1)
    model = native.to(device=device, dtype=torch.bfloat16 if on_cuda else torch.float32)
    reset_peak(device)
    acceleration = choose_acceleration(model, device, model.lm_head.weight.dtype, loss=loss, compile=compile,
                                       n_scored=n_positions, n_positions=n_positions)
    tuning = choose_tuning(tune_products, model, device, model.lm_head.weight.dtype, acceleration.compiled)
    s, nll, tok, compile_s, products = _time_fastppl(model, rows, batch_size, device, acceleration, tuning=tuning)
    how = "compiled" if acceleration.compiled else f"eager{', MLP epilogue, fused norms' if on_cuda else ''}"
    record(BenchRow("fastppl", tok, s, nll, peak_bytes(device),
                    f"{acceleration.loss} loss, {how}, batch {batch_size}, "
                    f"{'compile + ' if acceleration.compiled else ''}warm-up {compile_s:.1f} s",
                    acceleration.compile_reason, products=products))
    if not variants:
        return
    # the same weights for every variant: apply_fusions undoes the last variant's fusions, and the Dynamo
    # reset keeps a variant from silently reusing another's compiled graph
    options = [(loss, c) for loss in ("chunked", "fused") for c in ((True, False) if on_cuda else (False,))]
    for variant_loss, variant_compile in options:
        if (variant_loss, variant_compile) == (acceleration.loss, acceleration.compiled):
            continue
        if variant_loss == "fused" and not fused_loss_available(device):
            continue
        reset_peak(device)
        torch._dynamo.reset()
        variant = choose_acceleration(model, device, model.lm_head.weight.dtype, loss=variant_loss,
                                      compile="on" if variant_compile else "off",
                                      n_scored=n_positions, n_positions=n_positions)
        s, nll, tok, compile_s, _ = _time_fastppl(model, rows, batch_size, device, variant)
        record(BenchRow("variant", tok, s, nll, peak_bytes(device),
                        f"{variant_loss} loss, {'compiled' if variant_compile else 'eager'}, "
                        f"warm-up {compile_s:.1f} s"))


def _bench_report(model_spec: str, native, seq_len: int, batch_size: int, device: torch.device, ceiling: float,
                  results: list[BenchRow]) -> dict:
    flops = flops_per_token(native.config, seq_len)
    fast = next((r for r in results if r.name == "fastppl"), None)
    # a variant better than the default is reported, not silently used: the default is what eval runs
    table = [{
        "name": r.name, "tokens": r.tokens, "seconds": r.seconds, "tokens_per_second": r.tokens_per_second,
        "share_of_ceiling": r.tokens_per_second * flops / ceiling, "nll": r.nll, "peak_memory_bytes": r.peak_bytes,
        "fastppl_speedup": (fast.tokens_per_second / r.tokens_per_second) if fast else None, "note": r.note,
        **({"compile": r.compile} if r.compile is not None else {}),
        **({"products": r.products} if r.products is not None else {}),
    } for r in results]
    return {
        "model": model_spec, "seq_len": seq_len, "batch_size": batch_size, "device": str(device),
        "parameters": sum(p.numel() for p in native.parameters()),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "matmul_ceiling_flops": ceiling, "flops_per_token": flops, "rows": table,
        "date": time.strftime("%Y-%m-%d"),
    }


def run_bench_rounds(rounds: int, log: Callable[[str], None] = print, **bench_args) -> dict:
    """run_bench `rounds` times in a row, every peer once a round in the same order, merged by merge_rounds.
    A machine's state drifts (a shared GPU under its power cap moves a rate by a few % between passes), so a
    single pass's ratio carries that drift; rounds give its spread, and a median that one slow pass cannot move."""
    reports = []
    for number in range(1, rounds + 1):
        prefix = f"round {number}/{rounds}: " if rounds > 1 else ""
        reports.append(run_bench(log=lambda line: log(prefix + line), **bench_args))
    return merge_rounds(reports) if rounds > 1 else {**reports[0], "rounds": 1}


def merge_rounds(reports: list[dict]) -> dict:
    """One report from several rounds of the same bench: each row's rate, seconds and share of the ceiling are
    medians over the rounds, its peak memory the largest; fastppl's ratio to a peer is the median of the
    rounds' own ratios (each compares two passes minutes apart, not passes of different rounds), with their
    range; seconds and share of the ceiling follow from the median rate and the median ceiling. Each rate's
    rounds are kept (tokens_per_second_rounds), as is the ceiling's. A note's warm-up is the first round's (later
    rounds reuse what it compiled)."""
    first = reports[0]
    names = [row["name"] for row in first["rows"]]
    if any([row["name"] for row in r["rows"]] != names for r in reports):
        raise FastpplError("the bench's rounds ran different peers; their rows cannot be merged")

    def median(values) -> float:
        finite = [v for v in values if v is not None and math.isfinite(v)]   # a rate over no time is NaN
        return float(np.median(finite)) if finite else float("nan")

    merged = {**first, "rounds": len(reports),
              "matmul_ceiling_flops": median(r["matmul_ceiling_flops"] for r in reports),
              "matmul_ceiling_rounds": [r["matmul_ceiling_flops"] for r in reports]}
    rows = []
    for position, row in enumerate(first["rows"]):
        same = [r["rows"][position] for r in reports]
        peaks = [other["peak_memory_bytes"] for other in same if other["peak_memory_bytes"] is not None]
        ratios = [other["fastppl_speedup"] for other in same]
        known = [ratio for ratio in ratios if ratio is not None and math.isfinite(ratio)]
        rate = median(other["tokens_per_second"] for other in same)
        rows.append({
            **row,
            # seconds and share follow from the median rate, so that the row's figures agree with each other
            "seconds": row["tokens"] / rate if rate > 0 else float("nan"),
            "tokens_per_second": rate,
            "tokens_per_second_rounds": [other["tokens_per_second"] for other in same],
            "share_of_ceiling": rate * first["flops_per_token"] / merged["matmul_ceiling_flops"],
            "peak_memory_bytes": max(peaks) if peaks else None,
            "fastppl_speedup": float(np.median(known)) if known else None,
            "fastppl_speedup_range": [min(known), max(known)] if known else None,
            "note": row["note"] + (" (round 1)" if "warm-up" in row["note"] else ""),
        })
    merged["rows"] = rows
    return merged


def format_table(report: dict) -> str:
    rounds = report.get("rounds", 1)
    lines = [f"fastppl bench  {report['model']}  seq {report['seq_len']}  batch {report['batch_size']}  "
             f"{report['device_name']}  torch {report['torch']}  "
             f"ceiling {report['matmul_ceiling_flops'] / 1e12:.3g} TFLOP/s"
             + (f"  median of {rounds} rounds" if rounds > 1 else ""),
             f"{'what':<14}{'tokens/s':>14}{'% ceiling':>11}{'peak GiB':>10}{'fastppl x':>11}"
             + (f"{'x range':>13}{'tok/s range':>16}" if rounds > 1 else "") + "  note"]
    for r in report["rows"]:
        peak = "n/a" if r["peak_memory_bytes"] is None else f"{r['peak_memory_bytes'] / 2**30:.2f}"
        speedup = "" if r["fastppl_speedup"] is None else f"{r['fastppl_speedup']:.2f}"
        spread = ""
        if rounds > 1:
            low, high = r["fastppl_speedup_range"] or (None, None)
            ratio_range = "" if low is None else f"{low:.2f}-{high:.2f}"
            rates = [rate for rate in r["tokens_per_second_rounds"] if math.isfinite(rate)] or [math.nan]
            # the rounds' spread around the median, as a share of it
            rate_range = f"{(min(rates) - r['tokens_per_second']) / r['tokens_per_second']:+.1%}/" \
                         f"{(max(rates) - r['tokens_per_second']) / r['tokens_per_second']:+.1%}"
            spread = f"{ratio_range:>13}{rate_range:>16}"
        lines.append(f"{r['name']:<14}{r['tokens_per_second']:>14,.0f}{100 * r['share_of_ceiling']:>10.1f}%"
                     f"{peak:>10}{speedup:>11}{spread}  {r['note']}")
    products = next((r["products"] for r in report["rows"] if r.get("products")), None)
    if products:
        lines.append(f"fastppl's products: {products}")
    return "\n".join(lines)
