"""llama.cpp itself as the peer: `llama-perplexity` and `fastppl eval --protocol llama.cpp` on the same GGUF file and
the same text, side by side: PPL and its ±, tokens/s and the ratio, and with --base the KL divergence statistics of
llama.cpp's stored-logits workflow (`--kl-divergence-base` on the base, then `--kl-divergence` on the model) against
`fastppl eval --reference-model` (one pass, nothing stored).

    python benchmarks/llama_cpp_peer.py run --llama-perplexity build/bin/llama-perplexity --model q4_k.gguf \\
        --data wiki.test.raw [--base f16.gguf] [--ctx 512] [--chunks 64]
    python benchmarks/llama_cpp_peer.py write --shape llama-3-8b q4_k.gguf --base f16.gguf
    python benchmarks/llama_cpp_peer.py parse llama-perplexity.log

`write` makes a Llama-shaped GGUF of Q4_K blocks with random finite contents (d and dmin fp16 scales of one
magnitude, random 6-bit scales and 4-bit values: weights of mean about 0 and s.d. about 0.02), and with --base the
same weights dequantized to F16 (fastppl's dequantizer, on CUDA where there is one): the pair whose divergence is
the kernels' alone. Its vocabulary is GPT-2's (--tokenizer-dir: vocab.json and merges.txt; ../shared/data beside
the checkout by default) padded with control tokens to the shape's vocabulary. `llama-3-8b` is 4096 wide, 32
layers, 14,336 MLP, 32 heads of which 8 key-value, 128,256 ids (4.6 GB of Q4_K, 16 GB of F16); `llama-3-70b` is
8192 wide, 80 layers, 28,672 MLP, 64 heads of which 8 key-value (about 40 GB of Q4_K); `tiny` is 256 wide, 2 layers
(a few MB) for the CPU.

What differs between the two tools, and why their figures differ (a few 0.1 % of PPL on a Q4 file): llama.cpp
multiplies the quantized weights by activations quantized to 8 bits (q8_1 / q8_K blocks: its CPU dot products and
CUDA's MMQ kernels), and --kl-divergence-base stores the base's log-probabilities in 16 bits; fastppl dequantizes
the weights to --dtype (bf16 on CUDA, fp32 on the CPU) and multiplies in that dtype, with every loss and
divergence in fp32 from the logits it never writes. Against its own F16 copy a Q4_K file's weights are equal, so
fastppl's KLD there is (about) 0 and llama.cpp's is the floor its 8-bit activations put under every KLD it reports.
Both tools read the same ids from the file's tokenizer, in the same windows (blocks of --ctx whose first token is
BOS, the second half scored); the script checks that the chunk and token counts agree.

Timing: llama.cpp's from its own log's timestamps, from "calculating perplexity over N chunks" (or "computing over")
to the result (model load and tokenization excluded), over the N x ctx tokens it reads; fastppl's from its report
(scoring_seconds, over tokens_forwarded). Each tool's process wall time beside it.

Building llama-perplexity (the tarball's tree as SRC):
    CPU:  cmake -S SRC -B SRC/build -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=OFF -DLLAMA_CURL=OFF \\
              -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF && cmake --build SRC/build --target llama-perplexity -j2
    CUDA: the same with -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 (an H100) and -j16; the run passes -ngl 99
          (all layers offloaded), -fa on and -b 2048 -ub 2048 (four 512-token chunks a batch) by default.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("FASTPPL_SHARED_DATA", ROOT.parent / "shared" / "data"))
DEFAULT_LLAMA_ARGS = "-ngl 99 -fa on -b 2048 -ub 2048"


class PeerError(Exception):
    """A one-line reason the benchmark cannot go on (printed as `llama_cpp_peer: error: ...`, exit 2)."""


# ----------------------------------------------------------------------------------------- llama-perplexity's log

# each line may start with the log's timestamp and level ("0.21.712.675 I "): minutes.seconds.ms.us since start
_PREFIX = re.compile(r"^(?:(\d+)\.(\d+)\.(\d+)\.(\d+) [A-Z] )?")
_NUMBER = r"([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?|[-+]?inf|nan)"
_FINAL = re.compile(rf"Final estimate: PPL = {_NUMBER} \+/- {_NUMBER}")
_CHUNKS = re.compile(r"(?:calculating perplexity|computing) over (\d+) chunks, n_ctx=(\d+), batch_size=(\d+), "
                     r"n_seq=(\d+)")
_BPW = re.compile(rf"file size\s*=\s*{_NUMBER} ([KMG]i?B) \({_NUMBER} BPW\)")
_STATISTIC = re.compile(rf"^(.+?)\s*:\s*{_NUMBER}\s*(%)?\s*(?:±\s*{_NUMBER}\s*(%)?)?\s*$")
# --kl-divergence's lines (tools/perplexity/perplexity.cpp, kl_divergence) -> fastppl's divergence fields; a "%"
# line's figures are percentages
STATISTICS = {
    "Mean PPL(Q)": ("ppl", "ppl_error"), "Mean PPL(base)": ("reference_ppl", "reference_ppl_error"),
    "Cor(ln(PPL(Q)), ln(PPL(base)))": ("ln_ppl_correlation", None),
    "Mean ln(PPL(Q)/PPL(base))": ("ln_ppl_ratio", "ln_ppl_ratio_error"),
    "Mean PPL(Q)/PPL(base)": ("ppl_ratio", "ppl_ratio_error"),
    "Mean PPL(Q)-PPL(base)": ("ppl_difference", "ppl_difference_error"),
    "Mean KLD": ("kld_mean", "kld_mean_error"), "Maximum KLD": ("kld_max", None), "Minimum KLD": ("kld_min", None),
    "Median KLD": ("kld_median", None),
    **{f"{p}% KLD": (f"kld_p{float(p):g}", None)
       for p in ("99.9", "99.0", "95.0", "90.0", "10.0", "5.0", "1.0", "0.1")},
    "Mean Δp": ("delta_p_mean", "delta_p_mean_error"), "Maximum Δp": ("delta_p_max", None),
    "Minimum Δp": ("delta_p_min", None), "Median Δp": ("delta_p_median", None),
    **{f"{p}% Δp": (f"delta_p_p{float(p):g}", None)
       for p in ("99.9", "99.0", "95.0", "90.0", "75.0", "25.0", "10.0", "5.0", "1.0", "0.1")},
    "RMS Δp": ("delta_p_rms", "delta_p_rms_error"), "Same top p": ("same_top1", "same_top1_error"),
}


def _seconds(match: re.Match) -> Optional[float]:
    if match.group(1) is None:
        return None
    minutes, seconds, ms, us = (int(g) for g in match.groups())
    return minutes * 60 + seconds + ms / 1e3 + us / 1e6


def parse_llama_perplexity(text: str) -> dict:
    """What a llama-perplexity run printed (stdout and stderr together): its PPL and ± ("Final estimate"), the
    chunks, n_ctx, batch and sequences, the file's bits per weight (with -lv 4, which prints the loader's lines),
    the seconds from the start of the computation to its result (from the log's timestamps), and with
    --kl-divergence its statistics under fastppl's names (percentages as fractions)."""
    out: dict = {"divergence": {}}
    started = finished = None
    statistics_printed = False   # its lines carry no timestamp: the next line that does ends the computation
    for raw in text.splitlines():
        prefix = _PREFIX.match(raw)
        line, at = raw[prefix.end():].strip(), _seconds(prefix)
        if statistics_printed and finished is None and at is not None:
            finished = at
        if (m := _FINAL.search(line)):
            out["ppl"], out["ppl_plus_minus"], finished = float(m.group(1)), float(m.group(2)), at
        elif (m := _CHUNKS.search(line)):
            out.update(chunks=int(m.group(1)), ctx=int(m.group(2)), batch_size=int(m.group(3)), n_seq=int(m.group(4)))
            started = at
        elif (m := _BPW.search(line)):
            out["bits_per_weight"] = float(m.group(3))
        elif line.startswith("====== Perplexity statistics"):
            statistics_printed = True
        elif (m := _STATISTIC.match(line)) and " ".join(m.group(1).split()) in STATISTICS:
            value_name, error_name = STATISTICS[" ".join(m.group(1).split())]
            percent = m.group(3) or m.group(5)
            scale = 0.01 if percent else 1.0
            out["divergence"][value_name] = float(m.group(2)) * scale
            if error_name and m.group(4) is not None:
                out["divergence"][error_name] = float(m.group(4)) * scale
    if "ppl" not in out and "kld_mean" not in out["divergence"]:
        tail = " | ".join(line.strip() for line in text.strip().splitlines()[-3:])
        raise PeerError(f"llama-perplexity printed no 'Final estimate' and no KL divergence statistics; its last "
                        f"lines: {tail[:300]}")
    if started is not None and finished is not None and finished > started:
        out["seconds"] = finished - started
        out["tokens_read"] = out["chunks"] * out["ctx"]
        out["tokens_per_second"] = out["tokens_read"] / out["seconds"]
    return out


# --------------------------------------------------------------------------------------------------- the runs

@dataclass
class Timed:
    figures: dict
    wall_seconds: float


def _run(command: list[str], log: Path, timeout: float, what: str, env: Optional[dict] = None) -> float:
    """The command with stdout and stderr into `log`; its wall seconds. A failure names the log's last line."""
    started = time.perf_counter()
    with open(log, "w") as out:
        try:
            code = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, timeout=timeout, env=env).returncode
        except subprocess.TimeoutExpired:
            raise PeerError(f"{what} ran past {timeout:.0f} s; see {log}") from None
        except OSError as e:
            raise PeerError(f"{what}: cannot run {command[0]} ({e.strerror}); check the path") from None
    if code != 0:
        last = (log.read_text(errors="replace").strip().splitlines() or ["(no output)"])[-1]
        raise PeerError(f"{what} exited {code}: {last.strip()[:300]}; see {log}")
    return time.perf_counter() - started


