import os
from pathlib import Path

import pytest
import torch

# Without a GPU, Triton kernels run in Triton's interpreter on the CPU (it must be chosen before any kernel
# is defined), so that the fused kernels' tests run in CI too (with the triton extra)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("FASTPPL_SHARED_DATA", ROOT.parent / "shared" / "data"))
TOKENIZER_DIR = SHARED_DATA / "gpt2-tokenizer"
SHAKESPEARE = SHARED_DATA / "tinyshakespeare.txt"
HOW_TO_SUPPLY = ("put the GPT-2 tokenizer folder (gpt2-tokenizer/, with tokenizer.json) and tinyshakespeare.txt in "
                 "../shared/data beside the checkout, or point FASTPPL_SHARED_DATA at a folder holding them")


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    # every test gets the same session-wide cache dir, never the user's ~/.cache
    monkeypatch.setenv("FASTPPL_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "fastppl-cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def tokenizer_dir() -> Path:
    if not TOKENIZER_DIR.is_dir():
        pytest.fail(f"shared GPT-2 tokenizer not found at {TOKENIZER_DIR}: {HOW_TO_SUPPLY}", pytrace=False)
    return TOKENIZER_DIR


@pytest.fixture(scope="session")
def shakespeare() -> Path:
    if not SHAKESPEARE.is_file():
        pytest.fail(f"TinyShakespeare not found at {SHAKESPEARE}: {HOW_TO_SUPPLY}", pytrace=False)
    return SHAKESPEARE


@pytest.fixture(scope="session")
def tiny_trained_checkpoint(tmp_path_factory, tokenizer_dir, shakespeare) -> Path:
    """A 2-layer, d-128, ctx-128 GPT-2 trained for 12 steps at twice the script's learning rate (about 6 s on
    one CPU thread) on the train split of TinyShakespeare by tests/fixtures/train_tiny.py: an HF checkpoint
    directory with its tokenizer, whose predictions are far from uniform (val NLL about 7.1 nats, against 10.8
    for random weights; 30 steps at the script's rate give 6.8)."""
    from fixtures.train_tiny import train_tiny
    with pytest.MonkeyPatch.context() as mp:
        # a session fixture runs before the per-test cache isolation: isolate here too
        mp.setenv("FASTPPL_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "fastppl-cache"))
        mp.setenv("HF_HUB_OFFLINE", "1")
        return train_tiny(tmp_path_factory.mktemp("tiny-trained"), steps=12, seed=0, learning_rate=6e-3,
                          data=shakespeare, tokenizer=tokenizer_dir)


@pytest.fixture
def sharpened_random_models(monkeypatch):
    """random:<preset> models (fastppl.models.loading.random_native, which the bench builds from) with weights
    well above the 0.02 init (norms kept), so that predictions are far from uniform: with near-uniform ones
    every token's NLL is ~ln V whichever token is scored, and a scoring error would not show. Returns the
    patched random_native (the same weights for a preset, whatever the seed)."""
    import fastppl.models.loading as loading
    unsharp = loading.random_native

    def sharpened(*args, **kwargs):
        model = unsharp(*args, **kwargs)
        generator = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" not in name and "ln" not in name:
                    p.copy_(torch.randn(p.shape, generator=generator) * 0.1)
        return model

    monkeypatch.setattr(loading, "random_native", sharpened)
    return sharpened


@pytest.fixture
def related_models(monkeypatch):
    """random:<preset> weights well above the 0.02 init (predictions far from uniform, so that an error shows),
    each seed's the same base plus its own perturbation: two seeds are two related models, as a model and its
    quantised or fine-tuned copy are."""
    import fastppl.models.loading as loading
    plain = loading.random_native

    def related(preset, seed=0, device="cpu"):
        model = plain(preset, 0, device)
        base, own = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1000 + seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" not in name and "ln" not in name:
                    p.copy_(torch.randn(p.shape, generator=base) * 0.1 + torch.randn(p.shape, generator=own) * 0.03)
        return model

    monkeypatch.setattr(loading, "random_native", related)
    return related


@pytest.fixture
def one_thread():
    """torch on one CPU thread for a test of many tiny products (several threads wait on each other there)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
