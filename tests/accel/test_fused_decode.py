"""The fused Triton decode step (fastppl.accel.fused_decode) against the eager decode step and against the
model's own forward. On CUDA the kernels run for real, in CUDA graphs; without a GPU they run in Triton's
interpreter (conftest.py sets TRITON_INTERPRET=1; triton comes with the test extra), which checks their
arithmetic and masks, not their speed or races between programs."""
import os

import pytest
import torch

from fastppl import decode as D
from fastppl import generate as G
from fastppl.models.gpt2 import GPT2, GPT2Config
from fastppl.models.kv_cache import setup_kv_cache

import fastppl.accel.fused_decode as fused_decode   # imports without Triton too (CPU-only installs)

if fused_decode.triton is None:
    pytest.skip("Triton is not installed", allow_module_level=True)
CUDA = torch.cuda.is_available()
if not CUDA and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no GPU; set TRITON_INTERPRET=1 to run the kernels in Triton's interpreter",
                allow_module_level=True)
DEVICE = torch.device("cuda" if CUDA else "cpu")
pytestmark = pytest.mark.gpu if CUDA else []

# small enough for the interpreter, whose time goes by program instance (about 20 ms each), yet several programs
# for every product (the column tiling and its offsets) and a vocabulary that is not a multiple of any tile, so
# that every tail is masked
TINY = GPT2Config(n_layer=2, n_head=2, n_embd=64, n_positions=256, vocab_size=300)
# for the checks of the decoder's control (restarts, stops, fallbacks, ties): every layer's product one program
# (three for the vocabulary), about half TINY's programs a step; the arithmetic is TINY's tests'
NARROW = GPT2Config(n_layer=2, n_head=2, n_embd=32, n_positions=64, vocab_size=300)
# GPT-2's own widths (two layers), on the GPU only
GPT2_WIDTHS = GPT2Config(n_layer=2, n_head=12, n_embd=768)


def sharp_model(config: GPT2Config, dtype=torch.float32, seed: int = 0) -> GPT2:
    """Random weights scaled up, so that the logits are peaked and a greedy tie in fp32 is unlikely."""
    model = GPT2(config)
    model.init_weights(torch.Generator().manual_seed(seed))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if not name.startswith("blocks.") or name.endswith("weight"):
                parameter.mul_(3.0)
    return model.eval().to(DEVICE, dtype)


def prompts_of(lengths, vocab, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in lengths]