def llama_perplexity(args, model: str, log: Path, *extra: str) -> Timed:
    command = [args.llama_perplexity, "-m", model, "-f", args.data, "-c", str(args.ctx), "-lv", "4",
               "--log-timestamps", *(["--chunks", str(args.chunks)] if args.chunks else []),
               *(["-t", str(args.threads)] if args.threads else []), *args.llama_args.split(), *extra]
    wall = _run(command, log, args.timeout, f"llama-perplexity on {Path(model).name}")
    return Timed(parse_llama_perplexity(log.read_text(errors="replace")), wall)


def fastppl_eval(args, model: str, report: Path, log: Path, reference: Optional[str] = None) -> Timed:
    """`fastppl eval --protocol llama.cpp` in its own process (fastppl imported from this checkout), on the text
    llama.cpp read."""
    command = [sys.executable, "-m", "fastppl", "eval", "--protocol", "llama.cpp", "--model", model,
               "--data", args.data, "--ctx", str(args.ctx), "--device", args.device, "--dtype", args.dtype,
               "--quiet", "--json", str(report), *(["--reference-model", reference] if reference else []),
               *args.fastppl_args.split()]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    wall = _run(command, log, args.timeout, f"fastppl eval on {Path(model).name}", env)
    result = json.loads(report.read_text())
    figures = {"ppl": result["protocol"]["reported"]["ppl"],
               "ppl_plus_minus": result["protocol"]["reported"]["ppl_plus_minus"],
               "tokens_scored": result["tokens_scored"], "tokens_read": result["tokens_forwarded"],
               "seconds": result["scoring_seconds"], "loss": result.get("loss"), "dtype": result.get("dtype"),
               "tokens_per_second": result["tokens_forwarded"] / result["scoring_seconds"],
               "divergence": result.get("divergence") or {}}
    return Timed(figures, wall)


