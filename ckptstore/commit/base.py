"""A commit strategy publishes a checkpoint atomically and exclusively on one driver family.

There are two because storage systems offer two kinds of atomic, exclusive operation: a file
system renames a directory onto a name that must not exist (``RenameCommit``); an object store
creates an object only if absent (``ConditionalPutCommit``). Everything else in the protocol
(staging names no one else uses, durability before the commit point, readers that trust only
published manifests, unpublish before delete, grace-period GC) is the same idea on both.

A strategy keeps no storage state of its own between calls: everything it knows it reads back
through its driver, so a crash of the process at any call loses nothing that a fresh strategy
over the same storage cannot find.
"""

from __future__ import annotations

import abc
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, BinaryIO, ClassVar, Generic, Protocol, TypeVar

from ckptstore.driver import Capability
from ckptstore.errors import (
    CapabilityError,
    CheckpointExistsError,
    CkptStoreError,
    StorageError,
    StrayEntryError,
)
from ckptstore.manifest import Manifest, ShardRecord
from ckptstore.shardbytes import ShardBytes

__all__ = [
    "Catalogue",
    "Collecting",
    "CommitStrategy",
    "EpochRecords",
    "FileId",
    "GcItem",
    "GcReport",
    "Publishing",
    "ShardProblem",
    "ShardRanges",
    "ShardSink",
    "StrategyDriver",
    "clock_lead",
]

log = logging.getLogger(__name__)


FileId = tuple[int | str, ...]
"""Which stored file (or object) a shard is: equal for shards that share their bytes."""


class ShardSink(abc.ABC):
    """Where one shard's bytes go during an attempt; durable once its attempt is sealed."""

    @abc.abstractmethod
    def write(self, data: memoryview) -> None:
        """Append bytes to the shard; ``data`` is not used after the call returns."""

    @abc.abstractmethod
    def close(self) -> Mapping[str, str]:
        """Finish the shard and return its locator for the manifest.

        The shard is complete; it is durable once ``CommitStrategy.seal`` returns for its
        attempt (object stores: already when ``close`` returns).
        """

    @abc.abstractmethod
    def abort(self) -> None:
        """Give up on the shard, releasing what can be released (best effort)."""

    def clone_from(self, source: int) -> BinaryIO | None:
        """Make the (still empty) shard a copy-on-write clone of the whole open file
        ``source``, where the storage can: return a stream of the shard's bytes as stored
        (to checksum), or None, having changed nothing (then write the bytes)."""
        return None


@dataclass(frozen=True)
class ShardProblem:
    """A published shard that is missing from storage, or stored with the wrong size."""

    name: str
    missing: bool
    stored_size: int = 0
    recorded_size: int = 0

    def __str__(self) -> str:
        if self.missing:
            return f"shard {self.name!r} is missing"
        return (
            f"shard {self.name!r} has {self.stored_size} bytes, manifest says {self.recorded_size}"
        )


@dataclass(frozen=True)
class ShardRanges:
    """A published shard's object pinned to the one version opened: read it range by range.

    ``read(offset, view)`` fills ``view`` with the object's bytes from ``offset``, every byte
    from that version (a replaced object raises, never splices). Reads may run in parallel.
    """

    size: int
    """The stored object's size (the reader compares it with the manifest's)."""
    read: Callable[[int, memoryview], None]
    concurrency: int
    """How many ranges to read at once."""
    range_size: int
    """Bytes per ranged read (the reader rounds it to whole blocks)."""


@dataclass(frozen=True)
class GcItem:
    """One leftover found by GC: what it is, its name in storage, its age and its size."""

    kind: str
    name: str
    age_s: float
    size: int = 0
    why: str = ""
    """Why it goes, where its age alone does not say (a shared blob: who no longer uses it)."""


@dataclass
class GcReport:
    """What a GC pass removed (or would remove, on a dry run) and what it kept as too young."""

    dry_run: bool
    grace_s: float
    removed: list[GcItem] = field(default_factory=list)
    kept_young: list[GcItem] = field(default_factory=list)
    missing_operations: list[str] = field(default_factory=list)
    """Storage operations GC needed that the storage does not implement (e.g.
    ``ListMultipartUploads``): what only they could find was not collected; see ``warnings``."""
    warnings: list[str] = field(default_factory=list)
    """What the operator should know and do (e.g. install a lifecycle rule), one sentence each."""

    @property
    def removed_bytes(self) -> int:
        """Total size of what was (or would be) removed."""
        return sum(item.size for item in self.removed)


