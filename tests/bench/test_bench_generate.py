"""fastppl bench --generate (fastppl against transformers generate) and bench on Llama models, on the CPU."""
import json

import pytest
import torch

from fastppl.bench.dense import flops_per_token
from fastppl.bench.generate import time_generation, token_agreement
from fastppl.cli import main
from fastppl.models.gpt2 import PRESETS as GPT2_PRESETS
from fastppl.models.llama import PRESETS as LLAMA_PRESETS
from fastppl.models.loading import native_to_hf, random_native


@pytest.mark.slow
def test_bench_generate_cli(tmp_path, capsys):
    out = tmp_path / "gen.json"
    rc = main(["bench", "--generate", "--model", "random:gpt2-tiny", "--batch-sizes", "1,2", "--new-tokens", "8",
               "--prompt-tokens", "5", "--device", "cpu", "--json", str(out), "--quiet"])
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["benchmark"] == "generate" and report["dtype"] == "float32" and report["new_tokens"] == 8
    assert [(r["batch_size"], r["name"]) for r in report["rows"]] == [
        (b, name) for b in (1, 2) for name in ("fastppl", "hf-static", "hf-dynamic")]
    for row in report["rows"]:
        assert row["decode_tokens_per_second"] > 0 and row["time_to_first_token_seconds"] > 0
        assert row["compiled"] is False                       # nothing compiles on the CPU
        assert "tokens" not in row
        assert ("distinct_new_tokens" in row) == (row["name"] == "fastppl")
        if row["name"] != "fastppl":                          # fp32: greedy tokens equal fastppl's
            assert row["equal_token_fraction"] == 1.0 and row["equal_prefix_fraction"] == 1.0
    assert [r["batch_size"] for r in report["ratios"]] == [1, 2]
    assert all(r["fastppl_over_hf_static"] > 0 and r["fastppl_over_hf_dynamic"] > 0 for r in report["ratios"])
    assert report["targets"] == []                            # judged on CUDA with random:gpt2 only
    table = capsys.readouterr().out
    assert "fastppl / hf-static" in table and "hf-dynamic" in table


@pytest.mark.parametrize("preset", ["gpt2-tiny", pytest.param("llama-tiny", marks=pytest.mark.slow)])
def test_bench_generate_tokens_equal_transformers_in_fp32(preset):
    model = random_native(preset).eval()
    generator = torch.Generator().manual_seed(0)   # not the global RNG: the weights must not depend on test order
    with torch.no_grad():   # sharper than the 0.02 init, so that greedy text varies instead of repeating one id
        for name, p in model.named_parameters():
            if "norm" not in name and "ln" not in name:
                p.normal_(0.0, 0.1, generator=generator)
    hf = native_to_hf(model).eval()
    hf.generation_config.eos_token_id = None
    prompts = torch.randint(0, 50257, (3, 6), generator=torch.Generator().manual_seed(0))
    rows = time_generation(model, hf, prompts, 12, ["fastppl", "hf-static", "hf-dynamic"], repeats=1)
    fastppl_tokens = rows[0]["tokens"]
    assert len(set(sum(fastppl_tokens, []))) > 6               # a real test: not one id repeated
    assert [len(t) for t in fastppl_tokens] == [12] * 3
    for row in rows[1:]:
        assert row["tokens"] == fastppl_tokens, row["name"]
        assert row["equal_prefix_fraction"] == 1.0


def test_token_agreement():
    assert token_agreement([[1, 2, 3, 4]], [[1, 2, 3, 4]]) == (1.0, 1.0)
    assert token_agreement([[1, 2, 3, 4], [5, 6, 7, 8]], [[1, 9, 3, 4], [5, 6, 7, 8]]) == (7 / 8, (1 / 4 + 1) / 2)


