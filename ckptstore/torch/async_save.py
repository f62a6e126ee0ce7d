"""Asynchronous saves: a short blocking snapshot, then write and publish in the background.

``AsyncSaver.save`` copies the state into memory ckptstore owns (the part that blocks the
trainer), and returns a future of the published checkpoint. At most ``max_in_flight`` saves
run at once: a further save waits (backpressure) rather than piling up snapshots in memory.
An error in the background is raised by the future and again by the next ``save`` (or
``wait``/``close``), never swallowed (``ckptstore.background_saves``: a saver never closed
logs its failed saves when the interpreter exits). The manifest records ``blocked_s`` (how
long the trainer was blocked: the wait for a free slot and the snapshot; only saves that go
on in the background record it, so it is what such a save cost the trainer) and
``to_commit_s`` (from the call to the moment the manifest was sealed, just before the atomic
publish).
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
from ckptstore.torch.state import snapshot_state, write_snapshot

__all__ = ["AsyncSaver"]


class AsyncSaver(BackgroundSaver):
    """Saves trainer state in the background, at most ``max_in_flight`` at a time."""

    kind = "AsyncSaver"

    def __init__(self, store: CheckpointStore, *, max_in_flight: int = 1) -> None:
        super().__init__(store, max_in_flight=max_in_flight, threads=max_in_flight)

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
        self._check_open()
        self._raise_background_error()
        started = time.perf_counter()
        buffers = self._take_slot()  # backpressure: wait for a save in flight to finish
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
        timings = {"blocked_s": time.perf_counter() - started}
        return self._submit(
            step,
            buffers,
            functools.partial(  # not a lambda: it must not refer to the saver
                write_snapshot, self.store, step, snapshot, timings, started=started
            ),
        )
