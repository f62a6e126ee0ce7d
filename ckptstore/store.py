"""The store API: begin, write shards, publish; latest, list, get; delete, rollback, GC.

A ``Store`` is a commit strategy (and its driver) plus policy: retention after each publish,
the clock. It keeps no storage state of its own: every answer is read from storage, so any
number of Store objects, in any number of processes, over the same storage agree, and a
process that dies at any instant loses only its unpublished attempt.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import time
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any, BinaryIO, Literal, cast

from ckptstore.checkpoint import Checkpoint
from ckptstore.commit.base import (
    CommitStrategy,
    GcItem,
    GcReport,
    ShardRanges,
    StrategyDriver,
    clock_lead,
)
from ckptstore.digest import check_algorithm, default_algorithm
from ckptstore.driver import BytesLike
from ckptstore.errors import (
    CheckpointNotFoundError,
    CkptStoreError,
    EpochNotFoundError,
    IntegrityError,
    InvalidOptionError,
    NotACheckpointError,
    ObjectNotFoundError,
    RefusedError,
    ShardCorruptError,
    ShardMissingError,
    StorageError,
    TransientStorageError,
    UntrustedCheckpointError,
)
from ckptstore.fencing import HOLD, INTENT, INTENT_STALE_S, Markers
from ckptstore.hint import ignore_hint
from ckptstore.history import History, SupersededCheckpoint
from ckptstore.interface import CheckpointStore
from ckptstore.lineage import Epoch, Lineage
from ckptstore.manifest import Manifest, ShardRecord, WriterInfo, check_metadata
from ckptstore.names import (
    check_attempt_id,
    check_epoch,
    check_shard_name,
    check_step,
    new_attempt_id,
)
from ckptstore.pending import PendingCheckpoint
from ckptstore.publisher import JoinedAttempt, Publisher, StoreAttempt
from ckptstore.registry import resolve
from ckptstore.retention import CheckpointAge, RetentionPolicy
from ckptstore.sharing import StrategySharing, check_incremental
from ckptstore.signing import (
    SigningKey,
    SigningKeyLike,
    Trust,
    TrustLike,
    signing_key_from,
    trust_from,
)
from ckptstore.urls import parse_url, split_epoch, split_incremental

__all__ = [
    "DEFAULT_GRACE",
    "DEFAULT_SUPERSEDED_GRACE",
    "RolledBack",
    "Store",
    "StrayEntry",
    "SupersededCheckpoint",
    "newest_refused",
    "open_store",
]

log = logging.getLogger(__name__)

DEFAULT_GRACE = timedelta(hours=1)
DEFAULT_SUPERSEDED_GRACE = timedelta(hours=24)
"""How long GC keeps a checkpoint a takeover or rollback superseded (a mistaken one can be
undone meanwhile), from the takeover, on the storage's clock."""
_INTENT_WAIT_S = 30.0
_FENCED_ROUNDS = 8
"""Decisions a deleter makes again, after a takeover fenced it, before it gives up."""
"""How long a takeover waits for a live deleter of its parent checkpoint to finish."""
Clock = Callable[[], float]
_LATEST_ROUNDS = 16
"""Listings latest() makes while every candidate is deleted under it before it gives up."""


@dataclass(frozen=True)
class StrayEntry:
    """An entry named like a step that is not a readable checkpoint; ckptstore leaves it alone."""

    step: int
    reason: str


@dataclass(frozen=True)
class RolledBack:
    """What a rollback did: the takeover it made, and the checkpoints that left the history."""

    step: int
    left: list[int]
    """The steps whose checkpoints left the history, ascending (published still, until GC)."""
    epoch: Epoch | None
    """The epoch the rollback took (None: nothing was newer than ``step``, nothing was done)."""
    collected_after: datetime | None
    """From when a GC with the default superseded grace unpublishes them (storage clock)."""


@dataclass(frozen=True)
class _Confirmed:
    """What a Store read of a published manifest: which attempt, and when it was committed."""

    attempt: str
    committed_at: datetime


def _seconds(value: timedelta | float, what: str) -> float:
    seconds = value.total_seconds() if isinstance(value, timedelta) else float(value)
    if seconds < 0:
        raise InvalidOptionError(f"{what} must not be negative, got {value!r}")
    return seconds


@dataclass
class _SeenByLatest:
    """What one ``latest()`` call learnt of the checkpoints it passed over, so that listing
    again neither warns nor verifies twice."""

    warned: set[int] = field(default_factory=set)
    verified: dict[tuple[int, int, str], bool] = field(default_factory=dict)

    def intact(self, checkpoint: Checkpoint) -> bool:
        """Whether every shard of ``checkpoint`` verifies (read once per call)."""
        manifest = checkpoint.manifest
        key = (manifest.step, manifest.epoch, manifest.attempt)
        if key not in self.verified:
            report = checkpoint.verify()
            if not report.ok:
                log.warning(
                    "%s: skipping corrupt step %d: %s", checkpoint.url, manifest.step,
                    report.problems,
                )  # fmt: skip
            self.verified[key] = report.ok
        return self.verified[key]