def clock_lead(now: float, host_now: float | None = None) -> float:
    """How far a caller's clock runs ahead of this host's: a test clock's deliberate advance.

    GC ages leftovers on the storage's own clock, never on this host's, which may be skewed.
    The ``now`` a Store passes (its clock) counts only by how far it leads this host's clock:
    zero in production, where the Store's clock is this host's, and the advance by which a
    test ages leftovers past the grace period. A clock behind this host's counts as none.
    ``host_now``: this host's clock now, if read elsewhere (default: ``time.time()``).
    """
    return max(0.0, now - (time.time() if host_now is None else host_now))


class StrategyDriver(Protocol):
    """What a strategy needs of any driver, whatever its family: where it is, what it can."""

    url: str
    capabilities: frozenset[Capability]


DriverT = TypeVar("DriverT", bound=StrategyDriver, covariant=True)
StrategyT = TypeVar("StrategyT", bound="CommitStrategy[Any]")
ErrorT = TypeVar("ErrorT", bound=CkptStoreError)


class _Located(abc.ABC):
    """Where a role's storage is, for its messages."""

    @property
    @abc.abstractmethod
    def url(self) -> str:
        """The store's URL, for messages."""


class Publishing(_Located):
    """The writing role: stage an attempt's shards where no reader looks, make them durable,
    then commit the manifest in one atomic, exclusive operation (docs/protocol.md §4-5)."""

    @abc.abstractmethod
    def open_root(self, *, create: bool) -> None:
        """Check the store exists (creating an empty one if ``create`` and the system allows)."""

    @abc.abstractmethod
    def begin(self, step: int, attempt: str) -> None:
        """Prepare a staging area for ``attempt`` that no published checkpoint or attempt uses."""

    @abc.abstractmethod
    def open_shard(
        self, step: int, attempt: str, name: str, size_hint: int | None = None
    ) -> ShardSink:
        """Open a sink for a new shard of the attempt (``size_hint``: its size, if known)."""

    def seal(self, step: int, attempt: str) -> None:
        """Make every shard this process closed in the attempt durable (I2's first half).

        Called before publish, and by each rank of a multi-rank save before it sends its
        receipts. Strategies whose sinks are durable at close do nothing.
        """

    def release(self, step: int, attempt: str) -> None:
        """Let go of what this process holds open for the attempt; its staged data stays."""

    @property
    def shares_shards(self) -> bool:
        """True where an incremental save can share a shard with earlier checkpoints
        (``share_shard``); others write every shard (docs/protocol.md §12)."""
        return False

    @property
    def sharing_digest(self) -> str | None:
        """The strong digest (``ckptstore.digest``) that names a shared shard's bytes here,
        or None where sharing decides equality otherwise (file systems compare bytes)."""
        return None

    def share_shard(
        self,
        step: int,
        attempt: str,
        name: str,
        crc32c: str,
        size: int,
        data: ShardBytes,
        digest: str | None = None,
    ) -> Mapping[str, str] | None:
        """Make shard ``name`` of the attempt, without writing it again, bytes an earlier
        save stored that are exactly ``data`` (of CRC32C ``crc32c``, ``size`` bytes and, where
        ``sharing_digest`` names an algorithm, shard digest ``digest``, ``<alg>:<hex>``); its
        locator, or None (nothing made) where no such bytes are known: the shard is then
        written. ShardExistsError if the attempt already has the shard."""
        return None

    def saved_incrementally(self) -> bool:
        """True if an incremental save ever indexed shards here (a cheap check, so that
        listings of other stores cost nothing more)."""
        return False

    def shard_files(self, manifest: Manifest) -> dict[str, FileId]:
        """Which stored file each shard of a published checkpoint is (shards of several
        checkpoints that share bytes answer the same); empty where the storage cannot say
        (then no shard counts as shared)."""
        return {}

    def index_shards(self, step: int, attempt: str, shards: Mapping[str, tuple[str, int]]) -> None:
        """Once an attempt's shards are sealed (durable): make ``shards`` (by name, their
        CRC32C and size) found by later incremental saves; best effort: never raises for
        what it could not index."""

    @abc.abstractmethod
    def publish(self, manifest: Manifest) -> None:
        """Seal the attempt and commit it: one atomic, exclusive operation (the commit point).

        Returns only once the checkpoint is durable. Raises CheckpointExistsError, with the
        existing checkpoint untouched, when the step is already published by another attempt.
        """

    @abc.abstractmethod
    def abort(self, step: int, attempt: str) -> None:
        """Remove an unpublished attempt's staging data (best effort; GC finds what remains)."""

    def discard(self, step: int, attempt: str) -> None:
        """``abort``, with a storage error left to GC and said in a warning, never raised."""
        try:
            self.abort(step, attempt)
        except StorageError as exc:
            log.warning(
                "%s: could not remove attempt %s of step %d (gc will): %s",
                self.url,
                attempt,
                step,
                exc,
            )

    @abc.abstractmethod
    def advance_latest_hint(self, step: int) -> None:
        """Move the LATEST pointer forward to ``step``; never backward."""


