"""A whole shard's bytes, known before it is written, read piece by piece and never joined:
hashed, compared and uploaded without a copy of the whole, so that an incremental save can
share a shard made of many tensors (``PendingCheckpoint.write`` of a list of buffers) or a
file of a directory being pushed (``FileBytes``) with what an earlier save stored."""

from __future__ import annotations

import bisect
import os
from collections.abc import Iterable, Iterator

from ckptstore.errors import InvalidInputError

__all__ = ["FileBytes", "ShardBytes"]

_FILE_PIECE = 8 * 1024 * 1024
"""A file's bytes are read this much at a time (``FileBytes.pieces`` with no limit)."""


class ShardBytes:
    """The concatenation of byte views (1-D, format ``B``), read without a copy of the whole:
    the views must not change while it is in use (a snapshot's buffers, a caller's bytes)."""

    def __init__(self, views: Iterable[memoryview]) -> None:
        self._views = [view for view in views if view.nbytes]
        self._starts: list[int] = []
        total = 0
        for view in self._views:
            if view.ndim != 1 or view.format != "B":
                raise ValueError("ShardBytes holds 1-D byte views only")
            self._starts.append(total)
            total += view.nbytes
        self.nbytes = total
        """How many bytes it holds."""

    @classmethod
    def of(cls, data: memoryview | ShardBytes) -> ShardBytes:
        """``data`` as ShardBytes (a single buffer becomes one view of bytes)."""
        if isinstance(data, ShardBytes):
            return data
        return cls([data.cast("B") if data.format != "B" or data.ndim != 1 else data])

    def pieces(self, limit: int | None = None) -> Iterator[memoryview]:
        """The bytes in order, as views of at most ``limit`` bytes each (no copy)."""
        for view in self._views:
            if limit is None or view.nbytes <= limit:
                yield view
                continue
            for offset in range(0, view.nbytes, limit):
                yield view[offset : offset + limit]

    def range(self, start: int, stop: int) -> bytes:
        """A copy of the bytes from ``start`` up to ``stop`` (clamped to what it holds)."""
        start, stop = max(start, 0), min(stop, self.nbytes)
        if start >= stop:
            return b""
        index = bisect.bisect_right(self._starts, start) - 1
        out: list[bytes] = []
        while start < stop:
            view, base = self._views[index], self._starts[index]
            end = min(stop, base + view.nbytes)
            out.append(view[start - base : end - base].tobytes())
            start, index = end, index + 1
        return out[0] if len(out) == 1 else b"".join(out)


class FileBytes(ShardBytes):
    """The first ``size`` bytes of an open regular file, read with ``pread`` each time they
    are needed (the page cache serves the second pass), never held whole in memory.

    A file that ends before ``size`` bytes raises InvalidInputError (it changed while it was
    being published); one that grows is read to ``size`` only (its publisher checks its size
    and modification time afterwards). A piece is a view of a buffer reused for the next
    piece of the same iteration: use it before asking for the next.
    """

    def __init__(self, fd: int, size: int, name: str) -> None:
        super().__init__([])
        self.nbytes = size
        self._fd = fd
        self._name = name

    def pieces(self, limit: int | None = None) -> Iterator[memoryview]:
        step = min(limit or _FILE_PIECE, _FILE_PIECE, max(self.nbytes, 1))
        buffer = memoryview(bytearray(step))
        for offset in range(0, self.nbytes, step):
            yield self._read(buffer[: min(step, self.nbytes - offset)], offset)

    def range(self, start: int, stop: int) -> bytes:
        start, stop = max(start, 0), min(stop, self.nbytes)
        if start >= stop:
            return b""
        return self._read(memoryview(bytearray(stop - start)), start).tobytes()

    def _read(self, view: memoryview, offset: int) -> memoryview:
        got = 0
        while got < view.nbytes:
            count = os.preadv(self._fd, [view[got:]], offset + got)
            if not count:
                raise InvalidInputError(
                    f"{self._name} changed while it was published (it ended at byte "
                    f"{offset + got}, it had {self.nbytes} when listed): publish a directory "
                    f"only once its writer is done"
                )
            got += count
        return view
