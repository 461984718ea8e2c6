"""GPU checks (pytest -m gpu on the H200); skipped where there is no CUDA device.
Tolerances (the fused loss kernel's own tests, at real shapes too, are in test_fused_loss.py):
bf16 scoring vs fp32 scoring of the same model: mean NLL within 0.5 %."""
import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-6), (torch.bfloat16, 1e-3)])
@pytest.mark.parametrize("packed", [False, True])
def test_fused_residual_norms_match_plain_forward(dtype, tolerance, packed):
    """The fused residual forward (products added into the stream by cuBLAS, projection biases added back by the
    LayerNorm kernel) against the model's own forward: hidden states (fp32) and the mean NLL through the same
    loss (both dtypes), on weights whose biases are not zero (GPT-2's initialisation zeroes them)."""
    from fastppl.accel.fused_norm import fuse_residual_norms, unfuse_residual_norms
    from fastppl.engine.loss import chunked_token_nll
    from fastppl.models.loading import random_gpt2
    model = random_gpt2("gpt2", 0, torch.device("cuda"))
    g = torch.Generator(device="cuda").manual_seed(1)
    with torch.no_grad():
        for block in model.blocks:
            for linear in (block.attn.qkv, block.attn.proj, block.mlp.fc, block.mlp.proj):
                linear.bias.normal_(0, 0.05, generator=g)
    model = model.to(dtype).eval()
    ids = torch.randint(0, 50257, (4, 257), device="cuda", generator=g)
    inputs, targets = ids[:, :-1], ids[:, 1:].reshape(-1)
    args = ()
    if packed:
        positions = torch.cat([torch.arange(100), torch.arange(156)]).to("cuda").expand(4, -1)
        documents = torch.cat([torch.zeros(100), torch.ones(156)]).long().to("cuda").expand(4, -1)
        args = (positions, documents)
    with torch.inference_mode():
        plain = model(inputs, *args)
        assert fuse_residual_norms(model)
        fused = model(inputs, *args)
        unfuse_residual_norms(model)
        nll = [chunked_token_nll(h.reshape(-1, h.shape[-1]), model.lm_head.weight, targets).double().mean().item()
               for h in (plain, fused)]
    if dtype == torch.float32:
        assert _rel(fused, plain) <= 1e-5
    assert nll[1] == pytest.approx(nll[0], rel=tolerance)


def test_mlp_epilogue_matches_plain_mlp():
    """The MLP's bias + GELU in cuBLASLt's epilogue (tanh GELU, GPT-2's "gelu_new") against the plain MLP, fp32
    (within 1e-5 relative) and bf16 (within 1e-2, one bf16 rounding of the pre-activation less)."""
    from fastppl.accel.fused_mlp import fuse_mlp_epilogue, unfuse_mlp_epilogue
    from fastppl.models.loading import random_gpt2
    model = random_gpt2("gpt2", 0, torch.device("cuda"))
    g = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(4, 64, 768, device="cuda", generator=g)
    with torch.no_grad():
        for block in model.blocks:
            block.mlp.fc.bias.normal_(0, 0.5, generator=g)
    for dtype, tolerance in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
        mlp = model.to(dtype).blocks[0].mlp
        with torch.inference_mode():
            plain = mlp(x.to(dtype))
            assert fuse_mlp_epilogue(model) == len(model.blocks)
            fused = mlp(x.to(dtype))
            unfuse_mlp_epilogue(model)
            again = mlp(x.to(dtype))
        assert _rel(fused, plain) <= tolerance
        assert torch.equal(again, plain)


def _eval(tmp_path, tokenizer_dir, shakespeare, **overrides):
    from fastppl.config import EvalConfig
    from fastppl.pipeline import evaluate
    options = dict(model="random:gpt2", data=[str(shakespeare)], tokenizer=str(tokenizer_dir), split="val",
                   device="cuda", quiet=True, batch_size=16)
    options.update(overrides)
    return evaluate(EvalConfig(**options))


def test_fast_path_equals_plain_path(tmp_path, tokenizer_dir, shakespeare):
    plain = _eval(tmp_path, tokenizer_dir, shakespeare, dtype="fp32", loss="chunked", compile="off")
    fused = _eval(tmp_path, tokenizer_dir, shakespeare, dtype="fp32", loss="fused", compile="off")
    compiled = _eval(tmp_path, tokenizer_dir, shakespeare, dtype="fp32", loss="fused", compile="on", batch_size=8)
    assert plain["tokens_scored"] == fused["tokens_scored"] == 36059
    assert fused["nll_sum"] == pytest.approx(plain["nll_sum"], rel=1e-6)
    assert compiled["nll_sum"] == pytest.approx(plain["nll_sum"], rel=1e-6)


def test_auto_batch_size_matches_fixed(tmp_path, tokenizer_dir, shakespeare):
    fixed = _eval(tmp_path, tokenizer_dir, shakespeare, dtype="bf16")
    auto = _eval(tmp_path, tokenizer_dir, shakespeare, dtype="bf16", batch_size="auto")
    assert auto["batch_size"] >= 8
    assert auto["nll_sum"] == pytest.approx(fixed["nll_sum"], rel=1e-5)


