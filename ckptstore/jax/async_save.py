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

import functools
import time
from collections.abc import Mapping
from concurrent.futures import Future
from typing import Any

from ckptstore.background_saves import BackgroundSaver
from ckptstore.checkpoint import Checkpoint
from ckptstore.interface import CheckpointStore
from ckptstore.jax.save import fail_together, next_sequence, snapshot_pytree, write_snapshot

__all__ = ["AsyncPytreeSaver"]


class AsyncPytreeSaver(BackgroundSaver):
    """Saves pytrees in the background, at most ``max_in_flight`` at a time."""

    kind = "AsyncPytreeSaver"

    def __init__(
        self, store: CheckpointStore, *, max_in_flight: int = 1, timeout_s: float = 600.0
    ) -> None:
        # One thread: saves publish in the order they were asked for, and the processes of a
        # multi-process job make their coordinated commits in the same order.
        super().__init__(store, max_in_flight=max_in_flight, threads=1)
        self.timeout_s = timeout_s

    def save(
        self, step: int, tree: Any, *, metadata: Mapping[str, Any] | None = None
    ) -> Future[Checkpoint]:
        """Copy ``tree`` to the host now, publish it as ``step`` in the background."""
        self._check_open()
        # Taken first, whatever follows: every call is one coordinated save on every process
        # (a process that raises below fails it for all), or the processes fall out of step.
        sequence = next_sequence()
        started = time.perf_counter()
        buffers = None
        try:
            self._raise_background_error()
            buffers = self._take_slot()  # backpressure: wait for a save in flight to finish
            self._raise_background_error()  # the save that was in flight may have failed
            snapshot = snapshot_pytree(tree, metadata=metadata, copy=True, buffers=buffers)
        except BaseException as exc:
            if buffers is not None:
                self._release(buffers)
            if sequence is not None:  # the other processes' savers hear of it at once
                self._executor.submit(
                    fail_together, self.store, step, exc, sequence, self.timeout_s
                )
            raise
        timings = {"blocked_s": time.perf_counter() - started}
        return self._submit(
            step,
            buffers,
            functools.partial(  # not a lambda: it must not refer to the saver
                write_snapshot,
                self.store,
                step,
                snapshot,
                timings,
                started=started,
                sequence=sequence,
                timeout_s=self.timeout_s,
            ),
        )
