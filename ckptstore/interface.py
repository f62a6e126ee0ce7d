"""The one interface every store ``ckptstore.open`` returns offers, and every adapter takes.

``CheckpointStore`` is what a trainer and its adapters (torch state dicts, DCP, Lightning,
Hugging Face, directories) and the CLI use of a store: saving, reading, listing, deleting,
retention and closing. A ``Store`` (one storage system) and a ``TieredStore`` (a fast store
copied to a durable one) both satisfy it, so either may be passed wherever a store is taken,
and an adapter given a URL opens it with ``ckptstore.open`` (every URL form works, a tiered
``?replicate_to=`` one included). What differs between the two (a takeover of one store or of
a pair, GC reports per tier) stays on each class.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from types import TracebackType
from typing import Protocol, runtime_checkable

from ckptstore.checkpoint import Checkpoint
from ckptstore.pending import PendingCheckpoint, ShardData, save_shards
from ckptstore.retention import RetentionPolicy

__all__ = ["CheckpointStore"]


@runtime_checkable
class CheckpointStore(Protocol):
    """A store of checkpoints: readers see only published ones; a save publishes all or nothing.

    Implemented by ``ckptstore.Store`` and ``ckptstore.TieredStore``, which derive from it (and
    take ``save`` from it); any other class with these methods satisfies it too. The guarantees
    are docs/protocol.md's (a tiered store's: its "Tiers" section).
    """

    @property
    def url(self) -> str:
        """Where saves go (a tiered store: its fast tier), as ckptstore prints it."""
        ...

    def begin(
        self,
        step: int,
        metadata: Mapping[str, object] | None = None,
        *,
        expected_shards: Iterable[str] | None = None,
        world_size: int = 1,
        attempt: str | None = None,
    ) -> PendingCheckpoint:
        """Start saving ``step``; nothing is visible until the checkpoint publishes."""
        ...

    def join(self, step: int, attempt: str) -> PendingCheckpoint:
        """Write shards into a coordinator's attempt at ``step`` (multi-rank saves)."""
        ...

    def save(
        self,
        step: int,
        shards: Mapping[str, ShardData],
        metadata: Mapping[str, object] | None = None,
    ) -> Checkpoint:
        """Write every shard and publish, in one call; on any error nothing is published (a
        tiered store publishes in its fast tier; the durable copy follows).

        The one implementation, ``begin`` then every shard then ``publish``, for every store
        that derives from this class (``Store``, ``TieredStore``)."""
        return save_shards(self.begin(step, metadata), shards)

    def latest(self, *, verified: bool = False) -> Checkpoint | None:
        """The newest published checkpoint, or None."""
        ...

    def get(self, step: int) -> Checkpoint:
        """The published checkpoint at ``step`` (CheckpointNotFoundError if none)."""
        ...

    def steps(self) -> list[int]:
        """The published steps, ascending."""
        ...

    def checkpoints(self) -> list[Checkpoint]:
        """Every complete published checkpoint, ascending."""
        ...

    def delete(self, step: int, *, force: bool = False) -> None:
        """Unpublish ``step``, then delete its data; the newest only with ``force``."""
        ...

    def apply_retention(self, policy: RetentionPolicy | None = None) -> list[int]:
        """Apply ``policy`` (default: the store's own); return the steps removed."""
        ...

    def close(self) -> None:
        """Release what the store holds; never loses a published checkpoint."""
        ...

    def __enter__(self) -> CheckpointStore:
        """``with ckptstore.open(url) as store:`` closes the store on leaving the block."""
        ...

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...
