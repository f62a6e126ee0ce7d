"""Reads that wait out a stale answer: the suite never mistakes a storage's stale read for
a violation when the protocol tolerates stale reads (docs/conformance.md, "Stale reads").

ckptstore never overwrites data (every attempt writes keys of its own) and cross-checks the
LATEST hint with a listing, so storage that serves an overwritten object's old bytes for a
moment is sound for it. The suite, though, overwrites on purpose (a damaged shard, racing
compare-and-swaps in the probes, the hint it judges): where it reads such an object back,
it reads until the answer is the one it waits for, for at most ``SETTLE_S``. On storage that
reads its writes at once, the first read is the answer and nothing waits.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

__all__ = ["SETTLE_S", "settled"]

T = TypeVar("T")

SETTLE_S = 5.0
"""How long a stale answer may last before the suite takes it as the storage's answer."""


def settled(read: Callable[[], T], done: Callable[[T], bool], seconds: float | None = None) -> T:
    """``read()`` again, pausing a little longer each time, until ``done`` accepts its value
    or ``seconds`` (default ``SETTLE_S``) have passed; the last value read."""
    deadline = time.monotonic() + (SETTLE_S if seconds is None else seconds)
    pause = 0.01
    while True:
        value = read()
        if done(value) or time.monotonic() >= deadline:
            return value
        time.sleep(pause)
        pause = min(pause * 2, 0.25)
