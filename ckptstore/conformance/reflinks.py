"""Which ``FICLONE`` a push meets: the file system's own, or a stand-in, on any machine.

``publish_directory(clone=True)`` makes each shard a copy-on-write clone of the trainer's file
(``CloningDriver.clone``: ``PosixDriver`` asks the kernel for ``FICLONE``) where the file
system makes clones (XFS, btrfs), and copies the bytes where it refuses (ext4, tmpfs:
EOPNOTSUPP). A test machine has one kind of file system or the other, so the suite chooses what
a clone meets, for ``PosixDriver`` and the drivers derived from it (Lustre's), whose ``clone``
is that one system call:

- ``THE_FILE_SYSTEMS``: the file system's own answer, a clone or a refusal;
- ``STAND_IN``: a stand-in ``FICLONE`` that fills the new file with the whole source file, as a
  clone holds it (copied, not shared: what is checked is the store's protocol around the clone,
  not the sharing of extents), so a successful clone runs on every machine;
- ``REFUSED``: ``FICLONE`` refused as ext4 refuses it, so the fallback to copying runs on every
  machine.

Every other ``ioctl`` goes to the kernel. A driver whose clone is not that system call is
untouched: it clones (or refuses) as it does.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import threading
import types
from collections.abc import Iterator
from typing import Any

from ckptstore.backends import posix

__all__ = ["FICLONE", "REFUSED", "STAND_IN", "THE_FILE_SYSTEMS", "reflinks"]

FICLONE = 0x40049409
"""Linux's ``FICLONE`` ioctl: ``_IOW(0x94, 9, int)``."""
THE_FILE_SYSTEMS = "the file system's"
STAND_IN = "a stand-in"
REFUSED = "refused"
_CHUNK = 1 << 20
_swapping = threading.RLock()


class _StandInFcntl(types.ModuleType):
    """``fcntl`` as ``ckptstore.backends.posix`` sees it while a stand-in is in place."""

    def __init__(self, how: str) -> None:
        super().__init__("fcntl", fcntl.__doc__)
        self.how = how

    def __getattr__(self, name: str) -> Any:
        return getattr(fcntl, name)

    def ioctl(self, fd: int, request: int, arg: Any = 0, *rest: Any) -> Any:
        if request != FICLONE:
            return fcntl.ioctl(fd, request, arg, *rest)
        if self.how == REFUSED:
            raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP))
        _fill(fd, arg)
        return 0


def _fill(target: int, source: int) -> None:
    """Write the whole of the open file ``source`` into ``target`` at the same offsets, as
    ``FICLONE`` makes ``target`` hold it (neither file's position moves)."""
    offset = 0
    while chunk := os.pread(source, _CHUNK, offset):
        view = memoryview(chunk)
        while view:
            written = os.pwrite(target, view, offset)
            view, offset = view[written:], offset + written


@contextlib.contextmanager
def reflinks(how: str) -> Iterator[None]:
    """While entered, ``PosixDriver.clone`` meets ``how`` (``THE_FILE_SYSTEMS``, ``STAND_IN``,
    ``REFUSED``). Entered by one thread at a time (another waits); the threads that a push
    starts meet the same ``FICLONE``."""
    if how == THE_FILE_SYSTEMS:
        yield
        return
    if how not in (STAND_IN, REFUSED):
        raise ValueError(f"no such FICLONE: {how!r}")
    namespace = vars(posix)  # where ``PosixDriver.clone`` looks ``fcntl`` up
    with _swapping:
        real = namespace["fcntl"]
        namespace["fcntl"] = _StandInFcntl(how)
        try:
            yield
        finally:
            namespace["fcntl"] = real
