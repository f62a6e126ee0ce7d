"""A whole shard's bytes, known before it is written, read piece by piece and never joined:
hashed, compared and uploaded without a copy of the whole, so that an incremental save can
share a shard made of many tensors (``PendingCheckpoint.write`` of a list of buffers) or a
file of a directory being pushed (``FileBytes``) with what an earlier save stored."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator

from ckptstore.errors import InvalidInputError

__all__ = ["FileBytes", "LazyBytes", "ShardBytes"]

_FILE_PIECE = 8 * 1024 * 1024
"""A file's bytes are read this much at a time (``FileBytes.pieces`` with no limit)."""


class ShardBytes:
    """The concatenation of byte views (1-D, format ``B``), read without a copy of the whole:
    the views must not change while it is in use (a snapshot's buffers, a caller's bytes)."""

    stable = True
    """Every pass reads the same bytes (memory the save owns, or that the trainer leaves alone
    until the save returns). False for a file another process may still change: the bytes
    written are then checked against the checksums computed before (``FileBytes``)."""

    def __init__(self, views: Iterable[memoryview]) -> None:
        self._views = [view for view in views if view.nbytes]
        for view in self._views:
            if view.ndim != 1 or view.format != "B":
                raise ValueError("ShardBytes holds 1-D byte views only")
        self.nbytes = sum(view.nbytes for view in self._views)
        """How many bytes it holds."""

    def name(self) -> str:
        """What the bytes are, for errors."""
        return "the shard's bytes"

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


class FileBytes(ShardBytes):
    """The first ``size`` bytes of an open regular file, read with ``pread`` each time they
    are needed (the page cache serves the second pass), never held whole in memory.

    A file that ends before ``size`` bytes raises InvalidInputError (it changed while it was
    being published); one that grows is read to ``size`` only (its publisher checks its size
    and modification time afterwards). Not ``stable``: what is written or uploaded is checked
    against the checksums of the first pass. A piece is a view of a buffer reused for the next
    piece of the same iteration: use it before asking for the next.
    """

    stable = False

    def __init__(self, fd: int, size: int, name: str) -> None:
        super().__init__([])
        self.nbytes = size
        self._fd = fd
        self._name = name

    def name(self) -> str:
        return self._name

    def pieces(self, limit: int | None = None) -> Iterator[memoryview]:
        step = min(limit or _FILE_PIECE, _FILE_PIECE, max(self.nbytes, 1))
        buffer = memoryview(bytearray(step))
        for offset in range(0, self.nbytes, step):
            yield self._read(buffer[: min(step, self.nbytes - offset)], offset)

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


class LazyBytes(ShardBytes):
    """Bytes made again, piece by piece, at every pass: each of ``pieces`` is its size and a
    function that returns a byte view of exactly that size (a tensor copied to host memory,
    say), so that no more than one piece is held at a time, whatever the whole's size."""

    def __init__(self, pieces: Iterable[tuple[int, Callable[[], memoryview]]]) -> None:
        super().__init__([])
        self._makers = [(size, make) for size, make in pieces if size]
        self.nbytes = sum(size for size, _ in self._makers)

    def pieces(self, limit: int | None = None) -> Iterator[memoryview]:
        for size, make in self._makers:
            view = make()
            if view.nbytes != size:
                raise ValueError(f"a piece of {size} bytes came back as {view.nbytes}")
            if limit is None or size <= limit:
                yield view
                continue
            for offset in range(0, size, limit):
                yield view[offset : offset + limit]
