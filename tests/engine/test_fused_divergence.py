"""The fused divergence kernel (engine/fused_divergence.py) against the chunked path (engine/divergence.py) and a
float64 softmax of the same logits, on the CPU in Triton's interpreter (conftest.py sets TRITON_INTERPRET=1),
through both load paths, with and without biases, models of different widths, a vocabulary that is not a
multiple of the tile and several segments; on a GPU machine the same tests run on the GPU (`pytest -m gpu`).
Tolerances: every column within 1e-5 relative of the chunked path's (the KLs, entropies, NLLs within 2e-6 of
a float64 softmax), the top-1 agreement exact, the target's rank within 1 (its logit is computed beside the
kernel's product: an id within an ulp of it may fall on either side), the top-k overlaps NaN."""
import os

import pytest
import torch
import torch.nn.functional as F

fused_divergence = pytest.importorskip("fastppl.engine.fused_divergence")
if fused_divergence.triton is None or (not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"):
    pytest.skip("needs triton, and a GPU or TRITON_INTERPRET=1", allow_module_level=True)
from fastppl.engine.divergence import COLUMNS, chunked_divergence  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = [pytest.mark.gpu] if torch.cuda.is_available() else []
RANK, TOP_K = COLUMNS.index("target_rank"), [COLUMNS.index("top5_overlap"), COLUMNS.index("top10_overlap")]
TILES = dict(block_m=32, block_n=64, block_k=32)


def _inputs(n, c, ref_c, v, bias, dtype, seed, noise=0.3):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, c, generator=g)
    weight = 0.4 * torch.randn(v, c, generator=g)
    if ref_c == c:   # a perturbed copy, as a quantised model is of its base
        reference_hidden, reference_weight = hidden + noise * torch.randn(n, c, generator=g), weight.clone()
    else:
        reference_hidden = torch.randn(n, ref_c, generator=g)
        reference_weight = 0.4 * torch.randn(v, ref_c, generator=g)
    biases = (torch.randn(v, generator=g), torch.randn(v, generator=g)) if bias else (None, None)
    targets = torch.randint(0, v, (n,), generator=g)
    cast = lambda x: None if x is None else x.to(dtype).to(DEVICE)  # noqa: E731
    return ([cast(x) for x in (hidden, weight, reference_hidden, reference_weight)], cast(targets.to(dtype)).long(),
            [cast(b) for b in biases])


def _float64_columns(logits, reference_logits, targets):
    log_p, reference_log_p = (torch.log_softmax(x.double(), -1) for x in (logits, reference_logits))
    p, reference_p = log_p.exp(), reference_log_p.exp()
    return {"nll": -log_p.gather(1, targets[:, None])[:, 0],
            "reference_nll": -reference_log_p.gather(1, targets[:, None])[:, 0],
            "kld": (reference_p * (reference_log_p - log_p)).sum(-1),
            "reverse_kld": (p * (log_p - reference_log_p)).sum(-1),
            "entropy": -(p * log_p).sum(-1), "reference_entropy": -(reference_p * reference_log_p).sum(-1),
            "reference_top1_p": reference_p.max(-1).values}


def _check(out, chunked, float64):
    assert out.shape == chunked.shape == (chunked.shape[0], len(COLUMNS)) and out.dtype == torch.float32
    assert torch.isnan(out[:, TOP_K]).all()
    for i, name in enumerate(COLUMNS):
        if i in TOP_K:
            continue
        got, want = out[:, i].double().cpu(), chunked[:, i].double().cpu()
        if name == "same_top1":
            assert torch.equal(got, want), name
        elif name == "target_rank":
            assert (got - want).abs().max() <= 1, name
        else:
            assert ((got - want).abs() <= 1e-5 * want.abs() + 1e-7).all(), (name, (got - want).abs().max())
        if name in float64:
            assert ((got - float64[name]).abs() <= 2e-6 * float64[name].abs().clamp(min=1)).all(), name


@pytest.mark.parametrize("tma", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n, c, ref_c, v, bias", [(70, 64, 64, 300, False), (37, 40, 72, 257, True),
                                                  (5, 32, 32, 700, False)])
