"""accel.cublaslt on the CPU: `linear` with no tuner is torch's own call, routing linears changes no result, the
--tune-products policy, the picks store. The candidates themselves (bit for bit against torch's pick, the tuned
scorer against the plain one, a stored pick reused) are checked on CUDA in test_gpu.py."""
import json

import pytest
import torch
import torch.nn.functional as F

from fastppl.accel import cublaslt
from fastppl.accel import linear as linear_module
from fastppl.cli import main


def test_linear_without_a_tuner_is_torchs_call():
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(16, 8, generator=g), torch.randn(12, 8, generator=g), torch.randn(12, generator=g)
    assert torch.equal(linear_module.linear(x, w, b), F.linear(x, w, b))
    assert torch.equal(linear_module.linear(x, w), F.linear(x, w))
    assert torch.allclose(linear_module.linear(x, w, b, gelu=True), F.gelu(F.linear(x, w, b), approximate="tanh"),
                          atol=1e-6)
    assert torch.allclose(linear_module.linear(x, w, gelu=True), F.gelu(x @ w.t(), approximate="tanh"), atol=1e-6)
    stream = torch.randn(16, 12, generator=g)
    expected = stream + x @ w.t()
    out = linear_module.linear(x, w, accumulate_into=stream)
    assert out is stream and torch.allclose(stream, expected, atol=1e-5)


def test_routing_linears_changes_no_result():
    from fastppl.models.loading import random_native
    model = random_native("llama-tiny", 0, torch.device("cpu")).eval()
    ids = torch.randint(0, model.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        plain = model(ids)
        routed = linear_module.route_linears(model)
        assert routed == sum(type(m) is torch.nn.Linear for m in model.modules()) > 0
        assert torch.equal(model(ids), plain)
        linear_module.unroute_linears(model)
    assert not any("forward" in m.__dict__ for m in model.modules() if type(m) is torch.nn.Linear)


def test_tuning_policy():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert cublaslt.use_tuning("off", cuda, torch.bfloat16, False).mode == "off"
    assert cublaslt.use_tuning("on", cpu, torch.float32, False).mode == "off"
    assert cublaslt.use_tuning("on", cuda, torch.float32, False).mode == "off"     # fp32: torch's picks
    assert cublaslt.use_tuning("on", cuda, torch.bfloat16, True).mode == "off"     # Inductor's products
    for dtype in (torch.bfloat16, torch.float16):
        on = cublaslt.use_tuning("on", cuda, dtype, False)
        assert (on.mode, on.reason) == ("time", "on (--tune-products on)")


def test_tuning_is_opt_in():
    """Off unless asked for: a default run never times candidates nor reads stored picks."""
    from fastppl import EvalConfig
    from fastppl.cli import build_parser
    assert EvalConfig(model="m", data=["d"]).tune_products == "off"
    assert build_parser().parse_args(["eval", "--model", "m", "--data", "d"]).tune_products == "off"
    assert build_parser().parse_args(["bench"]).tune_products == "off"


class _FakePlan:
    """LinearPlan's interface without cuBLASLt: candidates 0-2, described by their index."""
    def __init__(self, *key, workspace_limit=cublaslt.WORKSPACE_BYTES):
        self.key, self.workspace_limit, self.chosen = key, workspace_limit, 0

    def one_pass_candidates(self):
        return [0, 1, 2]

    def describe(self, index):
        return {"tile": index}


def _tuner(monkeypatch, store, **kwargs):
    monkeypatch.setattr(cublaslt, "LinearPlan", _FakePlan)
    monkeypatch.setattr(cublaslt.ProductTuner, "_name", lambda self, key: "shape")
    return cublaslt.ProductTuner(store, **kwargs)


def _product(results=None, fail=None):
    """A product whose candidate i gives results[i] (torch's result is 0) and takes 3 - i ms."""
    results = results or [0, 0, 0]

    def candidate(plan, i):
        if fail is not None:
            raise fail
        return torch.tensor([results[i]])

    return cublaslt.Product((65536, 8, 8, torch.bfloat16, cublaslt.EPILOGUE_DEFAULT, 0.0),
                            lambda: torch.tensor([0]), candidate, candidate)


def test_tuner_keeps_the_fastest_candidate_that_gives_torchs_result(monkeypatch, tmp_path):
    store = tmp_path / "picks.json"
    monkeypatch.setattr(cublaslt, "time_candidates", lambda trial, indices: {k: 3.0 - k for k in indices})
    tuner = _tuner(monkeypatch, store)
    plan = tuner.plan(_product(results=[0, 0, 1]))   # candidate 2 is fastest but differs from torch's result
    assert plan.chosen == 1 and tuner.tuned == 1 and tuner.dropped == 1
    assert cublaslt.read_picks(store)["shape"]["index"] == 1
    assert "1 candidates left out" in tuner.summary()
    reused = _tuner(monkeypatch, store, timing_allowed=False).plan(_product(results=[0, 0, 1]))
    assert reused.chosen == 1
    # a stored pick that no longer gives torch's result is not taken
    assert _tuner(monkeypatch, store, timing_allowed=False).plan(_product(results=[0, 1, 1])) is None


@pytest.mark.parametrize("entry", [{"index": 1.0, "workspace_limit": cublaslt.WORKSPACE_BYTES, "config": {"tile": 1}},
                                   {"index": "1", "workspace_limit": cublaslt.WORKSPACE_BYTES, "config": {"tile": 1}},
                                   {"index": 1, "workspace_limit": 1.5, "config": {"tile": 1}},
                                   {"index": 1, "config": {"tile": 1}},
                                   {"index": 1, "workspace_limit": cublaslt.WORKSPACE_BYTES, "config": {"tile": 2}},
                                   {"index": 7, "workspace_limit": cublaslt.WORKSPACE_BYTES, "config": {"tile": 7}},
                                   [1, 2], "text"])
def test_damaged_stored_picks_are_not_taken(monkeypatch, tmp_path, entry):
    store = tmp_path / "picks.json"
    store.write_text(json.dumps({"shape": entry}))
    tuner = _tuner(monkeypatch, store, timing_allowed=False)
    assert tuner.plan(_product()) is None and tuner.failure is None


def test_tuner_falls_back_to_torch_on_a_cublaslt_error_and_for_one_shape_on_out_of_memory(monkeypatch, tmp_path):
    tuner = _tuner(monkeypatch, tmp_path / "picks.json")
    assert tuner.plan(_product(fail=RuntimeError("cuBLAS status 7"))) is None
    assert "cuBLAS status 7" in tuner.failure and "failed" in tuner.summary()
    # the candidates' extra outputs not fitting costs that shape its tuning, not the run its batch size
    tuner = _tuner(monkeypatch, tmp_path / "picks.json")
    assert tuner.plan(_product(fail=torch.OutOfMemoryError("out of memory"))) is None
    assert tuner.failure is None and "1 shapes left to torch: checking candidates ran out of memory" in tuner.summary()


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


def test_one_pass_candidates_leave_out_split_k_and_its_reductions():
    """Split-K sums a dot product in pieces, in another order than torch's one-pass kernel: never considered."""
    plan = cublaslt.LinearPlan.__new__(cublaslt.LinearPlan)   # no cuBLASLt: only the filter is under test
    configs = [{"split_k": 1, "reduction": 0}, {"split_k": 4, "reduction": 1}, {}, {"split_k": 1, "reduction": 2},
               {"split_k": 2, "reduction": 0}]
    plan.candidates = [object()] * len(configs)
    plan.describe = lambda index: configs[index]
    assert plan.one_pass_candidates() == [0, 2]
