"""What a path that is not a regular file is, in words, for the errors that refuse it (the
posix driver's reads, and ``push``/``publish_directory`` of a directory)."""

from __future__ import annotations

import stat

__all__ = ["file_kind"]

_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISLNK, "a symbolic link"),
)


def file_kind(mode: int, otherwise: str) -> str:
    """The kind of file ``mode`` (an ``st_mode``) is, such as "a FIFO"; ``otherwise`` for a
    mode none of the tests knows (a regular file among them)."""
    return next((name for test, name in _KINDS if test(mode)), otherwise)
