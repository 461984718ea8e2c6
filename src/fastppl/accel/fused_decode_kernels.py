"""The Triton kernels of the fused GPT-2 decode step; fastppl.accel.fused_decode says what each does in a
step and launches them. Every kernel takes GDC: launched with programmatic dependent launch, it waits for the
kernel before it (_wait_for_previous_kernel) before it reads anything that kernel may write."""
from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: fastppl.accel.fused_decode then says the step is unsupported
    triton = tl = None

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
    def gemv_kernel(
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
    def embed_kernel(token_ptr, pos_ptr, pad_ptr, wte_ptr, wpe_ptr, x_ptr, C, BLOCK_C: tl.constexpr,
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
    def attention_kernel(q_ptr, k_cache_ptr, v_cache_ptr, pos_ptr, pad_ptr, out_ptr,
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
    def pick_token_kernel(block_max_ptr, block_arg_ptr, n_blocks, token_ptr, finished_ptr, history_ptr,
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
