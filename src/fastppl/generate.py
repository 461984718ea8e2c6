"""Autoregressive generation with a static KV cache: prefill, decode_one_token, sample.

Prompts of different lengths are left-padded to a common length P, so that at every step all rows
write the same cache slot and one input_pos serves the whole batch (the shapes never change, which
is what a CUDA graph needs). A row's padding is masked out of every attention, and its positions
start at its first real token:

    slot        0    1    2    3  |  4    5    6       (P = 4, then decode steps)
    row 0       a0   a1   a2   a3 |  x    x    x       pad 0: positions 0 1 2 3 4 5 6
    row 1       --   --   b0   b1 |  y    y    y       pad 2: positions 0 0 0 1 2 3 4; slots 0, 1 hidden

A padding query attends to itself only (never to nothing, which would make NaN that then leaks into
the real rows' attention through 0 * NaN).

On CUDA, a greedy GPT-2 at small batch decodes through fastppl.accel.fused_decode (Triton kernels, 5 a
layer, one CUDA graph replay per token); other models, batches and sampling run decode_one_token compiled with
mode="reduce-overhead" (Inductor's CUDA graphs). On the CPU everything runs eagerly.
"""
from __future__ import annotations

import math
import time
import weakref
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from .errors import FastpplError
from .models.attention import MASKED_ATTENTION
from .models.kv_cache import CacheStep, ensure_kv_cache, supports_kv_cache
from .models.loading import position_limit_note

CACHE_LEN_MULTIPLE = 64   # cache lengths rounded up to this, so that nearby lengths share a compiled graph
LOGITS_ALIGN = 64         # aligned_logits: the vocabulary product's width rounded up to this
DECODE_ENV = "FASTPPL_DECODE"   # e.g. "fused=0,attention=matmul,cache_write=index_copy,attend_bucket=64"


