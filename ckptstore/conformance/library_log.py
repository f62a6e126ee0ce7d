"""What ckptstore logs while the suite runs goes into the report, counted, and is not printed.

The suite provokes every warning ckptstore can log: a damaged step skipped, a LATEST hint
ignored, a lagging listing, a server that deletes the live object. Printed, dozens of them
bury the progress lines and the report, and read as trouble with the storage under test
when most are about faults the suite made on purpose. While any run of the suite is going,
the ``ckptstore`` logger's warnings and errors go to a capture instead of its handlers; each
run gets the records that name its store, and those that name no store going (they are
counted in every run going), as a count and the first one, which the report prints in a
coverage line. A record about no run going, from a thread that ran before the suite began
(an application's, a test's leftover), is not the suite's: it is logged as without the
capture. Several runs at once (``batch``) share one capture: it is installed by the first
run and removed by the last. Records logged in the racer processes the suite starts are
sent to the leading process and counted there (``layers/races``).
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field

from ckptstore.urls import parse_url, redact

__all__ = ["CapturedLog", "captured"]

EXAMPLE_CHARS = 300
"""How much of the first record the report quotes."""
_LOGGER = "ckptstore"


@dataclass
class CapturedLog:
    """The records one run of the suite was given: how many, and the first."""

    needles: tuple[str, ...]
    """What a record names when it is about this run's store (its URL, its path)."""
    count: int = 0
    example: str = ""
    levels: set[str] = field(default_factory=set)

    def add(self, level: str, message: str) -> None:
        self.count += 1
        self.levels.add(level)
        if not self.example:  # redacted whole, then cut: a cut could split a secret
            shown = redact(message).replace("\n", " ")
            self.example = shown if len(shown) <= EXAMPLE_CHARS else shown[:EXAMPLE_CHARS] + "..."

    def line(self) -> str:
        """The report's coverage line ("" when nothing was logged)."""
        if not self.count:
            return ""
        plural = "s" if self.count > 1 else ""
        kinds = " and ".join(sorted(level.lower() + plural for level in self.levels))
        return (
            f"ckptstore logged {self.count} {kinds} during the run, not printed (most are "
            f"about faults the suite made on purpose); the first: {self.example}"
        )


class _Capture(logging.Handler):
    """Hands each record to the runs it names, or to every run when it names none."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage()
        except Exception:  # a record whose arguments do not format: still counted
            message = str(record.msg)
        with _lock:
            runs = [run for run in _active if any(_names(message, n) for n in run.needles)]
            if runs or threading.current_thread() not in _elsewhere:
                for run in runs or _active:
                    run.add(record.levelname, message)
                return
            level, propagate, handlers = _restore
        # Another thread's, about no run going: logged as it would be without the suite
        # (``Logger.callHandlers``: the root's handlers too, else logging's last resort).
        root = logging.getLogger()
        if record.levelno < (level or root.getEffectiveLevel()):
            return
        chain = [*handlers, *(root.handlers if propagate else [])]
        if not chain and logging.lastResort is not None:
            chain = [logging.lastResort]
        for handler in chain:
            if record.levelno >= handler.level:
                handler.handle(record)


def _names(message: str, needle: str) -> bool:
    """Whether ``message`` names the store ``needle`` is (or a place under it): not another
    whose name starts alike (``s3://b/run`` is not ``fsspec+s3://b/run-2``)."""
    pattern = rf"(?<![\w+.-]){re.escape(needle)}(?![\w.-])"
    return re.search(pattern, message) is not None


_lock = threading.Lock()
_active: list[CapturedLog] = []
_elsewhere: weakref.WeakSet[threading.Thread] = weakref.WeakSet()
"""Threads that ran before the capture was installed and run no suite: an application's, or
a test's leftover. Their records that name no run going are not the suite's to count."""
_handler = _Capture(logging.WARNING)
_restore: tuple[int, bool, list[logging.Handler]] = (logging.NOTSET, True, [])


@contextlib.contextmanager
def captured(url: str) -> Iterator[CapturedLog]:
    """While entered, ckptstore's warnings and errors are captured, not printed; those about
    the store at ``url`` (or all, if no other run is going) are counted in what it yields."""
    run = CapturedLog(_needles(url))
    logger = logging.getLogger(_LOGGER)
    global _restore
    with _lock:
        if not _active:
            _restore = (logger.level, logger.propagate, list(logger.handlers))
            logger.handlers = [_handler]
            logger.setLevel(logging.WARNING)
            logger.propagate = False
            _elsewhere.clear()
            _elsewhere.update(threading.enumerate())
        _elsewhere.discard(threading.current_thread())  # a run's own thread
        _active.append(run)
    try:
        yield run
    finally:
        with _lock:
            _active.remove(run)
            if not _active:
                logger.setLevel(_restore[0])
                logger.propagate = _restore[1]
                logger.handlers = _restore[2]


def _needles(url: str) -> tuple[str, ...]:
    """How a record names the store at ``url``: its URL without the query, and its bucket
    and path (or its path, for a file system), as messages print them."""
    shown = redact(url).split("?", 1)[0].rstrip("/")
    try:
        parsed = parse_url(url)
    except Exception:  # a tiered pair's "fast -> durable", or a URL the run refuses later
        return (shown,)
    where = f"{parsed.netloc}{parsed.path}" if parsed.netloc else parsed.path
    return tuple(n for n in (shown, where.rstrip("/")) if len(n) > 1)
