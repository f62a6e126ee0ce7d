"""Holds and deletion intents: a takeover from an older checkpoint and a deleter of that checkpoint
never both go ahead (docs/protocol.md §8.5).

A takeover whose parent is not the history's newest checkpoint (a rollback, the undo of a
takeover) creates a *hold* on its parent checkpoint before it creates its epoch, then looks
for a *deletion intent* on it. A deleter (retention, ``delete``, GC of superseded checkpoints)
creates an intent on the checkpoint it is about to unpublish, then looks for a hold on it and
for an epoch newer than those it decided on. Storage is strongly consistent for reads of a
name after a write of it, so of the two, at least one sees the other's marker: the deleter
then keeps the checkpoint, or the taker waits for the intent to go and checks the checkpoint
again before it creates its epoch. Markers have deterministic names: hidden files in the
store's root (``.hold-step-<N>``, file systems: a store never taken over keeps its layout, no
``epochs`` directory appears) or objects under ``epochs/`` (object stores). The two parties
read them directly (never listed) and remove them when done; GC removes those of dead
processes.

Ages are measured on the storage's clock: a marker's mtime or LastModified against that of a
clock file (``.gc-clock-<id>``, the file GC reads the file system's clock by) or object
written for the purpose.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

from ckptstore.commit.base import CommitStrategy, GcItem, GcReport, clock_lead
from ckptstore.commit.conditional_put import EPOCHS, ConditionalPutCommit
from ckptstore.commit.rename import EPOCH_RECORD, EPOCHS_DIR, GC_CLOCK_PREFIX, RenameCommit
from ckptstore.driver import DriverFamily, PutMode, driver_family
from ckptstore.errors import ObjectNotFoundError, StorageError, TargetExistsError
from ckptstore.names import (
    checkpoint_token,
    epoch_token,
    new_attempt_id,
    parse_checkpoint_token,
)

__all__ = [
    "CLOCK_MARKER",
    "FILE_MARKER_MARK",
    "HOLD",
    "INTENT",
    "INTENT_STALE_S",
    "Markers",
    "is_file_marker",
]

log = logging.getLogger(__name__)

HOLD = "hold-"
INTENT = "intent-"
CLOCK_MARKER = "clock-"
"""The name prefix of a reading of the storage's clock among the markers (written, then removed)."""
_PREFIXES = (HOLD, INTENT, CLOCK_MARKER)
FILE_MARKER_MARK = "."
"""On a file system, a marker is the root's hidden file ``.`` + ``hold-``/``intent-`` + token."""
INTENT_STALE_S = 120.0
"""An intent older than this (storage clock) is a dead deleter's: a taker passes over it, and
a live deleter that took longer than half of it between its intent and its unpublish keeps
the checkpoint instead."""


