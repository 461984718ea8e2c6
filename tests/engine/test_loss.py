"""fastppl.engine.loss.chunked_token_nll against F.cross_entropy(reduction="none") on full logits."""
import pytest
import torch
import torch.nn.functional as F

from fastppl.engine.loss import chunked_token_nll

N, C, V = 37, 16, 101   # 37 rows: prime, so most chunk sizes do not divide it


def _inputs(dtype, with_bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, C, generator=g)
    weight = torch.randn(V, C, generator=g) / C ** 0.5 * 3      # logits of a few units, like a real model
    bias = torch.randn(V, generator=g) if with_bias else None
    targets = torch.randint(0, V, (N,), generator=g)
    cast = lambda t: None if t is None else t.to(dtype)        # noqa: E731
    return cast(hidden), cast(weight), targets, cast(bias)


def _reference(hidden, weight, targets, bias):
    """fp32 cross-entropy of the full (N, V) logits, computed from the same (possibly bf16) inputs."""
    logits = F.linear(hidden.float(), weight.float(), None if bias is None else bias.float())
    return F.cross_entropy(logits, targets, reduction="none")


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("chunk_rows", [1, 5, 8, 36, 37, 38, 8192])   # 1, not dividing, N-1, N, > N
def test_fp32_matches_cross_entropy(chunk_rows, with_bias):
    hidden, weight, targets, bias = _inputs(torch.float32, with_bias)
    nll = chunked_token_nll(hidden, weight, targets, bias, chunk_rows=chunk_rows)
    assert nll.dtype == torch.float32 and nll.shape == (N,)
    # fp32 tolerance: only the matmul's summation order may differ
    torch.testing.assert_close(nll, _reference(hidden, weight, targets, bias), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("chunk_rows", [1, 7, 37, 100])
def test_bf16_matches_cross_entropy(chunk_rows, with_bias):
    hidden, weight, targets, bias = _inputs(torch.bfloat16, with_bias)
    nll = chunked_token_nll(hidden, weight, targets, bias, chunk_rows=chunk_rows)
    assert nll.dtype == torch.float32   # the log-softmax is always fp32
    # bf16 tolerance: the logits are rounded to bf16 (8 mantissa bits, relative 2^-8 = 0.4 %) before
    # the fp32 log-softmax; with logits of a few units that moves each NLL by at most a few 1e-2
    torch.testing.assert_close(nll, _reference(hidden, weight, targets, bias), rtol=2e-2, atol=5e-2)
    # and the log-softmax of those bf16 logits in fp32, not bf16: against a float64 one of the logits made in
    # float64 and rounded to bf16 (what a bf16 product holds), fp32 arithmetic is within 1e-5 (measured ~8e-7);
    # a bf16 log-softmax is off by 3e-2 to 5e-2 here
    logits = F.linear(hidden.double(), weight.double(), None if bias is None else bias.double()).bfloat16()
    reference = F.cross_entropy(logits.double(), targets, reduction="none")
    torch.testing.assert_close(nll.double(), reference, rtol=0, atol=1e-5)


def test_chunking_does_not_change_the_result():
    hidden, weight, targets, _ = _inputs(torch.float32, False, seed=1)
    whole = chunked_token_nll(hidden, weight, targets, chunk_rows=N)
    for chunk_rows in (1, 2, 3, 10):
        torch.testing.assert_close(chunked_token_nll(hidden, weight, targets, chunk_rows=chunk_rows), whole,
                                   rtol=1e-6, atol=1e-6)


def test_a_large_vocabulary_gives_no_biased_nll_on_the_cpu():
    """Summed in fp32 into running sums, a vocabulary's smallest exponentials are rounded away and every NLL comes
    out low (F.cross_entropy on the CPU: -7e-6 nats on average here); the mean signed error against float64 must
    be rounding, not a bias."""
    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(512, 64, generator=g), torch.randn(50257, 64, generator=g) * 0.6
    targets = torch.randint(0, 50257, (512,), generator=g)
    nll = chunked_token_nll(hidden, weight, targets, chunk_rows=200)
    logits = F.linear(hidden, weight).double()   # the same fp32 logits, their log-softmax in float64
    exact = torch.logsumexp(logits, 1) - logits.gather(1, targets[:, None])[:, 0]
    assert (nll.double() - exact).abs().max() < 1e-5
    assert abs((nll.double() - exact).mean()) < 5e-7
