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
The protocol: docs/protocol.md, "Tiers".
"""

from __future__ import annotations

import abc
import logging
import threading
import time
from collections.abc import Sequence
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
    SupersededError,
)
from ckptstore.manifest import Manifest, ReplicaSource, ShardRecord
from ckptstore.pending import PendingCheckpoint
from ckptstore.retention import CheckpointAge, RetentionPolicy
from ckptstore.store import Store
from ckptstore.urls import redact

__all__ = [
    "COPY_CHUNK",
    "KeepOwed",
    "ReplicateAll",
    "ReplicateEvery",
    "ReplicateNewest",
    "ReplicationPolicy",
    "Replicator",
    "replication_policy",
]

log = logging.getLogger(__name__)

COPY_CHUNK = 8 * 1024 * 1024
"""Bytes read from the fast store and written to the durable one at a time."""
_BACKOFF_S = (0.5, 30.0)
"""A failed pass is tried again after the first delay, doubled at each failure up to the second."""


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
        self.skipped: dict[int, str] = {}
        """Steps whose copy did not match the first write (never retried by this replicator)."""
        self.copied: list[int] = []
        """Steps this replicator published in the durable store, in order."""

    def __repr__(self) -> str:
        return f"<Replicator {self.fast.url} -> {self.durable.url} ({self.policy!r})>"

    # -- what is owed --------------------------------------------------------------------

    def refresh(self) -> int | None:
        """Read the durable store's newest step from storage; remember and return it."""
        steps = self.durable.steps()
        newest = steps[-1] if steps else None
        with self._cond:
            self._durable_newest = newest
        return newest

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
        fast_steps = self.fast.steps()
        durable_newest = self.refresh()
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

    def replicate(self, step: int) -> bool:
        """Copy the fast store's checkpoint at ``step`` and publish it in the durable store;
        True if this call published it.

        False when there is nothing to do: the fast store no longer has it, or the durable
        store already publishes a copy of that same attempt (a replicator that died after the
        durable publish). A durable checkpoint at ``step`` that is not a copy of it is left
        alone, with a warning. A shard whose copy does not hash to the first write's CRC32C
        aborts the copy (nothing is published) and the step is skipped from then on
        (``skipped``): ReplicationError.
        """
        try:
            source = self.fast.get(step)
        except CheckpointNotFoundError:
            return False  # deleted since it was listed (a retention pass, an operator)
        with self._cond:
            self._in_flight = step
        try:
            return self._copy(source)
        finally:
            with self._cond:
                self._in_flight = None

    def _copy(self, source: Checkpoint) -> bool:
        manifest = source.manifest
        try:
            pending = self.durable.begin(
                manifest.step,
                manifest.metadata,
                expected_shards=source.names,
                world_size=manifest.writer.world_size,
            )
        except CheckpointExistsError:
            self._already_there(manifest)
            return False
        pending.source = ReplicaSource(
            url=redact(self.fast.url),
            step=manifest.step,
            attempt=manifest.attempt,
            committed_at=manifest.committed_at,
        )
        for name, seconds in manifest.timings.items():
            pending.add_timing(name, seconds)  # what the save cost the trainer, not the copy
        try:
            with pending:
                for record in manifest.shards:
                    self._copy_shard(manifest, record, pending)
        except IntegrityError as exc:
            self.skipped[manifest.step] = str(exc)
            raise ReplicationError(
                f"{self.durable.url}: step {manifest.step} not replicated, nothing published: {exc}"
            ) from exc
        except CheckpointExistsError:
            self._already_there(manifest)  # another replicator published it meanwhile
            return False
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

    def _copy_shard(
        self, manifest: Manifest, record: ShardRecord, pending: PendingCheckpoint
    ) -> None:
        """Stream one shard from the fast store into ``pending``; its record must equal the
        first write's (size, CRC32C, and block CRC32Cs where both use one block size)."""
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
    still owes the durable tier (and the one it is copying)."""

    def __init__(self, inner: RetentionPolicy, replicator: Replicator) -> None:
        self.inner = inner
        self.replicator = replicator
        self.needs_times = inner.needs_times

    def keep(self, checkpoints: Sequence[CheckpointAge], now: datetime) -> set[int]:
        owed = self.replicator.owed([c.step for c in checkpoints])
        return self.inner.keep(checkpoints, now) | owed

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
    if problem is not None:
        raise ShardCorruptError(
            f"step {step}: shard {first.name!r}: the copy does not match the first write "
            f"({problem})"
        )


def _replication_error(replicator: Replicator, error: CkptStoreError) -> ReplicationError:
    if isinstance(error, ReplicationError):
        return error
    return ReplicationError(f"{replicator}: replication failed: {error}")
