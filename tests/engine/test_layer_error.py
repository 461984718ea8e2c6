"""--layer-error against a brute force: for every scored token, both models run in float64 over exactly the tokens
its window reads, each block's output at that token caught by a hook, and for each block i a hybrid model built
by hand (the reference's embeddings and blocks through i, the model's blocks after, its final norm and output
projection) run whole, its full float64 softmax compared with the reference's. fastppl's fp32 table equals it
within 1e-5; a model against itself has no error; the layer-error run leaves the run's own figures bit for bit as
they were, whatever the waves; the refusals are one line."""
import copy
import json
import re

import pytest
import torch
import torch.nn as nn
from transformers import AutoTokenizer

from fastppl.cli import main
from fastppl.config import EvalConfig, memory_size
from fastppl.errors import FastpplError
from fastppl.pipeline import evaluate
from fixtures.window_references import lm_eval_rolling_pairs

TEXT_CHARS, CTX, BOS = 400, 16, 50256
ERRORS = ("relative_l2_mean", "relative_l2_max", "cosine_mean", "cosine_min", "kld_with_reference_through_layer")


pytestmark = pytest.mark.usefixtures("one_thread")   # many tiny products: one thread is fastest


@pytest.fixture(scope="module")
def text_path(tmp_path_factory, shakespeare):
    path = tmp_path_factory.mktemp("layer_error") / "slice.txt"
    path.write_text(shakespeare.read_text()[:TEXT_CHARS])
    return path


def _evaluate(tokenizer_dir, text_path, preset, reference_seed=1, **settings) -> dict:
    settings = dict(device="cpu", dtype="fp32", quiet=True, ctx=CTX, batch_size=3) | settings
    return evaluate(EvalConfig(model=f"random:{preset}", reference_model=f"random:{preset}",
                               reference_seed=reference_seed, data=[str(text_path)], tokenizer=str(tokenizer_dir),
                               **settings))


def _hybrid(model: nn.Module, reference: nn.Module, layer: int) -> nn.Module:
    """The reference with its blocks after `layer`, its final norm and output projection swapped for the model's."""
    hybrid = copy.deepcopy(reference)
    hybrid.blocks = nn.ModuleList([*reference.blocks[:layer + 1], *model.blocks[layer + 1:]])
    for name in ("ln_f", "norm", "lm_head"):
        if hasattr(model, name):
            setattr(hybrid, name, getattr(model, name))
    return hybrid


