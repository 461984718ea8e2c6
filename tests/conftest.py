import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("FASTPPL_SHARED_DATA", ROOT.parent / "shared" / "data"))
TOKENIZER_DIR = SHARED_DATA / "gpt2-tokenizer"
SHAKESPEARE = SHARED_DATA / "tinyshakespeare.txt"


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    # every test gets the same session-wide cache dir, never the user's ~/.cache
    monkeypatch.setenv("FASTPPL_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "fastppl-cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def tokenizer_dir() -> Path:
    assert TOKENIZER_DIR.is_dir(), f"shared GPT-2 tokenizer not found at {TOKENIZER_DIR}"
    return TOKENIZER_DIR


@pytest.fixture(scope="session")
def shakespeare() -> Path:
    assert SHAKESPEARE.is_file(), f"TinyShakespeare not found at {SHAKESPEARE}"
    return SHAKESPEARE