class Store(CheckpointStore):
    """Checkpoints of one training run, in one storage location."""

    def __init__(
        self,
        strategy: CommitStrategy[StrategyDriver],
        *,
        retention: RetentionPolicy | None = None,
        clock: Clock = time.time,
        signing_key: SigningKey | None = None,
        trust: Trust | None = None,
        digest_algorithm: str | None = None,
        incremental: bool = False,
    ) -> None:
        """``signing_key``: sign every manifest published and epoch taken here; ``trust``:
        read only checkpoints and epochs a trusted key signed; ``digest_algorithm``: record
        every shard's cryptographic digests (default: the fastest available when signing,
        else none).
        ``ckptstore.open`` reads the first two from the environment too. ``incremental``: a
        shard written whole whose bytes an earlier checkpoint holds is shared with it, not
        written again (docs/protocol.md §12; InvalidOptionError on storage that cannot
        share)."""
        if retention is not None and not isinstance(retention, RetentionPolicy):
            raise InvalidOptionError(f"retention must be a RetentionPolicy, got {retention!r}")
        strategy.check_capabilities()
        self.strategy = strategy
        self.retention = retention
        self.clock = clock
        self.signing_key = signing_key
        self.trust = trust
        if incremental:
            check_incremental(strategy)
        self.incremental = incremental
        if digest_algorithm is None and signing_key is not None:
            digest_algorithm = default_algorithm()
        self.digest_algorithm = (
            None if digest_algorithm is None else check_algorithm(digest_algorithm)
        )
        self._confirmed: dict[int, _Confirmed] = {}
        self._history = History(strategy, clock, trust=trust, signing_key=signing_key)
        self._markers = Markers(strategy)
        self._epoch: int | None = None
        self._publisher = Publisher(self, self._history, self._checkpoint_of)

    @property
    def url(self) -> str:
        """The store's URL."""
        return self.strategy.url

    def sign_epochs_with(self, key: SigningKey | None) -> None:
        """Sign the epoch records this store takes with ``key``, and nothing else: the
        replicator's durable writer of a signing pair takes the pair's durable epochs, and its
        copies keep the first write's signature (it never signs a manifest)."""
        self._history.signing_key = key

    def __repr__(self) -> str:
        return f"<Store {self.url} ({self.strategy.name})>"

    def close(self) -> None:
        """Release what this store holds (upload and reader threads, its hold on a shared
        client's connections: strategy, then driver); never loses a checkpoint.

        Call it when a pending checkpoint is no longer being written: a published checkpoint
        stays published, and an unpublished attempt is left for GC, as after a crash. A
        closed store may be used again; it then starts what it needs afresh. ``with
        ckptstore.open(url) as store:`` closes it on leaving the block.
        """
        self.strategy.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- lineages (docs/protocol.md §8) ---------------------------------------------------

    def take_over(
        self,
        resumed_from: int | None,
        *,
        note: str = "",
        from_epoch: int | None = None,
        discard_history: bool = False,
    ) -> Epoch:
        """Take the store over for this run: create the next epoch and write in it.

        ``resumed_from``: the step of the checkpoint this run resumed from. From then on no
        reader returns a checkpoint that a writer of an older epoch (a zombie of the previous
        run) publishes above that step, and those writers' publishes fail with
        SupersededError. Call it once per run, after choosing the checkpoint to resume from;
        other processes of the same run join the epoch (``join_epoch``).

        ``from_epoch``: the epoch of that checkpoint, when it is not the history's (a
        checkpoint a takeover or rollback superseded): the new history is that checkpoint's
        history up to it, which undoes the takeover (docs/protocol.md §8.2). Default: the epoch
        that owns ``resumed_from`` in the history now.

        ``resumed_from=None`` is a fresh start: every checkpoint leaves the history. On a store
        whose history holds checkpoints it is refused (RefusedError) unless
        ``discard_history=True``: a run that found no checkpoint where there are some (a
        wrong path, an unmounted disk) must not discard them by mistake.
        """
        if resumed_from is None:
            if from_epoch is not None:
                raise InvalidOptionError("from_epoch names the epoch of resumed_from: pass both")
            if not discard_history:
                held = self.steps()
                if held:
                    raise RefusedError(
                        f"{self.url}: refusing a fresh start: the history holds "
                        f"{len(held)} checkpoint(s), newest step {held[-1]}; resume from it "
                        f"(take_over({held[-1]})), or pass discard_history=True "
                        f"(--discard-history) to supersede them all",
                        url=self.url,
                    )
            epoch = self._history.take(None, note=note)
        else:
            epoch = self._take_from(check_step(resumed_from), from_epoch, note)
        self._epoch = epoch.number
        return epoch

    def _take_from(
        self, step: int, from_epoch: int | None, note: str, *, required: bool = False
    ) -> Epoch:
        """Take over from checkpoint (``step``, its epoch), held against deleters (§8.5).
        ``required`` (and with ``from_epoch``): CheckpointNotFoundError, and no epoch taken,
        unless that checkpoint is published."""
        lineage = self._history.lineage()
        if from_epoch is None:
            base = lineage.owner(step)
        else:
            base = check_epoch(from_epoch)
            if not lineage.knows(base):
                raise EpochNotFoundError(
                    f"{self.url}: epoch {base} was never taken (newest: {lineage.newest})",
                    url=self.url,
                )
        existed = self._has_checkpoint(step, base)
        if not existed and (required or from_epoch is not None):
            raise CheckpointNotFoundError(
                f"{self.url}: epoch {base} has no published checkpoint at step {step} to "
                f"take over from (ckptstore ls lists the superseded ones); no epoch was taken",
                url=self.url,
                step=step,
            )
        if not existed or not self._markers.supported:
            return self._history.take(step, note=note, parent_epoch=base)
        hold = self._markers.put(HOLD, step, base)
        try:
            self._wait_for_intent(step, base)
            if not self._has_checkpoint(step, base):
                raise CheckpointNotFoundError(
                    f"{self.url}: step {step} (epoch {base}) was deleted while this takeover "
                    f"prepared; no epoch was taken: choose another checkpoint",
                    url=self.url,
                    step=step,
                )
            return self._history.take(step, note=note, parent_epoch=base)
        finally:
            self._markers.remove(hold)

    def _has_checkpoint(self, step: int, epoch: int) -> bool:
        try:
            self._history.read_manifest_of(step, epoch)
        except CheckpointNotFoundError:
            return False
        except IntegrityError:
            return True  # damage is still a checkpoint: not this check's to judge
        return True

    def _wait_for_intent(self, step: int, epoch: int) -> None:
        """Wait until no live deleter intends to unpublish checkpoint (``step``, ``epoch``): an
        intent older than INTENT_STALE_S on the storage's clock is a dead deleter's."""
        give_up = time.monotonic() + _INTENT_WAIT_S
        pause = 0.01
        while True:
            stamp = self._markers.stamp(INTENT, step, epoch)
            if stamp is None:
                return
            if self._markers.storage_now() - stamp > INTENT_STALE_S:
                log.warning("%s: passing over a stale deletion intent on step %d", self.url, step)
                return
            if time.monotonic() > give_up:
                raise RefusedError(
                    f"{self.url}: a deletion of step {step} has been in progress for "
                    f"{_INTENT_WAIT_S:.0f} s; nothing was taken over: try again",
                    url=self.url,
                    step=step,
                )
            time.sleep(pause)
            pause = min(pause * 2, 0.5)

    def join_epoch(self, epoch: int) -> None:
        """Write in ``epoch``, taken by another process of this run (EpochNotFoundError if it
        was never taken)."""
        self._history.check_exists(epoch)
        self._epoch = epoch

    @property
    def epoch(self) -> int | None:
        """The epoch this store writes in; None until it takes, joins or first saves (then
        epoch 0, or EpochRequiredError if the store was taken over: §8.3)."""
        return self._epoch

    def lineage(self) -> Lineage:
        """The store's epochs, as storage has them now (LineageCorruptError if one is
        unreadable)."""
        return self._history.lineage()

    def superseded(self) -> list[SupersededCheckpoint]:
        """Checkpoints that a takeover removed from the history (GC unpublishes them once the
        superseded grace period has passed; until then a takeover from one brings back its
        history: ``take_over(step, from_epoch=epoch)``)."""
        return self._history.superseded()

    def superseded_since(self) -> dict[tuple[int, int], datetime | None]:
        """When each superseded checkpoint (step, epoch) left the history, on the storage's
        clock: the time of the takeover that removed it (None where unknown)."""
        lineage = self._history.lineage()
        stamps: dict[int, float | None] = {}
        since: dict[tuple[int, int], datetime | None] = {}
        for entry in self._history.superseded():
            number = lineage.left_history_at(entry.step, entry.epoch)
            if number is None:
                continue
            if number not in stamps:
                stamps[number] = self._markers.epoch_stamp(number)
            stamp = stamps[number]
            since[(entry.step, entry.epoch)] = (
                None if stamp is None else datetime.fromtimestamp(stamp, timezone.utc)
            )
        return since

    # -- writing -------------------------------------------------------------------------

    def begin(
        self,
        step: int,
        metadata: Mapping[str, object] | None = None,
        *,
        expected_shards: Iterable[str] | None = None,
        world_size: int = 1,
        attempt: str | None = None,
    ) -> PendingCheckpoint:
        """Start saving ``step``; nothing is visible until the returned checkpoint publishes.

        Raises CheckpointExistsError at once if the step is already published, and
        StrayEntryError if an entry that is not a checkpoint holds the name it publishes under.
        ``expected_shards`` makes publish refuse unless exactly those shards were written.
        ``attempt`` is an attempt id chosen by a coordinator (multi-rank saves); default fresh.
        """
        check_step(step)
        clean_metadata = check_metadata(metadata)
        expected = None
        if expected_shards is not None:
            expected = frozenset(check_shard_name(name) for name in expected_shards)
        lineage = self._history.lineage()
        if self._epoch is None:  # epoch 0, kept for the lifetime of this store (§8.3)
            self._epoch = self._history.default_epoch(step, lineage)
        self._history.check_writable(step, self._epoch, lineage)
        if self._history.is_published(step, lineage):  # or a stray holds its name
            raise self.strategy.name_taken(step, lineage.owner(step))
        attempt_id = new_attempt_id() if attempt is None else check_attempt_id(attempt)
        self.strategy.begin(step, attempt_id)
        return self._released_when_dropped(
            PendingCheckpoint(
                step=step,
                attempt=attempt_id,
                metadata=clean_metadata,
                expected=expected,
                writer=WriterInfo.current(world_size=world_size),
                owner=StoreAttempt(self._publisher, step, attempt_id),
                digest_algorithm=self.digest_algorithm,
                sharing=self._sharing(step, attempt_id),
            )
        )

    def join(self, step: int, attempt: str) -> PendingCheckpoint:
        """Write shards into an attempt that a coordinator began in another process.

        The returned checkpoint cannot publish: ``seal`` it and send the receipts it returns to
        the coordinator, whose ``add_receipts`` and ``publish`` commit all ranks' shards at once.
        """
        check_step(step)
        attempt_id = check_attempt_id(attempt)

        return self._released_when_dropped(
            PendingCheckpoint(
                step=step,
                attempt=attempt_id,
                metadata={},
                expected=None,
                writer=WriterInfo.current(),
                owner=JoinedAttempt(self.strategy, step, attempt_id),
                digest_algorithm=self.digest_algorithm,
                sharing=self._sharing(step, attempt_id),
            )
        )

    def _sharing(self, step: int, attempt: str) -> StrategySharing | None:
        return StrategySharing(self.strategy, step, attempt) if self.incremental else None

    def _released_when_dropped(self, pending: PendingCheckpoint) -> PendingCheckpoint:
        """A pending checkpoint dropped without publish or abort lets go of the files it holds
        open (its staged data stays for GC)."""
        weakref.finalize(pending, _release_quietly, self.strategy, pending.step, pending.attempt)
        return pending

    def on_publish(self, listener: Callable[[int], None]) -> None:
        """Call ``listener(step)`` after each publish through this Store (after the LATEST
        hint and retention): how a tiered store wakes its replicator. It runs in the publishing
        thread and must not raise; the checkpoint is published whatever it does."""
        self._publisher.listeners.append(listener)

    def steps(self) -> list[int]:
        """Every published checkpoint's step, ascending.

        A step counts when its manifest is there and parses; an entry named like a step
        without one is a stray (see ``strays``), never counted, returned or deleted.
        """
        return self._checkpoint_steps(self._history.steps())

    def named_steps(self) -> list[int]:
        """Every step an entry of the history is named after: checkpoints and strays alike
        (``steps`` counts only checkpoints whose manifest parses), ascending."""
        return self._history.steps()

    def manifest(self, step: int) -> Manifest:
        """The manifest of the history's checkpoint at ``step``, without checking its shards
        (CheckpointNotFoundError, NotACheckpointError, ManifestCorruptError)."""
        return self._history.read_manifest(check_step(step))

    def strays(self) -> list[StrayEntry]:
        """Entries named like a step that are not readable checkpoints, with the reason.

        Strays (an operator's mkdir, a partial copy, a damaged manifest) are left alone by
        retention, rollback and GC; ``ls`` and ``verify`` report them.
        """
        found = []
        for step in self._history.steps():
            try:
                self._confirm(step)
            except CheckpointNotFoundError as exc:
                if isinstance(exc, NotACheckpointError):
                    found.append(StrayEntry(step, str(exc)))
            except IntegrityError as exc:
                found.append(StrayEntry(step, str(exc)))
        # Named like a step that a takeover (a rollback) moved out of the history: still a
        # stray, and still reported (only commit points whose manifest reads are superseded).
        for entry in self._history.superseded():
            try:
                self._history.read_manifest_of(entry.step, entry.epoch)
            except NotACheckpointError as exc:
                found.append(StrayEntry(entry.step, str(exc)))
            except CheckpointNotFoundError:
                continue
            except IntegrityError as exc:
                found.append(StrayEntry(entry.step, str(exc)))
        return sorted(found, key=lambda stray: stray.step)

    def _confirm(self, step: int) -> _Confirmed:
        """Read ``step``'s manifest unless it was read before; cache what retention needs."""
        known = self._confirmed.get(step)
        if known is None:
            manifest = self._history.read_manifest(step)
            known = self._confirmed[step] = _Confirmed(manifest.attempt, manifest.committed_at)
        return known

    def _checkpoint_steps(self, candidates: Iterable[int], *, min_step: int = 0) -> list[int]:
        """The ``candidates`` whose manifest parses (each read once per Store), ascending.

        ``candidates`` is a listing of every step from ``min_step`` on. A published manifest
        never changes, so it is read once; a cached step in that range that is no longer
        listed is forgotten (it may be published again by another attempt).
        """
        listed = sorted(candidates)
        for stale in set(self._confirmed) - set(listed):
            if stale >= min_step:
                self._confirmed.pop(stale, None)
        steps = []
        for step in listed:
            try:
                self._confirm(step)
            except (CheckpointNotFoundError, IntegrityError):
                continue
            steps.append(step)
        return steps

    def get(self, step: int) -> Checkpoint:
        """Return the published checkpoint at ``step``, checked for completeness (I1).

        Raises CheckpointNotFoundError (also when a delete or retention unpublishes the step
        while it is being checked: never an integrity error for that), NotACheckpointError for
        a stray entry named like a step, ManifestCorruptError or ShardMissingError.
        """
        manifest = self._history.read_manifest(check_step(step))
        problems = self.strategy.shard_problems(manifest)
        if problems:
            self._check_still_published(manifest)
            error = ShardMissingError if any(p.missing for p in problems) else ShardCorruptError
            raise error(
                f"{self.url}: step {step} is damaged: {'; '.join(map(str, problems[:5]))}"
                + (f" (+{len(problems) - 5} more)" if len(problems) > 5 else "")
            )
        self._confirmed[step] = _Confirmed(manifest.attempt, manifest.committed_at)
        return self._checkpoint_of(manifest)

    def _checkpoint_of(self, manifest: Manifest) -> Checkpoint:
        """The checkpoint of a manifest this store published or read, its shards read here."""
        return Checkpoint(manifest, self._opener, self.url, ranges=self._ranges)

    def _check_still_published(self, manifest: Manifest) -> None:
        """Raise CheckpointNotFoundError if ``manifest`` is no longer the published one.

        Missing shards of a checkpoint that is being unpublished (its manifest goes first) are
        a race with a deletion, not damage.
        """
        try:
            current = self._history.read_manifest_of(manifest.step, manifest.epoch)
        except IntegrityError:
            return
        if current.attempt != manifest.attempt:
            raise CheckpointNotFoundError(
                f"{self.url}: step {manifest.step} was deleted and published again meanwhile",
                url=self.url,
                step=manifest.step,
            )

    def _opener(self, manifest: Manifest, record: ShardRecord) -> BinaryIO:
        try:
            stream = self.strategy.open_shard_reader(manifest, record)
        except ShardMissingError:
            self._check_still_published(manifest)
            raise
        return cast(
            BinaryIO, _VanishingShardStream(stream, lambda: self._vanished(manifest, record))
        )

    def _ranges(self, manifest: Manifest, record: ShardRecord) -> ShardRanges | None:
        try:
            ranges = self.strategy.open_shard_ranges(manifest, record)
        except ShardMissingError:
            self._check_still_published(manifest)
            raise
        if ranges is None:
            return None
        read = ranges.read

        def read_or_vanish(offset: int, view: memoryview) -> None:
            try:
                read(offset, view)
            except ObjectNotFoundError as exc:  # deleted between two ranges
                raise self._vanished(manifest, record) from exc

        return dataclasses.replace(ranges, read=read_or_vanish)

    def _vanished(self, manifest: Manifest, record: ShardRecord) -> CkptStoreError:
        """The error for a shard that disappeared while it was being read."""
        self._check_still_published(manifest)  # unpublished meanwhile: CheckpointNotFoundError
        return ShardMissingError(
            f"{self.url}: step {manifest.step}: shard {record.name!r} disappeared while being "
            f"read, and the checkpoint is still published",
            url=self.url,
            step=manifest.step,
            key=record.name,
        )

    def latest(self, *, verified: bool = False) -> Checkpoint | None:
        """Return the newest published checkpoint, or None if there is none.

        With ``verified=True``, every shard's CRC32C is read and checked, and a checkpoint that
        fails is skipped for the next older one (I6). Without it, a damaged newest checkpoint
        raises an IntegrityError rather than being silently passed over. A checkpoint deleted
        while it is being read is passed over, and when the LATEST hint's candidates run out the
        reader lists every step; it lists again rather than return an older step than one that
        went under it, and reads the hint again after a listing that may have missed newer
        steps in flux: None means that no checkpoint exists (docs/protocol.md §5).
        """
        hint = self._history.read_hint()  # before any listing: it cross-checks them (§4.2)
        seen = _SeenByLatest()
        for round_ in range(_LATEST_ROUNDS):
            from_hint = hint is not None and round_ == 0 and not verified
            candidates = self._history.steps((hint or 0) if from_hint else 0, hint=hint)
            checkpoint, raced = self._newest_of(candidates, verified=verified, seen=seen)
            if raced:  # a newer candidate went under us: newer ones may have come since (I4)
                if round_ < _LATEST_ROUNDS - 1:
                    continue
                if checkpoint is None:
                    break
                return checkpoint  # every round raced: the newest this call could read
            if from_hint:
                if checkpoint is not None:
                    return checkpoint
                continue  # the hint's candidates ran out: list every step
            # A listing made while checkpoints come and go may show none of them (a directory
            # read during renames, a paginated listing). The hint, read again, names the
            # newest publish since, and is read directly: it answers for what was missed.
            again = self._history.read_hint(transient=True)  # not "no hint": that says None
            if again is None or (checkpoint is not None and again <= checkpoint.step):
                return checkpoint
            newer, raced = self._newest_of(
                self._history.steps(again, hint=again), verified=verified, seen=seen
            )
            if newer is not None:
                return newer
            if not raced or round_ == _LATEST_ROUNDS - 1:
                return checkpoint  # the hint names a step deleted or superseded since
            hint = again  # its step went between its listing and its read: list again
        raise TransientStorageError(
            errno.EAGAIN,
            f"{self.url}: every checkpoint listed was deleted before it could be read, "
            f"{_LATEST_ROUNDS} times in a row; try again",
            url=self.url,
        )

    def _newest_of(
        self, candidates: Sequence[int], *, verified: bool, seen: _SeenByLatest
    ) -> tuple[Checkpoint | None, bool]:
        """The newest readable checkpoint of ``candidates``, and whether a deletion raced us
        (a candidate newer than it went)."""
        raced = False
        for step in reversed(candidates):
            try:
                checkpoint = self.get(step)
            except NotACheckpointError:
                continue  # a stray: reported by ls and verify, never returned
            except CheckpointNotFoundError:
                raced = True  # unpublished since it was listed
                continue
            except UntrustedCheckpointError as exc:
                if step not in seen.warned:
                    seen.warned.add(step)
                    log.warning("%s: skipping step %d, not trusted: %s", self.url, step, exc)
                continue
            except IntegrityError as exc:
                if verified:
                    if step not in seen.warned:
                        seen.warned.add(step)
                        log.warning("%s: skipping damaged step %d: %s", self.url, step, exc)
                    continue
                raise type(exc)(
                    f"{exc}; latest(verified=True) falls back to the newest intact checkpoint"
                ) from exc
            if verified:
                try:
                    intact = seen.intact(checkpoint)
                except CheckpointNotFoundError:
                    raced = True
                    continue
                if not intact:
                    continue
            return checkpoint, raced
        return None, raced

    def checkpoints(self) -> list[Checkpoint]:
        """Every published checkpoint that is complete, ascending by step (damaged ones logged)."""
        result = []
        for step in self._history.steps():
            try:
                result.append(self.get(step))
            except CheckpointNotFoundError:
                continue
            except IntegrityError as exc:
                log.warning("%s: step %d is damaged and not listed: %s", self.url, step, exc)
        return result

    # -- removal -------------------------------------------------------------------------

    def delete(self, step: int, *, force: bool = False) -> None:
        """Unpublish ``step`` atomically, then delete its data.

        Refuses (RefusedError) to delete the newest checkpoint unless ``force``. A stray entry
        named like a step is not a checkpoint: NotACheckpointError, and it is left alone.
        A takeover from ``step`` in progress (a rollback to it) keeps it: RefusedError.
        """
        check_step(step)
        for _ in range(_FENCED_ROUNDS):
            newest = self._history.lineage().newest
            steps = self.steps()
            while steps and not self._still_confirmed(steps[-1]):
                steps.pop()  # the cached newest no longer parses: the guard protects the next
            if step not in steps:
                self._history.read_manifest(step)  # raises the precise error: stray, not found
                raise CheckpointNotFoundError(
                    f"{self.url}: no published checkpoint at step {step}", url=self.url, step=step
                )
            if step == steps[-1] and not force:
                raise newest_refused(self.url, step, "the newest", "a rollback to an older step")
            epoch = self._history.owner(step)
            try:
                self._unpublish_fenced(step, epoch, newest)
            except _Fenced:
                continue  # a takeover holds it, or the history changed: decide again
            self._confirmed.pop(step, None)
            if step == steps[-1]:
                self._reset_hint(steps[-2] if len(steps) > 1 else None)
            return
        raise RefusedError(
            f"{self.url}: step {step} was not deleted: a takeover (a rollback) from it is in "
            f"progress, or the store was taken over meanwhile; try again",
            url=self.url,
            step=step,
        )

    def _unpublish_fenced(self, step: int, epoch: int, newest: int) -> None:
        """Unpublish checkpoint (``step``, ``epoch``), decided on the epochs up to ``newest``,
        unless a takeover holds it or a newer epoch exists (_Fenced): the deleter's half of
        docs/protocol.md §8.5. CheckpointNotFoundError if it is gone already."""
        if not self._markers.supported:
            self._history.unpublish(step, epoch)
            return
        intent = self._markers.put(INTENT, step, epoch)
        began = time.monotonic()
        try:
            if self._markers.stamp(HOLD, step, epoch) is not None:
                raise _Fenced(f"a takeover holds step {step}")
            if self.strategy.read_epoch(newest + 1) is not None:
                raise _Fenced(f"epoch {newest + 1} was taken after the decision")
            if time.monotonic() - began > INTENT_STALE_S / 2:
                raise _Fenced("this deleter stalled past half the intent's lifetime")
            self._history.unpublish(step, epoch)
        finally:
            self._markers.remove(intent)

    def rollback(self, step: int) -> RolledBack:
        """Make ``step`` the history's newest checkpoint again: a takeover from it.

        Nothing is deleted: every checkpoint newer than ``step`` leaves the history at once
        (no reader returns it, retention does not count it), and GC unpublishes it once the
        superseded grace period has passed (``gc(superseded_grace=...)``); until then the
        rollback can be undone by a takeover from the newest of them
        (``take_over(step, from_epoch=epoch)``). Writers of the older epochs get
        SupersededError from then on. Returns what left the history and when GC takes it.
        Strays newer than ``step`` are not checkpoints: they are left alone.
        """
        check_step(step)
        try:
            self.get(step)
        except CheckpointNotFoundError as exc:
            raise CheckpointNotFoundError(
                f"{self.url}: cannot roll back to step {step}: it is not published ({exc})",
                url=self.url,
                step=step,
            ) from exc
        newer = self._checkpoint_steps(self._history.steps(min_step=step + 1), min_step=step + 1)
        if not self.strategy.keeps_lineages:
            removed = [doomed for doomed in reversed(newer) if self._unpublish_confirmed(doomed)]
            self._reset_hint(step)
            return RolledBack(step, sorted(removed), None, None)
        if not newer:
            return RolledBack(step, [], None, None)
        epoch = self._take_from(step, None, f"rollback to step {step}", required=True)
        self._epoch = epoch.number
        for left in newer:
            self._confirmed.pop(left, None)
        self._reset_hint(step)
        stamp = self._markers.epoch_stamp(epoch.number)
        after = None
        if stamp is not None:
            after = datetime.fromtimestamp(stamp, timezone.utc) + DEFAULT_SUPERSEDED_GRACE
        return RolledBack(step, newer, epoch, after)

    def _reset_hint(self, step: int | None) -> None:
        """Point LATEST back at ``step`` after a deletion; where it cannot be rewritten (a
        directory named LATEST), say so once: the deletion is done, and readers list past a
        hint that names no checkpoint."""
        try:
            self.strategy.reset_latest_hint(step)
        except StorageError as exc:
            if exc.errno not in (errno.EISDIR, errno.ENOTEMPTY, errno.ENOTDIR, errno.EEXIST):
                raise
            ignore_hint(f"{self.url}/LATEST", f"it cannot be rewritten ({exc.strerror})")

    def _unpublish_confirmed(self, step: int, newest: int | None = None) -> bool:
        """Unpublish ``step`` if it is still the checkpoint this Store confirmed; True if so.

        The manifest is read again just before: a checkpoint deleted and published again by
        another attempt, or replaced by a stray, since it was confirmed is not touched.
        ``newest``: the newest epoch the decision was made on (_Fenced if a newer one exists,
        or a takeover holds the checkpoint); None: unfenced (a store without lineages).
        """
        known = self._confirmed.pop(step, None)
        try:
            current = self._history.read_manifest(step)
        except (CheckpointNotFoundError, IntegrityError):
            return False
        if known is not None and current.attempt != known.attempt:
            return False
        try:
            if newest is None:
                self._history.unpublish(step, current.epoch)
            else:
                self._unpublish_fenced(step, current.epoch, newest)
        except CheckpointNotFoundError:
            return False  # deleted concurrently
        return True

    def apply_retention(self, policy: RetentionPolicy | None = None) -> list[int]:
        """Delete the checkpoints ``policy`` (default: the store's) does not keep; never the
        newest. Returns the deleted steps.

        Only checkpoints count and are deleted: a stray entry named like a step is neither
        counted as one of the kept nor removed.
        """
        policy = policy or self.retention
        if policy is None:
            return []
        deleted: list[int] = []
        for _ in range(_FENCED_ROUNDS):
            try:
                self._retention_pass(policy, deleted)
                return deleted
            except _Fenced as exc:
                log.debug("%s: retention pass stopped (%s); deciding again", self.url, exc)
        return deleted

    def _retention_pass(self, policy: RetentionPolicy, deleted: list[int]) -> None:
        """One pass on the history as read now; _Fenced (``deleted`` holding what went) when
        a takeover from a checkpoint it would delete is in progress, or came after the read."""
        newest = self._history.lineage().newest
        steps = self.steps()
        now = datetime.fromtimestamp(self.clock(), timezone.utc)
        while len(steps) > 1:
            ages = [CheckpointAge(step, self._committed_at(step, policy)) for step in steps]
            keep = policy.keep(ages, now) | {steps[-1]}
            doomed = [step for step in steps if step not in keep]
            if not doomed:
                return
            # The kept checkpoints newer than what goes are what justify deleting it: read
            # their manifests afresh (a cached one may have rotted since) and decide again
            # without any that no longer parses.
            stale = {s for s in keep if s > doomed[0] and not self._still_confirmed(s)}
            if not stale:
                for step in doomed:
                    if self._unpublish_confirmed(step, newest):
                        deleted.append(step)
                return
            steps = [step for step in steps if step not in stale]

    def _still_confirmed(self, step: int) -> bool:
        """Read ``step``'s manifest afresh: True if it parses and is the attempt confirmed."""
        known = self._confirmed.get(step)
        try:
            current = self._history.read_manifest(step)
        except (CheckpointNotFoundError, IntegrityError):
            self._confirmed.pop(step, None)
            return False
        if known is not None and known.attempt != current.attempt:
            self._confirmed[step] = _Confirmed(current.attempt, current.committed_at)
        return True

    def _committed_at(self, step: int, policy: RetentionPolicy) -> datetime | None:
        if not policy.needs_times:
            return None
        known = self._confirmed.get(step)
        return None if known is None else known.committed_at

    def gc(
        self,
        *,
        grace: timedelta | float = DEFAULT_GRACE,
        superseded_grace: timedelta | float = DEFAULT_SUPERSEDED_GRACE,
        dry_run: bool = False,
    ) -> GcReport:
        """Remove leftovers of dead attempts idle for longer than ``grace`` (I7).

        Never touches the checkpoints of the history, nor attempts with activity within
        ``grace``. Checkpoints that a takeover or rollback superseded are unpublished once that
        takeover is older than ``superseded_grace`` (on the storage's clock: its epoch record's
        time), reported as ``superseded``; younger ones are reported as kept, and a takeover
        from one of them (an undo) brings its history back whole. With an unreadable epoch
        record, they are left alone and the report says why.
        """
        keep_s = _seconds(superseded_grace, "superseded_grace")
        report = self.strategy.collect_garbage(
            grace_s=_seconds(grace, "grace"), now=self.clock(), dry_run=dry_run
        )
        try:
            self._markers.collect(report, self.clock())
        except StorageError as exc:
            report.warnings.append(f"holds and deletion intents were not collected: {exc}")
        try:
            lineage = self._history.lineage()
            superseded = self._history.superseded()
        except IntegrityError as exc:
            report.warnings.append(f"superseded checkpoints were not collected: {exc}")
            return report
        storage_now: float | None = None
        stamps: dict[int, float | None] = {}
        for entry in superseded:
            try:
                manifest = self._history.read_manifest_of(entry.step, entry.epoch)
            except (CheckpointNotFoundError, IntegrityError):
                continue  # a stray named like a step, or damage: never deleted (§5.2)
            since = lineage.left_history_at(entry.step, entry.epoch)
            if since is None:
                continue  # back in the history (an undo read after the listing)
            if since not in stamps:
                stamps[since] = self._markers.epoch_stamp(since)
            if storage_now is None:
                storage_now = self._markers.storage_now() + clock_lead(self.clock())
            stamp = stamps[since]
            name = f"step {entry.step} of epoch {entry.epoch} (superseded by epoch {since})"
            if stamp is None:
                report.warnings.append(f"{name} kept: the time of epoch {since} is unreadable")
                continue
            item = GcItem("superseded", name, max(0.0, storage_now - stamp), manifest.total_size)
            if item.age_s < keep_s:
                report.kept_young.append(item)
                continue
            if dry_run:
                report.removed.append(item)
                continue
            try:
                self._unpublish_fenced(entry.step, entry.epoch, lineage.newest)
            except CheckpointNotFoundError:
                continue  # unpublished by another GC meanwhile
            except _Fenced as exc:
                report.warnings.append(f"{name} kept: {exc}")
                continue
            report.removed.append(item)
        return report

    def is_empty(self) -> bool:
        """Tell whether the store holds nothing at all (no checkpoints, no leftovers)."""
        return self.strategy.is_empty()