def fused_tokens(model, prompts, new_tokens, eos_id=-1, keep_logits=False, cache_len=None, decoder=None,
                 dependent_launch=True):
    """(new tokens (B, new_tokens) as lists, the decoder) through prefill + the fused step; a given decoder
    is reused (its model's cache must have cache_len slots)."""
    ids, pad = D.left_pad(prompts, pad_id=0)
    B, P = ids.shape
    cache_len = cache_len or -(-(P + new_tokens) // G.CACHE_LEN_MULTIPLE) * G.CACHE_LEN_MULTIPLE
    if decoder is None:
        setup_kv_cache(model, B, cache_len)
    with torch.inference_mode():
        ids, pad = torch.from_numpy(ids).to(DEVICE), torch.from_numpy(pad).to(DEVICE)
        first = D.prefill(model, ids, pad, cache_len, D.Sampling())
        decoder = decoder or fused_decode.FusedGPT2Decoder(model, keep_logits=keep_logits,
                                                           dependent_launch=dependent_launch)
        decoder.start(first, pad, P, eos_id)
        for _ in range(new_tokens - 1):
            decoder.step()
        return decoder.new_tokens(new_tokens - 1).tolist(), decoder


@pytest.mark.slow   # Triton's interpreter on the CPU
@pytest.mark.parametrize("lengths", [[5], [3, 9, 1, 6][:fused_decode.MAX_BATCH]], ids=["batch1", "batch-max-padded"])
def test_fused_greedy_tokens_equal_the_eager_decode_step(lengths):
    model = sharp_model(TINY)
    prompts = prompts_of(lengths, TINY.vocab_size)
    new_tokens = 6
    reference = G.generate(model, prompts, new_tokens, compile=False)
    tokens, _ = fused_tokens(model, prompts, new_tokens)
    assert tokens == reference.tokens


@pytest.mark.slow   # Triton's interpreter on the CPU
def test_attention_combines_many_chunks_of_an_odd_length_cache_and_a_reused_decoder_restarts(monkeypatch):
    """4-slot chunks and a 14-slot cache: the attention spans up to 4 chunks, the last one partial, and the
    short row's padding fills whole chunks, so the chunk combine (and its rescaling by each chunk's max, and a
    chunk with nothing visible) decides every token. The same decoder then serves prompts of other lengths and
    padding."""
    monkeypatch.setattr(fused_decode, "CHUNK", 4)
    model = sharp_model(NARROW)
    first, then = prompts_of([1, 7], NARROW.vocab_size, seed=11), prompts_of([9, 2], NARROW.vocab_size, seed=12)
    expected_first = G.generate(model, first, 7, compile=False).tokens    # before: generate replaces the cache
    expected_then = G.generate(model, then, 5, compile=False).tokens
    tokens, decoder = fused_tokens(model, first, 7, cache_len=14)      # slots up to 7 + 6 - 1 = 12: chunk 4
    assert decoder.n_chunks == 4
    assert tokens == expected_first
    tokens, _ = fused_tokens(model, then, 5, cache_len=14, decoder=decoder)
    assert tokens == expected_then
    with pytest.raises(RuntimeError, match="past the 14-slot cache"):   # slots 9 + 4 + 2 > 14
        for _ in range(2):
            decoder.step()
    setup_kv_cache(model, 2, 14)                                       # a new cache: this decoder is stale
    with pytest.raises(AssertionError, match="moved"):
        fused_tokens(model, then, 5, cache_len=14, decoder=decoder)


@pytest.mark.slow   # Triton's interpreter on the CPU
def test_tied_top_logits_go_to_the_lowest_id_like_the_eager_step():
    """Three vocabulary rows equal and the final hidden state fixed (ln_f's weight 0, its bias u): at every step
    the three ids tie exactly, at the top. The eager step (torch.argmax) takes the lowest id, and so must the
    fused one: 3 over 5 within one program's block of the vocabulary, and 3 over 250 across blocks (taking the
    highest of a block gives 5, the last block's gives 250)."""
    model = sharp_model(NARROW)
    tied = (5, 3, 250)
    with torch.no_grad():
        u = torch.randn(NARROW.n_embd, generator=torch.Generator().manual_seed(0)).to(model.wte.weight)
        model.ln_f.weight.zero_()
        model.ln_f.bias.copy_(u)
        for i in tied:                       # logit |u|; the other rows' ~0.06 |u| N(0, 1)
            model.wte.weight[i] = u / u.norm()
    prompts = prompts_of([4, 7][:fused_decode.MAX_BATCH], NARROW.vocab_size, seed=4)
    reference = G.generate(model, prompts, 4, compile=False).tokens
    assert reference == [[3] * 4] * len(prompts)
    tokens, decoder = fused_tokens(model, prompts, 4)
    block = decoder._block_n(NARROW.vocab_size, NARROW.n_embd)    # the vocabulary's columns a program
    assert 3 // block == 5 // block != 250 // block
    assert tokens == reference


@pytest.mark.slow   # Triton's interpreter on the CPU
def test_fused_step_stops_a_row_at_end_of_text_like_the_eager_step():
    model = sharp_model(NARROW)
    prompts = prompts_of([4, 6], NARROW.vocab_size, seed=3)
    free = G.generate(model, prompts, 7, compile=False).tokens
    eos = free[0][3]                        # a token row 0 emits mid-way: row 0 stops there
    assert eos not in free[1][:4]           # row 1 goes on past it
    reference = G.generate(model, prompts, 7, eos_id=eos, compile=False)
    tokens, decoder = fused_tokens(model, prompts, 7, eos_id=eos)
    for row, expected in zip(tokens, reference.tokens):
        cut = row[:row.index(eos) + 1] if eos in row else row
        assert cut == expected
        assert all(t == eos for t in row[len(cut):])      # a finished row keeps emitting eos
    assert bool(decoder.finished[0])


def _reference_logits(model, prompts, new_tokens):
    """fp32 logits predicting each row's last token of prompt + new_tokens[:-1], from a plain uncached
    forward of the row's real tokens (no padding: that is what the padded, cached step must reproduce)."""
    rows = []
    with torch.inference_mode():
        for prompt, new in zip(prompts, new_tokens):
            ids = torch.tensor([prompt + new[:-1]], device=DEVICE)
            rows.append(D._logits(model, model(ids))[0])
    return torch.stack(rows)


@pytest.mark.slow   # Triton's interpreter on the CPU
@pytest.mark.parametrize("dtype", [torch.float32] + ([torch.bfloat16] if CUDA else []))
def test_fused_logits_match_the_models_forward(dtype):
    config = GPT2_WIDTHS if CUDA else TINY
    model = sharp_model(config, dtype)
    prompts = prompts_of([7, 3], config.vocab_size)
    tokens, decoder = fused_tokens(model, prompts, 6, keep_logits=True)
    # the logits of the last step predict token 6 from prompt + tokens[:5]
    reference = _reference_logits(sharp_model(config, torch.float32), prompts, [t[:6] for t in tokens])
    scale = reference.abs().max().item()
    # fp32: summation order only; bf16: weights rounded to bf16 (the fused step keeps activations fp32)
    tolerance = 1e-4 if dtype == torch.float32 else 5e-2
    assert (decoder.logits - reference).abs().max().item() <= tolerance * scale
    if dtype == torch.float32:
        assert decoder.logits.argmax(-1).tolist() == [t[5] for t in tokens]


@pytest.mark.skipif(not (CUDA and fused_decode.dependent_launch_supported(DEVICE)),
                    reason="programmatic dependent launch needs an NVIDIA GPU of compute capability 9+")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dependent_launches_give_the_same_tokens_and_logits_bit_for_bit(dtype):
    """Each kernel may start while the one before it finishes, and must read nothing that one writes before
    its wait: a race would move a logit, here at GPT-2's widths over 48 steps, with the attention's chunk
    combine and every residual read in play."""
    model = sharp_model(GPT2_WIDTHS, dtype)
    prompts = prompts_of([7, 3][:fused_decode.MAX_BATCH], GPT2_WIDTHS.vocab_size, seed=5)
    ids, pad = D.left_pad(prompts, pad_id=0)
    runs = {}
    for dependent in (False, True):
        setup_kv_cache(model, len(prompts), 64)
        with torch.inference_mode():
            ids_d, pad_d = torch.from_numpy(ids).to(DEVICE), torch.from_numpy(pad).to(DEVICE)
            first = D.prefill(model, ids_d, pad_d, 64, D.Sampling())
            decoder = fused_decode.FusedGPT2Decoder(model, keep_logits=True, dependent_launch=dependent)
            decoder.start(first, pad_d, ids.shape[1], -1)
            logits = []
            for _ in range(48):
                decoder.step()
                logits.append(decoder.logits.clone())   # every step's, not only the last one's
            runs[dependent] = decoder.new_tokens(48).tolist(), torch.stack(logits)
        assert decoder.dependent_launch is dependent and decoder.graph is not None
    assert runs[True][0] == runs[False][0]
    assert torch.equal(runs[True][1], runs[False][1])


_PTX_ORDER = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import fastppl.accel.fused_decode_kernels as fd
signature = dict(x_ptr="*fp32", w_ptr="*bf16", bias_ptr="*bf16", out_ptr="*fp32", N="i32", ln_w_ptr="*bf16",
                 ln_b_ptr="*bf16", eps="fp32", k_cache_ptr="*bf16", v_cache_ptr="*bf16", pos_ptr="*i64", L="i32",
                 block_max_ptr="*fp32", block_arg_ptr="*i32", n_blocks="i32")
constants = dict(B=1, K=64, PROLOGUE=fd.LAYER_NORM, EPILOGUE=fd.QKV_TO_CACHE, HAS_BIAS=True, GELU=False,
                 STORE_LOGITS=False, HEAD_DIM=32, BLOCK_B=1, BLOCK_N=16, BLOCK_K=64, GDC=True)
signature.update({name: "constexpr" for name in constants})
source = ASTSource(fn=fd.gemv_kernel, signature=signature, constexprs=constants)
try:
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, launch_pdl=True))
except RuntimeError as error:
    print(json.dumps(dict(skip=str(error)[:200]))); sys.exit(0)
