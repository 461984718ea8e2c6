"""GPT-2's greedy decode step at small batch as 5 Triton kernels per layer, one CUDA graph per token.

The compiled decode step (fastppl.generate.decode_one_token under torch.compile) runs ~145 kernels a
token at batch 1, most of them GEMVs of ~4.5 us whose latency, not the 250 MB of weights, sets the step
(docs/BENCHMARKS.md, session 4). Here each layer is five kernels, the small work folded into them:

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
decode_one_token, eager, is the reference
(tests/test_fused_decode.py). The model file is untouched: the kernels read its weights and its KV cache."""
from __future__ import annotations

import math
import os
import warnings
import weakref
from typing import Optional

import torch
import torch.nn as nn

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

from ..models.gpt2 import GPT2

MAX_BATCH = 2   # rows a decode step may have; larger batches run the compiled step (faster at 4, docs/BENCHMARKS.md)
# elements of a GEMV program's weight tile: BLOCK_N = TILE_ELEMENTS // (rows * K padded to a power of 2)
# columns, the whole K at once, so that a program's loads are all in flight together (a loop over K
# would wait on memory once per iteration). scripts/gpu_fused_decode.py sweeps these.
TILE_ELEMENTS = 8192
NUM_WARPS = 4
CHUNK = 32      # cache slots per attention program (32-128 within 2 % at batch 1; 256 13 % slower)
# each kernel launched with programmatic dependent launch where the GPU has it (compute capability 9+): it
# starts, and loads its weights, while the kernel before it finishes (_wait_for_previous_kernel): -16 % a step at
# batch 1 on an H100 (scripts/gpu_decode_pdl.py, docs/BENCHMARKS.md session 16)
DEPENDENT_LAUNCH = True

# prologues (how the K row is read) and epilogues (what is done with the (rows, cols) result)
PLAIN, LAYER_NORM = 0, 1
STORE, ADD_TO_RESIDUAL, QKV_TO_CACHE, BLOCK_ARGMAX = 0, 1, 2, 3


