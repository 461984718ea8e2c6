"""--protocol end to end on random:gpt2-tiny (sharpened weights, fp32, CPU): each protocol's numbers equal those
of the original program's loop run through transformers (tests/fixtures/protocol_references.py), the protocol
card is in every report, and the summary prints the figures as the protocol's tool prints them."""
import json

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from data.test_protocols import make_bos_tokenizer, wikitext_raw
from fastppl.cli import main
from fastppl.config import EvalConfig
from fastppl.models import load_model
from fastppl.models.loading import native_to_hf
from fastppl.pipeline import evaluate
from fixtures.protocol_references import (gptq_metric, gptq_pairs, hf_guide_text_pairs, llama_cpp_metric,
                                          llama_cpp_pairs, lm_eval_wikitext_metric, lm_eval_wikitext_pairs)

MODEL = "random:gpt2-tiny"
CTX = 16


@pytest.fixture(scope="module")
def bos_tokenizer_dir(tmp_path_factory, tokenizer_dir):
    return make_bos_tokenizer(tmp_path_factory.mktemp("bos-tokenizer"), tokenizer_dir)


@pytest.fixture
def hf_model(sharpened_random_models):
    """transformers' GPT-2 with the weights fastppl's run loads (the sharpened random:gpt2-tiny)."""
    return native_to_hf(load_model(MODEL, "native", torch.float32, seed=0)).eval()


def reference_nlls(hf_model, pairs) -> np.ndarray:
    """fp32 NLL of each (context, target) pair, one forward pass per run of pairs that extend each other."""
    nlls, group = [], []

    def flush():
        if not group:   # no pairs at all (an empty document)
            return
        ids = list(group[-1][0]) + [group[-1][1]]
        with torch.no_grad():
            logprobs = hf_model(input_ids=torch.tensor([ids[:-1]])).logits[0].float().log_softmax(-1)
        nlls.extend(-float(logprobs[len(context) - 1, target]) for context, target in group)
        group.clear()

    for pair in pairs:
        if group and pair[0] != group[-1][0] + (group[-1][1],):
            flush()
        group.append(pair)
    flush()
    return np.array(nlls)


def run(tokenizer, data, protocol, **kwargs):
    return evaluate(EvalConfig(model=MODEL, data=[str(d) for d in data], tokenizer=str(tokenizer), device="cpu",
                               dtype="fp32", quiet=True, ctx=kwargs.pop("ctx", CTX), protocol=protocol, **kwargs))


@pytest.mark.slow
def test_gptq_equals_its_eval_loop(tmp_path, hf_model, bos_tokenizer_dir, shakespeare):
    (tmp_path / "wiki.test.raw").write_text(wikitext_raw(shakespeare.read_text(), n_lines=12))
    result = run(bos_tokenizer_dir, ["wikitext2"], "gptq", data_dir=str(tmp_path), per_token=str(tmp_path / "t.npy"))
    with open(tmp_path / "wiki.test.raw", encoding="utf-8") as f:
        rows = [row if row.strip() else "" for row in f]
    pairs = gptq_pairs(rows, AutoTokenizer.from_pretrained(str(bos_tokenizer_dir)), CTX)
    nlls = reference_nlls(hf_model, pairs)
    assert result["tokens_scored"] == len(pairs) and result["windows"] == len(pairs) // (CTX - 1)
    assert result["ppl"] == pytest.approx(gptq_metric(nlls, CTX), rel=1e-5)
    per_token = result.per_token   # token k is stream position k + 1 (the tokenizer's BOS first)
    scored = ~np.isnan(per_token)
    assert [k for k in np.flatnonzero(~scored) if k + 1 < result["windows"] * CTX] == \
        [k for k in range(result["windows"] * CTX - 1) if (k + 1) % CTX == 0]
    np.testing.assert_allclose(per_token[scored], nlls, rtol=1e-5)
    card = result["protocol"]
    assert card["name"] == "gptq" and card["datasets"][0]["id"] == "wikitext"
    assert "'<|endoftext|>' (id 50256) once, at the start of the text" in card["bos"]
    assert card["reported"]["ppl"] == result["ppl"] and card["tail"].startswith("dropped: the ")


