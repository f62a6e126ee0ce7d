"""A store's history as its readers see it: only checkpoints whose epoch owns their step (I9).

``History`` stands between the Store and its commit strategy: every question the Store asks
by step (is it published, its manifest, unpublish it, which steps are there) is answered for
the one checkpoint of that step that is part of the history (docs/protocol.md §8.2), after
reading the epochs *after* what it answers from, so that nothing superseded before it was
published is ever returned. A store that was never taken over has only epoch 0, and answers
exactly as before lineages, for one extra read of a record that does not exist.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from ckptstore.commit.base import CommitStrategy
from ckptstore.errors import (
    CheckpointNotFoundError,
    EpochExistsError,
    EpochNotFoundError,
    EpochRequiredError,
    InvalidInputError,
    StepOutsideEpochError,
    StorageError,
    SupersededError,
    TransientStorageError,
)
from ckptstore.hint import ignore_hint, report_lagging_listing
from ckptstore.lineage import Epoch, Lineage
from ckptstore.manifest import Manifest, WriterInfo
from ckptstore.names import check_epoch, check_step
from ckptstore.signing import SigningKey, Trust

__all__ = ["History", "SupersededCheckpoint"]

_READ_HINT = object()
"""``History.steps``'s default: read the LATEST hint to cross-check the listing with."""
_RELISTS = 64
"""Listings a cross-check makes past where a listing ended, at most."""
_TAKE_TRIES = 64
"""Epoch numbers a takeover tries past the newest it read (others taking over at once)."""


@dataclass(frozen=True)
class SupersededCheckpoint:
    """A checkpoint no reader returns: a later epoch resumed from below its step."""

    step: int
    epoch: int
    owner: int
    """The epoch that owns the step now (its checkpoint of the step may or may not exist)."""


