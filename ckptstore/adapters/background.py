"""A checkpoint directory published in a thread of its own: the trainer waits only for links.

A directory-based trainer (Hugging Face ``Trainer``, Accelerate's ``save_state``) writes its
checkpoint directory, then hands it to ckptstore; publishing it on the training thread makes
training wait for every byte to be read and written again. ``BackgroundPublisher.publish``
instead hard-links every file of the directory into a hidden sibling made for the purpose
(``.ckptstore-snapshot-<name>-<id>/files``: one link per file, whatever its size) and publishes
that snapshot on a thread of its own, one checkpoint at a time: the next ``publish`` waits for
the previous one only if it is still going, and raises its failure if it failed.

What the snapshot guarantees, and when:

- The trainer may delete its directory as soon as ``publish`` returns (``save_total_limit``
  rotation): the links keep the files, and the publish reads them whole.
- A publish is one commit: a process killed while it runs publishes nothing of it (the
  snapshot left behind is removed by ``remove_stale_snapshots`` when the next run starts).
- The trainer must not rewrite a file of a saved directory in place (the same inode, opened
  for writing): a link shares the file, not a copy of it. Hugging Face and Accelerate write
  every checkpoint to a new directory. A file written again after the publish listed it (its
  size or modification time changed by the end of its read) is refused, and nothing is
  published; a rewrite within the file system's timestamp granularity of the listing (a clock
  tick: milliseconds, a second or two on some file systems) that keeps the size is not seen.
- Where the file system makes no hard links (some network and FUSE file systems, a directory
  on another device than its parent), the directory is published at once, on the caller's
  thread, as ``publish_directory`` does.

The publisher's store is used by its thread while a publish is in flight: the trainer's code
should not use the same Store object meanwhile (a Store is not shared between threads).
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import stat
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from ckptstore.adapters.directory import (
    DEFAULT_PARALLEL,
    directory_files,
    publish_directory,
    refuse_nested,
)
from ckptstore.checkpoint import Checkpoint
from ckptstore.errors import InvalidInputError
from ckptstore.interface import CheckpointStore
from ckptstore.names import new_attempt_id

__all__ = [
    "SNAPSHOT_PREFIX",
    "BackgroundPublisher",
    "remove_stale_snapshots",
    "snapshot_directory",
]

log = logging.getLogger(__name__)

SNAPSHOT_PREFIX = ".ckptstore-snapshot-"
"""The name of a snapshot directory begins so (hidden: a trainer's ``checkpoint-N`` pattern
never matches it)."""
_MARKER = "CKPTSTORE-SNAPSHOT"
"""A file in every snapshot directory: what ``remove_stale_snapshots`` removes must hold it."""
_FILES = "files"
_NO_LINKS = frozenset(
    {errno.EXDEV, errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK, errno.ENOSYS}
)
"""What ``link(2)`` answers where the file system makes no hard links (or not these)."""


def snapshot_directory(directory: str | os.PathLike[str]) -> Path | None:
    """Hard links to every file ``directory`` holds (as ``directory_files`` lists them), in a
    new hidden sibling directory; the directory of the links (publish it as you would
    ``directory``), or None where no snapshot can be made there (a file system without hard
    links, a read-only or full parent directory: nothing is left behind). Raises
    InvalidInputError for what ``publish_directory`` refuses, and for a file swapped for
    another between the listing and its link."""
    try:
        return _snapshot(Path(directory))
    except _NoSnapshot:
        return None


class _NoSnapshot(Exception):
    """No snapshot can be made beside the directory (the reason: the message)."""


def _snapshot(source: Path) -> Path:
    files = directory_files(source)
    top = source.parent / f"{SNAPSHOT_PREFIX}{source.name}-{new_attempt_id()}"
    try:
        os.mkdir(top, 0o700)
    except OSError as exc:  # a read-only or full output directory: published at once
        raise _NoSnapshot(f"cannot make {top.name} beside it: {exc.strerror or exc}") from exc
    try:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(top / _MARKER, flags, 0o600)
        try:
            os.write(fd, f"links to {source.name}, made by ckptstore to publish it\n".encode())
        finally:
            os.close(fd)
        root = top / _FILES
        os.mkdir(root, 0o700)
        for file in files:
            link = root / file.name
            link.parent.mkdir(parents=True, exist_ok=True)
            os.link(file.path, link, follow_symlinks=False)
            linked = os.stat(link, follow_symlinks=False)
            if (linked.st_dev, linked.st_ino) != (file.device, file.inode):
                raise InvalidInputError(
                    f"{file.path}: replaced by another file while it was being published; "
                    f"nothing was published"
                )
    except OSError as exc:
        _remove(top)
        if exc.errno in _NO_LINKS:
            raise _NoSnapshot("this file system makes no hard links") from exc
        raise _NoSnapshot(f"cannot link its files aside: {exc.strerror or exc}") from exc
    except BaseException:
        _remove(top)
        raise
    return root


def remove_stale_snapshots(parent: str | os.PathLike[str]) -> list[Path]:
    """Remove the snapshot directories in ``parent`` that a killed publisher left (each holds
    ckptstore's marker file; anything else named alike is left alone); return them."""
    removed: list[Path] = []
    try:
        entries = list(os.scandir(parent))
    except FileNotFoundError:
        return removed
    for entry in entries:
        if entry.name.startswith(SNAPSHOT_PREFIX) and entry.is_dir(follow_symlinks=False):
            path = Path(entry.path)
            if _ours(path):
                _remove(path)
                removed.append(path)
    return removed


def _ours(top: Path) -> bool:
    """Whether ``top`` is a snapshot directory ckptstore made (its marker is a regular file)."""
    try:
        return stat.S_ISREG(os.stat(top / _MARKER, follow_symlinks=False).st_mode)
    except OSError:
        return False


def _remove(top: Path) -> None:
    """Remove a snapshot directory this module made (links only: the files stay where the
    trainer wrote them)."""
    shutil.rmtree(top, ignore_errors=True)


class BackgroundPublisher:
    """Publishes checkpoint directories on a thread of its own, one at a time.

    ``publish`` returns once the directory's files are linked aside (``snapshot_directory``)
    and the previous publish has finished; the publish itself runs on the publisher's thread.
    ``wait`` waits for the publish in flight and raises its failure; ``close`` waits, then
    stops the thread. A failure of a background publish is raised by the next ``publish``,
    ``wait`` or ``close``: nothing of that checkpoint was published.
    """

    def __init__(self, store: CheckpointStore, *, parallel: int = DEFAULT_PARALLEL) -> None:
        if parallel < 1:
            raise InvalidInputError(f"parallel must be at least 1, got {parallel}")
        self.store = store
        self.parallel = parallel
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="ckptstore-publish")
        self._in_flight: Future[Checkpoint] | None = None
        self._in_flight_step: int | None = None
        self._warned_no_links = False
        self.last: Checkpoint | None = None
        """The newest checkpoint this publisher published (as of the last ``wait``)."""

    def publish(
        self,
        step: int,
        directory: str | os.PathLike[str],
        metadata: Mapping[str, object] | None = None,
    ) -> None:
        """Publish every file under ``directory`` as checkpoint ``step``, in the background;
        first wait for the previous publish (raising its failure)."""
        self.wait()
        refuse_nested(self.store.url, directory)
        try:
            links = _snapshot(Path(directory))
        except _NoSnapshot as exc:
            if not self._warned_no_links:
                self._warned_no_links = True
                log.warning(
                    "%s: %s: checkpoints are published on the training thread", directory, exc
                )
            self.last = publish_directory(
                self.store, step, directory, metadata=metadata, parallel=self.parallel, clone=True
            )
            return
        self._in_flight_step = step
        self._in_flight = self._executor.submit(self._publish_links, step, links, metadata)

    def _publish_links(
        self, step: int, links: Path, metadata: Mapping[str, object] | None
    ) -> Checkpoint:
        try:
            return publish_directory(
                self.store, step, links, metadata=metadata, parallel=self.parallel, clone=True
            )
        except BaseException as exc:  # said now, and raised by the next publish or wait
            log.error("%s: checkpoint %d was not published: %s", self.store.url, step, exc)
            raise
        finally:
            _remove(links.parent)

    @property
    def in_flight(self) -> int | None:
        """The step being published now, or None."""
        future = self._in_flight
        return self._in_flight_step if future is not None and not future.done() else None

    def wait(self) -> Checkpoint | None:
        """Wait for the publish in flight; return its checkpoint (None: none was in flight),
        or raise its failure."""
        future, self._in_flight = self._in_flight, None
        if future is None:
            return None
        self._in_flight_step = None
        self.last = future.result()  # its failure, logged when it happened, raised here
        return self.last

    def close(self) -> None:
        """Wait for the publish in flight (raising its failure), then stop the thread."""
        try:
            self.wait()
        finally:
            self._executor.shutdown(wait=True)
