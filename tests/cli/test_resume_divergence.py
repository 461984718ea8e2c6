"""--resume with --reference-model: a divergence run stopped after a checkpoint and started again ends with exactly
the divergence of an uninterrupted run (the checkpoint holds both models' per-token columns and the KLD sums), and
a checkpoint is refused for a reference model of other weights."""
import json

import numpy as np
import pytest

from fastppl.cli import main
from fastppl.resume import CHECKPOINT_FILE

TINY = "random:gpt2-tiny"


def _eval(tokenizer_dir, text, out, *extra):
    return main(["eval", "--model", TINY, "--reference-model", TINY, "--reference-seed", "1", "--data", str(text),
                 "--tokenizer", str(tokenizer_dir), "--device", "cpu", "--quiet", "--ctx", "16", "--batch-size", "1",
                 "--json", str(out / "r.json"), "--per-token", str(out / "t.npy"), *map(str, extra)])


@pytest.mark.slow   # three two-model runs
def test_a_resumed_divergence_run_equals_an_uninterrupted_one(tmp_path, tokenizer_dir, shakespeare, monkeypatch):
    import fastppl.resume as resume
    text = tmp_path / "text.txt"
    text.write_text(shakespeare.read_text()[:200])   # 5 windows of 16 tokens
    whole, resumed, checkpoints = (tmp_path / name for name in ("whole", "resumed", "ckpt"))
    whole.mkdir()
    resumed.mkdir()
    assert _eval(tokenizer_dir, text, whole) == 0
    save_and_continue = resume.Checkpointer.after_batch

    def stop_after_the_second(self, batches_done, sums):   # as a kill right after a checkpoint
        save_and_continue(self, batches_done, sums)
        if batches_done == 2:
            raise KeyboardInterrupt
    with monkeypatch.context() as patch:
        patch.setattr(resume.Checkpointer, "after_batch", stop_after_the_second)
        assert _eval(tokenizer_dir, text, resumed, "--resume", checkpoints, "--checkpoint-batches", 1) == 130
    assert not (resumed / "r.json").exists()
    with np.load(checkpoints / CHECKPOINT_FILE) as stored:
        assert json.loads(str(stored["meta"]))["batches_done"] == 2
        assert np.isnan(stored["divergence"]).any() and not np.isnan(stored["divergence"]).all()
    assert _eval(tokenizer_dir, text, resumed, "--resume", checkpoints, "--checkpoint-batches", 1) == 0
    expected, got = (json.loads((d / "r.json").read_text()) for d in (whole, resumed))
    assert got["resumed_from_batch"] == 2 and got["batches"] == expected["batches"] > 2
    assert expected["divergence"]["kld_mean"] > 0   # two models that differ: the divergence is not trivially 0
    assert got["divergence"] == expected["divergence"] and got["nll_sum"] == expected["nll_sum"]
    assert np.array_equal(np.load(whole / "t.npy"), np.load(resumed / "t.npy"), equal_nan=True)


def test_a_checkpoint_of_another_reference_seed_is_refused(tmp_path, tokenizer_dir, capsys):
    text = tmp_path / "text.txt"
    text.write_text("When shall we three meet again, in thunder, lightning, or in rain?\n")
    out = tmp_path / "out"
    out.mkdir()
    assert _eval(tokenizer_dir, text, out, "--resume", tmp_path / "ckpt") == 0
    assert _eval(tokenizer_dir, text, out, "--resume", tmp_path / "ckpt", "--reference-seed", 2) == 2
    assert "its checkpoint was made with other arguments (reference_seed: 1 then, 2 now)" in capsys.readouterr().err
