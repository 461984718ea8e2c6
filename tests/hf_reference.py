"""The transformers reference for tests in any folder (a module of its own: `from conftest import` would find
tests/cli/conftest.py first when that folder's tests ran earlier)."""
import torch


def hf_reference_nll(model, rows):
    """(n, T) fp32 NLL of rows[:, 1:] given rows[:, :-1] ((n, T + 1) int64), through transformers."""
    from fastppl.models.loading import native_to_hf
    hf = native_to_hf(model.float()).eval()
    with torch.no_grad():
        # normalised in float64: torch's fp32 log_softmax over a 50k vocabulary reads about 1e-5 nats low (its sum of
        # exponentials rounds down), a bias the model's fp32 forward does not have
        logprobs = hf(input_ids=rows[:, :-1]).logits.double().log_softmax(-1)
    return -logprobs.gather(-1, rows[:, 1:, None])[..., 0].float()
