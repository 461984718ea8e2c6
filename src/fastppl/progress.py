"""A progress line on stderr with tokens/s and ETA; silent when quiet or stderr is not a terminal."""
from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, total_tokens: int, enabled: bool, min_interval: float = 0.25):
        self.total = total_tokens
        self.done = 0
        self.enabled = enabled and sys.stderr.isatty()
        self.started = time.perf_counter()
        self.last_draw = 0.0
        self.min_interval = min_interval

    def advance(self, n_tokens: int) -> None:
        self.done += n_tokens
        now = time.perf_counter()
        if self.enabled and (now - self.last_draw >= self.min_interval or self.done >= self.total):
            self.last_draw = now
            self._draw(now)

    def _draw(self, now: float) -> None:
        elapsed = max(now - self.started, 1e-9)
        rate = self.done / elapsed
        eta = (self.total - self.done) / rate if rate > 0 else float("inf")
        fraction = self.done / max(self.total, 1)
        bar = "#" * int(30 * fraction)
        sys.stderr.write(
            f"\r[{bar:<30}] {fraction:6.1%} {self.done:,}/{self.total:,} tok  {rate:,.0f} tok/s  ETA {eta:5.1f}s"
        )
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")
            sys.stderr.flush()
