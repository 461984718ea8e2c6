"""GPT-2's greedy decode step at small batch as 5 Triton kernels per layer, one CUDA graph per token.

The compiled decode step (fastppl.decode.decode_one_token under torch.compile) runs ~145 kernels a
token at batch 1, most of them GEMVs of ~4.5 us whose latency, not the 250 MB of weights, sets the step.
Here each layer is five kernels (fastppl.accel.fused_decode_kernels), the small work folded into them:

    1. LayerNorm 1 -> QKV product + bias -> query to a buffer, key and value straight into cache slot pos
    2. the query over the cache, CHUNK slots a program; the last chunk of each head to finish combines
    3. output projection + bias -> added to the residual stream
    4. LayerNorm 2 -> MLP up-projection + bias -> GELU (tanh)
    5. MLP down-projection + bias -> added to the residual stream

plus one kernel for the embeddings, ln_f -> lm_head with each program's argmax, and one kernel that
picks each row's token, applies the end-of-text stop, records the token and advances the step: 63
kernels for GPT-2 124M. Each product program loads its whole (columns x K) weight tile at once, all
rows of the batch against it (so batches stay small, MAX_BATCH). The residual stream, LayerNorm and
every accumulation are fp32.

The semantics are decode_one_token's (left padding hidden, positions from a row's first real token, a
finished row emits eos, ties go to the lowest id). In fp32 the tokens are the eager step's; in bf16 they
can differ where logits nearly tie, since the activations here stay fp32 where the model's round to bf16.
decode_one_token, eager, is the reference (tests/accel/test_fused_decode.py). The model file is untouched:
the kernels read its weights and its KV cache."""
from __future__ import annotations

import math
import os
import warnings
import weakref
from typing import Optional

import torch
import torch.nn as nn

from ..models.gpt2 import GPT2
from ..models.registry import spec_of
from . import fused_decode_kernels as kernels
from .fused_decode_kernels import (ADD_TO_RESIDUAL, BLOCK_ARGMAX, LAYER_NORM, PLAIN, QKV_TO_CACHE, STORE, tl,
                                   triton)

MAX_BATCH = 2   # rows a decode step may have; larger batches run the compiled step (measured faster at 4)
# elements of a GEMV program's weight tile: BLOCK_N = TILE_ELEMENTS // (rows * K padded to a power of 2)
# columns, the whole K at once, so that a program's loads are all in flight together (a loop over K
# would wait on memory once per iteration)
TILE_ELEMENTS = 8192
NUM_WARPS = 4
CHUNK = 32      # cache slots per attention program (32-128 within 2 % at batch 1; 256 13 % slower)


def fused_decode_unsupported(model: nn.Module, temperature: float, batch: int = 1) -> Optional[str]:
    """None when FusedGPT2Decoder can run this model's decode steps, else the reason it cannot."""
    if triton is None:
        return "Triton is not installed"
    spec = spec_of(model)
    if spec is None or not spec.fused_decode:
        return f"the fused decode step is written for GPT-2, not {type(model).__name__}"
    if temperature > 0:
        return "the fused decode step is greedy only; sampling runs the compiled step"
    head_dim = model.config.head_dim
    if head_dim & (head_dim - 1):
        return f"head size {head_dim} is not a power of two"
    if not all(parameter.is_contiguous() for parameter in model.parameters()):
        return "a weight is not contiguous (the kernels read rows of K)"
    if batch > MAX_BATCH:
        return f"batch {batch} > {MAX_BATCH}, where the compiled step is faster"
    if any(block.attn.kv_cache is None for block in model.blocks):
        return "no KV cache attached"
    return None


# the error of the first launch with dependent launches that failed in this process, if one did: from then on
# every decoder launches plainly (FusedGPT2Decoder._launch_first_step)
_dependent_launch_failure: list[str] = []


def dependent_launch_supported(device: torch.device) -> bool:
    """Programmatic dependent launch: NVIDIA compute capability 9+, a Triton that has it (3.4+: gdc_wait and the
    launch_pdl option), not Triton's interpreter, not ROCm, and no failed launch with it in this process."""
    if (device.type != "cuda" or torch.version.hip is not None or os.environ.get("TRITON_INTERPRET") == "1"
            or _dependent_launch_failure):
        return False
    if triton is None or not hasattr(tl.extra.cuda, "gdc_wait"):
        return False
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    return "launch_pdl" in CUDAOptions.__dataclass_fields__ and torch.cuda.get_device_capability(device)[0] >= 9


