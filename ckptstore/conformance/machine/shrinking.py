"""Hypothesis stops searching for more failures and shrinking at the suite's deadline: the one
place the suite moves limits inside hypothesis's engine.

Hypothesis gives up shrinking five minutes after it began: its engine reads
``time.perf_counter() + MAX_SHRINKING_SECONDS`` (``hypothesis.internal.conjecture.engine``)
when shrinking starts. No public API bounds that time: the settings bound the number of
examples (``max_examples``), each example's time (``deadline``) and which phases run
(``phases``; without ``Phase.shrink`` nothing is shrunk, and the report would show the
unshrunk sequence), and ``hypothesis.stateful.run_state_machine_as_test`` takes only settings.
Its maintainers chose not to make the limit a setting (HypothesisWorks/hypothesis#3400). The
suite's time budget must cover shrinking, so ``shrinking_stops_at`` moves that private
constant, and nothing else does. ``tests/test_conformance_report.py`` holds the canary that
fails on a hypothesis whose engine no longer reads it so; pyproject.toml pins the range of
hypothesis versions it was checked on.

Once one failure is found, hypothesis also goes on generating examples to find other, distinct
failures, for up to ten seconds after the first (``ConjectureRunner.should_generate_more``),
whatever the settings' deadline: on a loaded machine that search alone took the layer 16 s
past an 8 s budget. While a deadline is set, that search ends at the deadline too (the
examples before the first failure are not cut: the settings' ``max_examples`` bounds them).
The same canary checks the method still exists.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator

__all__ = ["shrinking_stops_at"]

log = logging.getLogger(__name__)


@contextlib.contextmanager
def shrinking_stops_at(deadline: float | None, *, least_s: float = 0.0) -> Iterator[None]:
    """While entered, hypothesis stops searching for failures other than the first it found,
    and stops shrinking, at ``deadline`` (``time.monotonic()``; None: at its own limits), but
    shrinks for ``least_s`` seconds at least (its guaranteed share, for a failure found at
    the deadline), and reports the smallest failing example found by then.

    On a hypothesis without the limit this module moves, shrinking is not bounded (the run
    is still right, only maybe longer) and a warning says so.
    """
    if deadline is None:
        yield
        return
    from hypothesis.internal.conjecture import engine

    saved = getattr(engine, "MAX_SHRINKING_SECONDS", None)
    if not isinstance(saved, (int, float)):
        log.warning(
            "this hypothesis has no engine.MAX_SHRINKING_SECONDS: shrinking is not bounded "
            "by the conformance budget (see ckptstore.conformance.machine.shrinking)"
        )
        yield
        return
    left = deadline - time.monotonic()
    at = _AtDeadline(time.perf_counter() + left, least_s)
    runner = engine.ConjectureRunner
    searching = runner.__dict__.get("should_generate_more")

    def search_more(self: engine.ConjectureRunner) -> bool:
        if self.interesting_test_cases and time.monotonic() >= deadline:
            return False  # a failure is found and the time is up: shrink it
        assert searching is not None
        return bool(searching(self))

    engine.MAX_SHRINKING_SECONDS = at  # type: ignore[assignment]
    if searching is not None:
        runner.should_generate_more = search_more  # type: ignore[method-assign]
    try:
        yield
    finally:
        engine.MAX_SHRINKING_SECONDS = saved  # type: ignore[assignment]
        if searching is not None:
            runner.should_generate_more = searching  # type: ignore[method-assign]


class _AtDeadline(float):
    """A number of seconds that, added to the time shrinking starts, gives the deadline: the
    engine adds it to ``time.perf_counter()`` then, not now."""

    at: float
    least_s: float

    def __new__(cls, at: float, least_s: float = 0.0) -> _AtDeadline:
        seconds = super().__new__(cls, max(at - time.perf_counter(), least_s, 0.0))
        seconds.at = at
        seconds.least_s = least_s
        return seconds

    def __radd__(self, now: object) -> float:
        started = float(now) if isinstance(now, (int, float)) else time.perf_counter()
        return max(self.at, started + self.least_s)