class History:
    """The checkpoints of one history, by step, over a strategy that names them by epoch."""

    def __init__(
        self,
        strategy: CommitStrategy[Any],
        clock: Callable[[], float],
        *,
        trust: Trust | None = None,
        signing_key: SigningKey | None = None,
    ) -> None:
        """``trust``: every manifest and epoch record read must be signed by a trusted key
        (UntrustedCheckpointError); ``signing_key``: the epochs this history takes are signed."""
        self.strategy = strategy
        self.clock = clock
        self.trust = trust
        self.signing_key = signing_key
        self._epochs: list[Epoch] = []
        self._listed = False
        self._lock = threading.Lock()

    # -- the epochs ----------------------------------------------------------------------

    def lineage(self) -> Lineage:
        """The epochs as storage has them now: cached records, then each next number read
        directly until one is missing (no listing: a listing may lag, and epochs are few)."""
        with self._lock:
            self._listed = True
            while True:
                number = len(self._epochs) + 1
                data = self.strategy.read_epoch(number)
                if data is None:
                    break
                self._epochs.append(self._decode(number, data))
            return Lineage(tuple(self._epochs))

    def _decode(self, number: int, data: bytes) -> Epoch:
        where = f"{self.strategy.url}/epochs/epoch-{number:020d}"
        epoch = Epoch.decode(data, where=where, expected=number)
        if self.trust is not None:
            epoch.check_trust(self.trust, where=self.strategy.url)
        return epoch

    def take(
        self, resumed_from: int | None, note: str = "", *, parent_epoch: int | None = None
    ) -> Epoch:
        """Create the next epoch, resumed from step ``resumed_from`` (None: a fresh start) of
        the history of ``parent_epoch`` (None: the newest epoch read now)."""
        parent = None if resumed_from is None else check_step(resumed_from)
        number = self.lineage().newest + 1
        base = number - 1 if parent_epoch is None else parent_epoch
        for _ in range(_TAKE_TRIES):
            epoch = Epoch(
                number=number,
                parent=parent,
                started_at=datetime.fromtimestamp(self.clock(), timezone.utc),
                writer=WriterInfo.current(),
                note=note,
                parent_epoch=None if parent is None or base == number - 1 else base,
            )
            if self.signing_key is not None:
                epoch = epoch.signed_by(self.signing_key)
            try:
                self.strategy.create_epoch(number, epoch.encode())
            except EpochExistsError:
                number = max(number + 1, self.lineage().newest + 1)
                continue
            self.lineage()  # ours, and any taken before it, are now known
            return epoch
        raise EpochExistsError(
            f"{self.strategy.url}: {_TAKE_TRIES} epoch numbers in a row were taken by others "
            f"while this run tried to take the store over",
            url=self.strategy.url,
        )

    def check_exists(self, epoch: int) -> None:
        """Raise EpochNotFoundError unless ``epoch`` was taken (0 always was)."""
        if not self.lineage().knows(check_epoch(epoch)):
            raise EpochNotFoundError(
                f"{self.strategy.url}: epoch {epoch} was never taken (newest: "
                f"{self.lineage().newest}); take it over with Store.take_over first",
                url=self.strategy.url,
            )

    def check_writable(self, step: int, epoch: int, lineage: Lineage | None = None) -> None:
        """Raise unless a writer of ``epoch`` may publish ``step`` now: SupersededError when a
        newer epoch exists, StepOutsideEpochError when its parent is at or above ``step``.
        ``lineage``: the epochs, if just read."""
        lineage = self.lineage() if lineage is None else lineage
        newer = lineage.superseded_by(epoch)
        if newer is not None:
            raise SupersededError(
                f"{self.strategy.url}: this writer's epoch {epoch} was superseded by epoch "
                f"{newer.number}, taken at {newer.started_at.isoformat(timespec='seconds')} by "
                f"{newer.writer.host} (pid {newer.writer.pid}), resumed from "
                f"{_parent_text(newer)}; step {step} was not published. A restarted run owns "
                f"this store now: stop this process",
                step=step,
                url=self.strategy.url,
            )
        mine = lineage.epoch(epoch)
        if mine is not None and mine.floor >= step:
            raise StepOutsideEpochError(
                f"{self.strategy.url}: step {step} is not after step {mine.parent}, which "
                f"epoch {epoch} resumed from: it belongs to the history before the takeover "
                f"and cannot be saved again in this epoch",
                step=step,
                url=self.strategy.url,
            )

    def default_epoch(self, step: int, lineage: Lineage) -> int:
        """The epoch of a writer that neither took the store over nor joined an epoch: 0 while
        the store was never taken over; after a takeover, EpochRequiredError (§8.3), since
        such a writer cannot be told from the superseded run's (a zombie that opens a new
        handle for every save, ``ckptstore push`` among them)."""
        if lineage.newest == 0:
            return 0
        newest = lineage.epoch(lineage.newest)
        assert newest is not None
        number = newest.number
        raise EpochRequiredError(
            f"{self.strategy.url}: the store was taken over (epoch {number}, taken at "
            f"{newest.started_at.isoformat(timespec='seconds')} by {newest.writer.host} (pid "
            f"{newest.writer.pid}), resumed from {_parent_text(newest)}) and this writer named "
            f"no epoch, so it may be the run that was superseded; step {step} was not "
            f"published. Stop it if it is the old run; else take the store over, or join the "
            f"run's epoch (ckptstore.open(url, epoch={number}), push --epoch {number}, or "
            f"?epoch={number} in the URL)",
            step=step,
            url=self.strategy.url,
        )

    # -- the history, by step ------------------------------------------------------------

    def steps(self, min_step: int = 0, *, hint: int | object | None = _READ_HINT) -> list[int]:
        """The steps named by a commit point of the history, ascending (from a listing, then
        the epochs read after it).

        The listing is cross-checked (docs/protocol.md §4.2): the LATEST hint (``hint`` if
        the caller just read it, else read here) and the parent of the newest epoch known,
        both read before the listing, name steps published before it began. One the listing
        does not show, found by a direct read, makes it a lagging or cut-short listing: the
        step is counted, the listing is continued past where it ended, and a warning says so
        once per store.
        """
        if hint is _READ_HINT:
            hint = self.read_hint()
        if not self._listed:
            self.lineage()  # once per History: the epochs known before its first listing
        expected = {"the LATEST hint": hint, "the newest epoch's parent": self._known_parent()}
        listed = set(self.strategy.published_checkpoints(min_step))
        lineage = self.lineage()
        steps = {step for step, epoch in listed if lineage.in_history(step, epoch)}
        for why, step in expected.items():
            if not isinstance(step, int) or step < min_step or step in steps:
                continue
            if not _is_published(self.strategy, step, lineage.owner(step)):
                continue  # deleted or superseded since: the listing may be right
            report_lagging_listing(self.strategy.url, step, why)
            steps.add(step)
            steps.update(self._listed_past(listed, min_step, lineage))
        return sorted(steps)

    def _listed_past(
        self, listed: set[tuple[int, int]], min_step: int, lineage: Lineage
    ) -> set[int]:
        """The history's steps that listings from where ``listed`` ended show, listed again
        until nothing new comes (a page cut short and presented as complete hides the rest):
        from the last step listed (its other entries may follow the cut), then past it."""
        found: set[int] = set()
        start = max((step for step, _ in listed), default=min_step)
        past = False
        for _ in range(_RELISTS):
            more = set(self.strategy.published_checkpoints(start + 1 if past else start)) - listed
            if not more:
                if past:
                    break
                past = True
                continue
            listed |= more
            found.update(step for step, epoch in more if lineage.in_history(step, epoch))
            start, past = max(step for step, _ in more), False
        return found

    def read_hint(self, *, transient: bool = False) -> int | None:
        """The step the LATEST hint names, or None where it is missing or unreadable (said
        once per store: the hint only saves a listing). ``transient``: a TransientStorageError
        is raised, not taken for a missing hint (where the hint is what answers)."""
        try:
            return self.strategy.read_latest_hint()
        except (StorageError, InvalidInputError) as exc:  # the hint only saves a listing
            if transient and isinstance(exc, TransientStorageError):
                raise
            ignore_hint(f"{self.strategy.url}/LATEST", str(exc))
            return None

    def _known_parent(self) -> int | None:
        """The parent of the newest epoch this History has read (no storage read)."""
        with self._lock:
            return self._epochs[-1].parent if self._epochs else None

    def superseded(self) -> list[SupersededCheckpoint]:
        """Commit points that left the history (a takeover from an older checkpoint of their
        history brings them back), ascending."""
        listed = self.strategy.published_checkpoints()
        lineage = self.lineage()
        return [
            SupersededCheckpoint(step, epoch, lineage.owner(step))
            for step, epoch in listed
            if lineage.knows(epoch) and lineage.owner(step) != epoch
        ]

    def owner(self, step: int) -> int:
        """The epoch whose checkpoint of ``step`` is the history's, as of the epochs known
        (read first if none were)."""
        if not self._listed:
            return self.lineage().owner(step)
        with self._lock:
            known = Lineage(tuple(self._epochs))
        return known.owner(step)

    def is_published(self, step: int, lineage: Lineage | None = None) -> bool:
        """Whether the history has a commit point at ``step`` (``lineage``: if just read)."""
        lineage = self.lineage() if lineage is None else lineage
        return _is_published(self.strategy, step, lineage.owner(step))

    def read_manifest(self, step: int) -> Manifest:
        """The manifest of the history's checkpoint at ``step``.

        The epochs are read again after the manifest: if a takeover made another epoch the
        step's owner meanwhile, that epoch's checkpoint is read instead (CheckpointNotFoundError
        if it has none), so a checkpoint superseded before it was published is never returned.
        """
        epoch = self.owner(step)
        while True:  # each pass reads a newer lineage, and epochs are few: this ends
            try:
                manifest = self.read_manifest_of(step, epoch)
            except CheckpointNotFoundError:
                owner = self.lineage().owner(step)
                if owner == epoch:
                    raise
                epoch = owner
                continue
            owner = self.lineage().owner(step)
            if owner == epoch:
                return manifest
            epoch = owner

    def read_manifest_of(self, step: int, epoch: int) -> Manifest:
        """The manifest of checkpoint (``step``, ``epoch``), in the history or not (under
        ``trust``: only if a trusted key signed it, else UntrustedCheckpointError)."""
        manifest = _read_manifest(self.strategy, step, epoch)
        if self.trust is not None:
            manifest.check_trust(self.trust, where=self.strategy.url)
        return manifest

    def unpublish(self, step: int, epoch: int | None = None) -> None:
        """Unpublish the history's checkpoint at ``step`` (or that of ``epoch``)."""
        epoch = self.lineage().owner(step) if epoch is None else epoch
        if epoch == 0:
            self.strategy.unpublish(step)
        else:
            self.strategy.unpublish(step, epoch)


def _read_manifest(strategy: CommitStrategy[Any], step: int, epoch: int) -> Manifest:
    # Epoch 0 is asked for as before lineages: a strategy without them takes no epoch.
    if epoch == 0:
        return strategy.read_manifest(step)
    return strategy.read_manifest(step, epoch)


def _is_published(strategy: CommitStrategy[Any], step: int, epoch: int) -> bool:
    if epoch == 0:
        return strategy.is_published(step)
    return strategy.is_published(step, epoch)


def _parent_text(epoch: Epoch) -> str:
    return "a fresh start" if epoch.parent is None else f"step {epoch.parent}"
