"""Fixtures of the CLI's error tests: a text to score, the output paths that must stay unwritten, a tiny
checkpoint, and a directory nobody may write in."""
from pathlib import Path

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel


@pytest.fixture
def outputs(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    return out / "report.json", out / "tokens.npy"


@pytest.fixture
def text(tmp_path):
    path = tmp_path / "text.txt"
    path.write_text("It is a tale told by an idiot, full of sound and fury, signifying nothing.\n")
    return path


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny HF GPT-2 directory (vocabulary of 1,000 ids: smaller than GPT-2's tokenizer)."""
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=1000, n_positions=64, n_embd=32, n_layer=2, n_head=4,
                                       bos_token_id=999, eos_token_id=999))
    directory = tmp_path_factory.mktemp("small-vocab")
    model.save_pretrained(directory)
    return directory


def _can_create_in(directory: Path) -> bool:
    try:
        (directory / ".fastppl-probe").touch()
    except OSError:
        return False
    (directory / ".fastppl-probe").unlink()
    return True


@pytest.fixture
def unwritable_dir(tmp_path):
    """A directory this process cannot create files in: a chmod 555 one, or for root (who writes
    through permission bits) a pseudo filesystem that refuses everyone."""
    read_only = tmp_path / "read-only"
    read_only.mkdir()
    read_only.chmod(0o555)
    try:
        if not _can_create_in(read_only):
            yield read_only
            return
        for candidate in (Path("/sys"), Path("/proc")):
            if candidate.is_dir() and not _can_create_in(candidate):
                yield candidate
                return
        pytest.skip("no directory here refuses this user's writes")
    finally:
        read_only.chmod(0o755)

