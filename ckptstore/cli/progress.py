"""A one-line progress bar on a terminal's stderr; silent when stderr is not a terminal."""

from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["ProgressBar"]


class ProgressBar:
    """Shows ``label [#####.....] 52% 1.2 GiB/s`` while bytes are processed."""

    def __init__(
        self, label: str, total: int, *, enabled: bool = True, stream: TextIO | None = None
    ) -> None:
        self.stream = stream or sys.stderr
        self.enabled = enabled and self.stream.isatty()
        self.label = label
        self.total = max(total, 1)
        self.done = 0
        self.started = time.monotonic()
        self._last_draw = 0.0

    def advance(self, count: int) -> None:
        """Count ``count`` more bytes done; redraw at most ten times a second."""
        self.done += count
        now = time.monotonic()
        if self.enabled and now - self._last_draw >= 0.1:
            self._last_draw = now
            self._draw(now)

    def _draw(self, now: float) -> None:
        fraction = min(self.done / self.total, 1.0)
        filled = int(fraction * 30)
        rate = self.done / max(now - self.started, 1e-9) / 2**20
        bar = "#" * filled + "." * (30 - filled)
        self.stream.write(f"\r{self.label} [{bar}] {fraction:4.0%} {rate:8.1f} MiB/s")
        self.stream.flush()

    def finish(self) -> None:
        """Clear the bar's line."""
        if self.enabled:
            self.stream.write("\r" + " " * (len(self.label) + 60) + "\r")
            self.stream.flush()