def uses_dependent_launch(requested: bool, device: torch.device) -> bool:
    """Whether a decoder that asks for dependent launches gets them on this device."""
    return requested and dependent_launch_supported(device)


def _next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


class FusedGPT2Decoder:
    """Greedy decode steps of a GPT-2 whose KV cache holds the prefilled prompts (fastppl.decode.prefill).

        decoder = fused_decoder(model)            # one per attached cache, kept with its CUDA graph
        decoder.start(first_token, pad, prompt_len, eos_id)
        for _ in range(n): decoder.step()         # one CUDA graph replay (eager launches off CUDA)
        decoder.new_tokens(n)                     # (B, n + 1): the first token, then one per step

    Every buffer is allocated here, once, so that the graph's addresses stay valid; start() only writes
    into them. The decoder holds the model weakly (the cache of fused_decoder is keyed by the model's
    cache). keep_logits also writes each step's fp32 logits to .logits (tests).

    dependent_launch: each kernel launched with programmatic dependent launch where the GPU has it (compute
    capability 9+): it starts, and loads its weights, while the kernel before it finishes. Measured on an
    H100: batch 1 0.311 -> 0.261 ms a step, batch 2 0.393 -> 0.382 ms, the same tokens and logits bit for
    bit. False launches the kernels one after the other (the reference the tests compare with)."""

    def __init__(self, model: GPT2, keep_logits: bool = False, use_graph: Optional[bool] = None,
                 dependent_launch: bool = True):
        cache = model.blocks[0].attn.kv_cache
        reason = fused_decode_unsupported(model, 0.0, cache.k.shape[0] if cache is not None else 1)
        assert reason is None, reason
        config = model.config
        self.model_ref = weakref.ref(model)
        self.addresses = _addresses(model)
        B, C, self.cache_len = cache.k.shape[0], config.n_embd, cache.k.shape[2]
        device = cache.k.device
        self.batch = B
        self.n_chunks = -(-self.cache_len // CHUNK)
        # normal tensors even when built under inference_mode (generate), so that start() works outside it
        with torch.inference_mode(False):
            f32 = dict(dtype=torch.float32, device=device)
            self.residual = torch.empty(B, C, **f32)
            self.query = torch.empty(B, C, **f32)
            self.attended = torch.empty(B, C, **f32)
            self.hidden = torch.empty(B, 4 * C, **f32)
            self.chunk_out = torch.empty(B, config.n_head, self.n_chunks, config.head_dim, **f32)
            self.chunk_max = torch.empty(B, config.n_head, self.n_chunks, **f32)
            self.chunk_sum = torch.empty(B, config.n_head, self.n_chunks, **f32)
            # reset by each last program
            self.arrived = torch.zeros(B * config.n_head, dtype=torch.int32, device=device)
            self.n_vocab_blocks = -(-config.vocab_size // self._block_n(config.vocab_size, C))
            self.block_max = torch.empty(B, self.n_vocab_blocks, **f32)
            self.block_arg = torch.empty(B, self.n_vocab_blocks, dtype=torch.int32, device=device)
            self.logits = torch.empty(B, config.vocab_size, **f32) if keep_logits else None
            i64 = dict(dtype=torch.int64, device=device)
            self.token = torch.zeros(B, **i64)
            self.pad = torch.zeros(B, **i64)
            self.finished = torch.zeros(B, dtype=torch.int32, device=device)
            self.eos = torch.full((1,), -1, **i64)
            self.pos = torch.zeros(1, **i64)                     # the cache slot the current token goes to
            self.history = torch.zeros(B, self.cache_len + 1, **i64)   # history[b, slot + 1]: the token after slot
        self.prompt_len = self.steps_taken = 0
        self.device = device
        self.use_graph = device.type == "cuda" if use_graph is None else use_graph
        self.graph = None
        self.launched = False   # whether a step has been launched (the first one compiles; _launch_first_step)
        self.dependent_launch = uses_dependent_launch(dependent_launch, device)
        # each kernel's GDC (its wait) and launch_pdl (may start early) go together
        self.dependent = dict(GDC=True, launch_pdl=True) if self.dependent_launch else {}

    def start(self, first_token: torch.Tensor, pad: torch.Tensor, prompt_len: int, eos_id: int) -> None:
        """Begin a generation: first_token (B,) follows the prompts, left-padded (pad (B,)) to prompt_len
        slots; eos_id -1 for none."""
        model = self.model_ref()
        assert model is not None and _addresses(model) == self.addresses, \
            "the model's weights or KV cache moved since this decoder was built; fused_decoder(model) builds a new one"
        self.prompt_len, self.steps_taken = prompt_len, 0
        self.token.copy_(first_token)
        self.pad.copy_(pad)
        self.eos.fill_(eos_id)
        self.finished.copy_(first_token == eos_id)
        self.pos.fill_(prompt_len)
        self.history[:, prompt_len] = first_token

    def _block_n(self, N: int, K: int) -> int:
        return max(1, min(TILE_ELEMENTS // (_next_power_of_2(self.batch) * _next_power_of_2(K)), _next_power_of_2(N)))

    def _gemv(self, x, weight, bias, out, prologue=PLAIN, epilogue=STORE, gelu=False, norm=None, cache=None,
              head_dim: int = 1):
        N, K = weight.shape
        block_n = self._block_n(N, K)
        dummy = self.residual
        kernels.gemv_kernel[(triton.cdiv(N, block_n),)](
            x, weight, bias if bias is not None else dummy, out if out is not None else dummy, N,
            norm.weight if norm is not None else dummy, norm.bias if norm is not None else dummy,
            norm.eps if norm is not None else 0.0,
            cache.k if cache is not None else dummy, cache.v if cache is not None else dummy, self.pos,
            self.cache_len, self.block_max, self.block_arg, self.n_vocab_blocks,
            B=self.batch, K=K, PROLOGUE=prologue, EPILOGUE=epilogue, HAS_BIAS=bias is not None, GELU=gelu,
            STORE_LOGITS=epilogue == BLOCK_ARGMAX and out is not None, HEAD_DIM=head_dim,
            BLOCK_B=_next_power_of_2(self.batch), BLOCK_N=block_n, BLOCK_K=_next_power_of_2(K),
            num_warps=NUM_WARPS, **self.dependent,
        )

    def _launch_step(self) -> None:
        model = self.model_ref()
        config, B = model.config, self.batch
        C, hs = config.n_embd, config.head_dim
        kernels.embed_kernel[(B,)](self.token, self.pos, self.pad, model.wte.weight, model.wpe.weight, self.residual,
                            C, BLOCK_C=_next_power_of_2(C), **self.dependent)
        for block in model.blocks:
            attn, mlp, cache = block.attn, block.mlp, block.attn.kv_cache
            self._gemv(self.residual, attn.qkv.weight, attn.qkv.bias, self.query, LAYER_NORM, QKV_TO_CACHE,
                       norm=block.ln_1, cache=cache, head_dim=hs)
            kernels.attention_kernel[(B * config.n_head, self.n_chunks)](
                self.query, cache.k, cache.v, self.pos, self.pad, self.attended, self.chunk_out, self.chunk_max,
                self.chunk_sum, self.arrived, self.cache_len, self.n_chunks, 1.0 / math.sqrt(hs),
                N_HEAD=config.n_head, HEAD_DIM=hs, CHUNK=CHUNK, CHUNKS_PAD=_next_power_of_2(self.n_chunks),
                **self.dependent)
            self._gemv(self.attended, attn.proj.weight, attn.proj.bias, self.residual, PLAIN, ADD_TO_RESIDUAL)
            self._gemv(self.residual, mlp.fc.weight, mlp.fc.bias, self.hidden, LAYER_NORM, STORE, gelu=True,
                       norm=block.ln_2)
            self._gemv(self.hidden, mlp.proj.weight, mlp.proj.bias, self.residual, PLAIN, ADD_TO_RESIDUAL)
        self._gemv(self.residual, model.lm_head.weight, getattr(model.lm_head, "bias", None), self.logits,
                   LAYER_NORM, BLOCK_ARGMAX, norm=model.ln_f)
        kernels.pick_token_kernel[(1,)](
            self.block_max, self.block_arg, self.n_vocab_blocks, self.token, self.finished, self.history,
            self.history.shape[1], self.pos, B, self.eos,
            BLOCK_B=_next_power_of_2(B), BLOCKS_PAD=_next_power_of_2(self.n_vocab_blocks), num_warps=8,
            **self.dependent)

    def step(self) -> None:
        """One token for every row (asynchronous)."""
        # the kernels write cache slot pos and history[pos + 1] unchecked: never past the cache
        if self.steps_taken >= self.cache_len - self.prompt_len:
            raise RuntimeError(f"decode step {self.steps_taken + 1} would write past the {self.cache_len}-slot cache")
        self.steps_taken += 1
        if not self.use_graph:
            if self.launched:
                self._launch_step()
            else:
                self._launch_first_step()
            return
        with torch.cuda.device(self.device):   # Triton and graph capture use the current device
            if self.graph is None:
                self.graph = self._capture()
            self.graph.replay()

    def _launch_first_step(self) -> None:
        """The decoder's first launch, which compiles the kernels. Dependent launches also need a driver and
        a CUDA toolchain that have them, which the checks before cannot see: if this launch fails with them,
        it is redone with plain launches, and so is every later decoder in this process (with one warning)."""
        if not self.dependent_launch:
            self._launch_step()
            self.launched = True
            return
        saved = self._save_state()
        try:
            self._launch_step()
        except Exception as error:   # noqa: BLE001 -- whatever the toolchain raises
            dependent, self.dependent = self.dependent, {}
            self._restore_state(saved)   # kernels that ran before the failure advanced nothing else
            try:
                self._launch_step()
            except Exception:
                self.dependent = dependent   # plain launches fail too: the error is not the dependent launches'
                raise
            message = f"{type(error).__name__}: {(str(error).splitlines() or [''])[0][:200]}"
            _dependent_launch_failure.append(message)
            warnings.warn(f"the fused decode step's dependent launches failed ({message}); it launches its kernels "
                          "one after the other from now on", RuntimeWarning)
            self.dependent_launch = False
        self.launched = True

    def _save_state(self) -> list:
        """Copies of what a step advances (token, finished rows, position, history), for a step to be redone.
        The cache slot a step writes needs no copy: the redone step writes it again, identically."""
        return [t.clone() for t in (self.token, self.finished, self.pos, self.history)]

    def _restore_state(self, saved: list) -> None:
        for buffer, value in zip((self.token, self.finished, self.pos, self.history), saved):
            buffer.copy_(value)

    def _capture(self) -> "torch.cuda.CUDAGraph":
        # a first eager step compiles the kernels (Triton JIT) outside the capture; the state it advanced
        # is put back, and the cache slot it wrote is written again, identically, by the replay
        saved = self._save_state()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._launch_first_step()
        torch.cuda.current_stream().wait_stream(side)
        self._restore_state(saved)
        graph = torch.cuda.CUDAGraph()   # kept only once captured, so that a failed capture is retried
        with torch.cuda.graph(graph):
            self._launch_step()
        return graph

    def all_finished(self) -> bool:
        return bool(self.finished.all())

    def new_tokens(self, steps: int) -> torch.Tensor:
        """(B, steps + 1) int64: the first token and the tokens of the first `steps` steps."""
        return self.history[:, self.prompt_len:self.prompt_len + steps + 1]


# the first layer's KVCache -> its decoder; an entry goes when its cache does (a new setup_kv_cache,
# remove_kv_cache, or the model freed), since the decoder holds neither the cache nor the model
_decoders: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _addresses(model: GPT2) -> tuple:
    """Where the weights and caches a captured graph reads live: a graph must not outlive them."""
    caches = [block.attn.kv_cache for block in model.blocks]
    return tuple(p.data_ptr() for p in model.parameters()) + tuple(t.data_ptr() for c in caches for t in (c.k, c.v))


def fused_decoder(model: GPT2) -> FusedGPT2Decoder:
    """The decoder of the model's attached cache, built on first use and reused while the weights and
    caches stay where its graph reads them."""
    cache = model.blocks[0].attn.kv_cache
    decoder = _decoders.get(cache)
    if decoder is None or decoder.model_ref() is not model or decoder.addresses != _addresses(model):
        decoder = _decoders[cache] = FusedGPT2Decoder(model)
    return decoder