@pytest.fixture(scope="module")
def trained_300_steps(tmp_path_factory, tokenizer_dir, shakespeare):
    """The tiny GPT-2 of tests/fixtures/train_tiny.py after 300 steps (val NLL about 5.9 nats): a model whose
    predictions are sharp enough that bf16 rounding shows, unlike a near-uniform random one."""
    from fixtures.train_tiny import train_tiny
    return train_tiny(tmp_path_factory.mktemp("tiny-300"), steps=300, seed=0,
                                 data=shakespeare, tokenizer=tokenizer_dir)


@pytest.mark.parametrize("loss", ["fused", "chunked"])
def test_bf16_within_half_a_percent_of_fp32_on_a_trained_model(trained_300_steps, shakespeare, loss):
    from fastppl.config import EvalConfig
    from fastppl.pipeline import evaluate
    base = dict(model=str(trained_300_steps), data=[str(shakespeare)], split="val", device="cuda", quiet=True,
                loss=loss)
    fp32 = evaluate(EvalConfig(**base, dtype="fp32"))
    bf16 = evaluate(EvalConfig(**base, dtype="bf16"))
    assert fp32["nll"] < 7.0, "the fixture model is not trained"
    assert bf16["tokens_scored"] == fp32["tokens_scored"] == 36059
    print(f"{loss}: fp32 nll {fp32['nll']:.6f}  bf16 {bf16['nll']:.6f}  rel {bf16['nll'] / fp32['nll'] - 1:+.2e}")
    assert abs(bf16["nll"] / fp32["nll"] - 1) <= 5e-3



def test_fused_scorer_on_the_scored_rows_only_is_bit_for_bit_the_full_one():
    """The fused kernel computes each row alone, so gathering the scored rows before the loss changes no
    bit of any scored position's NLL (engine.score: what lets it run only for the fused loss)."""
    from fastppl.engine.score import make_score_fn
    from fastppl.models.loading import random_gpt2
    model = random_gpt2("gpt2", 0, torch.device("cuda")).to(torch.bfloat16).eval()
    score = make_score_fn(model, loss="fused")
    g = torch.Generator(device="cuda").manual_seed(3)
    ids = torch.randint(0, 50257, (6, 257), device="cuda", generator=g)
    inputs, targets = ids[:, :-1], ids[:, 1:]
    mask = torch.zeros_like(inputs, dtype=torch.bool)
    mask[:, 128:] = True          # a sliding window's new half
    mask[5] = False               # a padding row
    rows = mask.reshape(-1).nonzero().squeeze(1)
    rows = torch.cat([rows, rows[-1:].expand(37)])   # the last row repeated, as scored_rows_of pads it
    with torch.inference_mode():
        full = score(inputs, targets, mask)
        gathered = score(inputs, targets, mask, scored_rows=rows)
    assert torch.equal(full, gathered)
    assert full[mask].gt(0).all() and gathered[~mask].eq(0).all()


@pytest.mark.parametrize("preset", ["gpt2", "llama-1b"])
@pytest.mark.parametrize("loss", ["fused", "chunked"])
def test_memory_bound_covers_a_measured_scoring_batch(preset, loss):
    """--batch-size auto skips its probe where scoring_memory_bound says the batch fits: the bound must be
    above what a batch really adds, with room (it doubles its count; half of it must still cover)."""
    from fastppl.accel.batch_size import BOUND_SAFETY, scoring_memory_bound
    from fastppl.engine.score import make_score_fn
    from fastppl.models.loading import random_native
    device, seq_len = torch.device("cuda"), 1024
    model = random_native(preset, 0, device).to(torch.bfloat16).eval()
    score = make_score_fn(model, 8192, loss)
    bound = scoring_memory_bound(model, seq_len, 2, loss, 8192)
    for rows in (4, 16):
        ids = torch.randint(0, 1000, (rows, seq_len), device=device)
        mask = torch.ones(rows, seq_len, dtype=torch.bool, device=device)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        with torch.inference_mode():
            score(ids, ids, mask)
        torch.cuda.synchronize()
        added = torch.cuda.max_memory_allocated() - base
        print(f"{preset} {loss} {rows} rows: added {added / 2**20:.0f} MiB, bound {bound.total(rows) / 2**20:.0f} MiB")
        assert added <= bound.total(rows) / BOUND_SAFETY


