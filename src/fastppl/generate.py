"""Autoregressive generation with a static KV cache: prefill, then one decode step per token
(fastppl.decode has the step and the left padding of prompts of different lengths).

On CUDA, a greedy GPT-2 at small batch decodes through fastppl.accel.fused_decode (Triton kernels, 5 a
layer, one CUDA graph replay per token); other models, batches and sampling run decode_one_token compiled with
mode="reduce-overhead" (Inductor's CUDA graphs). On the CPU everything runs eagerly.
"""
from __future__ import annotations

import math

import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
import torch.nn as nn

from .decode import (Sampling, aligned_lm_head, compiled_decode_one_token, decode_one_token, left_pad,
                     prefill)
from .errors import FastpplError, check_input_file
from .models.kv_cache import ensure_kv_cache, supports_kv_cache
from .models.loading import position_limit_note

CACHE_LEN_MULTIPLE = 64   # cache lengths rounded up to this, so that nearby lengths share a compiled graph
NO_EOS = -1               # the end-of-text id of a generation without one


@dataclass
class Generation:
    tokens: list[list[int]]            # new tokens of each prompt, up to and including end-of-text
    prompt_lengths: list[int]
    time_to_first_token: float         # seconds: prefill + first sample, synchronised
    decode_steps: int                  # decode_one_token calls (each gives every row one token)
    decode_seconds: float              # of the steps after the warm-up ones
    decode_warmup_steps: int           # first steps not timed (compilation and CUDA graph capture)
    decode_warmup_seconds: float
    compiled: bool
    finished: list[bool] = field(default_factory=list)   # stopped at end-of-text
    decode_step: str = ""              # which decode step ran (_choose_decode_step), and why not the fused one

    @property
    def decode_tokens_per_second(self) -> float:
        """Tokens per second of the timed decode steps, counting every row of the batch."""
        timed = self.decode_steps - self.decode_warmup_steps
        rows = len(self.tokens)
        return rows * timed / self.decode_seconds if timed > 0 and self.decode_seconds > 0 else float("nan")

    def to_dict(self) -> dict:
        return dict(
            prompt_lengths=self.prompt_lengths, new_tokens=[len(t) for t in self.tokens], finished=self.finished,
            time_to_first_token_seconds=self.time_to_first_token, decode_steps=self.decode_steps,
            decode_seconds=self.decode_seconds, decode_warmup_steps=self.decode_warmup_steps,
            decode_warmup_seconds=self.decode_warmup_seconds,
            decode_tokens_per_second=self.decode_tokens_per_second, compiled=self.compiled,
            decode_step=self.decode_step,
        )


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def generate(
    model: nn.Module, prompts: Sequence[Sequence[int]], max_new_tokens: int, sampling: Sampling = Sampling(),
    eos_id: Optional[int] = None, compile: Optional[bool] = None, stop_check_every: int = 16,
    *, fused: bool = True, aligned_logits: bool = True,
) -> Generation:
    """New tokens for each prompt (token id lists, each non-empty), at most max_new_tokens, stopping a row
    at eos_id. The model stays on its device; compile defaults to on for CUDA, off otherwise.
    fused=False runs the compiled step where the fused one would run; aligned_logits=False gives the compiled
    step the plain lm_head product (see aligned_lm_head): the references that tests compare the defaults with."""
    _check_request(model, prompts, max_new_tokens)
    device = next(model.parameters()).device
    compile = device.type == "cuda" if compile is None else compile
    P = max(len(p) for p in prompts)
    cache_len = min(-(-(P + max_new_tokens) // CACHE_LEN_MULTIPLE) * CACHE_LEN_MULTIPLE, model.max_positions)
    eos = NO_EOS if eos_id is None else eos_id
    ids, pad = left_pad(prompts, pad_id=0 if eos_id is None else eos_id)
    if sampling.temperature > 0 and sampling.seed is not None:
        torch.manual_seed(sampling.seed)

    # left attached for the next call of the same shape (fastppl.models.kv_cache.remove_kv_cache frees it)
    ensure_kv_cache(model, len(prompts), cache_len)
    started = time.perf_counter()
    ids, pad = torch.from_numpy(ids).to(device), torch.from_numpy(pad).to(device)
    token = prefill(model, ids, pad, cache_len, sampling)
    _synchronize(device)
    time_to_first_token = time.perf_counter() - started

    decode_step, use_fused = _choose_decode_step(model, device, compile, sampling, len(prompts), fused)
    if use_fused:
        from .accel.fused_decode import fused_decoder
        stepper = fused_decoder(model)   # kept with the cache and its graph for the next call
        stepper.start(token, pad, P, eos)
    else:
        stepper = _TorchSteps(model, token, pad, P, cache_len, eos, sampling, compile, aligned_logits)
    warmup_steps = min(2, max_new_tokens - 1) if compile else 0   # compile + CUDA graph capture
    taken, warmup_seconds, decode_seconds = _decode_loop(
        stepper, max_new_tokens - 1, warmup_steps, eos != NO_EOS, stop_check_every, device)
    if use_fused and stepper.dependent_launch:   # known once the first step launched (it falls back if they fail)
        decode_step += ", dependent launches"
    tokens, stopped = _cut_at_eos(stepper.new_tokens(taken).cpu().tolist(), eos)
    return Generation(
        tokens=tokens, prompt_lengths=[len(p) for p in prompts], time_to_first_token=time_to_first_token,
        decode_steps=taken, decode_seconds=decode_seconds, decode_warmup_steps=min(warmup_steps, taken),
        decode_warmup_seconds=warmup_seconds, compiled=compile, finished=stopped, decode_step=decode_step,
    )


def _check_request(model: nn.Module, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> None:
    if not supports_kv_cache(model):
        raise FastpplError(f"{type(model).__name__} has no KV cache support; generate runs native models only "
                           "(GPT-2 and the Llama family)")
    if max_new_tokens < 1:
        raise FastpplError(f"--max-new-tokens must be at least 1, got {max_new_tokens}")
    if not prompts or any(len(p) == 0 for p in prompts):
        raise FastpplError("every prompt needs at least one token")
    P = max(len(p) for p in prompts)
    if P + max_new_tokens - 1 > model.max_positions:
        raise FastpplError(f"the longest prompt ({P} tokens) + --max-new-tokens {max_new_tokens} exceed the "
                           f"model's {model.max_positions} positions{position_limit_note(model)}; shorten them")


def _choose_decode_step(model: nn.Module, device: torch.device, compile: bool, sampling: Sampling, batch: int,
                        fused: bool = True) -> tuple[str, bool]:
    """(what the report says about the decode step, whether it is the fused one)."""
    if not compile:
        return "eager", False
    if device.type != "cuda":
        return "torch.compile", False
    if not fused:
        return "torch.compile, CUDA graphs (fused=False)", False
    from .accel.fused_decode import fused_decode_unsupported
    reason = fused_decode_unsupported(model, sampling.temperature, batch)
    if reason is not None:
        return f"torch.compile, CUDA graphs ({reason})", False
    return "fused Triton kernels, one CUDA graph per token", True   # generate adds whether launches were dependent


class _TorchSteps:
    """decode_one_token, eager or compiled, one call a token; the same step(), all_finished() and new_tokens()
    as the fused decoder (fastppl.accel.fused_decode.FusedGPT2Decoder)."""

    def __init__(self, model: nn.Module, token: torch.Tensor, pad: torch.Tensor, prompt_len: int, cache_len: int,
                 eos: int, sampling: Sampling, compile: bool, aligned_logits: bool):
        self.model, self.pad, self.cache_len, self.eos, self.sampling = model, pad, cache_len, eos, sampling
        self.step_fn = compiled_decode_one_token() if compile else decode_one_token
        self.graphs = compile and token.device.type == "cuda"
        # the compiled step only: eagerly the padded copy would cost memory for nothing measured
        self.aligned_head = aligned_lm_head(model) if aligned_logits and compile else None
        self.input_pos = torch.tensor([prompt_len], dtype=torch.int64, device=token.device)
        self.token, self.finished = token, token == eos
        self.outputs = [token]

    def step(self) -> None:
        if self.graphs:
            torch.compiler.cudagraph_mark_step_begin()
        s = self.sampling
        token, finished = self.step_fn(self.model, self.token[:, None], self.input_pos, self.pad, self.finished,
                                       self.cache_len, self.eos, s.temperature, s.top_k, s.top_p, self.aligned_head)
        # a graph's outputs: overwritten by its next replay
        self.token, self.finished = token.clone(), finished.clone()
        self.input_pos += 1
        self.outputs.append(self.token)

    def all_finished(self) -> bool:
        return bool(self.finished.all())

    def new_tokens(self, steps: int) -> torch.Tensor:
        """(B, steps + 1) int64: the first token and the tokens of the first `steps` steps."""
        return torch.stack(self.outputs[:steps + 1], dim=1)


def _decode_loop(stepper, max_steps: int, warmup_steps: int, can_stop: bool, stop_check_every: int,
                 device: torch.device) -> tuple[int, float, float]:
    """Run stepper.step() up to max_steps times, stopping early once every row has finished (checked every
    stop_check_every steps, a host sync each); (steps taken, seconds of the first warmup_steps, seconds of
    the rest)."""
    taken, warmup_seconds = 0, 0.0
    started = time.perf_counter()
    while taken < max_steps:
        stepper.step()
        taken += 1
        if taken == warmup_steps:
            _synchronize(device)
            warmup_seconds = time.perf_counter() - started
            started = time.perf_counter()
        if can_stop and taken % stop_check_every == 0 and stepper.all_finished():
            break
    _synchronize(device)
    return taken, warmup_seconds, time.perf_counter() - started


def _cut_at_eos(new_tokens: list[list[int]], eos: int) -> tuple[list[list[int]], list[bool]]:
    """Each row up to and including its first eos; whether it stopped there."""
    tokens, stopped = [], []
    for row in new_tokens:
        if eos in row:
            row = row[:row.index(eos) + 1]
        tokens.append(row)
        stopped.append(eos != NO_EOS and row[-1] == eos)
    return tokens, stopped


def benchmark_generate(model: nn.Module, batch_size: int = 1, prompt_length: int = 16, new_tokens: int = 256,
                       compile: Optional[bool] = None, seed: int = 0) -> dict:
    """Decode speed of model (already on its device) for a bench: random prompts, greedy, no end-of-text
    stop; one untimed run first, so that compilation and graph capture are not in the timed one."""
    generator = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, model.vocab_size, (batch_size, prompt_length), generator=generator).tolist()
    generate(model, prompts, new_tokens, Sampling(), eos_id=None, compile=compile)
    timed = generate(model, prompts, new_tokens, Sampling(), eos_id=None, compile=compile)
    return dict(batch_size=batch_size, prompt_length=prompt_length, max_new_tokens=new_tokens, **timed.to_dict())


@dataclass
class GenerateConfig:
    model: str                          # HF directory, hub id, or random:<preset>
    prompts: list[str]
    max_new_tokens: int = 64
    tokenizer: Optional[str] = None     # defaults to the model's own tokenizer
    sampling: Sampling = field(default_factory=Sampling)
    device: str = "auto"
    dtype: str = "auto"                 # auto = bf16 on CUDA, fp32 on CPU
    backend: str = "auto"               # generation needs a native model (KV cache)
    compile: str = "auto"               # auto = on for CUDA (CUDA graphs), off on the CPU
    model_seed: int = 0                 # seeds random:<preset> weights

    def __post_init__(self) -> None:
        if not self.prompts:
            raise FastpplError("give at least one --prompt or a --prompts file")
        if self.max_new_tokens < 1:
            raise FastpplError(f"--max-new-tokens must be at least 1, got {self.max_new_tokens}")
        if self.compile not in ("auto", "on", "off"):
            raise FastpplError(f"unknown --compile {self.compile!r}; use auto, on or off")


def read_prompts(path: str) -> list[str]:
    """One prompt per line; blank lines are skipped; a literal \\n inside a line stands for a newline."""
    if not path.strip():
        raise FastpplError("--prompts: empty path; give the file of prompts")
    check_input_file(path, "check --prompts, which takes a text file of one prompt per line")
    try:
        with open(path, "rb") as f:   # a binary file (a sparse one of zeros) is refused before it is read whole
            if b"\0" in f.read(1 << 16):
                raise FastpplError(f"--prompts {path}: holds a NUL byte, so it is binary, not text; save the prompts "
                                   "as UTF-8 text, one a line")
        lines = open(path, encoding="utf-8-sig").read().splitlines()   # -sig: a byte-order mark is not text
    except OSError as e:
        raise FastpplError(f"--prompts {path}: cannot be read ({e.strerror or e}); check the path") from None
    except UnicodeDecodeError as e:
        raise FastpplError(f"--prompts {path}: byte {e.start} is not valid UTF-8; save the file as UTF-8") from None
    prompts = [line.replace("\\n", "\n") for line in lines if line.strip()]
    if not prompts:
        raise FastpplError(f"--prompts {path}: holds no prompt (one per line)")
    return prompts


def run_generate(config: GenerateConfig) -> dict:
    """Load, tokenise, generate, decode: the result dict of `fastppl generate`."""
    from .data.tokenize import default_tokenizer_name, load_tokenizer
    from .engine.precision import resolve_device, resolve_dtype
    from .models import load_model
    from .models.loading import NoNativeModel
    from .report.result import environment

    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    tokenizer = load_tokenizer(config.tokenizer or default_tokenizer_name(config.model))
    no_native = (f"{config.model}: generate runs native models only (GPT-2 and the Llama family), and this "
                 "checkpoint's architecture or settings have none")
    try:
        model = load_model(config.model, config.backend, dtype, config.model_seed)
    except NoNativeModel as e:   # its advice, --backend hf, is not a generate option
        raise FastpplError(f"{no_native} ({e.reason}); fastppl eval scores it") from None
    if not supports_kv_cache(model):   # auto fell back to transformers
        raise FastpplError(f"{no_native}; fastppl eval scores it")
    if tokenizer.vocab_size > model.vocab_size:
        raise FastpplError(
            f"tokenizer {tokenizer.name!r} has {tokenizer.vocab_size:,} ids but the model's vocabulary has "
            f"{model.vocab_size:,}; pass the model's own tokenizer with --tokenizer")
    eos_id = tokenizer.eos_id
    prompt_ids = []
    for text in config.prompts:
        ids = tokenizer.encode(text).tolist()
        if not ids:   # an empty prompt starts from BOS / end-of-text, as GPT-2 was trained to
            if tokenizer.bos_id is None:
                raise FastpplError("an empty prompt needs a tokenizer with a BOS or end-of-text token")
            ids = [tokenizer.bos_id]
        prompt_ids.append(ids)
    model = model.to(device)
    compile = {"on": True, "off": False, "auto": None}[config.compile]
    result = generate(model, prompt_ids, config.max_new_tokens, config.sampling, eos_id, compile)
    completions = []
    for text, tokens, finished in zip(config.prompts, result.tokens, result.finished):
        text_tokens = tokens[:-1] if finished else tokens
        completions.append(dict(prompt=text, completion=tokenizer.decode(text_tokens), tokens=tokens,
                                finished=finished))
    return dict(model=config.model, completions=completions, **result.to_dict(),
                sampling=dict(temperature=config.sampling.temperature, top_k=config.sampling.top_k,
                              top_p=config.sampling.top_p, seed=config.sampling.seed),
                dtype=str(dtype).replace("torch.", ""), environment=environment(device))


def generation_summary(result: dict) -> str:
    lines = []
    for i, c in enumerate(result["completions"]):
        end = "  [end of text]" if c["finished"] else ""
        lines.append(f"--- {i}: {c['prompt']!r}\n{c['prompt']}{c['completion']}{end}")
    rate = result["decode_tokens_per_second"]
    # no timed step (one new token, or the warm-up's alone): no rate to give
    decode = f"{rate:,.{0 if rate >= 10 else 2}f} tokens/s" if math.isfinite(rate) else "n/a (no decode step timed)"
    lines.append(
        f"speed       time to first token {result['time_to_first_token_seconds'] * 1000:.1f} ms, decode "
        f"{decode} ({len(result['completions'])} row(s) x "
        f"{result['decode_steps']} steps, decode step: {result['decode_step']}, "
        f"{result['environment']['device_name']})")
    return "\n".join(lines)
