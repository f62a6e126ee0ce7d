"""Copies checkpoints published in a fast store to a durable one, where each is published again.

A ``Replicator`` decides what to copy from storage alone: the steps the fast store publishes
and the newest step the durable store publishes, through a ``ReplicationPolicy`` (every
checkpoint, one every N steps, or the newest when it falls behind). So a replicator that
starts in a new process finds what the last one left owed, and nothing it holds in memory is
needed for correctness. Each copy is an ordinary save into the durable store (its own commit
protocol, its own commit point, its own retention), whose manifest records where the
checkpoint was first published (``Manifest.source``). The bytes are streamed from the fast
store unverified and hashed as they go to the durable store: each shard's size, CRC32C and
block CRC32Cs must equal what the first write recorded, else the copy is aborted and nothing
is published. That check covers the whole way, from the trainer's bytes to the durable copy.
The pair has one history, the durable store's lineage: every checkpoint the tiered store
saves in the fast store records the durable epoch its writer was in (``TIER_KEY`` in its
metadata), and a fast checkpoint whose (step, durable epoch) the durable lineage does not
hold (a partitioned node's branch, a tier rolled back) is never copied.
The protocol: docs/protocol.md, "Tiers".
"""

from __future__ import annotations

import abc
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime

from ckptstore.checkpoint import Checkpoint
from ckptstore.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    CkptStoreError,
    IntegrityError,
    InvalidOptionError,
    ReplicationError,
    ReplicationTimeoutError,
    ShardCorruptError,
    StepOutsideEpochError,
    StrayEntryError,
    SupersededError,
)
from ckptstore.lineage import Lineage
from ckptstore.manifest import TIER_KEY, Manifest, ReplicaSource, ShardRecord, shown_location
from ckptstore.pending import PendingCheckpoint
from ckptstore.retention import CheckpointAge, RetentionPolicy
from ckptstore.store import Store
from ckptstore.urls import redact

__all__ = [
    "COPY_CHUNK",
    "TIER_KEY",
    "KeepOwed",
    "OutsideCheckpoint",
    "ReplicateAll",
    "ReplicateEvery",
    "ReplicateNewest",
    "ReplicationPolicy",
    "Replicator",
    "durable_epoch_of",
    "replication_policy",
    "shown_url",
    "tier_record",
]

log = logging.getLogger(__name__)

COPY_CHUNK = 8 * 1024 * 1024
"""Bytes read from the fast store and written to the durable one at a time."""
_BACKOFF_S = (0.5, 30.0)
"""A failed pass is tried again after the first delay, doubled at each failure up to the second."""


def shown_url(url: str) -> str:
    """``url`` as the tier record shows it: without userinfo, query or fragment."""
    return shown_location(url)


def tier_record(manifest: Manifest) -> Mapping[str, object] | None:
    """The tier record of a fast-tier checkpoint (``TIER_KEY``), or None if it has none."""
    record = manifest.metadata.get(TIER_KEY)
    return record if isinstance(record, Mapping) else None


def durable_epoch_of(manifest: Manifest) -> int | None:
    """The durable epoch a fast-tier checkpoint's writer was in: its tier record's, 0 for a
    checkpoint without one (saved before tiers kept lineages, or not through a tiered store),
    None for a record that does not parse (never in the history)."""
    if TIER_KEY not in manifest.metadata:
        return 0
    record = tier_record(manifest)
    epoch = None if record is None else record.get("durable_epoch")
    if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
        return None
    return epoch