def cut_to_chunks(text_path: str, model: str, ctx: int, chunks: int, directory: Path) -> str:
    """A copy of the text holding about chunks + 1/2 blocks of ctx tokens (llama.cpp's count: its BOS and the
    text's ids), so that both tools read exactly `chunks` blocks of the same ids; the text itself when it holds
    fewer. Cut at a token's end (decoding a prefix of a byte-level BPE's ids gives the text's prefix)."""
    from fastppl.data.tokenize import load_tokenizer
    text = Path(text_path).read_text()
    tokenizer = load_tokenizer(model).with_specials_as_text()
    ids = tokenizer.encode(text)
    wanted = chunks * ctx + ctx // 2 - 1   # less the BOS llama.cpp puts first
    if len(ids) <= wanted:
        return text_path
    cut = directory / f"{Path(text_path).stem}.{chunks}-chunks.txt"
    cut.write_text(tokenizer.decode(ids[:wanted]))
    return str(cut)


# ------------------------------------------------------------------------------------------- the side by side

def _figure(value, spec: str) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "n/a"
    return format(value, spec)


def _relative(ours, theirs) -> str:
    if ours is None or theirs is None or theirs == 0:
        return ""
    return f"{ours / theirs - 1:+.3%}"


# (label, fastppl's divergence field, its error field, format, printed as a percentage)
COMPARED = (("Mean KLD", "kld_mean", "kld_mean_error", ".4g", False), ("Median KLD", "kld_median", None, ".4g", False),
            ("99.0% KLD", "kld_p99", None, ".4g", False), ("Maximum KLD", "kld_max", None, ".4g", False),
            ("Same top p", "same_top1", "same_top1_error", ".3f", True),
            ("RMS Δp", "delta_p_rms", "delta_p_rms_error", ".3f", True),
            ("Mean Δp", "delta_p_mean", "delta_p_mean_error", ".3f", True),
            ("Mean PPL(Q)/PPL(base)", "ppl_ratio", "ppl_ratio_error", ".6f", False),
            ("Mean ln(PPL(Q)/PPL(base))", "ln_ppl_ratio", "ln_ppl_ratio_error", ".6f", False),
            ("Cor(ln(PPL(Q)), ln(PPL(base)))", "ln_ppl_correlation", None, ".3f", True),
            ("Mean PPL(base)", "reference_ppl", "reference_ppl_error", ".4f", False))


