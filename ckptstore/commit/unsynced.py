"""Closed shard files whose writeback is started but not waited for, within a descriptor budget.

A shard's fsync waits for its data to reach the disk. To let that writeback overlap the
writing of the next shards, a closed shard file stays open with its writeback started, and the
seal (before the manifest, or before a rank sends its receipts) fsyncs them all.

Each file held so keeps a file descriptor, and the process has only ``RLIMIT_NOFILE`` of them
for everything it does. So the files held by all the attempts in flight in the process share
one budget, a quarter of the soft limit (read at each use, so a limit lowered at run time is
obeyed), and an attempt holds at most ``PER_ATTEMPT_LIMIT``. When there is no room, the
attempt's oldest held file is fsynced and closed first, or, if it holds none, the new file is
fsynced and closed at once: the bound costs overlap, never correctness.
"""

from __future__ import annotations

import enum
import logging
import resource
import threading

from ckptstore.driver import FileSystemDriver
from ckptstore.errors import StorageError

__all__ = [
    "HELD_DESCRIPTORS",
    "PER_ATTEMPT_LIMIT",
    "DescriptorBudget",
    "HeldState",
    "UnsyncedFiles",
]

log = logging.getLogger(__name__)

PER_ATTEMPT_LIMIT = 64
_SHARE_OF_LIMIT = 4
"""Held files use at most 1/4 of the descriptors: the rest are the process's own (readers,
sockets, the shards being written)."""
_UNLIMITED_BUDGET = 4096


class DescriptorBudget:
    """How many descriptors of closed, unsynced shard files the whole process may hold."""

    def __init__(self) -> None:
        self._held = 0
        self._lock = threading.Lock()

    @staticmethod
    def capacity() -> int:
        """A quarter of the soft ``RLIMIT_NOFILE``, as it is now."""
        try:
            soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        except (OSError, ValueError):
            return PER_ATTEMPT_LIMIT
        if soft == resource.RLIM_INFINITY:
            return _UNLIMITED_BUDGET
        return max(0, soft // _SHARE_OF_LIMIT)

    @property
    def held(self) -> int:
        """Descriptors held now, by every attempt of the process."""
        with self._lock:
            return self._held

    def try_take(self) -> bool:
        """Take one descriptor's room if the budget has it."""
        capacity = self.capacity()
        with self._lock:
            if self._held >= capacity:
                return False
            self._held += 1
            return True

    def give_back(self, count: int) -> None:
        """Return the room of ``count`` descriptors that were closed or handed on."""
        with self._lock:
            self._held -= count


HELD_DESCRIPTORS = DescriptorBudget()


class HeldState(enum.Enum):
    """What an attempt's held files do with a file added now."""

    HOLDING = "holding"
    """Keep it open with its writeback started (fsynced at seal)."""
    SEALED = "sealed"
    """The attempt was sealed: fsync it at once (a shard that was still being written)."""
    DISCARDED = "discarded"
    """The attempt was abandoned: close it unsynced."""


class UnsyncedFiles:
    """The closed shard files of one attempt whose writeback is started but not waited for.

    ``seal`` fsyncs and closes them all, and from then on a file added late (a shard that was
    still being written) is fsynced at once. A failed fsync is remembered: the attempt's data
    may be lost, so every later seal of it fails too.
    """

    def __init__(
        self, driver: FileSystemDriver, budget: DescriptorBudget = HELD_DESCRIPTORS
    ) -> None:
        self._driver = driver
        self._budget = budget
        self._files: list[tuple[str, int]] = []
        self._room = 0  # budget taken: always len(self._files) once a call returns
        self._lock = threading.Lock()
        self._state = HeldState.HOLDING
        self._failure: StorageError | None = None

    def add(self, path: str, handle: int) -> None:
        """Start the file's writeback and keep it, or fsync the oldest (or it) for room."""
        with self._lock:
            if self._state is HeldState.DISCARDED:
                self._driver.close(handle)
                return
            self._files.append((path, handle))
            if self._state is HeldState.SEALED:
                self._sync_locked(len(self._files))
                return
            try:
                self._driver.start_writeback(handle)
            except StorageError:
                log.debug("starting the writeback of %s failed", path, exc_info=True)
            if len(self._files) <= PER_ATTEMPT_LIMIT and self._budget.try_take():
                self._room += 1
                return
            # No room for one more descriptor: the oldest file (this one if it is alone)
            # is made durable now and hands its room on to the newest.
            self._sync_locked(1)

    def seal(self) -> None:
        """Make every file added so far durable, or raise why one may not be."""
        with self._lock:
            if self._state is HeldState.HOLDING:
                self._state = HeldState.SEALED
            self._sync_locked(len(self._files))

    def discard(self) -> None:
        """Close every file without waiting for it (the attempt is abandoned)."""
        with self._lock:
            self._state = HeldState.DISCARDED
            self._close_all_locked()

    def _sync_locked(self, count: int) -> None:
        if self._failure is not None:
            self._close_all_locked()
            raise self._failure
        for _ in range(count):
            _path, handle = self._files.pop(0)
            self._release_room_locked()
            try:
                self._driver.fsync(handle)
            except StorageError as exc:
                self._failure = exc
                self._driver.close(handle)
                self._close_all_locked()  # the attempt cannot publish: close the rest too
                raise
            self._driver.close(handle)

    def _close_all_locked(self) -> None:
        files, self._files = self._files, []
        self._release_room_locked()  # first: a close that raises must not leak the room
        for path, handle in files:
            try:
                self._driver.close(handle)
            except OSError:
                log.debug("closing %s of an abandoned attempt failed", path, exc_info=True)

    def _release_room_locked(self) -> None:
        excess = self._room - len(self._files)
        if excess > 0:
            self._room -= excess
            self._budget.give_back(excess)
