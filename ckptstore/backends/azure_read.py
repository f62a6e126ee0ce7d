"""Reading an Azure blob: ranges fetched ahead in parallel, pinned to one object version.

Part of the az:// driver (``ckptstore.backends.azure``; docs/backends/azure.md). A stream opens
with one small ranged GET (a manifest arrives whole), then fetches ``READ_PIECE`` ranges on a
fixed grid, up to the driver's ``concurrency`` ahead, each with ``If-Match`` the first answer's
ETag: a blob replaced mid-read fails the read rather than splicing two objects' bytes. Streams
of the same object share the ranges in flight, so the two halves ``Checkpoint.read_into``
reads at once do not fetch the first half's read-ahead twice.
"""

from __future__ import annotations

import errno
import functools
import os
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from ckptstore.errors import ObjectNotFoundError, PreconditionFailedError, StorageError

if TYPE_CHECKING:
    from ckptstore.backends.azure import AzureBlobDriver

__all__ = ["FIRST_PIECE", "READ_PIECE", "BlobReader", "ObjectReplacedError"]

READ_PIECE = 8 * 1024 * 1024
"""Bytes per ranged GET of a large blob; ``concurrency`` of them are in flight per stream."""
FIRST_PIECE = 1024 * 1024
"""Bytes of the GET that opens a stream: a manifest in one request, and little read in vain
by a stream that seeks away at once (the second half of a shard)."""


class ObjectReplacedError(ObjectNotFoundError):
    """The object was replaced or deleted while being read: the bytes being read are gone."""


class _SharedPieces:
    """Ranges being fetched, shared by the streams of one object: two streams reading the two
    halves of a shard at once (``Checkpoint.read_into``) fetch the pieces one reads ahead past
    its half once, not twice. An entry lives while some stream holds it unread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pieces: dict[tuple[str, str, int], tuple[Future[bytes], int]] = {}

    def get(self, name: tuple[str, str, int], fetch: Callable[[], Future[bytes]]) -> Future[bytes]:
        with self._lock:
            known = self._pieces.get(name)
            if known is not None:
                self._pieces[name] = (known[0], known[1] + 1)
                return known[0]
            future = fetch()
            self._pieces[name] = (future, 1)
            return future

    def release(self, name: tuple[str, str, int]) -> None:
        with self._lock:
            known = self._pieces.get(name)
            if known is None:
                return
            if known[1] <= 1:
                del self._pieces[name]
                known[0].cancel()  # not started yet: nobody wants it any more
            else:
                self._pieces[name] = (known[0], known[1] - 1)


_shared_pieces = _SharedPieces()


class BlobReader:
    """A blob read as ranges fetched ahead in parallel, each pinned to the first answer's ETag
    (or to its version): the stream never splices two objects' bytes.

    Opening reads the first ``FIRST_PIECE`` bytes (all of a small object, in one request);
    then ``READ_PIECE`` ranges on a fixed grid are fetched up to ``concurrency`` ahead, shared
    with other streams of the same object version.
    """

    def __init__(self, driver: AzureBlobDriver, key: str, version_id: str | None) -> None:
        self._driver = driver
        self._key = key
        self._version_id = version_id
        first, properties = driver.get_range(key, version_id, 0, FIRST_PIECE, None)
        self.info = driver.properties_info(key, properties)
        self._size = self.info.size
        self._etag = self.info.etag if version_id is None else None
        self._pin = f"{self._driver.bucket}/{self._full()}#{self._etag or version_id}"
        self._chunk = memoryview(first)
        self._position = 0
        self._next = len(first)  # the first byte not yet asked for
        self._ahead: deque[tuple[tuple[str, str, int], Future[bytes]]] = deque()
        self._closed = False

    def _full(self) -> str:
        return self._driver.prefix + self._key

    def _fetch(self, offset: int, length: int) -> bytes:
        try:
            data, _ = self._driver.get_range(
                self._key, self._version_id, offset, length, self._etag
            )
        except (PreconditionFailedError, ObjectNotFoundError) as exc:
            raise ObjectReplacedError(
                errno.ESTALE,
                f"reading {self._driver.url}/{self._key}: the object was replaced or deleted "
                f"while being read (at byte {offset})",
            ) from exc
        if len(data) != length:
            raise StorageError(
                errno.EIO, f"GetBlob {self._key}: {len(data)} bytes at {offset}, expected {length}"
            )
        return data

    def _fill_ahead(self) -> None:
        depth = self._driver.read_concurrency
        while len(self._ahead) < depth and self._next < self._size:
            offset = self._next
            end = min(self._size, (offset // READ_PIECE + 1) * READ_PIECE)  # on the grid
            name = (self._pin, str(end - offset), offset)
            fetch = functools.partial(
                self._driver.readers().submit, self._fetch, offset, end - offset
            )
            future = _shared_pieces.get(name, fetch)
            self._ahead.append((name, future))
            self._next = end

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
            _shared_pieces.release(name)
        self._fill_ahead()
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

    def read(self, size: int = -1) -> bytes:
        left = self._size - self._position
        want = left if size < 0 else min(size, left)
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

    def seekable(self) -> bool:
        return True

    def seek(self, position: int, whence: int = os.SEEK_SET) -> int:
        """Continue from byte ``position`` (from the start), still pinned to the same object."""
        if whence != os.SEEK_SET or position < 0:
            raise OSError(errno.EINVAL, "only an absolute seek")
        if position != self._position:
            self._cancel_ahead()
            self._chunk = memoryview(b"")
            self._position = self._next = min(position, self._size)
        return position

    def _cancel_ahead(self) -> None:
        """Let go of the pieces fetched ahead (another stream may still want them)."""
        for name, _ in self._ahead:
            _shared_pieces.release(name)
        self._ahead.clear()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._cancel_ahead()
            self._chunk = memoryview(b"")

    def __enter__(self) -> BlobReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