print(json.dumps(dict(ptx=kernel.asm["ptx"])))
"""


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(fused_decode.tl.extra.cuda, "gdc_wait"), reason="this Triton has no dependent launch")
def test_the_product_kernel_reads_only_weights_before_its_wait():
    """Compiled for an sm_90 target (on the CPU too; in a process of its own, as the tests run Triton's
    interpreter): in the PTX, the weight tile's loads come before griddepcontrol.wait and every other load
    after it, so a kernel that starts early reads nothing the kernel before it writes."""
    import json
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", _PTX_ORDER], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    if "skip" in result:   # no ptxas for this target in this Triton build
        pytest.skip(f"cannot compile for sm_90 here: {result['skip']}")
    lines = result["ptx"].splitlines()
    wait = next(i for i, line in enumerate(lines) if "griddepcontrol.wait" in line)
    assert any("griddepcontrol.launch_dependents" in line for line in lines[wait:])
    import re

    def bytes_loaded(line):   # per thread: ld.global[.v2|.v4].bN
        vector = re.search(r"\.v(\d)\.", line)
        return (int(vector.group(1)) if vector else 1) * int(re.search(r"\.b(\d+)", line).group(1)) // 8

    loads = [(i, line) for i, line in enumerate(lines) if "ld.global" in line]
    before = sum(bytes_loaded(line) for i, line in loads if i < wait)
    # the (16 x 64) bf16 weight tile over 4 warps of 32 threads is 16 bytes a thread, and nothing else; x, the
    # LayerNorm's weights, the bias and pos are read after the wait
    assert before == 16 * 64 * 2 // (4 * 32)
    assert any(i > wait for i, _ in loads)


@pytest.mark.skipif(not CUDA, reason="generate() takes the fused step on CUDA only")
@pytest.mark.parametrize("batch", sorted({1, fused_decode.MAX_BATCH}))
def test_generate_on_cuda_takes_the_fused_step_and_matches_the_compiled_one(batch):
    model = sharp_model(GPT2_WIDTHS)
    prompts = prompts_of([3 + i % 11 for i in range(batch)], GPT2_WIDTHS.vocab_size)
    fused = G.generate(model, prompts, 40)
    assert fused.decode_step.startswith("fused")
    again = G.generate(model, prompts, 40)            # the decoder and its graph are reused
    compiled = G.generate(model, prompts, 40, fused=False)
    assert compiled.decode_step.startswith("torch.compile")
    assert fused.tokens == again.tokens == compiled.tokens


@pytest.mark.skipif(not CUDA, reason="generate() takes the fused step on CUDA only")
def test_generate_on_cuda_says_why_a_large_batch_runs_the_compiled_step():
    model = sharp_model(TINY)
    prompts = prompts_of([4] * (fused_decode.MAX_BATCH + 1), TINY.vocab_size)
    result = G.generate(model, prompts, 8)
    assert result.decode_step.startswith("torch.compile") and "batch" in result.decode_step
    assert result.tokens == G.generate(model, prompts, 8, compile=False).tokens


@pytest.mark.skipif(not CUDA, reason="generate() takes the fused step on CUDA only")
def test_generate_reuses_the_decoder_across_calls_and_end_of_text_ids():
    model = sharp_model(GPT2_WIDTHS)
    prompts = prompts_of([4, 9], GPT2_WIDTHS.vocab_size, seed=5)
    free = G.generate(model, prompts, 24)
    decoder = fused_decode.fused_decoder(model)
    eos = free.tokens[1][10]
    stopped = G.generate(model, prompts, 24, eos_id=eos)
    assert fused_decode.fused_decoder(model) is decoder
    assert stopped.tokens == G.generate(model, prompts, 24, eos_id=eos, compile=False).tokens
    assert stopped.finished[1]


def test_a_reused_decoder_follows_weights_that_moved():
    """A decoder (and its graph) is kept per cache; weights replaced by new tensors must not be read from
    where they were."""
    model = sharp_model(TINY)
    setup_kv_cache(model, 1, 64)
    decoder = fused_decode.fused_decoder(model)
    assert fused_decode.fused_decoder(model) is decoder
    with torch.no_grad():
        model.blocks[0].mlp.fc.weight = torch.nn.Parameter(model.blocks[0].mlp.fc.weight.clone())
    assert fused_decode.fused_decoder(model) is not decoder


def test_fused_step_is_refused_for_sampling_large_batches_and_other_models():
    from fastppl.models.llama import Llama, LlamaConfig
    model = sharp_model(TINY)
    setup_kv_cache(model, 1, 64)
    assert fused_decode.fused_decode_unsupported(model, temperature=0.0) is None
    assert "greedy" in fused_decode.fused_decode_unsupported(model, temperature=0.7)
    assert "batch" in fused_decode.fused_decode_unsupported(model, 0.0, batch=fused_decode.MAX_BATCH + 1)
    model.blocks[0].attn.proj.weight = torch.nn.Parameter(model.blocks[0].attn.proj.weight.t().contiguous().t())
    assert "contiguous" in fused_decode.fused_decode_unsupported(model, 0.0)
    llama = Llama(LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, n_layer=1, n_head=2, n_kv_head=1))
    assert "GPT-2" in fused_decode.fused_decode_unsupported(llama, temperature=0.0)


def _forced_fused_step(model, device, compile, *args):
    """generate()'s choice of decode step with the fused one forced where it would not be chosen (the CPU under
    the interpreter), when compiling; the eager step otherwise (the reference)."""
    return ("fused (forced)", True) if compile else ("eager", False)


@pytest.mark.slow   # Triton's interpreter on the CPU
def test_a_failed_dependent_launch_falls_back_to_plain_launches(monkeypatch):
    """A driver or toolchain without dependent launches fails the first launch: here a step that runs all its
    kernels (advancing the token, the position and the history) and then raises. The step is redone plainly
    from the state before it, with one warning; the tokens are the eager step's, the report does not claim
    dependent launches, and later decoders in the process launch plainly without trying again."""
    monkeypatch.setattr(fused_decode, "_dependent_launch_failure", [])
    monkeypatch.setattr(fused_decode, "dependent_launch_supported",
                        lambda device: not fused_decode._dependent_launch_failure)
    plain_launch = fused_decode.FusedGPT2Decoder._launch_step
    attempts = []

    def failing_launch(self):
        if self.dependent:
            attempts.append(1)
            dependent, self.dependent = self.dependent, {}
            plain_launch(self)              # the kernels run and advance the state...
            self.dependent = dependent
            raise RuntimeError("CUDA driver error: invalid argument")   # ...and then the launch fails
        plain_launch(self)

    monkeypatch.setattr(fused_decode.FusedGPT2Decoder, "_launch_step", failing_launch)
    monkeypatch.setattr(G, "_choose_decode_step", _forced_fused_step)
    model = sharp_model(NARROW)
    prompts = prompts_of([6, 2], NARROW.vocab_size, seed=7)
    expected = G.generate(model, prompts, 5, compile=False).tokens
    with pytest.warns(RuntimeWarning, match="dependent launches failed .*invalid argument"):
        got = G.generate(model, prompts, 5, compile=True)
    assert got.tokens == expected and got.decode_step == "fused (forced)"
    assert len(attempts) == 1 and fused_decode._dependent_launch_failure
    decoder = fused_decode._decoders[model.blocks[0].attn.kv_cache]
    # the failed step's effects were undone: the step was taken once, not twice
    assert not decoder.dependent_launch and int(decoder.pos) == decoder.prompt_len + decoder.steps_taken
    setup_kv_cache(model, len(prompts), 64)   # a new cache: a new decoder, which does not try again
    assert G.generate(model, prompts, 5, compile=True).tokens == expected and len(attempts) == 1


@pytest.mark.slow   # Triton's interpreter on the CPU
def test_generate_loop_with_the_fused_step_gives_the_eager_tokens_and_stops(monkeypatch):
    """generate()'s own loop around the fused step (warm-up timing, stop checks, token history), forced on
    where it would not be chosen (the CPU under the interpreter), against the eager step."""
    monkeypatch.setattr(G, "_choose_decode_step", _forced_fused_step)
    model = sharp_model(NARROW)
    prompts = prompts_of([6, 2], NARROW.vocab_size, seed=7)
    free = G.generate(model, prompts, 8, compile=False).tokens
    eos = free[1][3]
    for eos_id in (None, eos):
        expected = G.generate(model, prompts, 8, eos_id=eos_id, compile=False)
        got = G.generate(model, prompts, 8, eos_id=eos_id, compile=True, stop_check_every=2)
        # on CUDA the step adds dependent launches (their default); the interpreter has none
        assert got.decode_step in ("fused (forced)", "fused (forced), dependent launches")
        assert got.tokens == expected.tokens and got.finished == expected.finished
    # row 1 alone finishes at its 4th token: the loop stops at the next check instead of running all 7 steps
    expected = G.generate(model, prompts[1:], 8, eos_id=eos, compile=False, stop_check_every=2)
    got = G.generate(model, prompts[1:], 8, eos_id=eos, compile=True, stop_check_every=2)
    assert got.tokens == expected.tokens and got.finished == [True]
    assert got.decode_steps == expected.decode_steps == -(-max(free[1].index(eos), 1) // 2) * 2 < 7