def _with_error(d: dict, name: str, error: Optional[str], spec: str, percent: bool) -> str:
    scale, unit = (100.0, " %") if percent else (1.0, "")
    value = d.get(name)
    if value is None:
        return "n/a"
    shown = _figure(value * scale, spec)
    if error and d.get(error) is not None:
        shown += f" ± {_figure(d[error] * scale, spec)}"
    return shown + unit


def side_by_side(runs: dict, args) -> str:
    """The Markdown table of both tools' figures, the ratio of their speeds, and what differs."""
    peer, ours = runs["llama.cpp ppl"], runs["fastppl ppl"]
    p, o = peer.figures, ours.figures
    rows = [("PPL ±", f"{p['ppl']:.4f} ± {p['ppl_plus_minus']:.5f}", f"{o['ppl']:.4f} ± {o['ppl_plus_minus']:.5f}",
             _relative(o["ppl"], p["ppl"])),
            ("chunks of ctx", str(p.get("chunks")), str(o["tokens_scored"] // (args.ctx - 1 - args.ctx // 2)),
             "same" if p.get("chunks") == o["tokens_scored"] // (args.ctx - 1 - args.ctx // 2) else "DIFFERENT"),
            ("bits per weight (the file's tensors)", _figure(p.get("bits_per_weight"), ".2f"),
             _figure(runs["bits_per_weight"], ".4f"), ""),
            ("tokens read / s (scoring)", _figure(p.get("tokens_per_second"), ",.0f"),
             _figure(o["tokens_per_second"], ",.0f"),
             f"{o['tokens_per_second'] / p['tokens_per_second']:.2f}x" if p.get("tokens_per_second") else ""),
            ("scoring s", _figure(p.get("seconds"), ".2f"), _figure(o["seconds"], ".2f"), ""),
            ("process wall s", f"{peer.wall_seconds:.1f}", f"{ours.wall_seconds:.1f}", "")]
    if "fastppl divergence" in runs:
        base, quantized, mine = runs["llama.cpp kld base"], runs["llama.cpp kld"], runs["fastppl divergence"]
        theirs_d, mine_d = quantized.figures["divergence"], mine.figures["divergence"]
        rows += [(label, _with_error(theirs_d, name, error, spec, percent),
                  _with_error(mine_d, name, error, spec, percent), "")
                 for label, name, error, spec, percent in COMPARED]
        # both models read every token: llama.cpp in two runs (the base's logits stored, then read back)
        peer_seconds = (base.figures.get("seconds") or math.nan) + (quantized.figures.get("seconds") or math.nan)
        peer_rate = 2 * quantized.figures.get("tokens_read", 0) / peer_seconds
        mine_rate = 2 * mine.figures["tokens_read"] / mine.figures["seconds"]
        rows += [("divergence: tokens read / s (both models)", _figure(peer_rate, ",.0f"), _figure(mine_rate, ",.0f"),
                  f"{mine_rate / peer_rate:.2f}x" if math.isfinite(peer_rate) else ""),
                 ("divergence: process wall s (both runs for llama.cpp)",
                  f"{base.wall_seconds + quantized.wall_seconds:.1f}", f"{mine.wall_seconds:.1f}", "")]
    table = ["| figure | llama-perplexity | fastppl eval --protocol llama.cpp | fastppl against llama.cpp |",
             "| --- | ---: | ---: | ---: |", *(f"| {' | '.join(row)} |" for row in rows)]
    notes = [f"model {Path(args.model).name}; text {Path(args.data).name} cut to {args.chunks} chunks"
             if args.chunks else f"model {Path(args.model).name}; text {Path(args.data).name}",
             f"llama-perplexity {args.llama_args} -c {args.ctx}; fastppl --device {args.device} --dtype {args.dtype} "
             f"(ran {o['dtype']}, loss: {o['loss']})",
             WHY_THEY_DIFFER]
    return "\n".join(table + [""] + notes)


WHY_THEY_DIFFER = (
    "Why the figures differ: llama.cpp multiplies the quantized weights by activations quantized to 8 bits "
    "(q8_1/q8_K blocks in its CPU dot products and CUDA MMQ kernels) and stores the base's log-probabilities in "
    "16 bits for --kl-divergence; fastppl dequantizes the weights to its dtype and multiplies in it, every loss and "
    "divergence in fp32. Against a file's own F16 copy the weights are equal: fastppl's KLD there is about 0, "
    "llama.cpp's is the floor its 8-bit activations put under every KLD it reports.")


def check_inputs(args) -> None:
    for flag, path in (("--llama-perplexity", args.llama_perplexity), ("--model", args.model),
                       ("--base", args.base), ("--data", args.data)):
        if path is not None and not Path(path).is_file():
            raise PeerError(f"{path}: no such file; check {flag}")
    if not os.access(args.llama_perplexity, os.X_OK):
        raise PeerError(f"{args.llama_perplexity}: is not executable; give --llama-perplexity the built binary")


def run(args) -> int:
    check_inputs(args)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="llama-cpp-peer-"))
    work.mkdir(parents=True, exist_ok=True)
    if args.chunks:
        args.data = cut_to_chunks(args.data, args.model, args.ctx, args.chunks, work)
    from fastppl.models.bits import bits_per_weight
    runs: dict = {"bits_per_weight": bits_per_weight(args.model)}
    runs["llama.cpp ppl"] = llama_perplexity(args, args.model, work / "llama_ppl.log")
    runs["fastppl ppl"] = fastppl_eval(args, args.model, work / "fastppl_ppl.json", work / "fastppl_ppl.log")
    if args.base:
        logits = work / "base.logits"
        try:
            runs["llama.cpp kld base"] = llama_perplexity(args, args.base, work / "llama_kld_base.log",
                                                          "--kl-divergence-base", str(logits))
            runs["llama.cpp kld"] = llama_perplexity(args, args.model, work / "llama_kld.log",
                                                     "--kl-divergence-base", str(logits), "--kl-divergence")
        finally:
            logits.unlink(missing_ok=True)   # n_vocab x 2 bytes per scored token: GB for a large vocabulary
        runs["fastppl divergence"] = fastppl_eval(args, args.model, work / "fastppl_divergence.json",
                                                  work / "fastppl_divergence.log", reference=args.base)
    text = side_by_side(runs, args)
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps({name: (r.figures | {"wall_seconds": r.wall_seconds})
                                               if isinstance(r, Timed) else r for name, r in runs.items()}, indent=1))
    print(f"\nlogs and reports: {work}", file=sys.stderr)
    return 0


