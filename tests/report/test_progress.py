"""Progress on stderr: redrawn in place on a terminal, a plain line every LOG_INTERVAL seconds otherwise."""
import io

import pytest

from fastppl.report import progress as progress_module
from fastppl.report.progress import LOG_INTERVAL, Progress


class _Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


@pytest.mark.parametrize("terminal", [False, True])
def test_progress_lines(monkeypatch, terminal):
    stderr = io.StringIO()
    stderr.isatty = lambda: terminal
    clock = _Clock()
    monkeypatch.setattr(progress_module.sys, "stderr", stderr)
    monkeypatch.setattr(progress_module.time, "perf_counter", clock)
    bar = Progress(1000, enabled=True)
    bar.advance(0)
    clock.now += 1.0
    bar.advance(100)
    if not terminal:
        assert stderr.getvalue() == ""                  # a short run writes nothing into a log
    clock.now += LOG_INTERVAL
    bar.advance(400)
    bar.close()
    text = stderr.getvalue()
    if terminal:
        assert text.startswith("\r[") and "ETA    --" in text and text.endswith("\n")   # 0 tokens: no ETA yet
    else:
        # one line: 500 of 1,000 tokens in 31 s
        assert text == "fastppl: 50.0% 500/1,000 tok  16 tok/s  ETA  31.0s\n"


def test_quiet_writes_nothing(monkeypatch):
    stderr = io.StringIO()
    monkeypatch.setattr(progress_module.sys, "stderr", stderr)
    bar = Progress(10, enabled=False)
    bar.advance(10)
    bar.close()
    assert stderr.getvalue() == ""
