"""The store API: begin, write shards, publish; latest, list, get; delete, rollback, GC.

A ``Store`` is a commit strategy (and its driver) plus policy: retention after each publish,
the clock. It keeps no storage state of its own: every answer is read from storage, so any
number of Store objects, in any number of processes, over the same storage agree, and a
process that dies at any instant loses only its unpublished attempt.
"""

from __future__ import annotations

import builtins
import logging
import time
import weakref
from collections.abc import Callable, Iterable, Mapping
from datetime import datetime, timedelta, timezone
from typing import Any

from ckptstore.checkpoint import Checkpoint
from ckptstore.commit.base import CommitStrategy, GcReport
from ckptstore.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    CheckpointStateError,
    CkptStoreError,
    CoverageError,
    IntegrityError,
    InvalidOptionError,
    RefusedError,
    ShardCorruptError,
    ShardMissingError,
    StorageError,
)
from ckptstore.manifest import Manifest, WriterInfo, check_metadata
from ckptstore.names import check_attempt_id, check_shard_name, check_step, new_attempt_id
from ckptstore.pending import PendingCheckpoint, ShardData
from ckptstore.registry import resolve
from ckptstore.retention import CheckpointAge, RetentionPolicy
from ckptstore.urls import parse_url

__all__ = ["DEFAULT_GRACE", "Store", "open_store"]

log = logging.getLogger(__name__)

DEFAULT_GRACE = timedelta(hours=1)
Clock = Callable[[], float]


def _seconds(value: timedelta | float, what: str) -> float:
    seconds = value.total_seconds() if isinstance(value, timedelta) else float(value)
    if seconds < 0:
        raise InvalidOptionError(f"{what} must not be negative, got {value!r}")
    return seconds


