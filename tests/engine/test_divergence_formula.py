"""The divergence formula (engine/divergence.py) against a float64 softmax of the same logits. Tolerances: KL within
1e-6 relative (the fp32 formula measures ~1e-7; a plain fp32 log-softmax is off by 1e-5), NLL within 2e-6 nats, Δp
within 1e-6 of the probabilities; a row against itself exactly 0, and the top-1 agreement exact, ties to the lowest
id."""
import pytest
import torch
import torch.nn.functional as F

from fastppl.engine.divergence import COLUMNS, _divergence_of_logits, chunked_divergence

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = [pytest.mark.gpu] if torch.cuda.is_available() else []


def _run(logits: torch.Tensor, reference_logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return _divergence_of_logits(logits.float().clone(), reference_logits.float().clone(), targets)


def _float64_columns(logits, reference_logits, targets) -> torch.Tensor:
    log_p, reference_log_p = (torch.log_softmax(x.double(), -1) for x in (logits, reference_logits))
    nll = -log_p.gather(1, targets[:, None])[:, 0]
    reference_nll = -reference_log_p.gather(1, targets[:, None])[:, 0]
    kld = (reference_log_p.exp() * (reference_log_p - log_p)).sum(-1)
    same = (logits.argmax(-1) == reference_logits.argmax(-1)).double()
    return torch.stack([nll, reference_nll, kld, same, (-nll).exp() - (-reference_nll).exp()], dim=1)


def _logits(rows: int, vocabulary: int, dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    logits = 3 * torch.randn(rows, vocabulary, generator=g)
    reference_logits = logits + 0.5 * torch.randn(rows, vocabulary, generator=g)
    targets = torch.randint(0, vocabulary, (rows,), generator=g)
    return logits.to(dtype).to(DEVICE), reference_logits.to(dtype).to(DEVICE), targets.to(DEVICE)


# 16-bit as fp16: the interpreter has no bf16 arithmetic; V not a multiple of the tile, and smaller than one
@pytest.mark.parametrize("rows, vocabulary, dtype", [(9, 1000, torch.float32), (5, 300, torch.float16),
                                                     (3, 77, torch.float32)])
def test_columns_match_a_float64_softmax_of_the_same_logits(rows, vocabulary, dtype):
    logits, reference_logits, targets = _logits(rows, vocabulary, dtype, rows * vocabulary)
    out = _run(logits, reference_logits, targets).double().cpu()
    expected = _float64_columns(logits.cpu(), reference_logits.cpu(), targets.cpu())
    assert out.shape == (rows, len(COLUMNS))
    nll, kld, same, delta_p = slice(0, 2), COLUMNS.index("kld"), COLUMNS.index("same_top1"), COLUMNS.index("delta_p")
    assert (out[:, nll] - expected[:, nll]).abs().max() <= 2e-6
    assert ((out[:, kld] - expected[:, kld]) / expected[:, kld]).abs().max() <= 1e-6
    assert torch.equal(out[:, same], expected[:, same])
    probabilities = (-expected[:, nll]).exp().sum(-1)
    assert ((out[:, delta_p] - expected[:, delta_p]).abs() <= 1e-6 * probabilities).all()


def test_a_row_against_itself_is_exactly_zero_and_ties_go_to_the_lowest_id():
    logits, _, targets = _logits(4, 500, torch.float32, 7)
    out = _run(logits, logits.clone(), targets).cpu()
    assert torch.equal(out[:, 2], torch.zeros(4)) and torch.equal(out[:, 4], torch.zeros(4))
    assert torch.equal(out[:, 3], torch.ones(4)) and torch.equal(out[:, 0], out[:, 1])
    # two equal maxima in each row, in different tiles: the model puts its own first, the reference agrees only
    # where its first maximum is the same
    tied, reference_tied = logits.clone(), logits.clone()
    tied[:, 10], tied[:, 400] = 50.0, 50.0
    reference_tied[:, 10], reference_tied[:, 400] = 50.0, 50.0
    reference_tied[:2, 10] = 49.0
    out = _run(tied, reference_tied, targets).cpu()
    assert out[:, 3].tolist() == [0.0, 0.0, 1.0, 1.0]


def test_chunked_divergence_equals_a_float64_softmax_in_any_chunking():
    g = torch.Generator().manual_seed(0)
    hidden, reference_hidden = torch.randn(11, 16, generator=g), torch.randn(11, 16, generator=g)
    weight = torch.randn(300, 16, generator=g)
    reference_weight = weight + 0.2 * torch.randn(300, 16, generator=g)
    targets = torch.randint(0, 300, (11,), generator=g)
    args = [x.to(DEVICE) for x in (hidden, weight, reference_hidden, reference_weight, targets)]
    by_chunks = chunked_divergence(*args, chunk_rows=4)
    torch.testing.assert_close(by_chunks, chunked_divergence(*args, chunk_rows=11), rtol=0, atol=0)
    expected = _float64_columns(F.linear(hidden, weight), F.linear(reference_hidden, reference_weight), targets)
    torch.testing.assert_close(by_chunks.double().cpu()[:, :3], expected[:, :3], rtol=1e-6, atol=2e-6)
