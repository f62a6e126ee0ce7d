"""The store's side of an attempt: a pending checkpoint hands its manifest to one committer.

A ``PendingCheckpoint`` stages its shards through its owner, builds its own manifest, and hands
it to the owner's ``commit``: the commit point. ``StoreAttempt`` is the owner of an attempt a
store began; it commits through the store's one ``Publisher``, which checks that the writer
was not superseded just before the commit point (§8.2), publishes, and then does what follows
a publish and cannot undo it (the LATEST hint, retention, the store's listeners).
``JoinedAttempt`` is the owner of an attempt another process began: it stages and seals, and
never publishes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from ckptstore.checkpoint import Checkpoint
from ckptstore.commit.base import CommitStrategy, ShardSink
from ckptstore.errors import CheckpointStateError, CkptStoreError, StorageError
from ckptstore.hint import ignore_hint
from ckptstore.history import History
from ckptstore.manifest import Manifest
from ckptstore.pending import CommitStamp

if TYPE_CHECKING:
    from ckptstore.store import Store

__all__ = ["JoinedAttempt", "Publisher", "StoreAttempt"]

log = logging.getLogger(__name__)


class Publisher:
    """Publishes the manifests of one store's attempts, never for a superseded writer; what
    follows a publish (hint, retention, listeners) never undoes it."""

    def __init__(
        self, store: Store, history: History, checkpoint_of: Callable[[Manifest], Checkpoint]
    ) -> None:
        self.store = store
        self.history = history
        self.checkpoint_of = checkpoint_of
        self.listeners: list[Callable[[int], None]] = []

    def stamp(self) -> CommitStamp:
        """What the store records in a manifest it commits now: its backend, the epoch it
        writes in, and the time on its clock."""
        epoch = self.store.epoch
        assert epoch is not None  # chosen by begin
        return CommitStamp(
            backend=self.store.strategy.name,
            epoch=epoch,
            committed_at=datetime.fromtimestamp(self.store.clock(), timezone.utc),
        )

    def commit(self, manifest: Manifest) -> Checkpoint:
        """Write ``manifest``: the commit point, refused to a writer superseded since it began."""
        # Just before the commit point: a writer superseded since it began publishes nothing.
        # A takeover after this check is the race the readers' rule covers (§8.2).
        self.history.check_writable(manifest.step, manifest.epoch)
        if self.store.signing_key is not None:
            manifest = manifest.signed_by(self.store.signing_key)
        self.store.strategy.publish(manifest)
        return self.checkpoint_of(manifest)

    def published(self, step: int) -> None:
        """After ``step`` was published: the LATEST hint, retention, then the listeners."""
        strategy = self.store.strategy
        try:
            hint = self.history.read_hint()
            if hint is not None and hint > step and not self.history.is_published(hint):
                strategy.reset_latest_hint(step)  # a hint past every checkpoint: repaired
            else:
                strategy.advance_latest_hint(step)
        except StorageError as exc:
            # Readers do not need the hint; say so once, not at every publish.
            log.debug("%s: step %d published, LATEST hint not updated: %s", strategy.url, step, exc)
            ignore_hint(
                f"{strategy.url}/LATEST",
                f"publishing could not rewrite it ({type(exc).__name__}, errno {exc.errno})",
            )
        if self.store.retention is not None:
            try:
                self.store.apply_retention()
            except CkptStoreError as exc:
                log.warning("%s: step %d published; retention failed: %s", strategy.url, step, exc)
        for listener in list(self.listeners):
            listener(step)

    def abort(self, step: int, attempt: str) -> None:
        """Remove what an attempt staged; a storage error is left to GC, with a warning."""
        self.store.strategy.discard(step, attempt)


class JoinedAttempt:
    """The store's side of an attempt another process began: stage and seal shards here;
    only the coordinator publishes. Abort lets go of the files held, deletes nothing."""

    def __init__(self, strategy: CommitStrategy[Any], step: int, attempt: str) -> None:
        self.strategy = strategy
        self.url = strategy.url
        self.step = step
        self.attempt = attempt

    def open_sink(self, name: str, size_hint: int | None) -> ShardSink:
        return self.strategy.open_shard(self.step, self.attempt, name, size_hint)

    def seal(self) -> None:
        self.strategy.seal(self.step, self.attempt)

    def stamp(self) -> CommitStamp:
        raise self._not_the_coordinator()

    def commit(self, manifest: Manifest) -> Checkpoint:
        raise self._not_the_coordinator()

    def _not_the_coordinator(self) -> CheckpointStateError:
        return CheckpointStateError(
            f"{self.url}: step {self.step}: only the coordinator that began attempt "
            f"{self.attempt} publishes it; send it this process's receipts",
            url=self.url,
            step=self.step,
        )

    def published(self, checkpoint: Checkpoint) -> None:
        """Nothing: a joined attempt never publishes."""

    def abort(self) -> None:
        self.strategy.release(self.step, self.attempt)


class StoreAttempt(JoinedAttempt):
    """The store's side of an attempt it began: it publishes through the store's publisher,
    and abort removes its data."""

    def __init__(self, publisher: Publisher, step: int, attempt: str) -> None:
        super().__init__(publisher.store.strategy, step, attempt)
        self.publisher = publisher

    def stamp(self) -> CommitStamp:
        return self.publisher.stamp()

    def commit(self, manifest: Manifest) -> Checkpoint:
        return self.publisher.commit(manifest)

    def published(self, checkpoint: Checkpoint) -> None:
        self.publisher.published(checkpoint.step)

    def abort(self) -> None:
        self.publisher.abort(self.step, self.attempt)