def _last_position(model: nn.Module, read: list[int]) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Each block's output at the read's last token, and the log-probabilities of the token after it."""
    outputs = []
    hooks = [block.register_forward_hook(lambda _m, _i, out: outputs.append(out[0, -1])) for block in model.blocks]
    try:
        hidden = model(torch.tensor([read]))[0, -1]
    finally:
        for hook in hooks:
            hook.remove()
    return outputs, torch.log_softmax(model.lm_head(hidden), -1)


def _brute_force_table(model: nn.Module, reference: nn.Module, stream: list[int], pairs) -> list[dict]:
    model, reference = (copy.deepcopy(m).double().eval() for m in (model, reference))
    hybrids = [_hybrid(model, reference, layer) for layer in range(len(model.blocks))]
    per_layer = [dict(relative=[], cosine=[], kld=[]) for _ in hybrids]
    with torch.no_grad():
        for start, target in pairs:
            read = stream[start:target]
            (outputs, _), (reference_outputs, reference_log_p) = (_last_position(m, read) for m in (model, reference))
            for layer, (hybrid, values) in enumerate(zip(hybrids, per_layer)):
                h, r = outputs[layer], reference_outputs[layer]
                values["relative"].append(float((h - r).norm() / r.norm()))
                values["cosine"].append(float(h @ r / (h.norm() * r.norm())))
                log_p = _last_position(hybrid, read)[1]
                values["kld"].append(float((reference_log_p.exp() * (reference_log_p - log_p)).sum()))
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    return [dict(layer=layer, relative_l2_mean=mean(v["relative"]), relative_l2_max=max(v["relative"]),
                 cosine_mean=mean(v["cosine"]), cosine_min=min(v["cosine"]),
                 kld_with_reference_through_layer=mean(v["kld"])) for layer, v in enumerate(per_layer)]


@pytest.mark.parametrize("preset", ["gpt2-tiny", "llama-tiny"])
def test_the_table_equals_a_float64_brute_force(preset, related_models, tokenizer_dir, text_path):
    result = _evaluate(tokenizer_dir, text_path, preset, layer_error=True)
    table = result["divergence"]["layer_error"]
    ids = AutoTokenizer.from_pretrained(str(tokenizer_dir))(text_path.read_text())["input_ids"]
    models = [related_models(preset, seed) for seed in (0, 1)]
    expected = _brute_force_table(*models, [BOS] + ids, lm_eval_rolling_pairs(len(ids), CTX))
    assert len(table) == len(models[0].blocks) == len(expected) >= 2
    for row, want in zip(table, expected):
        assert row["layer"] == want["layer"]
        for name in ERRORS:
            assert row[name] == pytest.approx(want[name], rel=1e-5, abs=1e-7), (row["layer"], name)
    # the hybrids' KLDs are the reference's blocks taking over: the output's divergence falls by the last one
    assert table[-1]["kld_with_reference_through_layer"] < result["divergence"]["kld_mean"]


def test_a_model_against_itself_has_no_error(related_models, tokenizer_dir, text_path):
    table = _evaluate(tokenizer_dir, text_path, "llama-tiny", reference_seed=0, layer_error=True)["divergence"][
        "layer_error"]
    for row in table:
        assert row["relative_l2_mean"] == row["relative_l2_max"] == row["kld_with_reference_through_layer"] == 0
        assert row["cosine_min"] == pytest.approx(1, abs=1e-6)


def test_the_run_and_its_table_do_not_depend_on_the_layer_error_or_the_waves(related_models, tokenizer_dir,
                                                                             text_path):
    plain = _evaluate(tokenizer_dir, text_path, "gpt2-tiny", placement="streamed")
    one_wave = _evaluate(tokenizer_dir, text_path, "gpt2-tiny", layer_error=True)
    with pytest.raises(FastpplError, match="cannot hold one wave") as refused:   # the least limit that runs
        _evaluate(tokenizer_dir, text_path, "gpt2-tiny", layer_error=True, max_gpu_memory=1)
    least = memory_size(re.search(r"at least (\S+?)(,|$)", str(refused.value)).group(1), "limit") + 2**14
    waves = _evaluate(tokenizer_dir, text_path, "gpt2-tiny", layer_error=True, max_gpu_memory=least)
    assert one_wave["streaming"]["waves"] == 1 and waves["streaming"]["waves"] > 1
    for run in (one_wave, waves):
        assert run["nll_sum"] == plain["nll_sum"]
        assert run["divergence"]["kld_mean"] == plain["divergence"]["kld_mean"]
    assert waves["divergence"]["layer_error"] == one_wave["divergence"]["layer_error"]
    assert one_wave["placement_reason"].startswith("--layer-error")


@pytest.mark.parametrize("settings, message", [
    (dict(reference_model=None, reference_seed=None), "add reference_model"),
    (dict(placement="resident"), 'drop placement="resident"'),
    (dict(resume="checkpoints"), "not checkpointed"),
    (dict(compile="on"), 'drop compile="on" or drop layer_error'),
])
def test_what_layer_error_cannot_run_is_one_line(settings, message, text_path):
    given = dict(model="random:gpt2-tiny", reference_model="random:gpt2-tiny", reference_seed=1,
                 data=[str(text_path)], layer_error=True) | settings
    with pytest.raises(FastpplError, match=message) as refused:
        EvalConfig(**given)
    assert "\n" not in str(refused.value)


def test_a_reference_of_another_shape_is_refused(tokenizer_dir, text_path, capsys):
    args = ["eval", "--model", "random:gpt2-tiny", "--reference-model", "random:gpt2", "--layer-error",
            "--data", str(text_path), "--tokenizer", str(tokenizer_dir), "--device", "cpu", "--ctx", "16", "--quiet"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("fastppl: error: --layer-error compares the two models block by block")
    assert "12 blocks of width 768" in err and err.count("\n") == 1


def test_the_summary_and_the_json_hold_the_table(related_models, tokenizer_dir, text_path, tmp_path, capsys):
    report = tmp_path / "report.json"
    args = ["eval", "--model", "random:gpt2-tiny", "--reference-model", "random:gpt2-tiny", "--reference-seed", "1",
            "--layer-error", "--data", str(text_path), "--tokenizer", str(tokenizer_dir), "--device", "cpu",
            "--ctx", "16", "--quiet", "--json", str(report)]
    assert main(args) == 0
    out = capsys.readouterr().out
    table = json.loads(report.read_text())["divergence"]["layer_error"]
    assert "error by layer" in out and len(table) == 2
    assert f"{table[1]['kld_with_reference_through_layer']:.5g}" in out.splitlines()[-1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("preset", ["gpt2-tiny", "llama-tiny"])
def test_on_cuda_the_run_is_the_streamed_run_and_the_table_is_the_cpus(preset, related_models, tokenizer_dir,
                                                                       text_path):
    """bf16 on a GPU (the fused trunk and the fused divergence kernel): the run's own figures are the streamed
    run's bit for bit; the table is the CPU's fp32 one within bf16's rounding."""
    settings = dict(device="cuda", dtype="bf16")
    plain = _evaluate(tokenizer_dir, text_path, preset, placement="streamed", **settings)
    layered = _evaluate(tokenizer_dir, text_path, preset, layer_error=True, **settings)
    cpu = _evaluate(tokenizer_dir, text_path, preset, layer_error=True)
    assert layered["nll_sum"] == plain["nll_sum"]
    assert layered["divergence"]["kld_mean"] == plain["divergence"]["kld_mean"]
    for row, want in zip(layered["divergence"]["layer_error"], cpu["divergence"]["layer_error"]):
        assert row["relative_l2_mean"] == pytest.approx(want["relative_l2_mean"], rel=0.05, abs=0.01)
        assert row["kld_with_reference_through_layer"] == pytest.approx(want["kld_with_reference_through_layer"],
                                                                        rel=0.05, abs=1e-3)


