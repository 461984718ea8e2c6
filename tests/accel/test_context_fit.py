"""A --ctx past the model's maximum, and one whose single row runs out of GPU memory: one line each, the second naming
the largest --ctx that fits by the memory bound (the free-memory query and the GPU are stood in for on the CPU)."""
import pytest
import torch

from fastppl.accel import batch_size, context_fit
from fastppl.accel.context_fit import HEADROOM, ctx_error, explaining_ctx, largest_ctx_within
from fastppl.cli import main
from fastppl.config import EvalConfig
from fastppl.errors import FastpplError
from fastppl.models.gpt2 import GPT2
from fastppl.models.loading import random_native

GPU = torch.device("cuda")


def _bound(model, ctx, dtype=torch.bfloat16, chunk_rows=1024):
    return batch_size.scoring_memory_bound(model, ctx, dtype.itemsize, "chunked", chunk_rows).total(1)


@pytest.fixture(scope="module")
def llama():
    return random_native("llama-tiny")


def test_the_largest_ctx_within_a_budget_is_the_last_whose_bound_fits(llama):
    for budget in (_bound(llama, 1) - 1, _bound(llama, 1), _bound(llama, 300) + 1, _bound(llama, 511)):
        expected = max((c for c in range(1, 512) if _bound(llama, c) <= budget), default=0)
        assert largest_ctx_within(llama, budget, 2, "chunked", 1024, upto=511) == expected
    assert largest_ctx_within(torch.nn.Linear(2, 2), 1e12, 2, "chunked", 1024, upto=511) is None   # no bound


def test_a_ctx_that_does_not_fit_names_the_largest_that_does(llama, monkeypatch):
    free = _bound(llama, 300) / HEADROOM
    monkeypatch.setattr(batch_size, "_free_bytes", lambda device: free)
    error = ctx_error(llama, 512, GPU, torch.bfloat16, "chunked", 1024)
    assert str(error) == (f"--ctx 512 does not fit in GPU memory at batch size 1 ({free / 2**30:.1f} GiB free beside "
                          "the model); the largest --ctx that fits by fastppl's memory bound is 300 (an upper bound on "
                          "memory: a little more may fit); lower --ctx")
    assert ctx_error(llama, 300, GPU, torch.bfloat16, "chunked", 1024) is None   # the bound fits: not this cause
    monkeypatch.setattr(batch_size, "_free_bytes", lambda device: 1.0)
    assert "nor does any --ctx" in str(ctx_error(llama, 512, GPU, torch.bfloat16, "chunked", 1024))


def test_only_out_of_memory_on_a_gpu_becomes_the_ctx_error(llama, monkeypatch):
    monkeypatch.setattr(batch_size, "_free_bytes", lambda device: _bound(llama, 100) / HEADROOM)

    def out_of_memory():
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    arguments = dict(model=llama, ctx=512, dtype=torch.bfloat16, loss="chunked", chunk_rows=1024)
    with pytest.raises(FastpplError, match="largest --ctx that fits by fastppl's memory bound is 100"):
        explaining_ctx(out_of_memory, device=GPU, **arguments)
    with pytest.raises(torch.OutOfMemoryError):   # the CPU's out of memory is no GPU's
        explaining_ctx(out_of_memory, device=torch.device("cpu"), **arguments)
    with pytest.raises(torch.OutOfMemoryError):   # no model's bound (a reference model beside it): the original
        explaining_ctx(out_of_memory, device=GPU, **{**arguments, "model": None})
    with pytest.raises(ValueError):
        explaining_ctx(lambda: (_ for _ in ()).throw(ValueError("other")), device=GPU, **arguments)
    assert explaining_ctx(lambda: 7, device=GPU, **arguments) == 7


@pytest.fixture
def text(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("To be, or not to be, that is the question.\n" * 40)
    return path


def _eval(tokenizer_dir, text, tmp_path, model, ctx):
    return main(["eval", "--model", model, "--tokenizer", str(tokenizer_dir), "--data", str(text), "--ctx", str(ctx),
                 "--device", "cpu", "--quiet", "--json", str(tmp_path / "r.json")])


def test_a_ctx_past_the_models_maximum_is_one_line(tmp_path, tokenizer_dir, text, capsys):
    assert _eval(tokenizer_dir, text, tmp_path, "random:llama-tiny", 513) == 2
    err = capsys.readouterr().err
    assert err == "fastppl: error: --ctx 513 exceeds the model's maximum of 512 positions; lower --ctx\n"
    assert not (tmp_path / "r.json").exists()


def test_eval_whose_one_row_runs_out_of_memory_names_the_ctx_that_fits(tmp_path, tokenizer_dir, text, capsys,
                                                                       monkeypatch):
    """Every forward out of memory, on a stand-in GPU with room for a bound of 96 positions: the batches are split
    down to one row, which fails too, and the run ends with the ctx error and no report."""
    model = random_native("gpt2-tiny")
    monkeypatch.setattr(context_fit, "on_gpu", lambda device: True)
    free = _bound(model, 96, torch.float32, EvalConfig.loss_chunk_rows) / HEADROOM   # the CPU's chunked loss
    monkeypatch.setattr(batch_size, "_free_bytes", lambda device: free)

    def out_of_memory(self, *args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    monkeypatch.setattr(GPT2, "forward", out_of_memory)
    assert _eval(tokenizer_dir, text, tmp_path, "random:gpt2-tiny", 256) == 2
    err = capsys.readouterr().err
    assert err.startswith("fastppl: error: --ctx 256 does not fit in GPU memory at batch size 1") and \
        "the largest --ctx that fits by fastppl's memory bound is 96 " in err and err.count("\n") == 1
    assert not (tmp_path / "r.json").exists()