class _Fenced(CkptStoreError):
    """A deleter kept a checkpoint: a takeover holds it, or came after the decision (§8.5)."""


class _VanishingShardStream:
    """A shard stream whose object vanishing mid-read (a resumed read finding it deleted) is
    reported as the checkpoint's deletion, or as a missing shard, never as a storage error."""

    def __init__(self, raw: BinaryIO, vanished: Callable[[], CkptStoreError]) -> None:
        self._raw = raw
        self._vanished = vanished

    def read(self, size: int = -1) -> bytes:
        try:
            return self._raw.read(size)
        except ObjectNotFoundError as exc:
            raise self._vanished() from exc

    def readinto(self, buffer: BytesLike) -> int:
        try:
            return int(self._raw.readinto(buffer))  # type: ignore[attr-defined]
        except ObjectNotFoundError as exc:
            raise self._vanished() from exc

    def seek(self, position: int, whence: int = 0) -> int:
        try:
            return int(self._raw.seek(position, whence))
        except ObjectNotFoundError as exc:  # a ranged re-read found the object gone
            raise self._vanished() from exc

    def close(self) -> None:
        self._raw.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._raw, name)


def _release_quietly(strategy: CommitStrategy[Any], step: int, attempt: str) -> None:
    """Run from a finalizer, where an exception has nowhere to go: log it instead."""
    try:
        strategy.release(step, attempt)
    except BaseException:  # a crash simulated by the conformance suite, too
        log.debug("releasing attempt %s of step %d failed", attempt, step, exc_info=True)