def test_packed_documents_keep_the_runs_figures(related_models, tokenizer_dir, tmp_path, shakespeare):
    """Rows of several documents (each block reads the documents' positions and masks): the run's figures are the
    streamed run's, and a model against itself still has no error."""
    corpus = tmp_path / "documents.jsonl"
    text = shakespeare.read_text()
    corpus.write_text("".join(json.dumps({"text": text[i * 150:(i + 1) * 150 - i * 40]}) + "\n" for i in range(3)))
    settings = dict(batching="packed", ctx=64)
    plain = _evaluate(tokenizer_dir, corpus, "llama-tiny", placement="streamed", **settings)
    layered = _evaluate(tokenizer_dir, corpus, "llama-tiny", layer_error=True, **settings)
    assert layered["batching"] == "packed" and layered["nll_sum"] == plain["nll_sum"]
    assert layered["divergence"]["kld_mean"] == plain["divergence"]["kld_mean"]
    itself = _evaluate(tokenizer_dir, corpus, "llama-tiny", reference_seed=0, layer_error=True, **settings)
    assert all(row["relative_l2_max"] == row["kld_with_reference_through_layer"] == 0
               for row in itself["divergence"]["layer_error"])


def test_layer_error_runs_in_one_process_only(text_path):
    from fastppl.config import check_one_process
    config = EvalConfig(model="random:gpt2-tiny", reference_model="random:gpt2-tiny", reference_seed=1,
                        data=[str(text_path)], layer_error=True)
    with pytest.raises(FastpplError, match="--layer-error runs in one process only"):
        check_one_process(config)