if triton is not None:
    from .fused_norm import layer_norm_rows

    # the same codes as constexpr globals, the only globals a Triton kernel may read
    K_PLAIN, K_LAYER_NORM = tl.constexpr(PLAIN), tl.constexpr(LAYER_NORM)
    K_STORE, K_ADD_TO_RESIDUAL, K_QKV_TO_CACHE, K_BLOCK_ARGMAX = (
        tl.constexpr(c) for c in (STORE, ADD_TO_RESIDUAL, QKV_TO_CACHE, BLOCK_ARGMAX))

    @triton.jit
    def _tanh(x):
        # tanh through exp (no libdevice, so that the interpreter runs it too); saturates to +-1 cleanly
        return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)

    @triton.jit
    def _epilogue(acc, rows, cols, row_ok, col_ok, N, bias_ptr, out_ptr,
                  k_cache_ptr, v_cache_ptr, pos_ptr, L, block_max_ptr, block_arg_ptr, n_blocks,
                  EPILOGUE: tl.constexpr, HAS_BIAS: tl.constexpr, GELU: tl.constexpr,
                  STORE_LOGITS: tl.constexpr, HEAD_DIM: tl.constexpr):
        """What a product program does with its (rows, cols) fp32 tile of x @ w.T."""
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        if GELU:   # GPT-2's gelu_new
            acc = 0.5 * acc * (1.0 + _tanh(0.7978845608028654 * (acc + 0.044715 * acc * acc * acc)))
        ok = row_ok[:, None] & col_ok[None, :]
        if EPILOGUE == K_STORE:
            tl.store(out_ptr + rows[:, None] * N + cols[None, :], acc, mask=ok)
        if EPILOGUE == K_ADD_TO_RESIDUAL:
            residual = out_ptr + rows[:, None] * N + cols[None, :]
            tl.store(residual, tl.load(residual, mask=ok, other=0.0) + acc, mask=ok)
        if EPILOGUE == K_QKV_TO_CACHE:
            _qkv_to_cache(acc, rows, cols, ok, N, out_ptr, k_cache_ptr, v_cache_ptr, pos_ptr, L, HEAD_DIM)
        if EPILOGUE == K_BLOCK_ARGMAX:
            if STORE_LOGITS:
                tl.store(out_ptr + rows[:, None] * N + cols[None, :], acc, mask=ok)
            _block_argmax(acc, rows, cols, row_ok, ok, block_max_ptr, block_arg_ptr, n_blocks)

    @triton.jit
    def _qkv_to_cache(acc, rows, cols, ok, N, query_ptr, k_cache_ptr, v_cache_ptr, pos_ptr, L, HEAD_DIM: tl.constexpr):
        """cols [0, C): query -> query (B, C); [C, 2C): key, [2C, 3C): value -> cache[b, head, pos, d]."""
        C = N // 3
        n_head = C // HEAD_DIM
        pos = tl.load(pos_ptr)
        tl.store(query_ptr + rows[:, None] * C + cols[None, :], acc, mask=ok & (cols < C)[None, :])
        in_kv = cols % C
        slot = ((rows[:, None] * n_head + in_kv[None, :] // HEAD_DIM) * L + pos) * HEAD_DIM \
            + in_kv[None, :] % HEAD_DIM
        is_key = (cols >= C) & (cols < 2 * C)
        tl.store(k_cache_ptr + slot, acc.to(k_cache_ptr.dtype.element_ty), mask=ok & is_key[None, :])
        tl.store(v_cache_ptr + slot, acc.to(v_cache_ptr.dtype.element_ty), mask=ok & (cols >= 2 * C)[None, :])

    @triton.jit
    def _block_argmax(acc, rows, cols, row_ok, ok, block_max_ptr, block_arg_ptr, n_blocks):
        """Each row's largest logit among this program's columns and its lowest column (block_* (B, n_blocks))."""
        logits = tl.where(ok, acc, float("-inf"))
        best = tl.max(logits, axis=1)
        first = tl.min(tl.where(logits == best[:, None], cols[None, :], 2147483647), axis=1)
        block = tl.program_id(0)
        tl.store(block_max_ptr + rows * n_blocks + block, best, mask=row_ok)
        tl.store(block_arg_ptr + rows * n_blocks + block, first, mask=row_ok)

    @triton.jit
    def _wait_for_previous_kernel(GDC: tl.constexpr):
        """Programmatic dependent launch (Hopper+): a kernel launched with launch_pdl may start while the one
        before it runs; it waits here until that one has finished and its writes are visible, and only then
        lets the next kernel start. So at most one kernel runs ahead, and what it reads before its wait (the
        weights) no kernel writes. Without launch_pdl the wait returns at once."""
        if GDC:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()

    @triton.jit
    def _gemv_kernel(
        x_ptr, w_ptr, bias_ptr, out_ptr, N,
        ln_w_ptr, ln_b_ptr, eps,                              # LAYER_NORM
        k_cache_ptr, v_cache_ptr, pos_ptr, L,                 # QKV_TO_CACHE: caches (B, nh, L, hs)
        block_max_ptr, block_arg_ptr, n_blocks,               # BLOCK_ARGMAX: (B, n_blocks)
        B: tl.constexpr, K: tl.constexpr, PROLOGUE: tl.constexpr, EPILOGUE: tl.constexpr,
        HAS_BIAS: tl.constexpr, GELU: tl.constexpr, STORE_LOGITS: tl.constexpr, HEAD_DIM: tl.constexpr,
        BLOCK_B: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GDC: tl.constexpr = False,
    ):
        """out (B, N) = epilogue(prologue(x) (B, K) @ w.T (K, N) + bias); a program: all B rows
        (BLOCK_B >= B), BLOCK_N columns, the whole K (BLOCK_K >= K) in one load of the weights."""
        rows = tl.arange(0, BLOCK_B)
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        k = tl.arange(0, BLOCK_K)
        row_ok, col_ok, k_ok = rows < B, cols < N, k < K
        w = tl.load(w_ptr + cols[:, None] * K + k[None, :], mask=col_ok[:, None] & k_ok[None, :],
                    other=0.0)                                                            # (BN, BK)
        # the weights never change during decoding, so they load before the previous kernel has finished
        _wait_for_previous_kernel(GDC)
        x_ok = row_ok[:, None] & k_ok[None, :]
        x = tl.load(x_ptr + rows[:, None] * K + k[None, :], mask=x_ok, other=0.0).to(tl.float32)   # (BB, BK)
        if PROLOGUE == K_LAYER_NORM:   # the rows are in registers already
            x = layer_norm_rows(x, x_ok, ln_w_ptr, ln_b_ptr, k, k_ok, K, eps)
        acc = tl.sum(x[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)                # (BB, BN)
        _epilogue(acc, rows, cols, row_ok, col_ok, N, bias_ptr, out_ptr, k_cache_ptr, v_cache_ptr, pos_ptr, L,
                  block_max_ptr, block_arg_ptr, n_blocks, EPILOGUE, HAS_BIAS, GELU, STORE_LOGITS, HEAD_DIM)

    @triton.jit
    def _embed_kernel(token_ptr, pos_ptr, pad_ptr, wte_ptr, wpe_ptr, x_ptr, C, BLOCK_C: tl.constexpr,
                      GDC: tl.constexpr = False):
        """x[b] = wte[token[b]] + wpe[max(pos - pad[b], 0)], fp32."""
        _wait_for_previous_kernel(GDC)
        b = tl.program_id(0)
        token = tl.load(token_ptr + b)
        position = tl.maximum(tl.load(pos_ptr) - tl.load(pad_ptr + b), 0)
        c = tl.arange(0, BLOCK_C)
        ok = c < C
        x = tl.load(wte_ptr + token * C + c, mask=ok, other=0.0).to(tl.float32) \
            + tl.load(wpe_ptr + position * C + c, mask=ok, other=0.0).to(tl.float32)
        tl.store(x_ptr + b * C + c, x, mask=ok)

    @triton.jit
    def _attention_kernel(q_ptr, k_cache_ptr, v_cache_ptr, pos_ptr, pad_ptr, out_ptr,
                          chunk_out_ptr, chunk_max_ptr, chunk_sum_ptr, arrived_ptr, L, n_chunks, scale,
                          N_HEAD: tl.constexpr, HEAD_DIM: tl.constexpr, CHUNK: tl.constexpr,
                          CHUNKS_PAD: tl.constexpr, GDC: tl.constexpr = False):
        """One (row, head, chunk of CHUNK slots): the query's scores over the chunk's visible slots, their
        max m, sum of exp(s - m) l and exp-weighted values o, stored; the row-head's last chunk program to
        arrive combines them all into out (B, nh, hs):

            out = sum_c exp(m_c - M) o_c / sum_c exp(m_c - M) l_c,   M = max_c m_c

        A chunk with no visible slot has m = -inf, l = 0, o = 0 and weight exp(-inf) = 0."""
        _wait_for_previous_kernel(GDC)
        row_head, chunk = tl.program_id(0), tl.program_id(1)
        row = row_head // N_HEAD
        pos = tl.load(pos_ptr)
        pad = tl.load(pad_ptr + row)
        slots = chunk * CHUNK + tl.arange(0, CHUNK)
        # padded_mask: slots up to the query's, minus the row's left padding (a query always sees itself)
        visible = (slots <= pos) & ((slots >= pad) | (slots == pos))
        d = tl.arange(0, HEAD_DIM)
        at = (row_head * L + slots[:, None]) * HEAD_DIM + d[None, :]                           # (CHUNK, hs)
        keys = tl.load(k_cache_ptr + at, mask=visible[:, None], other=0.0).to(tl.float32)
        values = tl.load(v_cache_ptr + at, mask=visible[:, None], other=0.0).to(tl.float32)
        q = tl.load(q_ptr + row_head * HEAD_DIM + d)
        scores = tl.where(visible, tl.sum(keys * q[None, :], axis=1) * scale, float("-inf"))
        top = tl.max(scores, axis=0)
        p = tl.exp(scores - tl.where(top == float("-inf"), 0.0, top))
        part = row_head * n_chunks + chunk
        tl.store(chunk_out_ptr + part * HEAD_DIM + d, tl.sum(p[:, None] * values, axis=0))
        tl.store(chunk_max_ptr + part, top)
        tl.store(chunk_sum_ptr + part, tl.sum(p, axis=0))
        # all of this program's stores are done before it counts itself (the barrier), and visible to the
        # program that counts last (the acq_rel atomic at GPU scope); .cg loads skip a stale L1
        tl.debug_barrier()
        if tl.atomic_add(arrived_ptr + row_head, 1) == n_chunks - 1:
            c = tl.arange(0, CHUNKS_PAD)
            c_ok = c < n_chunks
            first = row_head * n_chunks
            maxima = tl.load(chunk_max_ptr + first + c, mask=c_ok, other=float("-inf"), cache_modifier=".cg")
            weight = tl.exp(maxima - tl.max(maxima, axis=0))
            total = tl.sum(weight * tl.load(chunk_sum_ptr + first + c, mask=c_ok, other=0.0, cache_modifier=".cg"),
                           axis=0)
            outputs = tl.load(chunk_out_ptr + (first + c[:, None]) * HEAD_DIM + d[None, :], mask=c_ok[:, None],
                              other=0.0, cache_modifier=".cg")                                 # (CP, hs)
            tl.store(out_ptr + row_head * HEAD_DIM + d, tl.sum(weight[:, None] * outputs, axis=0) / total)
            tl.store(arrived_ptr + row_head, 0)

    @triton.jit
    def _pick_token_kernel(block_max_ptr, block_arg_ptr, n_blocks, token_ptr, finished_ptr, history_ptr,
                           history_len, pos_ptr, B, eos_ptr, BLOCK_B: tl.constexpr, BLOCKS_PAD: tl.constexpr,
                           GDC: tl.constexpr = False):
        """Each row's token = the lowest id among the blocks' maxima (torch.argmax's tie rule); a finished row
        gets eos. Writes token, finished, history[b, pos + 1], and advances pos (one program: all rows)."""
        _wait_for_previous_kernel(GDC)
        rows = tl.arange(0, BLOCK_B)
        row_ok = rows < B
        blocks = tl.arange(0, BLOCKS_PAD)
        ok = row_ok[:, None] & (blocks < n_blocks)[None, :]
        at = rows[:, None] * n_blocks + blocks[None, :]
        maxima = tl.load(block_max_ptr + at, mask=ok, other=float("-inf"))
        best = tl.max(maxima, axis=1)
        args = tl.load(block_arg_ptr + at, mask=ok, other=2147483647)
        token = tl.min(tl.where(maxima == best[:, None], args, 2147483647), axis=1).to(tl.int64)
        eos_id = tl.load(eos_ptr)
        finished = tl.load(finished_ptr + rows, mask=row_ok, other=1)
        token = tl.where(finished != 0, eos_id, token)
        pos = tl.load(pos_ptr)
        tl.store(token_ptr + rows, token, mask=row_ok)
        tl.store(finished_ptr + rows, ((finished != 0) | (token == eos_id)).to(tl.int32), mask=row_ok)
        tl.store(history_ptr + rows * history_len + pos + 1, token, mask=row_ok)
        tl.debug_barrier()   # every thread has read pos before it moves
        tl.store(pos_ptr, pos + 1)


def fused_decode_unsupported(model: nn.Module, temperature: float, batch: int = 1) -> Optional[str]:
    """None when FusedGPT2Decoder can run this model's decode steps, else the reason it cannot."""
    if triton is None:
        return "Triton is not installed"
    if not isinstance(model, GPT2):
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


def uses_dependent_launch(requested: Optional[bool], device: torch.device) -> bool:
    """Whether a decoder asked for dependent launches (None: DEPENDENT_LAUNCH) gets them on this device."""
    return (DEPENDENT_LAUNCH if requested is None else requested) and dependent_launch_supported(device)


def _next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


class FusedGPT2Decoder:
    """Greedy decode steps of a GPT-2 whose KV cache holds the prefilled prompts (fastppl.generate.prefill).

        decoder = fused_decoder(model)            # one per attached cache, kept with its CUDA graph
        decoder.start(first_token, pad, prompt_len, eos_id)
        for _ in range(n): decoder.step()         # one CUDA graph replay (eager launches off CUDA)
        decoder.new_tokens(n)                     # (B, n + 1): the first token, then one per step

    Every buffer is allocated here, once, so that the graph's addresses stay valid; start() only writes
    into them. The decoder holds the model weakly (the cache of fused_decoder is keyed by the model's
    cache). keep_logits also writes each step's fp32 logits to .logits (tests)."""

    def __init__(self, model: GPT2, keep_logits: bool = False, use_graph: Optional[bool] = None,
                 dependent_launch: Optional[bool] = None):
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
            self.arrived = torch.zeros(B * config.n_head, dtype=torch.int32, device=device)   # reset by each last program
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
        _gemv_kernel[(triton.cdiv(N, block_n),)](
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
        _embed_kernel[(B,)](self.token, self.pos, self.pad, model.wte.weight, model.wpe.weight, self.residual,
                            C, BLOCK_C=_next_power_of_2(C), **self.dependent)
        for block in model.blocks:
            attn, mlp, cache = block.attn, block.mlp, block.attn.kv_cache
            self._gemv(self.residual, attn.qkv.weight, attn.qkv.bias, self.query, LAYER_NORM, QKV_TO_CACHE,
                       norm=block.ln_1, cache=cache, head_dim=hs)
            _attention_kernel[(B * config.n_head, self.n_chunks)](
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
        _pick_token_kernel[(1,)](
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
        except Exception as error:   # noqa: BLE001: whatever the toolchain raises
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


def fused_decoder(model: GPT2, dependent_launch: Optional[bool] = None) -> FusedGPT2Decoder:
    """The decoder of the model's attached cache, built on first use and reused while the weights and
    caches stay where its graph reads them (and the launch mode is the one asked for; None: DEPENDENT_LAUNCH)."""
    cache = model.blocks[0].attn.kv_cache
    decoder = _decoders.get(cache)
    if (decoder is None or decoder.model_ref() is not model or decoder.addresses != _addresses(model)
            or decoder.dependent_launch != uses_dependent_launch(dependent_launch, cache.k.device)):
        decoder = _decoders[cache] = FusedGPT2Decoder(model, dependent_launch=dependent_launch)
    return decoder
