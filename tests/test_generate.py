"""Generation: greedy equals transformers' generate, seeded sampling, batching, end-of-text, the CLI."""
import json

import pytest
import torch

from fastppl.cli import main
from fastppl.errors import FastpplError
from fastppl.decode import Sampling, sample
from fastppl.generate import benchmark_generate, generate, read_prompts
from fastppl.models.loading import native_to_hf, random_native

EOS = 50256


def _model(preset: str):
    model = random_native(preset).eval()
    generator = torch.Generator().manual_seed(2)   # fixed, not the global RNG that other tests move
    with torch.no_grad():   # sharper than the 0.02 init: greedy text then varies instead of repeating one id
        for name, p in model.named_parameters():
            if "norm" not in name and "ln" not in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.1)
    return model


def _prompts(lengths, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, EOS, (n,), generator=generator).tolist() for n in lengths]


@pytest.mark.parametrize("preset", ["gpt2-tiny", pytest.param("llama-tiny", marks=pytest.mark.slow)])
def test_greedy_equals_transformers_generate(preset):
    model = _model(preset)
    hf = native_to_hf(model).eval()
    for prompt in _prompts([7, 1]):
        got = generate(model, [prompt], 24, eos_id=None).tokens[0]
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=24, min_new_tokens=24, do_sample=False,
                              pad_token_id=EOS, eos_token_id=None)
        assert got == out[0, len(prompt):].tolist()
        assert len(set(got)) > 3     # a real test: the text is not one id repeated


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["gpt2-tiny", "llama-tiny"])
def test_batched_prompts_of_different_lengths_equal_one_by_one(preset):
    model = _model(preset)
    prompts = _prompts([9, 2, 5, 13])
    for sampling in (Sampling(), Sampling(temperature=0.7, top_k=20, seed=0)):
        batched = generate(model, prompts, 16, sampling, eos_id=None)
        if sampling.temperature == 0:
            for prompt, tokens in zip(prompts, batched.tokens):
                assert generate(model, [prompt], 16, eos_id=None).tokens[0] == tokens
        else:
            # sampled rows draw other random numbers than one by one, so compare with the row's own distribution:
            # every token is among the top 20 of its row's logits, recomputed without padding or cache (a random
            # id would be with probability 4e-4)
            for prompt, tokens in zip(prompts, batched.tokens):
                with torch.no_grad():
                    logits = model(torch.tensor([prompt + tokens]))[0] @ model.lm_head.weight.t()
                for step, token in enumerate(tokens):
                    row = logits[len(prompt) - 1 + step]
                    assert row[token] >= row.topk(20).values[-1] - 1e-4, (prompt, step)
        assert [len(t) for t in batched.tokens] == [16] * 4
        assert batched.decode_steps == 15


@pytest.mark.slow
def test_sampling_is_reproducible_with_a_seed():
    model = _model("llama-tiny")
    prompts = _prompts([4, 6])
    settings = dict(temperature=1.0, top_k=100, top_p=0.95)
    first = generate(model, prompts, 20, Sampling(**settings, seed=123), eos_id=None).tokens
    again = generate(model, prompts, 20, Sampling(**settings, seed=123), eos_id=None).tokens
    other = generate(model, prompts, 20, Sampling(**settings, seed=124), eos_id=None).tokens
    greedy = generate(model, prompts, 20, eos_id=None).tokens
    assert first == again
    assert first != other and first != greedy


def test_a_tiny_temperature_samples_the_greedy_token_not_nan():
    torch.manual_seed(0)
    logits = torch.randn(4, 1000) * 3
    for temperature in (1e-40, 1e-300, 5e-324):   # logits / temperature alone would overflow to inf, softmax to NaN
        assert torch.equal(sample(logits, temperature), logits.argmax(-1))


def test_a_prompts_file_with_a_byte_order_mark(tmp_path):
    path = tmp_path / "p.txt"
    path.write_bytes(b"\xef\xbb\xbffirst\n\nsecond\\nline\n")
    assert read_prompts(str(path)) == ["first", "second\nline"]   # the mark was part of the first prompt


