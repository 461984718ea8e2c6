"""fastppl.report.groups: each group's sums from the per-document sums, divided once; the micro average is the
corpus' figures, the macro average the mean of the groups'; the sums equal an ungrouped run's."""
import json
import math
from types import SimpleNamespace

import numpy as np
import pytest

from fastppl import EvalConfig, evaluate
from fastppl.report.groups import group_metrics, group_results



def _plan(scored_documents, scored_by_document):
    return SimpleNamespace(scored_documents=np.array(scored_documents, dtype=np.int64),
                           scored_by_document=np.array(scored_by_document, dtype=np.int64))


def test_groups_sum_their_documents_and_leave_out_groups_with_nothing_scored():
    documents = [SimpleNamespace(group=g) for g in ("b", "a", "b", "c", "a")]
    # document 3 (the only one of group c) has no token to score
    plan = _plan([0, 1, 2, 4], [4, 2, 6, 0, 3])
    nll_by_document = np.array([8.0, 3.0, 6.0, 0.0, 9.0])
    bytes_by_document = np.array([10, 5, 20, 0, 7])
    groups = group_results("source", documents, plan, nll_by_document, bytes_by_document)
    assert groups["field"] == "source" and [g["group"] for g in groups["groups"]] == ["a", "b"]
    a, b = groups["groups"]
    assert (a["documents"], a["tokens"], a["nll_sum"], a["bytes"]) == (2, 5, 12.0, 12)
    assert (b["documents"], b["tokens"], b["nll_sum"], b["bytes"]) == (2, 10, 14.0, 30)
    assert a["nll"] == 12.0 / 5 and a["ppl"] == pytest.approx(math.exp(12.0 / 5))
    assert a["bits_per_byte"] == pytest.approx(12.0 / math.log(2) / 12)
    micro, macro = groups["micro"], groups["macro"]
    assert (micro["documents"], micro["tokens"], micro["nll_sum"], micro["bytes"]) == (4, 15, 26.0, 42)
    assert micro["nll"] == 26.0 / 15   # every token weighs the same
    assert macro["nll"] == pytest.approx((12.0 / 5 + 14.0 / 10) / 2)   # every group weighs the same
    assert macro["ppl"] == pytest.approx((a["ppl"] + b["ppl"]) / 2)
    assert (macro["documents"], macro["tokens"]) == (4, 15)


def test_a_group_without_bytes_has_no_bits_per_byte():
    assert math.isnan(group_metrics("empty text", 1, 3, 6.0, 0)["bits_per_byte"])


def _jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def _run(tokenizer_dir, data, **overrides):
    return evaluate(EvalConfig(model="random:gpt2-tiny", tokenizer=str(tokenizer_dir), data=[data], ctx=32,
                               device="cpu", quiet=True, batch_size=4, per_doc="(kept)", **overrides))


@pytest.mark.slow   # five runs
def test_group_sums_equal_the_ungrouped_run(tmp_path, tokenizer_dir, records, sharpened_random_models):
    data = _jsonl(tmp_path / "docs.jsonl", records)
    plain = _run(tokenizer_dir, data)
    grouped = _run(tokenizer_dir, data, group_by="source")
    assert plain["groups"] is None and grouped["corpus_sha256"] == plain["corpus_sha256"]
    groups = grouped["groups"]
    assert groups["field"] == "source"
    assert [g["group"] for g in groups["groups"]] == sorted({r["source"] for r in records})
    assert sum(g["tokens"] for g in groups["groups"]) == plain["tokens_scored"]
    assert sum(g["bytes"] for g in groups["groups"]) == plain["bytes"]
    assert sum(g["documents"] for g in groups["groups"]) == len(records)
    assert math.fsum(g["nll_sum"] for g in groups["groups"]) == pytest.approx(plain["nll_sum"], rel=1e-12)
    micro, macro = groups["micro"], groups["macro"]
    assert micro["nll"] == pytest.approx(plain["nll"], rel=1e-12)
    assert micro["bits_per_byte"] == pytest.approx(plain["bits_per_byte"], rel=1e-12)
    for key in ("nll", "ppl", "bits_per_byte"):
        assert macro[key] == pytest.approx(np.mean([g[key] for g in groups["groups"]]), rel=1e-12)
    # each group's figures are those of a run over its documents alone (windows never cross documents)
    per_doc = {d["id"]: d for d in plain.per_doc}
    for group in groups["groups"]:
        members = [r for r in records if r["source"] == group["group"]]
        assert group["tokens"] == sum(per_doc[r["id"]]["tokens"] for r in members)
        alone = _run(tokenizer_dir, _jsonl(tmp_path / f"{group['group']}.jsonl", members))
        assert group["nll_sum"] == pytest.approx(alone["nll_sum"], rel=1e-5)
        assert (group["tokens"], group["bytes"]) == (alone["tokens_scored"], alone["bytes"])