class Store:
    """Checkpoints of one training run, in one storage location."""

    def __init__(
        self,
        strategy: CommitStrategy[Any],
        *,
        retention: RetentionPolicy | None = None,
        clock: Clock = time.time,
    ) -> None:
        if retention is not None and not isinstance(retention, RetentionPolicy):
            raise InvalidOptionError(f"retention must be a RetentionPolicy, got {retention!r}")
        strategy.check_capabilities()
        self.strategy = strategy
        self.retention = retention
        self.clock = clock

    @property
    def url(self) -> str:
        """The store's URL."""
        return self.strategy.url

    def __repr__(self) -> str:
        return f"<Store {self.url} ({self.strategy.name})>"

    # -- writing -------------------------------------------------------------------------

    def begin(
        self,
        step: int,
        metadata: Mapping[str, Any] | None = None,
        *,
        expected_shards: Iterable[str] | None = None,
        world_size: int = 1,
        attempt: str | None = None,
    ) -> PendingCheckpoint:
        """Start saving ``step``; nothing is visible until the returned checkpoint publishes.

        Raises CheckpointExistsError at once if the step is already published.
        ``expected_shards`` makes publish refuse unless exactly those shards were written.
        ``attempt`` is an attempt id chosen by a coordinator (multi-rank saves); default fresh.
        """
        check_step(step)
        clean_metadata = check_metadata(metadata)
        expected = None
        if expected_shards is not None:
            expected = frozenset(check_shard_name(name) for name in expected_shards)
        if self.strategy.is_published(step):
            raise CheckpointExistsError(f"{self.url}: step {step} is already published")
        attempt_id = new_attempt_id() if attempt is None else check_attempt_id(attempt)
        self.strategy.begin(step, attempt_id)
        return self._released_when_dropped(
            PendingCheckpoint(
                step=step,
                attempt=attempt_id,
                metadata=clean_metadata,
                expected=expected,
                writer=WriterInfo.current(world_size=world_size),
                open_sink=lambda name, size: self.strategy.open_shard(step, attempt_id, name, size),
                seal=lambda: self.strategy.seal(step, attempt_id),
                publish=self._publish,
                abort=self._abort,
            )
        )

    def join(self, step: int, attempt: str) -> PendingCheckpoint:
        """Write shards into an attempt that a coordinator began in another process.

        The returned checkpoint cannot publish: ``seal`` it and send the receipts it returns to
        the coordinator, whose ``add_receipts`` and ``publish`` commit all ranks' shards at once.
        """
        check_step(step)
        attempt_id = check_attempt_id(attempt)

        def refuse(pending: PendingCheckpoint) -> Checkpoint:
            raise CheckpointStateError(
                f"{self.url}: step {step}: only the coordinator that began attempt "
                f"{attempt_id} publishes it; send it this process's receipts"
            )

        return self._released_when_dropped(
            PendingCheckpoint(
                step=step,
                attempt=attempt_id,
                metadata={},
                expected=None,
                writer=WriterInfo.current(),
                open_sink=lambda name, size: self.strategy.open_shard(step, attempt_id, name, size),
                seal=lambda: self.strategy.seal(step, attempt_id),
                publish=refuse,
                abort=lambda pending: self.strategy.release(step, attempt_id),
            )
        )

    def _released_when_dropped(self, pending: PendingCheckpoint) -> PendingCheckpoint:
        """A pending checkpoint dropped without publish or abort lets go of the files it holds
        open (its staged data stays for GC)."""
        weakref.finalize(pending, _release_quietly, self.strategy, pending.step, pending.attempt)
        return pending

    def save(
        self, step: int, shards: Mapping[str, ShardData], metadata: Mapping[str, Any] | None = None
    ) -> Checkpoint:
        """Write every shard and publish, in one call; on any error nothing is published."""
        with self.begin(step, metadata) as pending:
            for name, data in shards.items():
                pending.write(name, data)
        assert pending.checkpoint is not None
        return pending.checkpoint

    def _publish(self, pending: PendingCheckpoint) -> Checkpoint:
        pending._check_open()
        try:
            self._check_coverage(pending)
        except CkptStoreError:
            self._abort(pending)
            raise
        pending.state = "publishing"  # no shard may start now
        try:
            shards = tuple(pending._seal_records())
        except StorageError:
            pending.state = "open"
            self._abort(pending)  # a shard may not be durable: nothing can publish this attempt
            raise
        except BaseException:
            pending.state = "failed"
            raise
        write_s = time.perf_counter() - pending.started_perf
        manifest = Manifest(
            step=pending.step,
            attempt=pending.attempt,
            shards=shards,
            writer=pending.writer,
            created_at=datetime.fromtimestamp(pending.started, timezone.utc),
            committed_at=datetime.fromtimestamp(self.clock(), timezone.utc),
            timings={"write_s": write_s, **pending.timings},
            metadata=pending.metadata,
            backend=self.strategy.name,
        )
        try:
            self.strategy.publish(manifest)
        except CheckpointExistsError:
            pending.state = "failed"
            self._abort(pending, force=True)
            raise
        except BaseException:
            # The outcome may be unknown (a crash, a timeout after retries): leave the staged
            # data for GC rather than delete what a late commit might reference.
            pending.state = "failed"
            raise
        pending.state = "published"
        pending.checkpoint = Checkpoint(manifest, self.strategy.open_shard_reader, self.url)
        self._after_publish(pending.step)
        return pending.checkpoint

    def _check_coverage(self, pending: PendingCheckpoint) -> None:
        failed = pending.failed_shards
        if failed:
            raise CoverageError(
                f"{self.url}: step {pending.step}: shard(s) {', '.join(sorted(failed))} failed "
                f"to write; nothing was published"
            )
        if pending.expected is None:
            return
        written = {record.name for record in pending.records}
        missing, extra = pending.expected - written, written - pending.expected
        if missing or extra:
            raise CoverageError(
                f"{self.url}: step {pending.step}: missing shards {sorted(missing)[:10]}, "
                f"unexpected shards {sorted(extra)[:10]}; nothing was published"
            )

    def _after_publish(self, step: int) -> None:
        try:
            self.strategy.advance_latest_hint(step)
        except StorageError as exc:
            log.warning("%s: step %d published, LATEST hint not updated: %s", self.url, step, exc)
        if self.retention is not None:
            try:
                self.apply_retention()
            except CkptStoreError as exc:
                log.warning("%s: step %d published; retention failed: %s", self.url, step, exc)

    def _abort(self, pending: PendingCheckpoint, force: bool = False) -> None:
        if pending.state not in ("open", "aborted") and not force:
            return
        pending.state = "aborted" if pending.state == "open" else pending.state
        try:
            self.strategy.abort(pending.step, pending.attempt)
        except StorageError as exc:
            log.warning(
                "%s: could not remove attempt %s of step %d (gc will): %s",
                self.url,
                pending.attempt,
                pending.step,
                exc,
            )

    # -- reading -------------------------------------------------------------------------

    def steps(self) -> list[int]:
        """Every published step, ascending (from the names; manifests are not read)."""
        return self.strategy.published_steps()

    def get(self, step: int) -> Checkpoint:
        """Return the published checkpoint at ``step``, checked for completeness (I1).

        Raises CheckpointNotFoundError, ManifestCorruptError or ShardMissingError.
        """
        manifest = self.strategy.read_manifest(check_step(step))
        problems = self.strategy.shard_problems(manifest)
        if problems:
            error = ShardMissingError if any(p.missing for p in problems) else ShardCorruptError
            raise error(
                f"{self.url}: step {step} is damaged: {'; '.join(map(str, problems[:5]))}"
                + (f" (+{len(problems) - 5} more)" if len(problems) > 5 else "")
            )
        return Checkpoint(manifest, self.strategy.open_shard_reader, self.url)

    def latest(self, *, verified: bool = False) -> Checkpoint | None:
        """Return the newest published checkpoint, or None if there is none.

        With ``verified=True``, every shard's CRC32C is read and checked, and a checkpoint that
        fails is skipped for the next older one (I6). Without it, a damaged newest checkpoint
        raises an IntegrityError rather than being silently passed over.
        """
        candidates: list[int] = []
        if not verified:
            hint = self.strategy.read_latest_hint()
            if hint is not None:
                candidates = self.strategy.published_steps(min_step=hint)
        if not candidates:
            candidates = self.strategy.published_steps()
        for step in reversed(candidates):
            try:
                checkpoint = self.get(step)
            except CheckpointNotFoundError:
                continue  # deleted since it was listed
            except IntegrityError as exc:
                if verified:
                    log.warning("%s: skipping damaged step %d: %s", self.url, step, exc)
                    continue
                raise type(exc)(
                    f"{exc}; latest(verified=True) falls back to the newest intact checkpoint"
                ) from exc
            if verified:
                report = checkpoint.verify()
                if not report.ok:
                    log.warning("%s: skipping corrupt step %d: %s", self.url, step, report.problems)
                    continue
            return checkpoint
        return None

    def list(self) -> builtins.list[Checkpoint]:
        """Every published checkpoint that is complete, ascending by step (damaged ones logged)."""
        result = []
        for step in self.strategy.published_steps():
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

        Refuses (RefusedError) to delete the newest checkpoint unless ``force``.
        """
        check_step(step)
        steps = self.strategy.published_steps()
        if step not in steps:
            raise CheckpointNotFoundError(f"{self.url}: no published checkpoint at step {step}")
        if step == steps[-1] and not force:
            raise RefusedError(
                f"{self.url}: step {step} is the newest checkpoint; deleting it needs force=True "
                f"(--force on the command line), or a rollback to an older step"
            )
        self.strategy.unpublish(step)
        if step == steps[-1]:
            self.strategy.reset_latest_hint(steps[-2] if len(steps) > 1 else None)

    def rollback(self, step: int) -> builtins.list[int]:
        """Delete every checkpoint newer than ``step`` (newest first); return their steps."""
        check_step(step)
        if not self.strategy.is_published(step):
            raise CheckpointNotFoundError(
                f"{self.url}: cannot roll back to step {step}: it is not published"
            )
        newer = self.strategy.published_steps(min_step=step + 1)
        for doomed in reversed(newer):
            self.strategy.unpublish(doomed)
        self.strategy.reset_latest_hint(step)
        return newer

    def apply_retention(self, policy: RetentionPolicy | None = None) -> builtins.list[int]:
        """Delete the checkpoints ``policy`` (default: the store's) does not keep; never the
        newest. Returns the deleted steps."""
        policy = policy or self.retention
        if policy is None:
            return []
        steps = self.strategy.published_steps()
        if len(steps) <= 1:
            return []
        ages = [CheckpointAge(step, self._committed_at(step, policy)) for step in steps]
        now = datetime.fromtimestamp(self.clock(), timezone.utc)
        keep = policy.keep(ages, now) | {steps[-1]}
        doomed = [step for step in steps if step not in keep]
        for step in doomed:
            try:
                self.strategy.unpublish(step)
            except CheckpointNotFoundError:
                continue  # deleted concurrently
        return doomed

    def _committed_at(self, step: int, policy: RetentionPolicy) -> datetime | None:
        if not policy.needs_times:
            return None
        try:
            return self.strategy.read_manifest(step).committed_at
        except (IntegrityError, CheckpointNotFoundError):
            return None

    def gc(self, *, grace: timedelta | float = DEFAULT_GRACE, dry_run: bool = False) -> GcReport:
        """Remove leftovers of dead attempts idle for longer than ``grace`` (I7).

        Never touches published checkpoints, nor attempts with activity within ``grace``.
        """
        return self.strategy.collect_garbage(
            grace_s=_seconds(grace, "grace"), now=self.clock(), dry_run=dry_run
        )

    def is_empty(self) -> bool:
        """Tell whether the store holds nothing at all (no checkpoints, no leftovers)."""
        return self.strategy.is_empty()


def _release_quietly(strategy: CommitStrategy[Any], step: int, attempt: str) -> None:
    """Run from a finalizer, where an exception has nowhere to go: log it instead."""
    try:
        strategy.release(step, attempt)
    except BaseException:  # a crash simulated by the conformance suite, too
        log.debug("releasing attempt %s of step %d failed", attempt, step, exc_info=True)


def open_store(
    url: str,
    *,
    create: bool = True,
    retention: RetentionPolicy | None = None,
    clock: Clock | None = None,
    **options: object,
) -> Store:
    """Open the store at ``url`` (``file:///path``, a bare path, ``memory://bucket/prefix``).

    ``create=False`` refuses to create a missing store (for readers and tools). Other keyword
    arguments are backend options and override the URL's query parameters.
    """
    parsed = parse_url(url)
    factory = resolve(parsed.scheme)
    strategy = factory(parsed, {**parsed.query, **options})
    strategy.open_root(create=create)
    return Store(strategy, retention=retention, clock=clock or time.time)
