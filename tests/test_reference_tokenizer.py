"""A divergence run refuses a reference model whose own tokenizer is not the run's, even with the same vocabulary
size: the same ids would stand for other text in the two models."""
import json
import shutil

import pytest

from fastppl.cli import main
from fastppl.models.loading import native_to_hf, random_native


def _tokenizer_copy(tokenizer_dir, directory, swapped_pairs=()):
    """GPT-2's tokenizer files in directory, with the ids of some pairs of tokens swapped (same size, other ids)."""
    directory.mkdir(parents=True, exist_ok=True)
    for path in tokenizer_dir.iterdir():
        shutil.copy(path, directory / path.name)
    tokenizer = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    for a, b in swapped_pairs:
        vocab[a], vocab[b] = vocab[b], vocab[a]
    (directory / "tokenizer.json").write_text(json.dumps(tokenizer))
    return directory


@pytest.fixture(scope="module")
def reference_weights(tmp_path_factory):
    """random:gpt2-tiny's weights as a checkpoint directory of weights alone."""
    directory = tmp_path_factory.mktemp("reference")
    native_to_hf(random_native("gpt2-tiny", 1, "cpu")).save_pretrained(directory)
    return directory


def _run(tokenizer_dir, reference, tmp_path) -> int:
    data = tmp_path / "text.txt"
    data.write_text("The quick brown fox jumps over the lazy dog. " * 5)
    return main(["eval", "--model", "random:gpt2-tiny", "--tokenizer", str(tokenizer_dir), "--data", str(data),
                 "--device", "cpu", "--ctx", "32", "--quiet", "--reference-model", str(reference)])


@pytest.mark.slow
def test_a_reference_with_the_same_tokenizer_is_accepted(tokenizer_dir, reference_weights, tmp_path):
    reference = tmp_path / "same"
    shutil.copytree(reference_weights, reference)
    _tokenizer_copy(tokenizer_dir, reference)
    assert _run(tokenizer_dir, reference, tmp_path) == 0
    assert _run(tokenizer_dir, reference_weights, tmp_path) == 0   # no tokenizer of its own: nothing to compare


def test_a_reference_whose_tokenizer_swaps_ids_is_refused(tokenizer_dir, reference_weights, tmp_path, capsys):
    reference = tmp_path / "swapped"
    shutil.copytree(reference_weights, reference)
    _tokenizer_copy(tokenizer_dir, reference, [("the", "and"), ("Ġthe", "Ġand"), ("ing", "ed")])
    assert _run(tokenizer_dir, reference, tmp_path) == 2
    captured = capsys.readouterr()
    assert captured.err == (f"fastppl: error: --reference-model {reference} has a tokenizer of its own that differs "
                            f"from the run's ({tokenizer_dir}): the same ids would stand for other text; compare two "
                            "models of one tokenizer\n") and captured.out == ""