@dataclass(frozen=True)
class DecodeOptions:
    """How the decode step computes; every choice gives the same tokens in fp32 (tests/test_generate.py,
    tests/test_fused_decode.py).
    The defaults come from the environment variable FASTPPL_DECODE (DecodeOptions.from_env).
    `fused` and `dependent_launch` apply to the fused step, the others to the compiled step, which fused=False
    selects where the fused one could run."""
    fused: bool = True               # Triton decode step (fastppl.accel.fused_decode) where it supports the model
    attention: str = "sdpa"          # masked_attention's kernel: sdpa, matmul or reduction
    additive_mask: bool = False      # the mask as a float 0 / -inf tensor, built once a step, not bool
    # index_copy: every row writes the same slot (index_copy_); per_row: each row its own (index_put_)
    cache_write: str = "index_copy"
    # > 0: a step attends to the first ceil((input_pos + 1) / attend_bucket) * attend_bucket cache slots, not
    # to all of them (one compiled shape per bucket; 0 = always the whole cache)
    attend_bucket: int = 0
    dynamic: Optional[bool] = None   # torch.compile's dynamic; False compiles every batch size and bucket apart
    # the compiled step's vocabulary product over lm_head's rows padded with zeros to a multiple of
    # LOGITS_ALIGN (the padding ids' logits are cut before sampling): GPT-2's 50,257 ids give cuBLAS an output
    # row it cannot align. Measured on the H200: -14 % a step at batch 8 and 64, -9 % at 128 (docs/BENCHMARKS.md)
    aligned_logits: bool = True
    # the fused step's kernels launched with programmatic dependent launch (Hopper+): each starts and loads its
    # weights while the one before it finishes (fastppl.accel.fused_decode). Session 16, H100: batch 1 0.311 ->
    # 0.261 ms a step, batch 2 0.393 -> 0.382, the same tokens and logits bit for bit
    dependent_launch: bool = True

    def __post_init__(self) -> None:
        if self.attention not in MASKED_ATTENTION:
            raise FastpplError(f"{DECODE_ENV}: attention must be one of {', '.join(MASKED_ATTENTION)}, "
                               f"got {self.attention!r}")
        if self.cache_write not in ("index_copy", "per_row"):
            raise FastpplError(f"{DECODE_ENV}: cache_write must be index_copy or per_row, got {self.cache_write!r}")
        if self.attend_bucket < 0:
            raise FastpplError(f"{DECODE_ENV}: attend_bucket must be >= 0, got {self.attend_bucket}")

    @classmethod
    def parse(cls, text: str) -> "DecodeOptions":
        """"key=value,key=value" -> DecodeOptions; "" gives the defaults."""
        fields = {}
        for item in filter(None, (part.strip() for part in text.split(","))):
            key, _, value = item.partition("=")
            key, value = key.strip(), value.strip()
            if key in ("attention", "cache_write"):
                fields[key] = value
            elif key == "attend_bucket":
                if not (value.isascii() and value.isdigit()):   # "²".isdigit() is True, int("²") fails
                    raise FastpplError(f"{DECODE_ENV}: attend_bucket must be an integer >= 0, got {value!r}")
                fields[key] = int(value)
            elif key in ("fused", "additive_mask", "dynamic", "aligned_logits", "dependent_launch"):
                allowed = ("0", "1", "true", "false") + (("none",) if key == "dynamic" else ())
                if value.lower() not in allowed:
                    raise FastpplError(f"{DECODE_ENV}: {key} must be true, false (or none for dynamic), got {value!r}")
                fields[key] = None if value.lower() == "none" else value.lower() in ("1", "true")
            else:
                raise FastpplError(f"{DECODE_ENV}: unknown option {key!r}; use fused, attention, additive_mask, "
                                   "cache_write, attend_bucket, dynamic, aligned_logits, dependent_launch")
        return cls(**fields)

    @classmethod
    def from_env(cls) -> "DecodeOptions":
        import os
        return cls.parse(os.environ.get(DECODE_ENV, ""))

    def attend_len(self, input_pos: int, cache_len: int) -> int:
        """How many cache slots a step that writes slot input_pos reads."""
        if self.attend_bucket == 0:
            return cache_len
        return min(cache_len, -(-(input_pos + 1) // self.attend_bucket) * self.attend_bucket)


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0           # 0 = greedy (argmax)
    top_k: Optional[int] = None        # keep the k most likely ids
    top_p: Optional[float] = None      # keep the smallest set of most likely ids whose probability reaches top_p
    seed: Optional[int] = 0            # when sampling, reseeds torch's RNG (reproducible on one device and setting)

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise FastpplError(f"--temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise FastpplError(f"--top-k must be >= 1, got {self.top_k}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise FastpplError(f"--top-p must be in (0, 1], got {self.top_p}")


def sample(logits: torch.Tensor, temperature: float = 0.0, top_k: Optional[int] = None,
           top_p: Optional[float] = None) -> torch.Tensor:
    """(B, V) fp32 logits -> (B,) token ids, without a host sync."""
    if temperature <= 0:
        return logits.argmax(dim=-1)
    # shifted to a row maximum of 0 first (softmax, top-k and top-p do not change): a tiny temperature then
    # sends the others to -inf, not every logit to +-inf and the probabilities to NaN
    # (and a temperature below the dtype's smallest normal number would round to 0 in it: 0 / 0)
    temperature = max(temperature, torch.finfo(logits.dtype).tiny)
    logits = (logits - logits.amax(dim=-1, keepdim=True)) / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth_largest = torch.topk(logits, top_k, dim=-1).values[:, -1:]            # (B, 1)
        logits = logits.masked_fill(logits < kth_largest, -math.inf)
    if top_p is not None and top_p < 1:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs                  # of the more likely ids
        drop_sorted = mass_before >= top_p           # the most likely id always stays (mass_before = 0)
        drop = drop_sorted.scatter(-1, order, drop_sorted)                         # back to id order
        logits = logits.masked_fill(drop, -math.inf)
    probs = logits.softmax(dim=-1)
    # exponential race: argmax_i p_i / E_i with E_i ~ Exp(1) is a draw from p (multinomial would sync).
    # E = -log(u) with u clamped away from 0 is never 0, so p_i = 0 is never drawn.
    exponential = -torch.rand_like(probs).clamp_(min=torch.finfo(probs.dtype).tiny).log()
    return (probs / exponential).argmax(dim=-1)


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """(B, P) int64 ids, right-aligned, and (B,) int64 padding counts."""
    P = max(len(p) for p in prompts)
    ids = np.full((len(prompts), P), pad_id, dtype=np.int64)
    pad = np.zeros(len(prompts), dtype=np.int64)
    for row, prompt in enumerate(prompts):
        ids[row, P - len(prompt):] = prompt
        pad[row] = P - len(prompt)
    return ids, pad


def padded_mask(pad: torch.Tensor, query_slots: torch.Tensor, cache_len: int) -> torch.Tensor:
    """(B, 1, T, L) bool: query in slot i of row b sees slot j iff j <= i and j is not padding of row b
    (a padding query sees itself only)."""
    key_slots = torch.arange(cache_len, device=pad.device)
    i, j = query_slots[:, None], key_slots[None, :]                            # (T, 1), (1, L)
    causal = j <= i                                                            # (T, L)
    real = j[None] >= pad[:, None, None]                                       # (B, 1, L)
    return (causal & (real | (j == i)))[:, None]                              # (B, 1, T, L)


def _logits(model: nn.Module, hidden: torch.Tensor, aligned_head: Optional[tuple] = None) -> torch.Tensor:
    """fp32 logits (B, V) of the last position of hidden (B, T, C); through aligned_head's (weight, bias) when
    given (aligned_lm_head), cut back to the V real ids."""
    plain_head = (model.lm_head.weight, getattr(model.lm_head, "bias", None))
    weight, bias = plain_head if aligned_head is None else aligned_head
    return F.linear(hidden[:, -1], weight, bias)[:, :plain_head[0].shape[0]].float()


# model -> (the lm_head tensors the copy was made from, their versions, the padded (weight, bias))
_aligned_heads: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def aligned_lm_head(model: nn.Module) -> Optional[tuple]:
    """(weight, bias) of lm_head with zero rows appended up to a multiple of LOGITS_ALIGN ids, or None when V
    already is one, or when the weights are inference tensors (they keep no version counter, so a change
    to them in place could not be seen). Kept per model while its lm_head is unchanged, so that a compiled
    step's CUDA graph sees the same tensors (marked static: never copied into the graph's inputs) at every call."""
    weight, bias = model.lm_head.weight, getattr(model.lm_head, "bias", None)
    extra = -weight.shape[0] % LOGITS_ALIGN
    sources = (weight,) if bias is None else (weight, bias)
    if extra == 0 or any(t.is_inference() for t in sources):
        return None
    cached = _aligned_heads.get(model)
    # the cache holds the source tensors, so their memory cannot be reused by a new weight at the same address
    # (a model converted with .half().float(), or .data replaced); in-place changes bump the version
    if cached is not None and len(cached[0]) == len(sources) and all(
            old.data_ptr() == new.data_ptr() and old.dtype == new.dtype and old.device == new.device
            and version == new._version for old, new, version in zip(cached[0], sources, cached[1])):
        return cached[2]
    with torch.no_grad():
        padded = (torch.cat([weight, weight.new_zeros(extra, weight.shape[1])]),
                  None if bias is None else torch.cat([bias, bias.new_zeros(extra)]))
    if weight.is_cuda:
        for tensor in padded:
            if tensor is not None:
                torch._dynamo.mark_static_address(tensor)
    _aligned_heads[model] = (tuple(t.detach() for t in sources), tuple(t._version for t in sources), padded)
    return padded


def prefill(model: nn.Module, ids: torch.Tensor, pad: torch.Tensor, cache_len: int,
            sampling: Sampling) -> torch.Tensor:
    """Run the left-padded prompts (B, P) through the model, filling cache slots 0 .. P-1; (B,) first tokens."""
    B, P = ids.shape
    slots = torch.arange(P, device=ids.device)
    positions = (slots[None, :] - pad[:, None]).clamp(min=0)                  # (B, P)
    step = CacheStep(slots=slots, mask=padded_mask(pad, slots, cache_len))   # (P,) slots: every row the same
    hidden = model(ids, positions, cache_step=step)
    logits = _logits(model, hidden)
    # one host sync per generation: NaN logits would silently become token 0 at every step
    if not bool(torch.isfinite(logits).all()):
        raise FastpplError("the model's logits are not finite (NaN or inf): its weights or config.json are broken, "
                           "or the dtype overflows; try --dtype fp32")
    return sample(logits, sampling.temperature, sampling.top_k, sampling.top_p)


def decode_one_token(
    model: nn.Module, token: torch.Tensor, input_pos: torch.Tensor, pad: torch.Tensor, finished: torch.Tensor,
    cache_len: int, eos_id: int, temperature: float, top_k: Optional[int], top_p: Optional[float],
    attention: str = "sdpa", additive_mask: bool = False, cache_write: str = "index_copy",
    aligned_head: Optional[tuple] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One step: token (B, 1) goes into cache slot input_pos (1,); -> next token (B,), finished (B,).
    The step attends to the first cache_len slots (at most the cache's length). A finished row keeps
    emitting eos_id (its outputs are cut at the first one). attention, additive_mask, cache_write: see
    DecodeOptions; aligned_head: see aligned_lm_head."""
    B = token.shape[0]
    positions = (input_pos[None, :] - pad[:, None]).clamp(min=0)              # (B, 1)
    mask = padded_mask(pad, input_pos, cache_len)                             # (B, 1, 1, cache_len), every layer's
    if additive_mask:
        dtype = next(model.parameters()).dtype
        mask = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, -math.inf)
    slots = input_pos if cache_write == "index_copy" else input_pos.expand(B, 1)   # (1,) or (B, 1)
    step = CacheStep(slots=slots, mask=mask, attention=attention)
    hidden = model(token, positions, cache_step=step)
    next_token = sample(_logits(model, hidden, aligned_head), temperature, top_k, top_p)
    next_token = torch.where(finished, eos_id, next_token)
    return next_token, finished | (next_token == eos_id)


_compiled_decode: dict = {}   # torch.compile's dynamic -> the compiled decode_one_token


def compiled_decode_one_token(dynamic: Optional[bool] = None):
    """decode_one_token under torch.compile with Inductor's CUDA graphs (mode="reduce-overhead"), compiled
    once per process, per shape."""
    from .accel.compile import allow_shapes
    # one graph per (batch, cache length): a process that generates at many shapes must not hit Dynamo's
    # default limit of 8, which under fullgraph=True is an error (raised on every call: cheap, and it holds
    # if something lowered the limit since)
    allow_shapes(64)
    if dynamic not in _compiled_decode:
        import os
        from .config import cache_dir
        # kept across runs, as for the scorer (fastppl.accel.compile)
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir() / "inductor"))
        os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "1")
        _compiled_decode[dynamic] = torch.compile(decode_one_token, mode="reduce-overhead", fullgraph=True,
                                                  dynamic=dynamic)
    return _compiled_decode[dynamic]


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
    decode: Optional[DecodeOptions] = None,
) -> Generation:
    """New tokens for each prompt (token id lists, each non-empty), at most max_new_tokens, stopping a row
    at eos_id. The model stays on its device; compile defaults to on for CUDA, off otherwise; decode
    defaults to DecodeOptions.from_env()."""
    if not supports_kv_cache(model):
        raise FastpplError(f"{type(model).__name__} has no KV cache support; generate runs native models only "
                           "(GPT-2 and the Llama family)")
    if max_new_tokens < 1:
        raise FastpplError(f"--max-new-tokens must be at least 1, got {max_new_tokens}")
    if not prompts or any(len(p) == 0 for p in prompts):
        raise FastpplError("every prompt needs at least one token")
    device = next(model.parameters()).device
    compile = device.type == "cuda" if compile is None else compile
    decode = DecodeOptions.from_env() if decode is None else decode
    P = max(len(p) for p in prompts)
    if P + max_new_tokens - 1 > model.max_positions:
        raise FastpplError(f"the longest prompt ({P} tokens) + --max-new-tokens {max_new_tokens} exceed the "
                           f"model's {model.max_positions} positions{position_limit_note(model)}; shorten them")
    cache_len = min(-(-(P + max_new_tokens) // CACHE_LEN_MULTIPLE) * CACHE_LEN_MULTIPLE, model.max_positions)
    B = len(prompts)
    no_eos = -1
    eos = no_eos if eos_id is None else eos_id
    ids_np, pad_np = left_pad(prompts, pad_id=0 if eos_id is None else eos_id)
    if sampling.temperature > 0 and sampling.seed is not None:
        torch.manual_seed(sampling.seed)

    # left attached for the next call of the same shape (fastppl.models.kv_cache.remove_kv_cache frees it)
    ensure_kv_cache(model, B, cache_len)
    started = time.perf_counter()
    ids = torch.from_numpy(ids_np).to(device)
    pad = torch.from_numpy(pad_np).to(device)
    token = prefill(model, ids, pad, cache_len, sampling)
    finished = token == eos
    outputs = [token]
    _synchronize(device)
    time_to_first_token = time.perf_counter() - started

    decode_step, fused = _choose_decode_step(model, device, compile, decode, sampling, B)
    if fused:
        from .accel.fused_decode import fused_decoder
        decoder = fused_decoder(model, decode.dependent_launch)   # kept with the cache and graph for the next call
        decoder.start(token, pad, P, eos)
    step_fn = compiled_decode_one_token(decode.dynamic) if compile and not fused else decode_one_token
    # the compiled step only: measured there (docs/BENCHMARKS.md, session 9); elsewhere the copy would cost
    # memory for nothing shown
    aligned_head = aligned_lm_head(model) if decode.aligned_logits and compile and not fused else None
    warmup_steps = min(2, max_new_tokens - 1) if compile else 0   # compile + CUDA graph capture
    input_pos = torch.tensor([P], dtype=torch.int64, device=device)
    steps, warmup_seconds = 0, 0.0
    decode_started = time.perf_counter()
    while steps < max_new_tokens - 1:
        if fused:
            decoder.step()                        # records its token on the device
        else:
            if compile and device.type == "cuda":
                torch.compiler.cudagraph_mark_step_begin()
            token, finished = step_fn(model, token[:, None], input_pos, pad, finished,
                                      decode.attend_len(P + steps, cache_len), eos, sampling.temperature,
                                      sampling.top_k, sampling.top_p, decode.attention, decode.additive_mask,
                                      decode.cache_write, aligned_head)
            token, finished = token.clone(), finished.clone()   # a graph's outputs are overwritten by its next replay
            input_pos += 1
            outputs.append(token)
        steps += 1
        if steps == warmup_steps:
            _synchronize(device)
            warmup_seconds = time.perf_counter() - decode_started
            decode_started = time.perf_counter()
        if eos != no_eos and steps % stop_check_every == 0 and (
                decoder.all_finished() if fused else bool(finished.all())):
            break
    _synchronize(device)
    decode_seconds = time.perf_counter() - decode_started
    if fused and decoder.dependent_launch:   # known once the first step launched (it falls back if they fail)
        decode_step += ", dependent launches"

    new_tokens = (decoder.new_tokens(steps) if fused else torch.stack(outputs, dim=1)).cpu().tolist()  # (B, steps + 1)
    tokens, stopped = [], []
    for row in new_tokens:
        if eos in row:
            row = row[:row.index(eos) + 1]
        tokens.append(row)
        stopped.append(eos != no_eos and row[-1] == eos)
    return Generation(
        tokens=tokens, prompt_lengths=[len(p) for p in prompts], time_to_first_token=time_to_first_token,
        decode_steps=steps, decode_seconds=decode_seconds, decode_warmup_steps=min(warmup_steps, steps),
        decode_warmup_seconds=warmup_seconds, compiled=compile, finished=stopped, decode_step=decode_step,
    )


def _choose_decode_step(model: nn.Module, device: torch.device, compile: bool, decode: DecodeOptions,
                        sampling: Sampling, batch: int) -> tuple[str, bool]:
    """(what the report says about the decode step, whether it is the fused one)."""
    if not compile:
        return "eager", False
    if device.type != "cuda":
        return "torch.compile", False
    if not decode.fused:
        return f"torch.compile, CUDA graphs ({DECODE_ENV} fused=0)", False
    from .accel.fused_decode import fused_decode_unsupported
    reason = fused_decode_unsupported(model, sampling.temperature, batch)
    if reason is not None:
        return f"torch.compile, CUDA graphs ({reason})", False
    return "fused Triton kernels, one CUDA graph per token", True   # generate adds whether launches were dependent


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
    try:
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
    lines.append(
        f"speed       time to first token {result['time_to_first_token_seconds'] * 1000:.1f} ms, decode "
        f"{result['decode_tokens_per_second']:,.0f} tokens/s ({len(result['completions'])} row(s) x "
        f"{result['decode_steps']} steps, decode step: {result['decode_step']}, "
        f"{result['environment']['device_name']})")
    return "\n".join(lines)
