"""--resume DIR where DIR/checkpoint.npz is not a regular file: one line naming it, exit 2, nothing written; a
FIFO there made the run wait forever for a writer."""
import contextlib
import os
import threading

import pytest

from fastppl.cli import main
from fastppl.resume import CHECKPOINT_FILE


def _unblock_after(fifo, seconds: float) -> threading.Timer:
    """Writes nothing to fifo after `seconds` if a reader waits on it: a run that blocks fails, not hangs."""
    def open_and_close():
        with contextlib.suppress(OSError):   # ENXIO: nobody is reading, nothing to unblock
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    timer = threading.Timer(seconds, open_and_close)
    timer.daemon = True
    timer.start()
    return timer


@pytest.mark.parametrize("kind", ["FIFO", "device"])
def test_a_checkpoint_that_is_not_a_regular_file_is_refused(tmp_path, tokenizer_dir, capsys, kind):
    (tmp_path / "docs.txt").write_text("To be, or not to be, that is the question. " * 4)
    resume = tmp_path / "resume"
    resume.mkdir()
    checkpoint = resume / CHECKPOINT_FILE
    if kind == "FIFO":
        os.mkfifo(checkpoint)
        timer = _unblock_after(checkpoint, 30)
    else:
        checkpoint.symlink_to("/dev/zero")
    report = tmp_path / "r.json"
    rc = main(["eval", "--model", "random:gpt2-tiny", "--tokenizer", str(tokenizer_dir), "--data",
               str(tmp_path / "docs.txt"), "--ctx", "16", "--device", "cpu", "--quiet", "--resume", str(resume),
               "--json", str(report)])
    if kind == "FIFO":
        timer.cancel()
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err == f"fastppl: error: {checkpoint}: is a {kind}, not a checkpoint file; remove it to start over\n"
    assert not report.exists() and sorted(os.listdir(resume)) == [CHECKPOINT_FILE]