def test_nan_logits_are_an_error_not_token_zero():
    model = random_native("gpt2-tiny")
    with torch.no_grad():
        model.blocks[0].mlp.fc.weight[0, 0] = float("nan")   # a corrupt checkpoint
    with pytest.raises(FastpplError, match="logits are not finite"):
        generate(model, [[5, 6, 7]], 3, compile=False)


def test_sample_respects_top_k_and_top_p():
    torch.manual_seed(0)
    logits = torch.randn(4, 1000) * 3
    greedy = logits.argmax(-1)
    assert torch.equal(sample(logits, 1.0, top_k=1), greedy)
    assert torch.equal(sample(logits, 1.0, top_p=1e-6), greedy)          # the most likely id always stays
    top5 = torch.topk(logits, 5).indices
    draws = torch.stack([sample(logits, 2.0, top_k=5) for _ in range(200)], dim=1)   # (4, 200)
    assert all(set(draws[row].tolist()) <= set(top5[row].tolist()) for row in range(4))
    assert len(set(draws[0].tolist())) > 1
    # top_p: only the smallest most-likely set whose probability reaches p
    probs = logits.softmax(-1)
    sorted_probs, order = probs.sort(-1, descending=True)
    n_keep = (sorted_probs.cumsum(-1) - sorted_probs < 0.5).sum(-1)
    draws = torch.stack([sample(logits, 1.0, top_p=0.5) for _ in range(200)], dim=1)
    for row in range(4):
        assert set(draws[row].tolist()) <= set(order[row, :n_keep[row]].tolist())


@pytest.mark.parametrize("settings, expected", [
    (dict(temperature=1.0), [0.5, 0.3, 0.2]),
    (dict(temperature=0.5), [0.25 / 0.38, 0.09 / 0.38, 0.04 / 0.38]),   # p^(1/T), normalised
    (dict(temperature=1.0, top_k=2), [0.625, 0.375, 0.0]),
    (dict(temperature=1.0, top_p=0.6), [0.625, 0.375, 0.0]),            # 0.5 < 0.6: the second id stays too
])
def test_sample_draws_from_the_stated_distribution(settings, expected):
    """Frequencies over 20,000 rows, not only which ids can appear: a race that drew from another distribution
    with the same support (p * E instead of p / E, a temperature applied twice) fails this."""
    torch.manual_seed(0)
    n = 20_000
    logits = torch.tensor([0.5, 0.3, 0.2]).log().expand(n, 3).contiguous()
    frequencies = torch.bincount(sample(logits, **settings), minlength=3).double() / n
    # binomial standard deviation at n = 20,000 is at most 0.0036: 0.015 is over 4 of them
    assert frequencies.tolist() == pytest.approx(expected, abs=0.015)


def test_zero_probability_is_never_drawn():
    logits = torch.full((2, 50), -float("inf"))
    logits[:, 7] = 0.0
    logits[1, 9] = 0.0
    draws = torch.stack([sample(logits, 1.0) for _ in range(100)])
    assert set(draws[:, 0].tolist()) == {7} and set(draws[:, 1].tolist()) <= {7, 9}


