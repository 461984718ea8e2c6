"""Progress on stderr with tokens/s and ETA: a line redrawn in place on a terminal; otherwise (a log file under
nohup or a batch scheduler) a plain line every LOG_INTERVAL seconds, so that a long run is not silent."""
from __future__ import annotations

import sys
import time

LOG_INTERVAL = 30.0   # seconds between lines when stderr is not a terminal; a shorter run prints none


class Progress:
    def __init__(self, total_tokens: int, enabled: bool, min_interval: float = 0.25):
        self.total = total_tokens
        self.done = 0
        self.enabled = enabled
        self.terminal = sys.stderr.isatty()
        self.started = time.perf_counter()
        self.last_draw = 0.0 if self.terminal else self.started
        self.min_interval = min_interval if self.terminal else LOG_INTERVAL

    def advance(self, n_tokens: int) -> None:
        self.done += n_tokens
        if not self.enabled:
            return
        now = time.perf_counter()
        if now - self.last_draw >= self.min_interval or (self.terminal and self.done >= self.total):
            self.last_draw = now
            self._draw(now)

    def _draw(self, now: float) -> None:
        elapsed = max(now - self.started, 1e-9)
        rate = self.done / elapsed
        eta = f"{(self.total - self.done) / rate:5.1f}s" if rate > 0 else "   --"
        fraction = self.done / max(self.total, 1)
        counts = f"{fraction:6.1%} {self.done:,}/{self.total:,} tok  {rate:,.0f} tok/s  ETA {eta}"
        if self.terminal:
            sys.stderr.write(f"\r[{'#' * int(30 * fraction):<30}] {counts}")
        else:
            sys.stderr.write(f"fastppl: {counts.strip()}\n")
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled and self.terminal:
            sys.stderr.write("\n")
            sys.stderr.flush()
