"""Reading one object as ranges fetched ahead in parallel, every range pinned to one version.

A stream of the drivers whose storage reads ranges by condition (a GCS generation, an Azure
ETag): ranges of ``window`` bytes on a fixed grid are fetched up to ``depth`` ahead of the
reader, on the driver's threads; a seek drops the read-ahead. ``fetch(offset, length)`` asks
for one range pinned to the object first opened, so a replaced object fails the read
(``ObjectReplacedError``) rather than splicing two objects' bytes. Streams of the same object
share the ranges in flight (``SharedRanges``): the segments ``Checkpoint.read_into`` reads at
once do not fetch a segment's read-ahead twice.
"""

from __future__ import annotations

import errno
import functools
import io
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from typing import Any

from ckptstore.backends.object_store import pinned_read
from ckptstore.driver import ObjectInfo
from ckptstore.errors import StorageError

__all__ = ["RangeReader", "ReadAhead", "SharedRanges"]

Data = bytes | bytearray
RangeName = tuple[str, int, int]
"""(the pinned object, offset, length) of a range in flight."""


class SharedRanges:
    """Ranges being fetched, shared by the streams of one object: an entry lives while some
    stream holds it unread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ranges: dict[RangeName, tuple[Future[Data], int]] = {}

    def get(self, name: RangeName, fetch: Callable[[], Future[Data]]) -> Future[Data]:
        with self._lock:
            known = self._ranges.get(name)
            if known is not None:
                self._ranges[name] = (known[0], known[1] + 1)
                return known[0]
            future = fetch()
            self._ranges[name] = (future, 1)
            return future

    def release(self, name: RangeName) -> None:
        with self._lock:
            known = self._ranges.get(name)
            if known is None:
                return
            if known[1] <= 1:
                del self._ranges[name]
                known[0].cancel()  # not started yet: nobody wants it any more
            else:
                self._ranges[name] = (known[0], known[1] - 1)


@dataclass(frozen=True)
class ReadAhead:
    """How a driver's streams read ahead: ranges of ``window`` bytes on a fixed grid, up to
    ``depth`` in flight, on the driver's ``executor``; the ranges in flight are shared by the
    streams of one object (``shared``)."""

    window: int
    depth: int
    executor: Callable[[], Executor]
    shared: SharedRanges = field(default_factory=SharedRanges)


class RangeReader(io.RawIOBase):
    """One object version read in pinned ranges, fetched ahead in parallel.

    ``info``: the object's (its ``size`` bounds the reads); ``pin`` names the version for
    sharing; ``ahead``: the driver's way of reading ahead; ``first``: bytes from offset 0
    already read (by the call that opened it).
    """

    def __init__(
        self,
        info: ObjectInfo,
        fetch: Callable[[int, int], Data],
        *,
        pin: str,
        ahead: ReadAhead,
        first: bytes = b"",
    ) -> None:
        super().__init__()
        self.info = info
        self._fetch_range = fetch
        self._pin = pin
        self._read_ahead = ahead
        self._shared = ahead.shared
        self._size = info.size
        self._chunk = memoryview(first)
        self._position = 0
        self._next = len(first)  # the first byte not yet asked for
        self._ahead: deque[tuple[RangeName, Future[Data]]] = deque()

    def _fetch(self, offset: int, length: int) -> Data:
        with pinned_read(f"reading {self._pin}", offset):
            data = self._fetch_range(offset, length)
        if len(data) != length:
            raise StorageError(
                errno.EIO, f"reading {self._pin}: {len(data)} bytes at {offset}, expected {length}"
            )
        return data

    def _fill_ahead(self) -> None:
        window, depth = self._read_ahead.window, self._read_ahead.depth
        while len(self._ahead) < depth and self._next < self._size:
            offset = self._next
            end = min(self._size, (offset // window + 1) * window)  # on the grid
            name = (self._pin, offset, end - offset)
            if depth == 1:
                future: Future[Data] = Future()
                future.set_result(self._fetch(offset, end - offset))
            else:
                submit = functools.partial(self._submit, offset, end - offset)
                future = self._shared.get(name, submit)
            self._ahead.append((name, future))
            self._next = end

    def _submit(self, offset: int, length: int) -> Future[Data]:
        return self._read_ahead.executor().submit(self._fetch, offset, length)

    def _advance(self) -> bool:
        """Make the next fetched range current; False at the end."""
        if self._position >= self._size:
            return False
        self._fill_ahead()
        if not self._ahead:
            return False
        name, future = self._ahead.popleft()
        try:
            self._chunk = memoryview(future.result())
        finally:
            self._shared.release(name)
        self._fill_ahead()
        return True

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        got = 0
        while got < view.nbytes:
            if not self._chunk.nbytes and not self._advance():
                break
            count = min(self._chunk.nbytes, view.nbytes - got)
            view[got : got + count] = self._chunk[:count]
            self._chunk = self._chunk[count:]
            self._position += count
            got += count
        return got

    def read(self, size: int | None = -1) -> bytes:
        left = self._size - self._position
        want = left if size is None or size < 0 else min(size, left)
        if want <= 0:
            return b""
        if self._chunk.nbytes >= want:  # the common small read: no copy beyond the slice
            piece = bytes(self._chunk[:want])
            self._chunk = self._chunk[want:]
            self._position += want
            return piece
        buffer = bytearray(want)
        got = self.readinto(buffer)
        del buffer[got:]
        return bytes(buffer)

    def readall(self) -> bytes:
        return self.read()

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, position: int, whence: int = io.SEEK_SET) -> int:
        """Continue from ``position``, still pinned to the same object."""
        if whence == io.SEEK_CUR:
            position += self._position
        elif whence == io.SEEK_END:
            position += self._size
        if position < 0:
            raise ValueError("negative seek position")
        if position != self._position:
            self._cancel_ahead()
            self._chunk = memoryview(b"")
            self._position = self._next = min(position, self._size)
        return position

    def _cancel_ahead(self) -> None:
        """Let go of the ranges fetched ahead (another stream may still want them)."""
        for name, _ in self._ahead:
            self._shared.release(name)
        self._ahead.clear()

    def close(self) -> None:
        if not self.closed:
            self._cancel_ahead()
            self._chunk = memoryview(b"")
        super().close()
