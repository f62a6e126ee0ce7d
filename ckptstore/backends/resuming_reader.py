"""A response body that resumes at the byte reached when its connection breaks.

The one resume-at-offset reader of the object-store drivers: a read that breaks mid-body
(reset, timeout, short body) asks again from the byte reached, through the driver's
``reopen(position)``, which pins the new request to the object first opened (its ETag,
generation or version): the stream never splices two objects' bytes.
"""

from __future__ import annotations

import contextlib
import functools
import io
import logging
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, TypeVar

from ckptstore.driver import ObjectInfo
from ckptstore.errors import TransientStorageError

__all__ = ["READ_PIECE", "ResumingReader"]

log = logging.getLogger(__name__)
T = TypeVar("T")

READ_PIECE = 1024 * 1024
"""Largest single body read. A read that breaks returns nothing (urllib3 drops what it got),
so a resume starts from the last whole piece: a broken connection costs at most this much."""


class ResumingReader:
    """A body (``read``, ``readinto``, ``close``) that resumes after a broken connection; its
    errors are ckptstore's (``translate``: the driver's translation of a body's errors).

    ``reopen(position)`` returns the body from ``position`` on, pinned to the same object (it
    raises ``ObjectReplacedError`` when the object is gone); ``pinned``: such a pin exists
    (without one, a resume could splice two objects: a broken read fails instead); ``size``:
    the body's length (-1: unknown). Each read gets ``max_attempts`` tries.
    """

    def __init__(
        self,
        body: Any,
        info: ObjectInfo,
        *,
        size: int,
        what: str,
        pinned: bool,
        max_attempts: int,
        translate: Callable[[], AbstractContextManager[None]],
        reopen: Callable[[int], Any],
    ) -> None:
        self.info = info
        self._body = body
        self._what = what
        self._pinned = pinned
        self._max_attempts = max_attempts
        self._translate = translate
        self._reopen = reopen
        self._size = size
        self._position = 0

    def read(self, size: int = -1) -> bytes:
        pieces = []
        left = size
        while left != 0:
            want = READ_PIECE if left < 0 else min(left, READ_PIECE)
            piece = self._resilient(functools.partial(self._read_body, want), len)
            if not piece:
                break
            pieces.append(piece)
            left -= len(piece) if left > 0 else 0
        return b"".join(pieces)

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        got = 0
        while got < view.nbytes:
            piece = view[got : got + READ_PIECE]
            count = self._resilient(functools.partial(self._readinto_body, piece), int)
            if not count:
                break
            got += count
        return got

    def _read_body(self, size: int) -> bytes:
        return bytes(self._body.read(size))  # the body of the moment: a resume replaces it

    def _readinto_body(self, view: memoryview) -> int:
        return int(self._body.readinto(view))

    def _resilient(self, read: Callable[[], T], size_of: Callable[[T], int]) -> T:
        """``read()`` from the current body (the body of the moment: a resume replaces it)."""
        for tries_left in reversed(range(self._max_attempts)):
            try:
                with self._translate():
                    result = read()
            except TransientStorageError as exc:
                if not tries_left or not self._pinned:
                    raise
                self._move_to(self._position)
                log.info("%s: connection broke (%s); resumed at byte %d", self._what, exc,
                         self._position)  # fmt: skip
                continue
            self._position += size_of(result)
            return result
        raise AssertionError("unreachable")  # max_attempts >= 1

    def seekable(self) -> bool:
        """True when a seek can be pinned to this object."""
        return self._pinned

    def seek(self, position: int, whence: int = io.SEEK_SET) -> int:
        """Continue from byte ``position`` (from the start), still from the object first
        opened."""
        if whence != io.SEEK_SET or position < 0 or not self._pinned:
            raise io.UnsupportedOperation("only an absolute seek of an object with an ETag")
        if position != self._position:
            self._move_to(position)
            self._position = position
        return position

    def _move_to(self, position: int) -> None:
        with contextlib.suppress(Exception):  # the old connection is broken or not needed
            self._body.close()
        if 0 <= self._size <= position:
            self._body = io.BytesIO()  # at (or past) the end: nothing more to read
            return
        self._body = self._reopen(position)

    def close(self) -> None:
        self._body.close()

    def __enter__(self) -> ResumingReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