def newest_refused(url: str, step: int, newest: str, instead: str) -> RefusedError:
    """The refusal to delete ``step``, which is ``newest`` checkpoint of ``url``, without
    force (``instead``: the way to make an older one the newest)."""
    return RefusedError(
        f"{url}: step {step} is {newest} checkpoint; deleting it needs force=True (--force on "
        f"the command line), or {instead}",
        url=url,
        step=step,
    )


def open_store(
    url: str,
    *,
    create: bool = True,
    retention: RetentionPolicy | None = None,
    clock: Clock | None = None,
    epoch: int | None = None,
    signing_key: SigningKeyLike | Literal[False] | None = None,
    trust: TrustLike | Literal[False] | None = None,
    digests: bool | str | None = None,
    incremental: bool | None = None,
    **options: object,
) -> Store:
    """Open the store at ``url`` (``file:///path``, a bare path, ``memory://bucket/prefix``).

    ``create=False`` refuses to create a missing store (for readers and tools). ``epoch`` (or
    ``?epoch=N`` in the URL): write in that epoch, taken by another process of this run
    (``Store.join_epoch``). ``signing_key`` (a PEM file's path; default
    ``$CKPTSTORE_SIGNING_KEY``): sign what this store publishes. ``trust`` (public key files;
    default ``$CKPTSTORE_TRUST``): read only what a trusted key signed (``ckptstore.signing``).
    ``digests``: record shards' cryptographic digests (True, ``"blake3"``, ``"sha256"``;
    on by default when signing). ``incremental`` (or ``?incremental=1``): share unchanged
    shards with earlier checkpoints instead of writing them again (file systems with hard
    links; docs/protocol.md §12). Other keyword arguments are backend options and override
    the URL's query parameters.
    """
    key = signing_key_from(signing_key)
    trusted = trust_from(trust)
    if trusted is None and key is not None and trust is not False:
        # A store that signs reads what it signed, not what anyone with write access left
        # (it would resume from a forgery, and sign what it trains from it): trust=False opts out.
        trusted = Trust([key.public_key()])
    if digests is False and key is not None:
        raise InvalidOptionError(
            "digests=False with a signing key: a signature fixes shard bytes only through "
            "their digests"
        )
    algorithm = default_algorithm() if digests is True else digests or None
    parsed, url_epoch = split_epoch(parse_url(url))
    if url_epoch is not None and epoch is not None and url_epoch != epoch:
        raise InvalidOptionError(
            f"{parsed.scheme}:// URL says epoch {url_epoch}, the epoch option {epoch}: give one"
        )
    epoch = url_epoch if epoch is None else epoch
    parsed, url_incremental = split_incremental(parsed)
    if incremental is not None and not isinstance(incremental, bool):
        raise InvalidOptionError(f"incremental must be True or False, not {incremental!r}")
    if url_incremental is not None and incremental is not None and url_incremental != incremental:
        raise InvalidOptionError(
            f"{parsed.scheme}:// URL says incremental={int(url_incremental)}, the incremental "
            f"option {incremental}: give one"
        )
    incremental = bool(url_incremental if incremental is None else incremental)
    factory = resolve(parsed.scheme)
    strategy = factory(parsed, {**parsed.query, **options})
    strategy.open_root(create=create)
    store = Store(
        strategy,
        retention=retention,
        clock=clock or time.time,
        signing_key=key,
        trust=trusted,
        digest_algorithm=algorithm,
        incremental=incremental,
    )
    if epoch is not None:
        store.join_epoch(epoch)
    return store
