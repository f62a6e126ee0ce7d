"""Ranged reads of a checkpoint's shards in which no checked block is read twice.

A ranged read checks every block it touches against the CRC32C the manifest recorded for it,
so it reads each block it touches whole. A tree of many small leaves has many of them in one
block: read one by one, that block would be read (and checked) once per leaf. Here a small
read goes through a cache of whole blocks (bounded, least recently used first out), and a
large one straight into its destination, but for the blocks it covers only in part (its two
ends), which go through the cache: a block that two reads share is read once.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass, field

from ckptstore.checkpoint import Checkpoint

__all__ = ["BlockReader", "ReadStats"]

CACHED_BLOCKS = 32
"""Whole blocks kept for small reads (32 of 4 MiB: 128 MiB; a shard recorded without block
checksums, written before they were, is one block as large as the shard)."""


@dataclass
class ReadStats:
    """What a load needed (the bytes of the boxes it returned), what it read from storage
    (whole checked blocks), and in how many ranged reads."""

    needed: int = 0
    read: int = 0
    requests: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, *, needed: int = 0, read: int = 0, requests: int = 0) -> None:
        """Count more bytes needed, read, and requests."""
        with self._lock:
            self.needed += needed
            self.read += read
            self.requests += requests


class BlockReader:
    """Reads byte ranges of one checkpoint's shards; thread-safe."""

    def __init__(self, checkpoint: Checkpoint, stats: ReadStats | None = None) -> None:
        self.checkpoint = checkpoint
        self.stats = stats
        self._lock = threading.Lock()
        self._blocks: OrderedDict[tuple[str, int], Future[memoryview]] = OrderedDict()

    def read(
        self, shard: str, offset: int, length: int, into: memoryview | None = None
    ) -> memoryview:
        """Bytes ``offset..offset + length`` of ``shard``, checked; into ``into`` if given."""
        if length == 0:
            return memoryview(bytearray(0)) if into is None else into[:0]
        record = self.checkpoint.shards[shard]
        size = record.block_size or record.size  # no blocks recorded: the shard is one
        first, last = offset // size, (offset + length - 1) // size
        out = memoryview(bytearray(length) if into is None else into)[:length]
        end = offset + length
        whole = range(first + (offset % size != 0), last + (end % size == 0 or end == record.size))
        if len(whole) >= 2:  # the blocks it covers whole: straight into place, one read
            start, stop = whole.start * size, min(whole.stop * size, record.size)
            self.checkpoint.read_range(
                shard, start, stop - start, out[start - offset : stop - offset]
            )
            self._count(record.size, size, whole.start, whole.stop - 1)
        else:
            whole = range(0)
        for index in range(first, last + 1):  # the others through the cache: each read once
            if index in whole:
                continue
            block = self._block(shard, index, size, record.size)
            start = max(offset, index * size) - index * size
            stop = min(end, (index + 1) * size) - index * size
            at = index * size + start - offset
            out[at : at + stop - start] = block[start:stop]
        return out

    def _block(self, shard: str, index: int, size: int, shard_size: int) -> memoryview:
        """Block ``index`` of ``shard``, read once while it stays in the cache."""
        key = (shard, index)
        with self._lock:
            future = self._blocks.get(key)
            owner = future is None
            if future is None:
                future = Future()
                self._blocks[key] = future
                while len(self._blocks) > CACHED_BLOCKS:
                    self._blocks.popitem(last=False)
            else:
                self._blocks.move_to_end(key)
        if not owner:
            return future.result()
        start = index * size
        try:
            data = self.checkpoint.read_range(shard, start, min(size, shard_size - start))
        except BaseException as exc:
            with self._lock:
                if self._blocks.get(key) is future:
                    del self._blocks[key]
            future.set_exception(exc)
            raise
        self._count(shard_size, size, index, index)
        future.set_result(data)
        return data

    def _count(self, shard_size: int, size: int, first: int, last: int) -> None:
        if self.stats is not None:
            read = min((last + 1) * size, shard_size) - first * size
            self.stats.add(read=read, requests=1)