@pytest.mark.parametrize("bos", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_llama_cpp_equals_perplexity_cpp(tmp_path, hf_model, tokenizer_dir, bos_tokenizer_dir, shakespeare, bos):
    tokenizer = bos_tokenizer_dir if bos else tokenizer_dir
    path = tmp_path / "wiki.test.raw"
    text = shakespeare.read_text()
    path.write_text(text[:450] + " <|endoftext|> " + text[450:900])   # "<|endoftext|>" is text to llama.cpp
    result = run(tokenizer, [path], "llama.cpp", ctx=CTX + 1)
    nlls = reference_nlls(hf_model, llama_cpp_pairs(path.read_text(), AutoTokenizer.from_pretrained(str(tokenizer)),
                                                    CTX + 1))
    ppl, plus_minus = llama_cpp_metric(nlls)
    reported = result["protocol"]["reported"]
    assert result["tokens_scored"] == len(nlls) and result["ppl"] == pytest.approx(ppl, rel=1e-5)
    assert reported["ppl_plus_minus"] == pytest.approx(plus_minus, rel=1e-4)
    assert reported["line"] == f"Final estimate: PPL = {reported['ppl']:.4f} +/- {reported['ppl_plus_minus']:.5f}"
    card = result["protocol"]
    assert card["corpus"] == "one text, as llama-perplexity -f reads it: one final newline dropped"
    assert "a special token's spelling in the text (such as '<|endoftext|>') is text" in card["tokens"]


@pytest.mark.slow
def test_lm_eval_wikitext_equals_the_task(tmp_path, hf_model, tokenizer_dir, shakespeare):
    raw = wikitext_raw(shakespeare.read_text(), n_lines=10)
    pages = [raw[:len(raw) // 2], raw[len(raw) // 2:], ""]   # an empty page adds one word, as in lm-eval
    path = tmp_path / "pages.jsonl"
    path.write_text("".join(json.dumps({"page": page}) + "\n" for page in pages))
    result = run(tokenizer_dir, [path], "lm-eval-wikitext", text_field="page", per_doc=str(tmp_path / "d.jsonl"))
    hf_tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    nll_by_page = [reference_nlls(hf_model, lm_eval_wikitext_pairs([page], hf_tokenizer, CTX)).sum() for page in pages]
    expected = lm_eval_wikitext_metric(nll_by_page, pages)
    for metric, value in expected.items():
        assert result[metric] == pytest.approx(value, rel=1e-6)
        assert result["protocol"]["reported"][metric] == result[metric]
    assert [d["nll_sum"] for d in result.per_doc] == pytest.approx(nll_by_page[:2], rel=1e-5)


@pytest.mark.slow
def test_hf_guide_equals_the_guide(tmp_path, hf_model, bos_tokenizer_dir, shakespeare):
    rows = [line + "\n" for line in shakespeare.read_text().splitlines()[:30]]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"text": row}) + "\n" for row in rows))
    result = run(bos_tokenizer_dir, [path], "hf-guide", stride=6)
    nlls = reference_nlls(hf_model, hf_guide_text_pairs(rows, AutoTokenizer.from_pretrained(str(bos_tokenizer_dir)),
                                                          CTX, 6))
    assert result["tokens_scored"] == len(nlls) and result["nll"] == pytest.approx(nlls.mean(), rel=1e-6)
    assert result["protocol"]["windows"].endswith("ctx 16, stride 6: each scores the tokens no earlier window scored")


def test_lm_eval_rolling_is_the_chunked_run_and_every_report_has_a_card(tmp_path, tokenizer_dir, shakespeare):
    path = tmp_path / "slice.txt"
    path.write_text(shakespeare.read_text()[:1200])
    preset = run(tokenizer_dir, [path], "lm-eval-rolling")
    plain = run(tokenizer_dir, [path], None)
    assert preset["nll_sum"] == plain["nll_sum"] and preset["tokens_scored"] == plain["tokens_scored"]
    assert plain["protocol"]["name"] is None and "reported" not in plain["protocol"]
    assert plain["protocol"]["bos"].startswith("'<|endoftext|>' (id 50256) before each document")


def test_cli_summary_and_errors(tmp_path, tokenizer_dir, shakespeare, capsys):
    path = tmp_path / "wiki.test.raw"
    path.write_text(shakespeare.read_text()[:900])
    common = ["eval", "--model", MODEL, "--tokenizer", str(tokenizer_dir), "--data", str(path), "--device", "cpu",
              "--quiet", "--ctx", str(CTX)]
    assert main(common + ["--protocol", "llama.cpp", "--json", str(tmp_path / "r.json")]) == 0
    out = capsys.readouterr().out
    card = json.loads((tmp_path / "r.json").read_text())["protocol"]
    assert f"protocol    llama.cpp: {card['reported']['line']}" in out and "Final estimate: PPL = " in out
    for extra, message in ((["--protocol", "gptq", "--window", "sliding"], "--window sliding does not go with"),
                           (["--protocol", "llama.cpp", "--ctx", "200"], "needs at least 2 x --ctx = 400 tokens")):
        assert main(common + extra) == 2
        err = capsys.readouterr().err
        assert err.startswith("fastppl: error: ") and message in err and len(err.strip().splitlines()) == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_llama_cpp_on_cuda_equals_the_cpu_run(tmp_path, tokenizer_dir, shakespeare):
    """On CUDA the fused loss runs on the scored rows only (half of each block here): fp32 equals the CPU. One
    saved checkpoint: random: weights are drawn on the run's device, so a CUDA run's differ from a CPU run's."""
    from fastppl.models.loading import random_gpt2, save_hf_gpt2
    path, model = tmp_path / "wiki.test.raw", tmp_path / "model"
    path.write_text(shakespeare.read_text()[:20000])
    save_hf_gpt2(random_gpt2(MODEL.removeprefix("random:"), 0), model)
    cpu, cuda = (evaluate(EvalConfig(model=str(model), data=[str(path)], tokenizer=str(tokenizer_dir), device=device,
                                     dtype="fp32", quiet=True, ctx=128, protocol="llama.cpp"))
                 for device in ("cpu", "cuda"))
    assert cuda["tokens_scored"] == cpu["tokens_scored"] and cuda["loss"] == "fused"
    assert cuda["protocol"]["reported"]["ppl"] == pytest.approx(cpu["protocol"]["reported"]["ppl"], rel=1e-4)
    assert cuda["protocol"]["reported"]["ppl_plus_minus"] == pytest.approx(
        cpu["protocol"]["reported"]["ppl_plus_minus"], rel=1e-3)