@pytest.mark.slow
def test_rows_stop_at_end_of_text():
    model = _model("gpt2-tiny")
    prompts = _prompts([3, 8])
    free = generate(model, prompts, 12, eos_id=None).tokens
    stop_id = free[0][4]       # pretend row 0's fifth token is end-of-text
    result = generate(model, prompts, 12, eos_id=stop_id, stop_check_every=2)
    assert result.tokens[0] == free[0][:free[0].index(stop_id) + 1] and result.finished[0]
    if stop_id not in free[1]:
        assert result.tokens[1] == free[1] and not result.finished[1]
    # once every row has finished, the loop stops at the next check (every 2 steps) instead of running all 11
    alone = generate(model, prompts[:1], 12, eos_id=stop_id, stop_check_every=2)
    assert alone.tokens == result.tokens[:1] and alone.finished == [True]
    assert alone.decode_steps == -(-max(free[0].index(stop_id), 1) // 2) * 2 < 11


def test_prompt_too_long_is_a_user_error():
    model = random_native("gpt2-tiny")
    with pytest.raises(FastpplError, match="positions"):
        generate(model, [[1] * 250], 10)


def test_cli_generate_writes_json(tmp_path, tokenizer_dir):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("To be, or not to be\n\nWhat light through yonder\n")
    out = tmp_path / "g.json"
    rc = main(["generate", "--model", "random:llama-tiny", "--tokenizer", str(tokenizer_dir), "--prompts", str(prompts),
               "--prompt", "Hello", "--max-new-tokens", "5", "--temperature", "0.8", "--top-p", "0.9",
               "--device", "cpu", "--json", str(out)])
    assert rc == 0
    result = json.loads(out.read_text())
    assert [c["prompt"] for c in result["completions"]] == ["Hello", "To be, or not to be", "What light through yonder"]
    assert all(len(c["tokens"]) == 5 for c in result["completions"])
    assert result["time_to_first_token_seconds"] > 0 and result["decode_tokens_per_second"] > 0
    assert result["sampling"]["top_p"] == 0.9 and not result["compiled"]


def test_cli_generate_without_prompts_is_a_user_error(capsys):
    assert main(["generate", "--model", "random:gpt2-tiny", "--max-new-tokens", "3"]) == 2
    assert "prompt" in capsys.readouterr().err


def test_generate_reuses_an_attached_cache_of_the_same_shape():
    model = _model("llama-tiny")
    prompts = _prompts([5, 3])
    first = generate(model, prompts, 8, eos_id=None)
    cache = model.blocks[0].attn.kv_cache
    assert generate(model, prompts, 8, eos_id=None).tokens == first.tokens
    assert model.blocks[0].attn.kv_cache is cache     # same tensors: a compiled step keeps its CUDA graph


def test_benchmark_generate_reports_decode_speed():
    result = benchmark_generate(random_native("gpt2-tiny"), batch_size=2, prompt_length=4, new_tokens=6)
    assert result["decode_steps"] == 5 and result["new_tokens"] == [6, 6]
    assert result["decode_tokens_per_second"] > 0 and result["time_to_first_token_seconds"] > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("preset", ["gpt2-tiny", "llama-tiny"])
@pytest.mark.parametrize("new_tokens", [1, 2, 3, 24, 40])
def test_compiled_decode_in_cuda_graphs_gives_the_eager_tokens(preset, new_tokens):
    """fp32, prompts of different lengths: the compiled decode step (one CUDA graph replay per token, after
    the 2 warm-up steps) gives the eager tokens; rows stop at end-of-text as eagerly; sampling with a seed
    repeats itself."""
    model = _model(preset).cuda()
    prompts = _prompts([9, 2, 5, 13])
    expected = generate(model, prompts, new_tokens, eos_id=None, compile=False).tokens
    got = generate(model, prompts, new_tokens, eos_id=None, compile=True)
    assert got.tokens == expected and got.decode_steps == new_tokens - 1
    eos = expected[1][min(5, new_tokens - 1)]     # a token that row 1 emits: it stops there
    stop = generate(model, prompts, new_tokens, eos_id=eos, compile=False).tokens
    assert generate(model, prompts, new_tokens, eos_id=eos, compile=True).tokens == stop
    sampling = Sampling(temperature=1.0, top_k=50, seed=3)
    first = generate(model, prompts, new_tokens, sampling, eos_id=None, compile=True).tokens
    assert generate(model, prompts, new_tokens, sampling, eos_id=None, compile=True).tokens == first
    assert all(0 <= t < model.vocab_size for row in first for t in row)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_compiled_decode_with_aligned_logits_gives_the_eager_tokens():
    """fp32, CUDA graphs: the vocabulary product over lm_head padded to 64-aligned ids (the default; its tensors
    marked static for the graph) gives the eager tokens, greedy and sampled as without it, in two calls (the
    cached head)."""
    model = _model("gpt2-tiny").cuda()
    prompts = _prompts([9, 2, 5, 13])
    aligned = dict(fused=False)                         # the default head, on the compiled step
    plain = dict(fused=False, aligned_logits=False)
    expected = generate(model, prompts, 24, eos_id=None, compile=False, **plain).tokens
    for _ in range(2):
        assert generate(model, prompts, 24, eos_id=None, compile=True, **aligned).tokens == expected
    sampling = Sampling(temperature=1.0, top_k=50, seed=3)
    sampled = generate(model, prompts, 24, sampling, eos_id=None, compile=True, **plain)
    assert generate(model, prompts, 24, sampling, eos_id=None, compile=True, **aligned).tokens == sampled.tokens


@pytest.mark.slow
def test_the_compiled_step_serves_more_shapes_than_dynamos_recompile_limit():
    """One graph per (batch, cache length): with fullgraph=True, Dynamo's recompile limit (8 by default) would
    make the next new shape an error, so compiled_decode_one_token raises it. Here the limit starts at 1."""
    import torch._dynamo.config as dynamo_config
    # saved and set back by hand: monkeypatch's undo deletes a config entry on torch 2.13 (a later compile in the
    # same process then fails: "torch._dynamo.config.recompile_limit does not exist")
    saved = {name: getattr(dynamo_config, name) for name in ("recompile_limit", "cache_size_limit")
             if hasattr(dynamo_config, name)}
    try:
        for name in saved:
            setattr(dynamo_config, name, 1)
        model = _model("gpt2-tiny")
        for batch in (1, 2):   # the second shape is already past the limit of 1
            prompts = _prompts([4] * batch, seed=batch)
            assert generate(model, prompts, 4, eos_id=None, compile=True).tokens == \
                generate(model, prompts, 4, eos_id=None, compile=False).tokens
    finally:
        for name, value in saved.items():
            setattr(dynamo_config, name, value)


def test_aligned_lm_head_pads_with_zero_rows_and_is_kept_while_the_weights_stand():
    from fastppl.decode import LOGITS_ALIGN, aligned_lm_head
    model = _model("gpt2-tiny")
    V = model.lm_head.weight.shape[0]
    weight, bias = aligned_lm_head(model)
    assert weight.shape[0] % LOGITS_ALIGN == 0 and 0 < weight.shape[0] - V < LOGITS_ALIGN
    assert torch.equal(weight[:V], model.lm_head.weight) and not weight[V:].any()
    assert bias is None or (torch.equal(bias[:V], model.lm_head.bias) and not bias[V:].any())
    assert aligned_lm_head(model)[0] is weight          # the same tensor again: a CUDA graph keeps its address

    def fresh():   # a new copy, equal to the weights as they are now
        padded = aligned_lm_head(model)[0]
        assert torch.equal(padded[:V], model.lm_head.weight)
        return padded

    with torch.no_grad():
        model.lm_head.weight.mul_(2)                    # in place: the version moves
    weight = fresh()
    model.half().float()                                # new tensors, which could reuse the old addresses
    weight = fresh()
    model.lm_head.weight.data = torch.randn_like(model.lm_head.weight)   # .data replaced: no version change
    assert fresh() is not weight
    with torch.inference_mode():
        frozen = _model("gpt2-tiny")
    assert aligned_lm_head(frozen) is None              # no version counter: the plain product


def test_logits_over_the_aligned_head_are_the_plain_ones():
    from fastppl.decode import _logits, aligned_lm_head
    model = _model("gpt2-tiny")
    hidden = torch.randn(3, 2, model.lm_head.weight.shape[1])
    aligned = _logits(model, hidden, aligned_lm_head(model))
    plain = _logits(model, hidden)
    assert aligned.shape == plain.shape == (3, model.lm_head.weight.shape[0]) and aligned.dtype == torch.float32
    torch.testing.assert_close(aligned, plain, rtol=1e-5, atol=1e-5)
    assert torch.equal(aligned.argmax(-1), plain.argmax(-1))
