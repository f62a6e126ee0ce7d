"""Asynchronous pytree saves: the trainer waits for the device-to-host copy only.

``AsyncPytreeSaver.save`` copies what this process writes of the tree into host memory that
ckptstore owns (every copy started before the first is waited for), then writes and publishes
on a background thread, and returns a future of the checkpoint. At most ``max_in_flight``
saves run at once (a further save waits: backpressure, not snapshots piling up in memory). A
background error is raised by the future and again by the next ``save``, ``wait`` or
``close``, never swallowed. In a multi-process job each process's saver makes the same saves
in the same order; the commit is ``ckptstore.coordinated``'s, from the background threads.
The manifest records ``blocked_s`` (what the save cost the trainer) and ``to_commit_s``.
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
from ckptstore.jax.save import fail_together, next_sequence, snapshot_pytree, write_snapshot

__all__ = ["AsyncPytreeSaver"]


class AsyncPytreeSaver:
    """Saves pytrees in the background, at most ``max_in_flight`` at a time."""

    def __init__(
        self, store: CheckpointStore, *, max_in_flight: int = 1, timeout_s: float = 600.0
    ) -> None:
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be at least 1, got {max_in_flight}")
        self.store = store
        self.timeout_s = timeout_s
        self._slots = threading.BoundedSemaphore(max_in_flight)
        # One thread: saves publish in the order they were asked for, and the processes of a
        # multi-process job make their coordinated commits in the same order.
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="ckptstore-jax-async")
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self._futures: list[Future[Checkpoint]] = []
        # One set of host buffers per save in flight, reused from save to save: a snapshot is
        # then a copy into memory that is already there (no allocation, no page faults).
        self._buffer_sets: list[dict[Any, Any]] = []
        self._closed = False

    def save(
        self, step: int, tree: Any, *, metadata: Mapping[str, Any] | None = None
    ) -> Future[Checkpoint]:
        """Copy ``tree`` to the host now, publish it as ``step`` in the background."""
        if self._closed:
            raise CheckpointStateError("this AsyncPytreeSaver is closed")
        self._raise_background_error()
        sequence = next_sequence()
        started = time.perf_counter()
        self._slots.acquire()  # backpressure: wait for a save in flight to finish
        with self._lock:
            buffers = self._buffer_sets.pop() if self._buffer_sets else {}
        try:
            self._raise_background_error()  # the save that was in flight may have failed
            snapshot = snapshot_pytree(tree, metadata=metadata, copy=True, buffers=buffers)
        except BaseException as exc:
            self._release(buffers)
            if sequence is not None:  # the other processes' savers hear of it at once
                self._executor.submit(
                    fail_together, self.store, step, exc, sequence, self.timeout_s
                )
            raise
        blocked = time.perf_counter() - started
        future = self._executor.submit(
            self._write, step, snapshot, buffers, blocked, started, sequence
        )
        self._futures.append(future)
        return future

    def _write(
        self,
        step: int,
        snapshot: Any,
        buffers: dict[Any, Any],
        blocked: float,
        started: float,
        sequence: int | None,
    ) -> Checkpoint:
        """Publish ``snapshot``; its buffers and its slot are free before its future is done."""
        try:
            return write_snapshot(
                self.store,
                step,
                snapshot,
                {"blocked_s": blocked},
                started=started,
                sequence=sequence,
                timeout_s=self.timeout_s,
            )
        except BaseException as exc:
            with self._lock:
                if self._error is None:
                    self._error = exc
            raise
        finally:
            self._release(buffers)

    def _release(self, buffers: dict[Any, Any]) -> None:
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

    def __enter__(self) -> AsyncPytreeSaver:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()