@dataclass(frozen=True)
class OutsideCheckpoint:
    """A fast-tier checkpoint the durable lineage does not hold: never returned, copied or
    counted (a partitioned node's branch, or what a rollback of the pair left behind)."""

    step: int
    attempt: str
    durable_epoch: int | None
    """The durable epoch its writer was in (None: an unreadable tier record)."""
    owner: int
    """The durable epoch that owns the step."""

    def describe(self, fast_url: str) -> str:
        """One line for the log and ``ckptstore ls``."""
        written = (
            "an unreadable tier record"
            if self.durable_epoch is None
            else f"durable epoch {self.durable_epoch}"
        )
        return (
            f"{fast_url}: step {self.step} (attempt {self.attempt}) of the fast tier is not in "
            f"the durable history: written in {written}, while the durable lineage gives "
            f"step {self.step} to epoch {self.owner}; it is never returned, replicated or "
            f"counted, and the pair's gc removes it once the takeover that put it out is older "
            f"than the grace period"
        )


def outside_history(manifest: Manifest, lineage: Lineage) -> OutsideCheckpoint | None:
    """None if the fast checkpoint of ``manifest`` is in the durable history of ``lineage``,
    else what it is."""
    epoch = durable_epoch_of(manifest)
    if epoch is not None and lineage.in_history(manifest.step, epoch):
        return None
    return OutsideCheckpoint(manifest.step, manifest.attempt, epoch, lineage.owner(manifest.step))


class ReplicationPolicy(abc.ABC):
    """Chooses the fast store's checkpoints to copy, from what both stores publish."""

    @abc.abstractmethod
    def select(self, fast_steps: Sequence[int], durable_newest: int | None) -> list[int]:
        """The steps of ``fast_steps`` (ascending) to copy, ascending; ``durable_newest`` is the
        newest step the durable store publishes (None: none). Only steps newer than it are
        ever chosen: what the durable store's retention removed is not copied again."""


class ReplicateAll(ReplicationPolicy):
    """Copy every checkpoint newer than the durable store's newest."""

    def select(self, fast_steps: Sequence[int], durable_newest: int | None) -> list[int]:
        return [step for step in fast_steps if durable_newest is None or step > durable_newest]

    def __repr__(self) -> str:
        return "ReplicateAll()"


class ReplicateEvery(ReplicationPolicy):
    """Copy one checkpoint every ``steps`` training steps: walking up from the durable store's
    newest, each checkpoint at least ``steps`` past the last one chosen (the first checkpoint
    when the durable store has none). A trainer that saves every s steps and wants every k-th
    save durable passes ``steps=k * s``."""

    def __init__(self, steps: int) -> None:
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise InvalidOptionError(f"ReplicateEvery(steps) needs an int >= 1, got {steps!r}")
        self.steps = steps

    def select(self, fast_steps: Sequence[int], durable_newest: int | None) -> list[int]:
        chosen, last = [], durable_newest
        for step in fast_steps:
            if last is None or step >= last + self.steps:
                chosen.append(step)
                last = step
        return chosen

    def __repr__(self) -> str:
        return f"ReplicateEvery({self.steps})"


class ReplicateNewest(ReplicationPolicy):
    """Copy only the newest checkpoint: a replicator that falls behind skips the older ones."""

    def select(self, fast_steps: Sequence[int], durable_newest: int | None) -> list[int]:
        if not fast_steps or (durable_newest is not None and fast_steps[-1] <= durable_newest):
            return []
        return [fast_steps[-1]]

    def __repr__(self) -> str:
        return "ReplicateNewest()"


def replication_policy(value: object) -> ReplicationPolicy:
    """A policy from ``open``'s ``replication=`` option: a ReplicationPolicy, ``"all"``,
    ``"newest"`` or ``"every:N"`` (N steps); InvalidOptionError for anything else."""
    if isinstance(value, ReplicationPolicy):
        return value
    if value == "all":
        return ReplicateAll()
    if value == "newest":
        return ReplicateNewest()
    if isinstance(value, str) and value.startswith("every:"):
        try:
            steps = int(value.removeprefix("every:"))
        except ValueError as exc:
            raise InvalidOptionError(f"replication={value!r}: N must be an integer") from exc
        return ReplicateEvery(steps)
    raise InvalidOptionError(
        f"unknown replication policy {value!r}: use 'all', 'newest', 'every:N' (steps) or a "
        f"ckptstore.replication.ReplicationPolicy"
    )