# ------------------------------------------------------------------------------------- a Llama-shaped Q4_K GGUF

@dataclass(frozen=True)
class Shape:
    width: int
    layers: int
    mlp: int
    heads: int
    kv_heads: int
    vocab: int
    context: int = 8192
    rope_theta: float = 500000.0


SHAPES = {"llama-3-8b": Shape(4096, 32, 14336, 32, 8, 128256),
          "llama-3-70b": Shape(8192, 80, 28672, 64, 8, 128256),   # the streamed path's 70B check (docs/big-models.md)
          "tiny": Shape(256, 2, 512, 4, 2, 50304, context=1024)}
Q4_K_VALUES, Q4_K_BYTES = 256, 144   # a block: fp16 d and dmin, 12 bytes of 6-bit scales and mins, 128 of nibbles
# d of every block is about this; dmin = 7.5 d centres d * scale * q - dmin * min (all uniform) on 0, s.d. ~ 0.02
Q4_K_D = 1e-4


def _tensors(shape: Shape) -> list[tuple[str, tuple[int, int] | tuple[int]]]:
    """Every tensor of a Llama GGUF, in llama.cpp's names and order, with its shape (rows, columns)."""
    head_dim = shape.width // shape.heads
    kv = shape.kv_heads * head_dim
    names: list = [("token_embd.weight", (shape.vocab, shape.width))]
    for i in range(shape.layers):
        names += [(f"blk.{i}.attn_norm.weight", (shape.width,)), (f"blk.{i}.attn_q.weight", (shape.width, shape.width)),
                  (f"blk.{i}.attn_k.weight", (kv, shape.width)), (f"blk.{i}.attn_v.weight", (kv, shape.width)),
                  (f"blk.{i}.attn_output.weight", (shape.width, shape.width)),
                  (f"blk.{i}.ffn_norm.weight", (shape.width,)), (f"blk.{i}.ffn_gate.weight", (shape.mlp, shape.width)),
                  (f"blk.{i}.ffn_up.weight", (shape.mlp, shape.width)),
                  (f"blk.{i}.ffn_down.weight", (shape.width, shape.mlp))]
    return names + [("output_norm.weight", (shape.width,)), ("output.weight", (shape.vocab, shape.width))]