class Catalogue(_Located):
    """The reading role: what is published, and its manifests and shards; readers trust
    nothing else (docs/protocol.md §6)."""

    @abc.abstractmethod
    def published_steps(self, min_step: int = 0) -> list[int]:
        """Return the published steps >= ``min_step`` of epoch 0, ascending, from storage."""

    def published_checkpoints(self, min_step: int = 0) -> list[tuple[int, int]]:
        """Return (step, epoch) of every commit point named in storage from ``min_step`` on,
        ascending, whatever its epoch (docs/protocol.md §8.1); only a listing: the Store
        decides which are checkpoints and which are the history's. A strategy without
        lineages has only epoch 0."""
        return [(step, 0) for step in self.published_steps(min_step)]

    @abc.abstractmethod
    def is_published(self, step: int, epoch: int = 0) -> bool:
        """Tell whether ``step`` is published in ``epoch``."""

    @abc.abstractmethod
    def read_manifest(self, step: int, epoch: int = 0) -> Manifest:
        """Read and validate a published manifest (CheckpointNotFoundError if not published)."""

    def name_taken(self, step: int, epoch: int = 0) -> CheckpointExistsError | StrayEntryError:
        """The error for a save of ``step`` in ``epoch`` whose commit point's name is taken:
        CheckpointExistsError when a checkpoint is published there, StrayEntryError (naming
        the entry to remove) when what holds the name is not one (docs/protocol.md §5.2)."""
        return CheckpointExistsError(
            f"{self.url}: step {step} is already published", url=self.url, step=step
        )

    @abc.abstractmethod
    def open_shard_reader(self, manifest: Manifest, record: ShardRecord) -> BinaryIO:
        """Open a published shard through its locator (raises ShardMissingError if gone)."""

    def open_shard_ranges(self, manifest: Manifest, record: ShardRecord) -> ShardRanges | None:
        """Pin a published shard for parallel ranged reads, or None where the driver has none
        (the shard is then read through ``open_shard_reader``). ShardMissingError if gone."""
        return None

    @abc.abstractmethod
    def shard_problems(self, manifest: Manifest) -> list[ShardProblem]:
        """Return what is wrong with the presence and sizes of a checkpoint's shards (cheap)."""

    @abc.abstractmethod
    def read_latest_hint(self) -> int | None:
        """Return the step the LATEST pointer names, or None (it is only a hint)."""

    @abc.abstractmethod
    def is_empty(self) -> bool:
        """Tell whether the store holds nothing at all."""


class Collecting(_Located):
    """The removing role: unpublish (atomically, before any data goes) and collect what dead
    attempts left, never a stray (docs/protocol.md §7)."""

    @abc.abstractmethod
    def unpublish(self, step: int, epoch: int = 0) -> None:
        """Make a checkpoint invisible atomically, then delete its data."""

    @abc.abstractmethod
    def reset_latest_hint(self, step: int | None) -> None:
        """Set (or remove) the LATEST pointer, backward if need be: rollback and delete only."""

    @abc.abstractmethod
    def collect_garbage(self, *, grace_s: float, now: float, dry_run: bool) -> GcReport:
        """Remove leftovers of dead attempts idle for longer than ``grace_s`` (I7).

        Idle time is measured on the storage's clock (a file system's timestamps, an object
        store's), so that a GC host whose clock is skewed removes nothing live; ``now``, the
        caller's clock, counts only by ``clock_lead(now)``.
        """


