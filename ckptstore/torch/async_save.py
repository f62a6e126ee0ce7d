"""Asynchronous saves: a short blocking snapshot, then write and publish in the background.

``AsyncSaver.save`` copies the state into memory ckptstore owns (the part that blocks the
trainer), and returns a future of the published checkpoint. At most ``max_in_flight`` saves
run at once: a further save waits (backpressure) rather than piling up snapshots in memory.
An error in the background is raised by the future and again by the next ``save`` (or
``wait``/``close``), never swallowed. The manifest records ``blocked_s`` (how long the trainer
was blocked: the wait for a free slot and the snapshot; only saves that go on in the background
record it, so it is what such a save cost the trainer) and ``to_commit_s`` (from the call to the
moment the manifest was sealed, just before the atomic publish).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ckptstore.checkpoint import Checkpoint
from ckptstore.errors import CheckpointStateError, CkptStoreError
from ckptstore.interface import CheckpointStore
from ckptstore.torch.state import Snapshot, snapshot_state, write_snapshot

__all__ = ["AsyncSaver"]


class AsyncSaver:
    """Saves trainer state in the background, at most ``max_in_flight`` at a time."""

    def __init__(self, store: CheckpointStore, *, max_in_flight: int = 1) -> None:
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be at least 1, got {max_in_flight}")
        self.store = store
        self.max_in_flight = max_in_flight
        self._slots = threading.BoundedSemaphore(max_in_flight)
        self._executor = ThreadPoolExecutor(max_in_flight, thread_name_prefix="ckptstore-async")
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self._futures: list[Future[Checkpoint]] = []
        # One set of host buffers per save in flight, reused from save to save: a snapshot is
        # then a copy into memory that is already there (no allocation, no page faults).
        self._buffer_sets: list[dict[str, Any]] = []
        self._closed = False
        self.in_flight_peak = 0
        self._in_flight = 0

    def save(
        self,
        step: int,
        components: Mapping[str, Any],
        *,
        counters: Mapping[str, Any] | None = None,
        metadata: Mapping[str, Any] | None = None,
        rng: bool = True,
    ) -> Future[Checkpoint]:
        """Snapshot now, publish in the background; the future resolves to the checkpoint."""
        if self._closed:
            raise CheckpointStateError("this AsyncSaver is closed")
        self._raise_background_error()
        started = time.perf_counter()
        self._slots.acquire()  # backpressure: wait for a save in flight to finish
        with self._lock:
            buffers = self._buffer_sets.pop() if self._buffer_sets else {}
        try:
            snapshot = snapshot_state(
                components,
                counters=counters,
                metadata=metadata,
                rng=rng,
                copy=True,
                buffers=buffers,
            )
        except BaseException:
            self._release(buffers)
            raise
        blocked = time.perf_counter() - started
        with self._lock:
            self._in_flight += 1
            self.in_flight_peak = max(self.in_flight_peak, self._in_flight)
        future = self._executor.submit(self._write, step, snapshot, started, blocked)
        future.add_done_callback(lambda done: self._finished(done, buffers))
        self._futures.append(future)
        return future

    def _write(self, step: int, snapshot: Snapshot, started: float, blocked: float) -> Checkpoint:
        return write_snapshot(self.store, step, snapshot, {"blocked_s": blocked}, started=started)

    def _finished(self, future: Future[Checkpoint], buffers: dict[str, Any]) -> None:
        with self._lock:
            self._in_flight -= 1
            error = future.exception()
            if error is not None and self._error is None:
                self._error = error
        self._release(buffers)

    def _release(self, buffers: dict[str, Any]) -> None:
        with self._lock:
            self._buffer_sets.append(buffers)  # free for the next snapshot
        self._slots.release()

    def _raise_background_error(self) -> None:
        with self._lock:
            error, self._error = self._error, None
        if error is not None:
            raise CkptStoreError(f"an earlier asynchronous save failed: {error!r}") from error

    def wait(self) -> list[Checkpoint]:
        """Wait for every save in flight; raise the first background error."""
        futures, self._futures = self._futures, []
        results = []
        for future in futures:
            try:
                results.append(future.result())
            except BaseException:
                pass
        self._raise_background_error()
        return results

    def close(self) -> None:
        """Wait for the saves in flight, then stop the background thread."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            self._executor.shutdown(wait=True)

    def __enter__(self) -> AsyncSaver:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()