def _metadata(writer, shape: Shape, tokenizer_dir: Path, name: str) -> None:
    """A Llama's hyperparameters and GPT-2's byte-level BPE, padded with control tokens to the shape's vocabulary."""
    vocab = json.loads((tokenizer_dir / "vocab.json").read_text())
    merges = [line for line in (tokenizer_dir / "merges.txt").read_text().splitlines()[1:] if line]
    tokens = sorted(vocab, key=vocab.get)
    if len(tokens) > shape.vocab:
        raise PeerError(f"{tokenizer_dir}: {len(tokens):,} tokens do not fit the shape's {shape.vocab:,} ids")
    end_of_text = vocab["<|endoftext|>"]
    types = [3 if i == end_of_text else 1 for i in range(len(tokens))] + [3] * (shape.vocab - len(tokens))
    tokens += [f"<|unused_{i}|>" for i in range(shape.vocab - len(tokens))]
    writer.add_name(name)
    writer.add_block_count(shape.layers)
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.width)
    writer.add_feed_forward_length(shape.mlp)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_rope_dimension_count(shape.width // shape.heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(shape.vocab)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(end_of_text)
    writer.add_eos_token_id(end_of_text)
    writer.add_add_bos_token(True)


def random_q4_k(rows: int, columns: int, generator):
    """(rows, columns / 256 * 144) uint8: Q4_K blocks of random scales and values, d and dmin finite fp16."""
    import numpy as np
    blocks = generator.integers(0, 256, size=(rows * columns // Q4_K_VALUES, Q4_K_BYTES), dtype=np.uint8)
    d = (Q4_K_D * generator.uniform(0.5, 1.5, size=len(blocks))).astype(np.float16)
    blocks[:, 0:2] = d.view(np.uint8).reshape(-1, 2)
    blocks[:, 2:4] = (d.astype(np.float32) * 7.5).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


def write_gguf(args) -> int:
    """The Q4_K file, and with --base its weights dequantized to F16, tensor by tensor (neither held whole)."""
    import gguf
    import numpy as np
    import torch
    from fastppl.models.gguf_quants import dequantize
    shape, generator = SHAPES[args.shape], np.random.default_rng(args.seed)
    device = torch.device(args.device if args.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu")
    writers = [gguf.GGUFWriter(str(args.out), "llama")] + ([gguf.GGUFWriter(str(args.base), "llama")] if args.base
                                                            else [])
    Q = gguf.GGMLQuantizationType
    for writer, kind in zip(writers, ("Q4_K", "F16")):
        _metadata(writer, shape, Path(args.tokenizer_dir), f"random {args.shape} {kind}")
        writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M if kind == "Q4_K" else gguf.LlamaFileType.MOSTLY_F16)
        for name, dims in _tensors(shape):
            if len(dims) == 1:
                writer.add_tensor_info(name, dims, np.dtype(np.float32), dims[0] * 4)
            elif kind == "Q4_K":
                n_bytes = dims[0] * dims[1] // Q4_K_VALUES * Q4_K_BYTES
                writer.add_tensor_info(name, (dims[0], n_bytes // dims[0]), np.dtype(np.uint8), n_bytes, Q.Q4_K)
            else:
                writer.add_tensor_info(name, dims, np.dtype(np.float16), dims[0] * dims[1] * 2)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
    started = time.perf_counter()
    for name, dims in _tensors(shape):
        if len(dims) == 1:
            ones = np.ones(dims, dtype=np.float32)
            for writer in writers:
                writer.write_tensor_data(ones)
            continue
        blocks = random_q4_k(*dims, generator)
        writers[0].write_tensor_data(blocks)
        if args.base:
            values = dequantize(torch.from_numpy(blocks).to(device), "Q4_K", dims)
            if not torch.isfinite(values).all():
                raise PeerError(f"{name}: a random Q4_K block dequantized to a non-finite value")
            writers[1].write_tensor_data(values.half().cpu().numpy())
    for writer in writers:
        writer.close()
    files = [args.out] + ([args.base] if args.base else [])
    print(f"wrote {', '.join(f'{f} ({Path(f).stat().st_size / 1e9:.2f} GB)' for f in files)} "
          f"in {time.perf_counter() - started:.0f} s", file=sys.stderr)
    return 0


# ------------------------------------------------------------------------------------------------------- main

def parse(args) -> int:
    print(json.dumps(parse_llama_perplexity(Path(args.log).read_text(errors="replace")), indent=1))
    return 0


def arguments(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    peer = commands.add_parser("run", help="both tools on one GGUF and one text, side by side")
    peer.add_argument("--llama-perplexity", required=True, help="the llama-perplexity binary")
    peer.add_argument("--model", required=True, help="the GGUF file both tools score")
    peer.add_argument("--data", required=True, help="a text file (llama-perplexity -f)")
    peer.add_argument("--base", help="a base GGUF of the same vocabulary: llama.cpp's --kl-divergence-base and "
                                     "fastppl's --reference-model (default: no divergence)")
    peer.add_argument("--ctx", type=int, default=512, help="llama.cpp's -c and fastppl's --ctx (default: %(default)s)")
    peer.add_argument("--chunks", type=int, help="cut the text to this many chunks of ctx (default: all of it)")
    peer.add_argument("--threads", type=int, help="llama-perplexity -t (default: its own)")
    peer.add_argument("--llama-args", default=DEFAULT_LLAMA_ARGS,
                      help="more llama-perplexity arguments (default: %(default)r; give '' on the CPU)")
    peer.add_argument("--device", default="auto", help="fastppl --device (default: %(default)s)")
    peer.add_argument("--dtype", default="auto", help="fastppl --dtype (default: %(default)s: bf16 on CUDA)")
    peer.add_argument("--fastppl-args", default="", help="more fastppl eval arguments (default: none)")
    peer.add_argument("--timeout", type=float, default=600, help="seconds each run may take (default: %(default)s)")
    peer.add_argument("--work-dir", help="where the logs, reports and llama.cpp's logits go (default: a new "
                                         "temporary directory)")
    peer.add_argument("--json", help="write every run's figures here (default: not written)")
    peer.set_defaults(run=run)
    write = commands.add_parser("write", help="a Llama-shaped GGUF of random Q4_K blocks, and its F16 copy")
    write.add_argument("out", help="the Q4_K GGUF to write")
    write.add_argument("--base", help="also write the same weights dequantized to F16 here (default: not written)")
    write.add_argument("--shape", choices=list(SHAPES), default="llama-3-8b", help="(default: %(default)s)")
    write.add_argument("--seed", type=int, default=0, help="(default: %(default)s)")
    write.add_argument("--tokenizer-dir", default=str(SHARED_DATA / "gpt2-tokenizer"),
                       help="GPT-2's vocab.json and merges.txt (default: %(default)s)")
    write.add_argument("--device", default="auto", help="where the F16 copy is dequantized (default: cuda if any)")
    write.set_defaults(run=write_gguf)
    read = commands.add_parser("parse", help="print what a stored llama-perplexity log says, as JSON")
    read.add_argument("log")
    read.set_defaults(run=parse)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    from fastppl.errors import FastpplError
    args = arguments(argv)
    try:
        return args.run(args)
    except (PeerError, FastpplError) as e:
        print(f"llama_cpp_peer: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