class EpochRecords(_Located):
    """The lineage role, optional: epoch records created once each (docs/protocol.md §8).

    A strategy that keeps lineages declares ``keeps_lineages = True`` and implements
    ``create_epoch`` and ``read_epoch``; one that does not has only epoch 0, and a takeover of
    its store is refused (CapabilityError).
    """

    name: str = ""

    keeps_lineages: ClassVar[bool] = False
    """Declared by a strategy that implements the epoch records (checked when it is defined)."""

    def create_epoch(self, epoch: int, record: bytes) -> None:
        """Create epoch ``epoch``'s record if absent, durably (EpochExistsError if present).

        The record is complete or absent for every reader, like a manifest; an unknown
        outcome is resolved by reading the record back.
        """
        raise CapabilityError(
            f"{self.url}: the {self.name} commit protocol does not keep lineages, so this store "
            f"cannot be taken over (docs/protocol.md §8)",
            url=self.url,
            key=self.name,
        )

    def read_epoch(self, epoch: int) -> bytes | None:
        """Return epoch ``epoch``'s stored record, or None if it does not exist."""
        return None

    def listed_epochs(self) -> list[int]:
        """The epoch records a listing shows (a hint only: readers probe past it)."""
        return []


class CommitStrategy(Publishing, Catalogue, Collecting, EpochRecords, Generic[DriverT]):
    """The protocol on one driver family: its four roles over one driver.

    Specified in docs/protocol.md §4-8. ``driver`` is the strategy's only access to storage;
    the conformance suite replaces it with a fault-injecting wrapper. What the suite needs to
    audit a store's raw contents is not part of it (``ckptstore.conformance.audit``).
    """

    name: str = ""
    required_capabilities: frozenset[Capability] = frozenset()
    fixed_names: ClassVar[frozenset[str]] = frozenset()
    """Raw names that belong to the store itself rather than to any checkpoint (the hint)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """A strategy declares its lineages: ``keeps_lineages`` is True exactly when it has a
        ``create_epoch`` of its own (one that opts out of an inherited implementation sets
        both back: ``keeps_lineages = False``, ``create_epoch = CommitStrategy.create_epoch``).
        """
        super().__init_subclass__(**kwargs)
        implements = cls.create_epoch is not EpochRecords.create_epoch
        if implements and not cls.keeps_lineages:
            raise TypeError(
                f"{cls.__name__} has a create_epoch: declare keeps_lineages = True (or, to keep "
                f"no lineages, create_epoch = CommitStrategy.create_epoch)"
            )
        if cls.keeps_lineages and not implements:
            raise TypeError(f"{cls.__name__} declares keeps_lineages but has no create_epoch")

    def __init__(self, driver: DriverT) -> None:
        self.driver = driver

    @property
    def url(self) -> str:
        """The store's URL, for messages."""
        return self.driver.url

    def shard_error(
        self, error: type[ErrorT], manifest: Manifest, record: ShardRecord, problem: str
    ) -> ErrorT:
        """``error`` about one shard of a checkpoint: its message and its context name the
        store, the step and the shard."""
        return error(
            f"{self.url}: step {manifest.step}: shard {record.name!r} {problem}",
            url=self.url,
            step=manifest.step,
            key=record.name,
        )

    def close(self) -> None:
        """Release the threads this strategy holds; it may be used again afterwards."""

    def settings(self) -> dict[str, Any]:
        """The keyword arguments that, with a driver, rebuild this strategy (``with_driver``).

        A strategy whose constructor takes settings returns them here.
        """
        return {}

    def with_driver(self: StrategyT, driver: Any) -> StrategyT:
        """A fresh strategy of this class, with the same settings, over another driver.

        Nothing per-instance is shared (held files, caches, threads). The conformance suite
        uses it to put a fault-injecting or simulated driver underneath.
        """
        return type(self)(driver, **self.settings())

    @property
    def capabilities(self) -> frozenset[Capability]:
        """What the driver declares its storage provides."""
        return self.driver.capabilities

    def check_capabilities(self) -> None:
        """Refuse to work on storage lacking a capability this strategy needs."""
        missing = self.required_capabilities - self.capabilities
        if missing:
            names = ", ".join(sorted(c.value for c in missing))
            raise CapabilityError(
                f"{self.url}: the storage does not provide {names}, which the {self.name} "
                f"commit protocol needs; ckptstore cannot make checkpoints safe there",
                url=self.url,
                key=self.name,
            )
