"""accel.cublaslt on the CPU: `linear` with no tuner is torch's own call, routing linears changes no result, the
--tune-products policy, the picks store. The candidates themselves (bit for bit against torch's pick, the tuned
scorer against the plain one, a stored pick reused) are checked on CUDA in test_gpu.py."""
import json

import pytest
import torch
import torch.nn.functional as F

from fastppl.accel import cublaslt
from fastppl.cli import main


def test_linear_without_a_tuner_is_torchs_call():
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(16, 8, generator=g), torch.randn(12, 8, generator=g), torch.randn(12, generator=g)
    assert torch.equal(cublaslt.linear(x, w, b), F.linear(x, w, b))
    assert torch.equal(cublaslt.linear(x, w), F.linear(x, w))
    assert torch.allclose(cublaslt.linear(x, w, b, gelu=True), F.gelu(F.linear(x, w, b), approximate="tanh"),
                          atol=1e-6)
    assert torch.allclose(cublaslt.linear(x, w, gelu=True), F.gelu(x @ w.t(), approximate="tanh"), atol=1e-6)
    stream = torch.randn(16, 12, generator=g)
    expected = stream + x @ w.t()
    out = cublaslt.linear(x, w, accumulate_into=stream)
    assert out is stream and torch.allclose(stream, expected, atol=1e-5)


def test_routing_linears_changes_no_result():
    from fastppl.models.loading import random_native
    model = random_native("llama-tiny", 0, torch.device("cpu")).eval()
    ids = torch.randint(0, model.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        plain = model(ids)
        routed = cublaslt.route_linears(model)
        assert routed == sum(type(m) is torch.nn.Linear for m in model.modules()) > 0
        assert torch.equal(model(ids), plain)
        cublaslt.unroute_linears(model)
    assert not any("forward" in m.__dict__ for m in model.modules() if type(m) is torch.nn.Linear)


def test_tuning_policy():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert cublaslt.use_tuning("off", cuda, torch.bfloat16, 10**9, False)[0] == "off"
    assert cublaslt.use_tuning("on", cpu, torch.float32, 10**9, False)[0] == "off"
    assert cublaslt.use_tuning("on", cuda, torch.float32, 10**9, False)[0] == "off"     # fp32: torch's picks
    assert cublaslt.use_tuning("on", cuda, torch.bfloat16, 10**9, True)[0] == "off"     # Inductor's products
    assert cublaslt.use_tuning("on", cuda, torch.bfloat16, 1, False) == ("time", "on (--tune-products on)")
    assert cublaslt.use_tuning("auto", cuda, torch.float16, cublaslt.TUNE_MIN_TOKENS, False) == ("time", "on (auto)")
    mode, why = cublaslt.use_tuning("auto", cuda, torch.bfloat16, 1000, False)
    assert mode == "off" and "no picks are stored" in why          # conftest: an empty cache directory
    cublaslt.write_picks(cublaslt.picks_store(), {"some GPU|cublasLt 1|shape": {"index": 1, "config": {}}})
    mode, why = cublaslt.use_tuning("auto", cuda, torch.bfloat16, 1000, False)
    assert mode == "stored" and "too few" in why


def test_picks_store_merges_and_survives_damage(tmp_path):
    store = tmp_path / "deep" / "picks.json"
    assert cublaslt.read_picks(store) == {}
    cublaslt.write_picks(store, {"a": {"index": 1}})
    cublaslt.write_picks(store, {"b": {"index": 2}})
    assert cublaslt.read_picks(store) == {"a": {"index": 1}, "b": {"index": 2}}
    assert [p.name for p in store.parent.iterdir()] == ["picks.json"]   # no partial file left behind
    for damage in ("{not json", "[1, 2]", ""):
        store.write_text(damage)
        assert cublaslt.read_picks(store) == {}
    store.write_text("{not json")
    cublaslt.write_picks(store, {"c": {"index": 0}})                 # a damaged store is replaced
    assert json.loads(store.read_text()) == {"c": {"index": 0}}
    tuner = cublaslt.ProductTuner(store, timing_allowed=False)
    assert tuner.summary() == "torch's cuBLAS picks (no product shape was tuned)"


def test_eval_reports_whose_products_ran(tmp_path, tokenizer_dir):
    text = tmp_path / "t.txt"
    text.write_text("Now is the winter of our discontent made glorious summer by this sun of York. " * 8)
    out = tmp_path / "r.json"
    assert main(["eval", "--model", "random:gpt2-tiny", "--data", str(text), "--tokenizer", str(tokenizer_dir),
                 "--ctx", "64", "--device", "cpu", "--quiet", "--tune-products", "on", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["products"] == "torch's picks (tuning is for 16-bit products on CUDA)"


def test_bench_docs_refuses_tune_products(capsys):
    assert main(["bench", "--corpus", "docs", "--tune-products", "on"]) == 2
    assert "--tune-products" in capsys.readouterr().err
