"""scripts/train_tiny.py: a repeatable tiny checkpoint that fastppl reads without further flags."""
import importlib.util
import json
from pathlib import Path

from fastppl.cli import main
from fastppl.data.corpus import split_text
from fastppl.models import load_model

ROOT = Path(__file__).resolve().parents[1]


def _train_tiny_module():
    spec = importlib.util.spec_from_file_location("train_tiny", ROOT / "scripts" / "train_tiny.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_same_seed_same_weights(tmp_path, tokenizer_dir, shakespeare):
    train_tiny = _train_tiny_module().train_tiny
    small = dict(steps=2, seed=3, data=shakespeare, tokenizer=tokenizer_dir, n_layer=1, n_head=2, n_embd=32,
                 ctx=16, batch_size=2)
    a, b = train_tiny(tmp_path / "a", **small), train_tiny(tmp_path / "b", **small)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    other = train_tiny(tmp_path / "c", **{**small, "seed": 4})   # and the seed is what sets them
    assert (other / "model.safetensors").read_bytes() != (a / "model.safetensors").read_bytes()


def test_trained_checkpoint_is_evaluated_by_fastppl(tmp_path, tiny_trained_checkpoint, shakespeare):
    training = json.loads((tiny_trained_checkpoint / "training.json").read_text())
    assert training["last_loss"] < training["first_loss"] - 2
    model = load_model(str(tiny_trained_checkpoint))
    assert (model.config.n_layer, model.config.n_embd, model.max_positions) == (2, 128, 128)

    # a slice of the val split (never trained on); no --tokenizer: the checkpoint carries its own
    text = tmp_path / "val-slice.txt"
    text.write_text(split_text(shakespeare.read_text(), "val")[:3000])
    out = tmp_path / "r.json"
    assert main(["eval", "--model", str(tiny_trained_checkpoint), "--data", str(text), "--device", "cpu",
                 "--quiet", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["nll"] < 8.0   # random weights: 10.8
