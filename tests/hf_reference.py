"""The transformers reference for tests in any folder (a module of its own: `from conftest import` would find
tests/cli/conftest.py first when that folder's tests ran earlier)."""
import torch


def hf_reference_nll(model, rows):
    """(n, T) fp32 NLL of rows[:, 1:] given rows[:, :-1] ((n, T + 1) int64), through transformers."""
    from fastppl.models.loading import native_to_hf
    hf = native_to_hf(model.float()).eval()
    with torch.no_grad():
        logprobs = hf(input_ids=rows[:, :-1]).logits.float().log_softmax(-1)
    return -logprobs.gather(-1, rows[:, 1:, None])[..., 0]
