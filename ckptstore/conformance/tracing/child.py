"""The traced process: the standard workload on the real driver, each driver call marked.

Run as ``python -m ckptstore.conformance.tracing.child RECIPE RESULT`` under strace
(``layers.syscall_trace``). RECIPE is a pickle of the strategy's class, its settings and its driver.
Before and after every driver call the calling thread writes a marker line
(``ckptstore-syscall-mark begin 12``) to a descriptor open on /dev/null: a harmless system
call the trace shows in place, so every recorded system call can be mapped back to the
driver call (and the thread) that made it. RESULT receives, as a pickle, the driver calls
(name, arguments, result, error), the model as it stood at the start of each call where it
changed, and the workload's error if it failed.
"""

from __future__ import annotations

import os
import pickle
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ckptstore.conformance.faults import FaultPlan
from ckptstore.conformance.layers.workload import big_shard_size, standard_workload
from ckptstore.conformance.location import StrategyLocation, measuring_class
from ckptstore.conformance.model import Model
from ckptstore.conformance.outcomes import storage_failure
from ckptstore.driver import storage_calls

__all__ = ["MARK", "DriverCall", "TraceOutcome", "main"]

MARK = b"ckptstore-syscall-mark "


@dataclass(frozen=True)
class DriverCall:
    """One driver call of the traced workload."""

    index: int
    name: str
    args: tuple[Any, ...]
    """Paths and handles as given; a buffer as its length."""
    result: Any = None
    """What it returned, where that is a plain value (a handle)."""
    error: str | None = None

    def __str__(self) -> str:
        shown = ", ".join(str(a) if a != "" else '""' for a in self.args)
        return f"#{self.index} {self.name}({shown})"


@dataclass(frozen=True)
class Bytes:
    """A buffer argument, recorded by its length."""

    size: int

    def __str__(self) -> str:
        return f"<{self.size} bytes>"


@dataclass
class TraceOutcome:
    """What the traced process reports back besides the trace itself."""

    calls: list[DriverCall] = field(default_factory=list)
    models: dict[int, bytes] = field(default_factory=dict)
    """Call index -> the pickled model at that call's start (only where it changed)."""
    error: str | None = None
    storage_failed: bool = False
    """The workload failed because the storage did (an undecided run, not a verdict)."""


class _Journal:
    """Marks each driver call in the trace and remembers it."""

    def __init__(self, model: Model) -> None:
        self.outcome = TraceOutcome()
        self._model = model
        self._last_model = b""
        self._fd = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
        self._lock = threading.Lock()

    def begin(self, name: str, args: tuple[Any, ...]) -> int:
        with self._lock:
            index = len(self.outcome.calls)
            self.outcome.calls.append(DriverCall(index, name, tuple(_plain(a) for a in args)))
            model = pickle.dumps(self._model)
            if model != self._last_model:
                self.outcome.models[index] = self._last_model = model
        self._mark(f"begin {index}")
        return index

    def end(self, index: int, result: Any, error: BaseException | None) -> None:
        self._mark(f"end {index}")
        with self._lock:
            call = self.outcome.calls[index]
            plain = result if isinstance(result, (int, str, bool)) else None
            self.outcome.calls[index] = DriverCall(
                index, call.name, call.args, plain, None if error is None else repr(error)
            )

    def _mark(self, text: str) -> None:
        os.write(self._fd, MARK + text.encode() + b"\n")


class _MarkingDriver:
    """Forwards to the real driver, marking the start and end of every storage call."""

    def __init__(self, inner: Any, journal: _Journal) -> None:
        self._inner = inner
        self._journal = journal
        self._calls = storage_calls(inner)

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._inner, name)
        if name not in self._calls:
            return attribute
        return self._marked(name, attribute)

    def _marked(self, name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            index = self._journal.begin(name, args)
            try:
                result = method(*args, **kwargs)
            except BaseException as exc:
                self._journal.end(index, None, exc)
                raise
            self._journal.end(index, result, None)
            return result

        return call


def _plain(value: Any) -> Any:
    if isinstance(value, (bytes, bytearray, memoryview)):
        return Bytes(memoryview(value).nbytes)
    if value is None or isinstance(value, (int, str, float, bool)):
        return value
    return repr(value)


def main(argv: list[str]) -> int:
    """Run the workload of the recipe at ``argv[0]``; write the outcome to ``argv[1]``."""
    recipe, result = argv
    with open(recipe, "rb") as stream:
        strategy_type, settings, driver = pickle.load(stream)  # written by our own parent
    model = Model()
    journal = _Journal(model)
    strategy_type = measuring_class(strategy_type)  # measured as the parent does: no refusal
    strategy = strategy_type(_MarkingDriver(driver, journal), **settings)
    location = StrategyLocation(strategy)  # the one location, over the marked real driver
    try:
        standard_workload(location, FaultPlan(), model, big_shard_size(location))  # type: ignore[arg-type]
    except Exception as exc:
        journal.outcome.error = repr(exc)
        journal.outcome.storage_failed = storage_failure(exc) is not None
    with open(result, "wb") as stream:
        pickle.dump(journal.outcome, stream)
    return 0


if __name__ == "__main__":
    # Run the module under its own name, so that what it pickles is found by the parent.
    from ckptstore.conformance.tracing import child

    sys.exit(child.main(sys.argv[1:]))