class _Stopped(CkptStoreError):
    """The replicator was told to stop in the middle of a copy (it is aborted)."""


@dataclass(frozen=True)
class _Failure:
    """A pass that failed: the request it was serving, and why."""

    generation: int
    error: CkptStoreError


SHARED_COPY_MAX = 2 * 1024**3
"""A shard up to this size is read whole by a replicator whose durable store saves
incrementally, so that it can be shared there; a larger one is streamed (and copied)."""


class Replicator:
    """Copies what ``policy`` selects from ``fast`` to ``durable``, in passes, each read afresh
    from storage; in a thread of its own (``start``) or called directly (``run_pass``).

    ``fast`` and ``durable`` are Stores this replicator alone uses (a Store is not shared
    between threads); ``durable``'s retention is the durable tier's.
    """

    def __init__(
        self,
        fast: Store,
        durable: Store,
        policy: ReplicationPolicy,
        *,
        chunk_size: int = COPY_CHUNK,
    ) -> None:
        self.fast = fast
        self.durable = durable
        self.policy = policy
        self.chunk_size = chunk_size
        self._cond = threading.Condition()
        self._durable_newest: int | None = None
        self._in_flight: int | None = None
        self._requested = 1  # a first pass is owed: what an earlier process left
        self._completed = 0
        self._failure: _Failure | None = None
        self._newest_wanted = 0  # the request from which the newest is copied whatever policy
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._copy_lock = threading.Lock()  # held through each copy; ``paused`` takes it
        self.lineage: Lineage | None = None
        """The durable store's epochs as the last pass (or ``refresh``) read them."""
        self.outside: dict[int, OutsideCheckpoint] = {}
        """Fast-tier checkpoints the last pass found outside the durable history (not copied)."""
        self._reported: set[tuple[int, str]] = set()
        self.skipped: dict[int, str] = {}
        """Steps whose copy did not match the first write, or that the durable writer's epoch
        cannot hold (never retried by this replicator)."""
        self.copied: list[int] = []
        """Steps this replicator published in the durable store, in order."""

    def __repr__(self) -> str:
        return f"<Replicator {self.fast.url} -> {self.durable.url} ({self.policy!r})>"

    # -- what is owed --------------------------------------------------------------------

    def refresh(self) -> int | None:
        """Read the durable store's newest step and its epochs from storage; remember both
        and return the step."""
        steps = self.durable.steps()
        newest = steps[-1] if steps else None
        lineage = self.durable.lineage()
        with self._cond:
            self._durable_newest = newest
            self.lineage = lineage
        return newest

    def holds(self, manifest: Manifest, lineage: Lineage) -> bool:
        """Whether the fast checkpoint of ``manifest`` is in the durable history of
        ``lineage`` (docs/protocol.md §9.3, T5): only those are ever copied."""
        outside = outside_history(manifest, lineage)
        if outside is None:
            return True
        self.outside[manifest.step] = outside
        self.report(outside)
        return False

    def report(self, outside: OutsideCheckpoint) -> None:
        """Warn of a fast checkpoint outside the durable history, once per attempt (for the
        replicator and the tiered store's readers alike)."""
        key = (outside.step, outside.attempt)
        with self._cond:
            if key in self._reported:
                return
            self._reported.add(key)
        log.warning("%s", outside.describe(self.fast.url))

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """No copy runs inside the block (one in progress is waited for): for a takeover or
        a rollback of the pair, after which each copy reads the epochs afresh."""
        with self._copy_lock:
            yield

    @property
    def durable_newest(self) -> int | None:
        """The newest step the durable store published, as last read or copied."""
        return self._durable_newest

    def owed(self, fast_steps: Sequence[int]) -> set[int]:
        """Of ``fast_steps``, those still to be copied (and the one being copied): what the
        fast tier's retention must keep. Decided on the durable newest as last read, which
        only lags the storage: it may keep more than needed, never less."""
        with self._cond:
            durable_newest, in_flight = self._durable_newest, self._in_flight
        owed = set(self.policy.select(sorted(fast_steps), durable_newest))
        if in_flight is not None:
            owed.add(in_flight)
        return owed

    # -- one pass ------------------------------------------------------------------------

    def run_pass(self, *, newest: bool = False) -> list[int]:
        """Copy every checkpoint the policy selects now (and the fast tier's newest, if
        ``newest``); return the steps published in the durable store by this pass.

        Raises the first error that stopped the pass (a StorageError, ReplicationError): what
        was not copied is owed to the next pass.
        """
        # Decided under the copy lock: a takeover or rollback of the pair (``paused``) is seen
        # whole or not at all. Half of one (the durable epoch taken, this writer's epoch not
        # yet moved to it) read as this writer superseded, and stopped the replicator.
        with self._copy_lock:
            fast_steps = self._held_steps(self.fast.steps(), self.refresh())
            self._check_not_superseded()
            durable_newest = self._durable_newest
        todo = self.policy.select(fast_steps, durable_newest)
        if newest and fast_steps and (durable_newest is None or fast_steps[-1] > durable_newest):
            todo = sorted({*todo, fast_steps[-1]})
        done = []
        for step in todo:
            if self._stopping:
                raise _Stopped("the replicator was stopped")
            if step in self.skipped:
                continue
            if self.replicate(step):
                done.append(step)
        return done

    def _held_steps(self, fast_steps: Sequence[int], durable_newest: int | None) -> list[int]:
        """Of ``fast_steps``, those the policy may choose: at or below the durable newest as
        listed (never chosen), and above it those in the durable history."""
        lineage = self.lineage
        self.outside = {}
        if lineage is None:
            return list(fast_steps)
        held = []
        for step in fast_steps:
            if durable_newest is not None and step <= durable_newest:
                held.append(step)
                continue
            try:
                manifest = self.fast.manifest(step)
            except (CheckpointNotFoundError, IntegrityError):
                continue  # gone since the listing, or damaged: nothing to copy
            if self.holds(manifest, lineage):
                held.append(step)
        return held

    def _check_not_superseded(self) -> None:
        """SupersededError if this pair's writer saved, in a durable epoch a takeover has
        superseded since, a checkpoint the durable history therefore does not hold: the
        replicator of a zombie stops, and its trainer learns it (``wait_replicated``)."""
        mine, lineage = self.durable.epoch, self.lineage
        if mine is None or lineage is None:
            return
        newer = lineage.superseded_by(mine)
        left = sorted(s for s, o in self.outside.items() if o.durable_epoch == mine)
        if newer is None or not left:
            return
        parent = "a fresh start" if newer.parent is None else f"step {newer.parent}"
        raise SupersededError(
            f"{self.durable.url}: this writer's epoch {mine} was superseded by epoch "
            f"{newer.number}, taken at {newer.started_at.isoformat(timespec='seconds')} by "
            f"{newer.writer.host} (pid {newer.writer.pid}), resumed from {parent}; step(s) "
            f"{', '.join(map(str, left))} of the fast tier were not replicated. A restarted "
            f"run owns the pair now: stop this process"
        )

    def replicate(self, step: int) -> bool:
        """Copy the fast store's checkpoint at ``step`` and publish it in the durable store;
        True if this call published it.

        False when there is nothing to do: the fast store no longer has it, or the durable
        store already publishes a copy of that same attempt (a replicator that died after the
        durable publish). A durable checkpoint at ``step`` that is not a copy of it is left
        alone, with a warning. A fast checkpoint outside the durable history, as the epochs
        read just before say, is not copied (False, and reported once). A shard whose copy
        does not hash to the first write's CRC32C aborts the copy (nothing is published) and
        the step is skipped from then on (``skipped``): ReplicationError.
        """
        with self._copy_lock:
            with self._cond:  # owed from now on: the fast tier's retention keeps it
                self._in_flight = step
            try:
                try:
                    source = self.fast.get(step)
                except CheckpointNotFoundError:
                    return False  # deleted since it was listed (a retention pass, an operator)
                if not self.holds(source.manifest, self.durable.lineage()):
                    return False
                return self._copy(source)
            finally:
                with self._cond:
                    self._in_flight = None

    def _copy(self, source: Checkpoint) -> bool:
        manifest = source.manifest
        metadata = {k: v for k, v in manifest.metadata.items() if k != TIER_KEY}
        try:
            pending = self.durable.begin(
                manifest.step,
                metadata,
                expected_shards=source.names,
                world_size=manifest.writer.world_size,
            )
        except CheckpointExistsError:
            self._already_there(manifest)
            return False
        except StepOutsideEpochError as exc:  # older than the step the durable run resumed from
            self.skipped[manifest.step] = str(exc)
            log.warning("%s: step %d not replicated: %s", self, manifest.step, exc)
            return False
        pending.source = ReplicaSource(
            url=redact(self.fast.url),
            step=manifest.step,
            attempt=manifest.attempt,
            committed_at=manifest.committed_at,
            signature=manifest.signature,  # kept, never made: the replicator signs nothing
            signed=manifest.signed,
        )
        # The copy records the digests the first write did (so a trusting reader checks it).
        pending.digest_algorithm = next(
            (s.digest_algorithm for s in manifest.shards if s.digest), None
        )
        for name, seconds in manifest.timings.items():
            pending.add_timing(name, seconds)  # what the save cost the trainer, not the copy
        try:
            with pending:  # aborted on any error: nothing published
                for record in manifest.shards:
                    self._copy_shard(manifest, record, pending)
        except CheckpointExistsError:
            self._already_there(manifest)  # another replicator published it meanwhile
            return False
        except CkptStoreError as exc:
            if isinstance(exc, _Stopped):
                raise
            if self._deleted_since(manifest):  # the fast tier's retention (it judged on what
                return False  # it read of the owed steps just before), or an operator
            if not isinstance(exc, (IntegrityError, StrayEntryError)):
                raise
            # a shard that does not hash as first written, or a stray in the durable tier
            self.skipped[manifest.step] = str(exc)
            raise ReplicationError(
                f"{self.durable.url}: step {manifest.step} not replicated, nothing published: "
                f"{exc}",
                step=manifest.step,
            ) from exc
        with self._cond:
            if self._durable_newest is None or manifest.step > self._durable_newest:
                self._durable_newest = manifest.step
        self.copied.append(manifest.step)
        return True

    def _already_there(self, manifest: Manifest) -> None:
        """The durable store publishes ``manifest.step``: a copy of this attempt, or not."""
        try:
            there = self.durable.manifest(manifest.step)
        except (CheckpointNotFoundError, IntegrityError) as exc:
            log.warning(
                "%s: step %d: cannot tell what is there: %s", self.durable.url, manifest.step, exc
            )
            return
        if there.source is None or there.source.attempt != manifest.attempt:
            log.warning(
                "%s: step %d is published there, but not as a copy of attempt %s of %s; left alone",
                self.durable.url,
                manifest.step,
                manifest.attempt,
                self.fast.url,
            )

    def _deleted_since(self, manifest: Manifest) -> bool:
        """Whether the fast tier no longer publishes the attempt of ``manifest`` (a copy that
        failed because its source went is nothing to report: it is no longer owed)."""
        try:
            return self.fast.manifest(manifest.step).attempt != manifest.attempt
        except CheckpointNotFoundError:
            return True
        except CkptStoreError:
            return False  # cannot tell: the copy's own error is reported

    def _copy_shard(
        self, manifest: Manifest, record: ShardRecord, pending: PendingCheckpoint
    ) -> None:
        """Stream one shard from the fast store into ``pending``; its record must equal the
        first write's (size, CRC32C, and block CRC32Cs where both use one block size).

        Into an incremental durable store, a shard of up to ``SHARED_COPY_MAX`` bytes is read
        whole and written as a buffer: where the durable store holds its bytes already (an
        unchanged frozen tensor), it is shared there, not copied (docs/protocol.md §12.4)."""
        if self.durable.incremental and record.size <= SHARED_COPY_MAX:
            whole = bytearray(record.size)
            with self.fast.strategy.open_shard_reader(manifest, record) as raw:
                got = _read_some(raw, memoryview(whole))
            if got != record.size:
                raise ShardCorruptError(
                    f"step {manifest.step}: shard {record.name!r}: {got} bytes read from the "
                    f"fast tier, {record.size} recorded",
                    step=manifest.step,
                )
            _check_same(manifest.step, record, pending.write(record.name, whole))
            return
        buffer = bytearray(min(self.chunk_size, max(record.size, 1)))
        view = memoryview(buffer)
        with (
            self.fast.strategy.open_shard_reader(manifest, record) as raw,
            pending.open_shard(record.name, record.size) as writer,
        ):
            while True:
                if self._stopping:
                    raise _Stopped(f"the replicator was stopped copying step {manifest.step}")
                read = _read_some(raw, view)
                if not read:
                    break
                writer.write(view[:read])
            copied = writer.close()
        _check_same(manifest.step, record, copied)

    # -- the thread ----------------------------------------------------------------------

    def start(self) -> None:
        """Run passes in a daemon thread: one now, one after each ``notify``, and after a
        failed pass one more after a delay (0.5 s, doubling to 30 s)."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(
            target=self._run, name=f"ckptstore-replicator {self.fast.url}", daemon=True
        )
        self._thread.start()

    def notify(self, step: int | None = None) -> None:
        """Ask for a pass: something was published in the fast store."""
        with self._cond:
            self._requested += 1
            self._cond.notify_all()

    def wait(self, timeout: float | None = None, *, newest: bool = False) -> None:
        """Return once a pass that started after this call has copied everything owed (and
        the fast tier's newest checkpoint, if ``newest``).

        Raises ReplicationError with the error of such a pass that failed, and
        ReplicationTimeoutError after ``timeout`` seconds. Without a thread, runs the pass.
        """
        if self._thread is None:
            try:
                self.run_pass(newest=newest)
            except CkptStoreError as exc:
                raise _replication_error(self, exc) from exc
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            self._requested += 1
            target = self._requested
            if newest:
                self._newest_wanted = target
            self._cond.notify_all()
            while self._completed < target:
                failure = self._failure
                if failure is not None and failure.generation >= target:
                    raise _replication_error(self, failure.error) from failure.error
                if self._stopping or not self._thread.is_alive():
                    why = f": {failure.error}" if failure is not None else ""
                    raise ReplicationError(f"{self}: the replicator has stopped{why}")
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    last = f"; last error: {failure.error}" if failure is not None else ""
                    raise ReplicationTimeoutError(
                        f"{self}: the durable store has not caught up after {timeout} s"
                        f" (durable newest: {self._durable_newest}){last}"
                    )
                self._cond.wait(left)

    def stop(self) -> None:
        """Stop the thread: a copy in progress is aborted (its staging removed; what a crash
        would leave is GC's), and is owed to the next replicator."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    def _run(self) -> None:
        delay = _BACKOFF_S[0]
        while True:
            with self._cond:
                while not self._stopping and self._completed >= self._requested:
                    self._cond.wait()
                if self._stopping:
                    return
                generation = self._requested
                newest = self._newest_wanted > self._completed
            try:
                self.run_pass(newest=newest)
            except _Stopped:
                return
            except SupersededError as exc:  # a restarted run owns the durable tier: for good
                log.error("%s: replication stopped: %s", self, exc)
                with self._cond:
                    self._failure = _Failure(generation, exc)
                    self._stopping = True
                    self._cond.notify_all()
                return
            except CkptStoreError as exc:
                log.warning(
                    "%s: replication pass failed (will retry in %.1f s): %s", self, delay, exc
                )
                with self._cond:
                    self._failure = _Failure(generation, exc)
                    self._cond.notify_all()
                    self._cond.wait_for(lambda: self._stopping, timeout=delay)
                delay = min(delay * 2, _BACKOFF_S[1])
                continue
            except BaseException as exc:  # a bug: say so, and let waiters know
                log.exception("%s: replicator thread died", self)
                with self._cond:
                    self._failure = _Failure(generation, ReplicationError(repr(exc)))
                    self._cond.notify_all()
                raise
            delay = _BACKOFF_S[0]
            with self._cond:
                self._completed = max(self._completed, generation)
                self._failure = None
                self._cond.notify_all()


class KeepOwed(RetentionPolicy):
    """The fast tier's retention: what ``inner`` keeps, plus every checkpoint the replicator
    still owes the durable tier (and the one it is copying).

    ``outside``, if given, names the checkpoints of a list of steps that are outside the
    durable history: they are not counted (``inner`` and the replication policy never see
    them) and not removed here (a takeover of the pair supersedes them; GC collects them)."""

    def __init__(
        self,
        inner: RetentionPolicy,
        replicator: Replicator,
        outside: Callable[[Sequence[int]], set[int]] | None = None,
    ) -> None:
        self.inner = inner
        self.replicator = replicator
        self.outside = outside
        self.needs_times = inner.needs_times

    def keep(self, checkpoints: Sequence[CheckpointAge], now: datetime) -> set[int]:
        outside = set() if self.outside is None else self.outside([c.step for c in checkpoints])
        counted = [c for c in checkpoints if c.step not in outside]
        owed = self.replicator.owed([c.step for c in counted])
        return self.inner.keep(counted, now) | owed | outside

    def __repr__(self) -> str:
        return f"KeepOwed({self.inner!r})"


def _read_some(raw: object, view: memoryview) -> int:
    """Fill ``view`` from a raw shard stream as far as it goes; 0 at its end."""
    readinto = getattr(raw, "readinto", None)
    if readinto is not None:
        got = 0
        while got < len(view):
            n = readinto(view[got:])
            if not n:
                break
            got += n
        return got
    data = raw.read(len(view))  # type: ignore[attr-defined]
    view[: len(data)] = data
    return len(data)


def _check_same(step: int, first: ShardRecord, copied: ShardRecord) -> None:
    """Raise ShardCorruptError unless the copy hashes to what the first write recorded."""
    problem = None
    if copied.size != first.size:
        problem = f"{copied.size} bytes copied, {first.size} recorded"
    elif copied.crc32c != first.crc32c:
        problem = f"CRC32C {copied.crc32c} copied, {first.crc32c} recorded"
    elif first.block_size == copied.block_size and first.block_crc32c != copied.block_crc32c:
        problem = "block CRC32Cs differ from those recorded"
    elif first.digest and (first.digest, first.block_digests) != (
        copied.digest,
        copied.block_digests,
    ):
        problem = f"digest {copied.digest or 'none'} copied, {first.digest} recorded"
    if problem is not None:
        raise ShardCorruptError(
            f"step {step}: shard {first.name!r}: the copy does not match the first write "
            f"({problem})",
            step=step,
        )


def _replication_error(replicator: Replicator, error: CkptStoreError) -> ReplicationError:
    if isinstance(error, ReplicationError):
        return error
    return ReplicationError(f"{replicator}: replication failed: {error}")