class Markers:
    """Holds, intents and the storage's clock, for one strategy's storage."""

    def __init__(self, strategy: CommitStrategy[Any]) -> None:
        self.strategy = strategy
        driver = strategy.driver
        self.driver = driver
        kind = None
        if isinstance(strategy, RenameCommit):
            kind = "files"
        elif isinstance(strategy, ConditionalPutCommit):
            kind = "objects"
        elif strategy.keeps_lineages:
            family = driver_family(driver)
            kind = "files" if family is DriverFamily.FILE_SYSTEM else "objects"
        self.kind = kind
        self._versions: dict[str, str | None] = {}

    @property
    def supported(self) -> bool:
        """Whether this storage keeps epochs, and so holds and intents."""
        return self.kind is not None and self.strategy.keeps_lineages

    # -- names ---------------------------------------------------------------------------

    def _name(self, prefix: str, step: int, epoch: int) -> str:
        token = f"{prefix}{checkpoint_token(step, epoch)}"
        if self.kind == "files":
            return f"{FILE_MARKER_MARK}{token}"
        return f"{EPOCHS}{token}"

    # -- markers -------------------------------------------------------------------------

    def put(self, prefix: str, step: int, epoch: int) -> str:
        """Create the marker ``prefix`` of checkpoint (``step``, ``epoch``) (present already:
        fine); return its name."""
        name = self._name(prefix, step, epoch)
        self._create(name)
        return name

    def _create(self, name: str) -> None:
        if self.kind == "files":
            try:
                self.driver.close(self.driver.create(name))
            except TargetExistsError:
                pass
            return
        written = self.driver.put(name, b"", mode=PutMode.OVERWRITE)
        self._versions[name] = written.version_id

    def remove(self, name: str) -> None:
        """Remove a marker this process created; a failure is left to GC, logged."""
        try:
            if self.kind == "files":
                self.driver.unlink(name)
                return
            version = self._versions.pop(name, None)
            if version is not None:
                self.driver.delete(name, version_id=version)
            else:
                self.driver.delete(name)
        except ObjectNotFoundError:
            return
        except StorageError as exc:
            log.warning("%s: could not remove %s (gc will): %s", self.strategy.url, name, exc)

    def stamp(self, prefix: str, step: int, epoch: int) -> float | None:
        """The storage's time of the marker's last write; None if it does not exist."""
        return self._stamp(self._name(prefix, step, epoch))

    def _stamp(self, name: str) -> float | None:
        try:
            if self.kind == "files":
                return float(self.driver.stat(name).mtime)
            return float(self.driver.head(name).last_modified)
        except ObjectNotFoundError:
            return None

    def storage_now(self) -> float:
        """The storage's clock now: the stamp of a marker written for the purpose (removed),
        plus how far the store's clock leads this host's (a test's advance)."""
        if self.kind == "files":
            name = GC_CLOCK_PREFIX + new_attempt_id()  # GC knows a dead one's: "gc-clock"
        else:
            name = EPOCHS + CLOCK_MARKER + new_attempt_id()
        self._create(name)
        try:
            stamp = self._stamp(name)
        finally:
            self.remove(name)
        return time.time() if stamp is None else stamp

    def epoch_stamp(self, epoch: int) -> float | None:
        """The storage's time of epoch ``epoch``'s record (None where it cannot be read)."""
        if self.kind == "files":
            name = f"{EPOCHS_DIR}/{epoch_token(epoch)}/{EPOCH_RECORD}"
        else:
            name = f"{EPOCHS}{epoch_token(epoch)}.json"
        try:
            return self._stamp(name)
        except StorageError:
            return None

    # -- GC ------------------------------------------------------------------------------

    def leftovers(self) -> Iterator[tuple[str, float]]:
        """Every marker in storage (a listing: GC only), with its stamp."""
        if self.kind == "files":
            try:
                names = self.driver.listdir("")
            except StorageError:
                return
            for name in names:
                if is_file_marker(name):
                    stamp = self._stamp(name)
                    if stamp is not None:
                        yield name, stamp
            return
        for info in self.driver.list(EPOCHS):
            if info.key[len(EPOCHS) :].startswith(_PREFIXES):
                yield info.key, info.last_modified

    def collect(self, report: GcReport, now: float) -> None:
        """Remove markers older than the report's grace period (their process died)."""
        if not self.supported:
            return
        markers = list(self.leftovers())
        if not markers:
            return  # the storage's clock is read only when there is something to age
        storage_now = self.storage_now() + clock_lead(now)
        for name, stamp in markers:
            age = max(0.0, storage_now - stamp)
            item = GcItem("marker", name, age, 0)
            if age < max(report.grace_s, INTENT_STALE_S):
                continue
            report.removed.append(item)
            if not report.dry_run:
                self._remove_dead(name)

    def _remove_dead(self, name: str) -> None:
        """Remove a dead process's marker, every version of it on a versioned bucket (its
        creator's version is not known here; a plain delete would leave it behind)."""
        if self.kind != "files":
            try:
                versions = [
                    info.version_id
                    for info in self.driver.list_versions(name)
                    if info.key == name and info.version_id
                ]
            except StorageError:
                versions = []
            for version in versions:
                try:
                    self.driver.delete(name, version_id=version)
                except ObjectNotFoundError:
                    continue
                except StorageError as exc:
                    log.warning(
                        "%s: could not remove %s (gc will): %s", self.strategy.url, name, exc
                    )
                    return
            if versions:
                return
        self.remove(name)


def is_file_marker(name: str) -> bool:
    """True if a store root's entry ``name`` is a hold or an intent, named exactly as made (an
    operator's ``.hold-mine`` is not one, and GC leaves it alone)."""
    if not name.startswith(FILE_MARKER_MARK):
        return False
    rest = name[len(FILE_MARKER_MARK) :]
    for prefix in (HOLD, INTENT):
        if rest.startswith(prefix):
            return parse_checkpoint_token(rest[len(prefix) :]) is not None
    return False