def test_bench_generate_user_errors(capsys):
    assert main(["bench", "--generate", "--model", "random:gpt2-tiny", "--batch-size", "4", "--device", "cpu"]) == 2
    assert "--batch-sizes" in capsys.readouterr().err
    assert main(["bench", "--generate", "--model", "random:gpt2-tiny", "--peers", "hf-bf16", "--device", "cpu"]) == 2
    assert "unknown --peers" in capsys.readouterr().err
    assert main(["bench", "--generate", "--model", "random:gpt2-tiny", "--prompt-tokens", "200", "--new-tokens", "100",
                 "--device", "cpu"]) == 2
    assert "positions" in capsys.readouterr().err


@pytest.mark.slow
def test_bench_llama_peers_agree(tmp_path, sharpened_random_models):
    """Both rows' NLL against a direct fp32 computation with transformers on the bench's own rows (CPU: fp32):
    fastppl's over all T targets of each row, the labels= peer's over the T - 1 it scores."""
    import numpy as np
    from hf_reference import hf_reference_nll
    out = tmp_path / "bench.json"
    rc = main(["bench", "--model", "random:llama-tiny", "--peers", "hf-bf16,fastppl", "--tokens", "512", "--seq", "32",
               "--device", "cpu", "--json", str(out), "--quiet"])
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["batch_size"] == 8                           # Llama's default
    assert [r["name"] for r in report["rows"]] == ["hf-bf16", "fastppl"]
    assert report["rows"][0]["note"].startswith("fp32 weights on the CPU (bf16 on CUDA only), SDPA, batch 8")
    hf_nll, fastppl_nll = (r["nll"] for r in report["rows"])
    model = sharpened_random_models("llama-tiny")
    rows = np.random.default_rng(0).integers(0, model.vocab_size, size=(16, 33), dtype=np.int64)   # the bench's
    nll = hf_reference_nll(model, torch.from_numpy(rows))
    assert nll.std().item() > 0.3                              # far from uniform predictions
    assert fastppl_nll == pytest.approx(nll.mean().item(), rel=1e-5)
    assert hf_nll == pytest.approx(nll[:, :31].mean().item(), rel=1e-5)
    assert report["flops_per_token"] == flops_per_token(LLAMA_PRESETS["llama-tiny"], 32)


def test_flops_per_token_by_hand():
    # GPT-2 124M at T 1024: 266.0 MFLOP a token
    assert flops_per_token(GPT2_PRESETS["gpt2"], 1024) / 1e6 == pytest.approx(266.0, abs=0.05)
    # Llama-3.2-1B shape at T 2048: per layer qkv 2048 x (2048 + 2 x 512), o 2048 x 2048, SwiGLU 3 x 2048 x 8192;
    # head 2048 x 128,256; attention 2 x 16 x 2048 x 2049
    per_layer = 2048 * 3072 + 2048 * 2048 + 3 * 2048 * 8192
    expected = 2 * (16 * per_layer + 2048 * 128256) + 2 * 16 * 2048 * 2049
    assert flops_per_token(LLAMA_PRESETS["llama-1b"], 2048) == expected
    assert expected / 1e9 == pytest.approx(2.606, abs=0.001)   # x 184 k tok/s = 72 % of 661 TFLOP/s


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_bench_generate_on_cuda(dtype):
    """The compiled paths: fastppl's CUDA-graph decode step and transformers' compiled static cache."""
    from fastppl.bench.generate import run_bench_generate
    report = run_bench_generate("random:gpt2-tiny", [2], new_tokens=16, prompt_tokens=8, device_name="cuda",
                                repeats=1, dtype_name=dtype, log=lambda line: None)
    rows = {r["name"]: r for r in report["rows"]}
    assert rows["fastppl"]["compiled"] and rows["hf-static"]["compiled"] and not rows["hf-dynamic"]["compiled"]
    assert all(r["decode_tokens_per_second"] > 0 and r["working_memory_bytes"] >= 0 for r in rows.values())
    # fp32 on the GPU: kernels differ from transformers' (not bit-equal as on the CPU), near-ties are rare
    minimum = 0.9 if dtype == "fp32" else 0.0
    assert rows["hf-static"]["equal_prefix_fraction"] >= minimum
    assert rows["hf-dynamic"]["equal_prefix_fraction"] >= minimum