def test_fused_divergence_equals_the_chunked_path_and_a_float64_softmax(tma, dtype, n, c, ref_c, v, bias):
    (hidden, weight, reference_hidden, reference_weight), targets, (b, reference_b) = _inputs(
        n, c, ref_c, v, bias, dtype, n * v + c)
    out = fused_divergence.fused_divergence(hidden, weight, reference_hidden, reference_weight, targets, b,
                                            reference_b, tma=tma, **TILES)
    chunked = chunked_divergence(hidden.float(), weight.float(), reference_hidden.float(), reference_weight.float(),
                                 targets, None if b is None else b.float(),
                                 None if reference_b is None else reference_b.float())
    logits = F.linear(hidden.double(), weight.double(), None if b is None else b.double()).cpu()
    reference_logits = F.linear(reference_hidden.double(), reference_weight.double(),
                                None if reference_b is None else reference_b.double()).cpu()
    _check(out, chunked, _float64_columns(logits, reference_logits, targets.cpu()))


def test_segments_agree_and_a_model_against_itself_is_exactly_zero():
    """The vocabulary split over segments (combined in float64) against one segment; and identical inputs give
    both KLs exactly 0, the same top-1, equal NLLs and Δp 0, as the chunked path does."""
    (hidden, weight, reference_hidden, reference_weight), targets, _ = _inputs(40, 32, 32, 700, False,
                                                                               torch.float32, 3)
    assert fused_divergence.vocabulary_segments(700, 64) > 1
    split = fused_divergence.fused_divergence(hidden, weight, reference_hidden, reference_weight, targets, **TILES)
    whole = fused_divergence.fused_divergence(hidden, weight, reference_hidden, reference_weight, targets, segments=1,
                                              **TILES)
    _check(split, chunked_divergence(hidden, weight, reference_hidden, reference_weight, targets), {})
    _check(whole, split, {})
    itself = fused_divergence.fused_divergence(hidden, weight, hidden, weight, targets, **TILES).cpu()
    columns = dict(zip(COLUMNS, itself.T))
    assert torch.equal(columns["kld"], torch.zeros(40)) and torch.equal(columns["reverse_kld"], torch.zeros(40))
    assert torch.equal(columns["same_top1"], torch.ones(40)) and torch.equal(columns["delta_p"], torch.zeros(40))
    assert torch.equal(columns["nll"], columns["reference_nll"])


def test_ties_go_to_the_lowest_id_across_tiles_and_segments():
    """Ids 10 and 600 (in other segments) with equal weights and the largest logits: the model's top-1 is 10; the
    reference, with id 10 a little lower in rows 0 and 1, agrees only in rows 2 and 3. The target's rank counts an
    equal logit of a lower id as above: 600 ranks 1, 10 ranks 0."""
    (hidden, weight, _, _), _, _ = _inputs(4, 32, 32, 700, False, torch.float32, 9)
    hidden, weight = hidden.clone(), weight.clone()
    hidden[:2, 0], hidden[2:, 0] = 100.0, 0.0   # rows 2 and 3: column 0 plays no part, the two models agree
    weight[:, 0] = 0.0
    weight[10, 0] = 1.0
    weight[600] = weight[10]
    reference_weight = weight.clone()
    reference_weight[10, 0] = 0.99
    targets = torch.tensor([600, 10, 600, 3], device=DEVICE)
    out = fused_divergence.fused_divergence(hidden, weight, hidden, reference_weight, targets, **TILES).cpu()
    chunked = chunked_divergence(hidden, weight, hidden, reference_weight, targets).cpu()
    assert out[:, COLUMNS.index("same_top1")].tolist() == [0.0, 0.0, 1.0, 1.0]
    assert torch.equal(out[:, COLUMNS.index("same_top1")], chunked[:, COLUMNS.index("same_top1")])
    # rows 2 and 3 as any row: a logit equal to the target's may be an ulp off it in the dot product beside the kernel
    assert out[:2, RANK].tolist() == [1.0, 0.0] and (out[:, RANK] - chunked[:, RANK]).abs().max() <= 1
    itself = fused_divergence.fused_divergence(hidden, weight, hidden, weight, targets, **TILES).cpu()
    assert itself[:, COLUMNS.index("same_top1")].tolist() == [1.0] * 4


def test_no_rows_launches_nothing():
    w = torch.randn(100, 16, device=DEVICE)
    out = fused_divergence.fused_divergence(torch.empty(0, 16, device=DEVICE), w, torch.empty(0, 16, device=DEVICE),
                                            w, torch.empty(0, dtype=torch.long, device=DEVICE))
    assert out.shape == (0, len(COLUMNS))
