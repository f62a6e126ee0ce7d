"""Saves that publish in the background: every failure reaches the trainer, none is swallowed.

The machinery an asynchronous saver shares (``ckptstore.torch.AsyncSaver``,
``ckptstore.jax.AsyncPytreeSaver``): at most ``max_in_flight`` saves at once (a further save
waits for a slot: backpressure, not snapshots piling up in memory); host buffers reused from
save to save; a background error recorded before its future is done, so that it is raised by
the future and again by the next ``save``, ``wait`` or ``close``. A saver that is dropped, or
still open when the interpreter exits (after its threads finished their saves), without being
closed logs as an error each save that failed and was not reported: a lost checkpoint is never
silent.
A ``with`` block that raises keeps its own exception: a background error found while closing
is logged beside it, not raised in its place.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from types import TracebackType
from typing import Any, TypeVar

from ckptstore.checkpoint import Checkpoint
from ckptstore.errors import CheckpointStateError, CkptStoreError
from ckptstore.interface import CheckpointStore

__all__ = ["BackgroundSaver"]

log = logging.getLogger(__name__)

Buffers = dict[Any, Any]
"""Host memory of one snapshot, kept for the next one (the snapshot function's own keys)."""

_Self = TypeVar("_Self", bound="BackgroundSaver")


class BackgroundSaver:
    """The slots, threads, buffers and errors of a saver that publishes in the background."""

    kind = "asynchronous saver"
    """What a subclass is called in its errors."""

    def __init__(self, store: CheckpointStore, *, max_in_flight: int, threads: int) -> None:
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be at least 1, got {max_in_flight}")
        self.store = store
        self.max_in_flight = max_in_flight
        self._executor = ThreadPoolExecutor(threads, thread_name_prefix="ckptstore-async")
        self._saves = _Saves(store.url, self.kind, max_in_flight)
        # Reports the saves that failed unseen if this saver is dropped, or still open when
        # the interpreter exits, without being closed (nothing in the background refers to
        # the saver itself, so that it can be dropped).
        self._finalizer = weakref.finalize(self, self._saves.report_unwaited)
        self._closed = False

    @property
    def in_flight_peak(self) -> int:
        """The most saves that were in flight at once."""
        return self._saves.in_flight_peak

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointStateError(f"this {self.kind} is closed")

    def _take_slot(self) -> Buffers:
        """Wait for a free slot (backpressure); the host buffers the snapshot may reuse."""
        return self._saves.take_slot()

    def _release(self, buffers: Buffers) -> None:
        """Give back a slot and its buffers (the snapshot in them is no longer needed)."""
        self._saves.release(buffers)

    def _submit(
        self, step: int, buffers: Buffers, write: Callable[[], Checkpoint]
    ) -> Future[Checkpoint]:
        """Run ``write`` in the background (it must not refer to the saver); its slot and
        buffers are free, and its error recorded, before its future is done."""
        save = _Save(step)
        self._saves.started(save)
        future = self._executor.submit(self._saves.run, save, buffers, write)
        save.future = future
        return future

    def _raise_background_error(self) -> None:
        error = self._saves.take_error()
        if error is not None:
            raise CkptStoreError(f"an earlier asynchronous save failed: {error!r}") from error

    def wait(self) -> list[Checkpoint]:
        """Wait for every save in flight; raise the first background error."""
        saves = list(self._saves.unwaited)
        self._saves.unwaited.clear()
        results = []
        for save in saves:
            assert save.future is not None
            try:
                results.append(save.future.result())
            except BaseException:
                pass  # recorded as the background error (the first one is raised below)
        self._raise_background_error()
        return results

    def close(self) -> None:
        """Wait for the saves in flight, then stop the background threads; raise the first
        background error not raised yet. Closing again does nothing."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            self._executor.shutdown(wait=True)
            self._finalizer.detach()

    def __enter__(self: _Self) -> _Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if exc is None:
            self.close()
            return
        try:
            self.close()
        except Exception as error:  # the block's own exception goes on; this one is logged
            log.error("%s: while a with block raised %r: %s", self.store.url, exc, error)


class _Saves:
    """The state of one saver's background saves, apart from the saver (a failed save's
    traceback refers to this, not to the saver)."""

    def __init__(self, url: str, kind: str, max_in_flight: int) -> None:
        self.url, self.kind = url, kind
        self.lock = threading.Lock()
        self.slots = threading.BoundedSemaphore(max_in_flight)
        # One set of host buffers per save in flight, reused from save to save: a snapshot is
        # then a copy into memory that is already there (no allocation, no page faults).
        self.buffer_sets: list[Buffers] = []
        self.error: BaseException | None = None
        self.failed: _Save | None = None  # the save that raised ``error``
        self.unwaited: list[_Save] = []
        self.in_flight = 0
        self.in_flight_peak = 0

    def take_slot(self) -> Buffers:
        self.slots.acquire()
        with self.lock:
            return self.buffer_sets.pop() if self.buffer_sets else {}

    def release(self, buffers: Buffers) -> None:
        with self.lock:
            self.buffer_sets.append(buffers)
        self.slots.release()

    def started(self, save: _Save) -> None:
        with self.lock:
            self.unwaited.append(save)
            self.in_flight += 1
            self.in_flight_peak = max(self.in_flight_peak, self.in_flight)

    def run(self, save: _Save, buffers: Buffers, write: Callable[[], Checkpoint]) -> Checkpoint:
        try:
            return write()
        except BaseException as exc:
            with self.lock:
                if self.error is None:
                    self.error, self.failed = exc, save
            raise
        finally:
            with self.lock:
                self.in_flight -= 1
            self.release(buffers)

    def take_error(self) -> BaseException | None:
        """The first background error not raised yet (then it counts as raised)."""
        with self.lock:
            error, failed, self.error, self.failed = self.error, self.failed, None, None
        if failed is not None:
            failed.reported = True
        return error

    def report_unwaited(self) -> None:
        """Log each save that failed and was not reported (the saver is dropped, or the
        interpreter exits: its threads have finished their saves); a save still running when
        the saver is dropped is reported when it ends."""
        for save in self.unwaited:
            assert save.future is not None
            save.future.add_done_callback(functools.partial(self.report, save))
        self.unwaited.clear()

    def report(self, save: _Save, future: Future[Checkpoint]) -> None:
        error = future.exception()
        if error is not None and not save.reported:
            log.error(
                "%s: the asynchronous save of step %d failed, and the %s was not closed to "
                "report it: %r",
                self.url,
                save.step,
                self.kind,
                error,
            )


@dataclasses.dataclass
class _Save:
    """One save in the background: its step, its future, whether its error was raised."""

    step: int
    future: Future[Checkpoint] | None = None
    reported: bool = False