def test_every_one_pass_cublaslt_candidate_gives_torchs_result():
    """accel.cublaslt: every candidate the tuner may pick, for GPT-2's four product kinds at 4,096 rows (bias +
    GELU, bias, and the two added into the residual stream), against torch's own call, bit for bit."""
    from fastppl.accel import cublaslt as lt
    g = torch.Generator(device="cuda").manual_seed(0)
    M, C = 4096, 768
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    x, h, stream = (torch.randn(M, n, generator=g, **bf16) for n in (C, 4 * C, C))
    w_up, w_qkv = torch.randn(4 * C, C, generator=g, **bf16) * 0.02, torch.randn(3 * C, C, generator=g, **bf16) * 0.02
    w_proj, w_down = torch.randn(C, C, generator=g, **bf16) * 0.02, torch.randn(C, 4 * C, generator=g, **bf16) * 0.02
    b_up, b_qkv = torch.randn(4 * C, generator=g, **bf16), torch.randn(3 * C, generator=g, **bf16)
    cases = [
        ((4 * C, C, lt.EPILOGUE_GELU_BIAS, 0.0),
         torch._addmm_activation(b_up, x, w_up.t(), use_gelu=True), lambda p, i: p.run(x, w_up, b_up, index=i)),
        ((3 * C, C, lt.EPILOGUE_BIAS, 0.0),
         torch.nn.functional.linear(x, w_qkv, b_qkv), lambda p, i: p.run(x, w_qkv, b_qkv, index=i)),
        ((C, C, lt.EPILOGUE_DEFAULT, 1.0),
         stream.clone().addmm_(x, w_proj.t()), lambda p, i: p.run(x, w_proj, out=stream.clone(), index=i)),
        ((C, 4 * C, lt.EPILOGUE_DEFAULT, 1.0),
         stream.clone().addmm_(h, w_down.t()), lambda p, i: p.run(h, w_down, out=stream.clone(), index=i)),
    ]
    for (n_out, n_in, epilogue, beta), expected, run in cases:
        candidates = 0
        for limit in lt.WORKSPACE_LIMITS:   # the tuner's heuristic queries
            plan = lt.LinearPlan(M, n_out, n_in, torch.bfloat16, epilogue, beta, workspace_limit=limit)
            for i in plan.one_pass_candidates():
                assert torch.equal(run(plan, i), expected), (epilogue, beta, limit, i, plan.describe(i))
                candidates += 1
        assert candidates


def test_tuned_products_score_as_torchs_and_stored_picks_are_reused(tmp_path):
    """The dense scorer as eval runs it on CUDA, with every linear through the tuner: the same NLL bit for bit as
    torch's picks; a second tuner on the same store reuses all four picks and times nothing."""
    from fastppl.accel import linear as linear_module
    from fastppl.accel.fused_mlp import fuse_mlp_epilogue
    from fastppl.accel.fused_norm import fuse_residual_norms
    from fastppl.engine.score import make_score_fn
    from fastppl.models.loading import random_gpt2
    model = random_gpt2("gpt2", 0, torch.device("cuda")).to(torch.bfloat16).eval()
    fuse_mlp_epilogue(model)
    fuse_residual_norms(model)
    score = make_score_fn(model, loss="fused")
    ids = torch.randint(0, 50257, (4, 1025), device="cuda", generator=torch.Generator(device="cuda").manual_seed(2))
    batch = (ids[:, :-1].contiguous(), ids[:, 1:].contiguous(), torch.ones(4, 1024, dtype=torch.bool, device="cuda"))
    store = tmp_path / "picks.json"
    linear_module.route_linears(model)
    try:
        with torch.inference_mode():
            plain = score(*batch)
            first = linear_module.start_tuning(store)
            tuned = score(*batch)
            assert first.tuned == 4 and first.reused == 0 and torch.equal(tuned, plain), first.summary()
            second = linear_module.start_tuning(store, timing_allowed=False)
            again = score(*batch)
            assert second.tuned == 0 and second.reused == 4 and torch.equal(again, plain), second.summary()
            assert [p.chosen for p in second.plans.values()] == [p.chosen for p in first.plans.values()]
            # whichever candidate was fastest here, every one the tuner may keep scores the same
            for plan in second.plans.values():
                plan.chosen = plan.one_pass_candidates()[-1]
            assert torch.equal(score(*batch), plain)
    finally:
        linear_module.stop_tuning()
        linear_module.unroute_linears(model)


def test_error_bars_on_cuda_equal_a_direct_computation(tmp_path, tokenizer_dir, shakespeare):
    """The standard error from the device's sums of squares (bf16 weights, fused loss, packed documents) equals
    numpy's on the per-token NLL the run wrote; the bootstrap of one document's windows sums to the run."""
    import json
    import math

    import numpy as np

    from fastppl import EvalConfig, evaluate
    tokenizer, text = str(tokenizer_dir), shakespeare.read_text()
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": text[i * 2000:(i + 1) * 2000]}) + "\n" for i in range(40)))
    single = tmp_path / "one.txt"
    single.write_text(text[:200_000])
    for data in (docs, single):
        result = evaluate(EvalConfig(model="random:gpt2", tokenizer=tokenizer, data=[str(data)], ctx=1024,
                                     quiet=True, per_token="(returned)", bootstrap=200))
        scored = result.per_token[~np.isnan(result.per_token)].astype(np.float64)
        assert result["nll_stderr"] == pytest.approx(scored.std(ddof=1) / math.sqrt(len(scored)), rel=1e-6)
        units = result["bootstrap"]["resampled"]
        assert sum(units["tokens"]) == result["tokens_scored"]
        assert math.fsum(units["nll_sum"]) == pytest.approx(result["nll_sum"], rel=1e-9)
