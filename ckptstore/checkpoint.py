"""A published checkpoint, and readers that return its bytes only as they were committed (I6).

Every read checks the size and CRC32C the manifest recorded, while streaming. A streaming
reader raises ShardCorruptError at the read that reaches the end of the shard if the bytes
differ; ``read`` and ``read_into`` check before they return anything.

``read_into`` of a large shard on storage whose driver reads ranges (``RangedReadDriver``)
reads it as ranged reads in parallel, all pinned to the one object version a HEAD found, each
landing in place in the caller's buffer; each block is checked against its recorded CRC32C as
its range lands, and the blocks' CRC32Cs combine into the shard's (no second pass).

A shard whose manifest records cryptographic digests (``ckptstore.digest``) is checked against
them instead, block by block on every path, and its CRC32C is not computed; a block that fails
is zeroed where it was written into the caller's buffer (docs/protocol.md §10).
"""

from __future__ import annotations

import contextlib
import io
import threading
from collections.abc import Callable, Collection, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from datetime import datetime
from typing import BinaryIO, NoReturn, Protocol, TypeVar, cast

from ckptstore.checksum import Crc32c, crc32c_combine, crc32c_of
from ckptstore.commit.base import ShardRanges
from ckptstore.digest import BlockDigests, block_hexdigest, digest_length
from ckptstore.driver import BytesLike
from ckptstore.errors import (
    IntegrityError,
    InvalidInputError,
    ShardCorruptError,
    ShardNotFoundError,
)
from ckptstore.manifest import JSONValue, Manifest, ShardRecord

__all__ = ["Checkpoint", "ShardReader", "VerifyReport"]

T = TypeVar("T")

_CHUNK = 8 * 1024 * 1024
_HOT_PIECE = 2 * 1024 * 1024
"""A large read in one thread reads and checksums this much at a time (still in the L3 cache).
Measured (benchmarks/README.md): 512 KiB pieces fit the L2 cache but cost 2.5x the user CPU
of 2 MiB pieces in per-piece overhead; 4 and 8 MiB were no faster."""
_PIPELINE_PIECE = 16 * 1024 * 1024
"""A read at least twice this large checksums each piece while the next one is read (small
pieces: only the last piece's checksum is not overlapped with reading)."""
_READ_SEGMENTS = 2
"""Streams a large shard's ``read_into`` reads at once where the storage's streams seek."""
_SEGMENT_GRAIN = 4096
"""Segment boundaries of a shard without digests fall on multiples of this (pages)."""
Opener = Callable[[Manifest, ShardRecord], BinaryIO]
RangeOpener = Callable[[Manifest, ShardRecord], "ShardRanges | None"]


class _ShardCheck(Protocol):
    """What a streaming read checks a shard's bytes with, fed in order as they arrive."""

    size: int

    def update(self, data: bytes | bytearray | memoryview) -> None: ...

    def early_problem(self) -> str | None:
        """A mismatch already certain (a block's digest), or None."""

    def final_problem(self, record: ShardRecord) -> str | None:
        """Once every byte arrived: the mismatch, or None."""


class _CrcCheck(Crc32c):
    """A shard without digests is checked against its CRC32C."""

    def early_problem(self) -> str | None:
        return None

    def final_problem(self, record: ShardRecord) -> str | None:
        if self.hexdigest() == record.crc32c:
            return None
        return (
            f"CRC32C mismatch: stored bytes have {self.hexdigest()}, manifest says {record.crc32c}"
        )


class _DigestCheck(BlockDigests):
    """A shard with digests is checked block by block against them (a CRC32C adds nothing a
    cryptographic digest does not already prove, so it is not computed)."""

    def __init__(self, record: ShardRecord, first_block: int = 0) -> None:
        super().__init__(
            record.digest_algorithm,
            record.block_size,
            expected=record.block_digests,
            first_block=first_block,
        )

    def early_problem(self) -> str | None:
        return self.mismatch

    def final_problem(self, record: ShardRecord) -> str | None:
        self.finish()
        if self.mismatch is not None:
            return self.mismatch
        if f"{self.algorithm}:{self.hexdigest()}" != record.digest:
            return (
                f"{self.algorithm} digest mismatch: the shard's digest differs from the manifest's"
            )
        return None


class ShardReader(io.RawIOBase):
    """A read-only stream of one shard that verifies its size and CRC32C as it goes."""

    def __init__(
        self, raw: BinaryIO, record: ShardRecord, *, where: str, checksum_thread: bool = True
    ) -> None:
        super().__init__()
        self._raw = raw
        self.record = record
        self._where = where
        self._checksum_thread = checksum_thread
        self._crc: _ShardCheck = _DigestCheck(record) if record.digest else _CrcCheck()
        self._verified = False
        self._checksummer: ThreadPoolExecutor | None = None

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: BytesLike) -> int:
        """Fill ``buffer`` with the shard's next bytes, checked as they come; a mismatch
        raises ShardCorruptError and, for a shard with digests, zeroes what this call wrote
        (bytes of the failing block that earlier calls returned are the caller's to drop)."""
        view = memoryview(buffer).cast("B")
        remaining = self.record.size - self._crc.size
        if remaining <= 0:
            self._finish()
            return 0
        view = view[:remaining]
        try:
            return self._readinto_checked(view)
        except IntegrityError:
            if self.record.digest and not view.readonly:
                _wipe(view)
            raise

    def _readinto_checked(self, view: memoryview) -> int:
        if view.nbytes >= 2 * _PIPELINE_PIECE and not view.readonly and self._checksum_thread:
            count = self._readinto_pipelined(view)
        else:  # piece by piece, each checksummed while it is still in the CPU's cache
            count = 0
            while count < view.nbytes:
                piece = view[count : count + _HOT_PIECE]
                more = self._raw.readinto(piece) or 0  # type: ignore[attr-defined]
                self._update(piece[:more])
                count += more
                if more < piece.nbytes:
                    break
        if not count:
            self._fail(f"truncated: {self._crc.size} of {self.record.size} bytes")
        if self._crc.size == self.record.size:
            self._finish()
        return int(count)

    def _readinto_pipelined(self, view: memoryview) -> int:
        """Fill ``view`` piece by piece, checksumming each piece while the next is read.

        Every piece is checksummed before this returns, so the caller's buffer is never read
        by another thread after it has it back.
        """
        got = 0
        checksumming: Future[None] | None = None
        if self._checksummer is None:
            self._checksummer = ThreadPoolExecutor(1, thread_name_prefix="ckptstore-crc")
        checksummer = self._checksummer
        try:
            while got < view.nbytes:
                piece = view[got : got + _PIPELINE_PIECE]
                count = 0
                while count < piece.nbytes:
                    more = self._raw.readinto(piece[count:])  # type: ignore[attr-defined]
                    if not more:
                        break
                    count += more
                if checksumming is not None:
                    checksumming.result()
                    checksumming = None
                if count:
                    checksumming = checksummer.submit(self._update, piece[:count])
                got += count
                if count < piece.nbytes:
                    break
        finally:
            if checksumming is not None:
                checksumming.result()
        return got

    def readall(self) -> bytes:
        """Read the rest of the shard; verified before it is returned."""
        chunks = []
        while self._crc.size < self.record.size:
            chunk = self._raw.read(self.record.size - self._crc.size)
            if not chunk:
                self._fail(f"truncated: {self._crc.size} of {self.record.size} bytes")
            self._update(chunk)
            chunks.append(chunk)
        self._finish()
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def _update(self, piece: memoryview | bytes) -> None:
        self._crc.update(piece)
        problem = self._crc.early_problem()
        if problem is not None:
            self._fail(problem)

    def _finish(self) -> None:
        if self._verified:
            return
        if self._raw.read(1):
            self._fail(f"longer than the recorded {self.record.size} bytes")
        problem = self._crc.final_problem(self.record)
        if problem is not None:
            self._fail(problem)
        self._verified = True

    def _fail(self, problem: str) -> None:
        raise ShardCorruptError(
            f"{self._where}: shard {self.record.name!r}: {problem}", key=self.record.name
        )

    def close(self) -> None:
        if not self.closed:
            if self._checksummer is not None:
                self._checksummer.shutdown(wait=True)
            self._raw.close()
        super().close()


def _skip_to(raw: BinaryIO, position: int) -> None:
    """Move a fresh shard stream to ``position``: a seek where it can, else read and drop."""
    if not position:
        return
    seekable = getattr(raw, "seekable", None)
    if seekable is not None and seekable():
        raw.seek(position)
        return
    scratch = memoryview(bytearray(min(_CHUNK, position)))
    while position:
        count = raw.readinto(scratch[: min(position, scratch.nbytes)])  # type: ignore[attr-defined]
        if not count:
            return  # short: the block read that follows reports the truncation
        position -= count


def _in_parallel(tasks: list[Callable[[], T]], workers: int) -> list[T]:
    """Each task's result, in order; up to ``workers`` at once (one task: in this thread).
    On a failure the tasks not started are dropped and those under way finish (they may
    write into a caller's buffer) before the first failure is raised."""
    if len(tasks) <= 1:
        return [task() for task in tasks]
    failed = threading.Event()

    def guarded(task: Callable[[], T]) -> T | None:
        if failed.is_set():
            return None  # another task failed: the result is not used
        try:
            return task()
        except BaseException:
            failed.set()
            raise

    with ThreadPoolExecutor(min(workers, len(tasks)), "ckptstore-read") as pool:
        futures = [pool.submit(guarded, task) for task in tasks]
        try:
            return [cast(T, future.result()) for future in futures]
        except BaseException:
            failed.set()
            for future in futures:
                future.cancel()
            raise


def _wipe(view: memoryview) -> None:
    """Zero ``view``: bytes that failed a digest are not left where the caller reads."""
    view[:] = bytes(view.nbytes)


def _fill(raw: BinaryIO, view: memoryview) -> int:
    """Read until ``view`` is full or the stream ends; return the bytes read."""
    got = 0
    while got < view.nbytes:
        count = raw.readinto(view[got:])  # type: ignore[attr-defined]
        if not count:
            break
        got += count
    return got


@dataclass
class VerifyReport:
    """The result of verifying a checkpoint: ok, or the problem found in each bad shard."""

    step: int
    problems: dict[str, str] = field(default_factory=dict)
    bytes_checked: int = 0
    not_read_again: list[str] = field(default_factory=list)
    """Shards whose stored file was checked already (``verify(checked=...)``): shared with a
    checkpoint verified before, in the same pass."""

    @property
    def ok(self) -> bool:
        """True when every shard matched its recorded size and CRC32C."""
        return not self.problems


class Checkpoint:
    """A published checkpoint: its manifest and verified access to its shards."""

    def __init__(
        self, manifest: Manifest, opener: Opener, url: str, *, ranges: RangeOpener | None = None
    ) -> None:
        self.manifest = manifest
        self._opener = opener
        self._ranges = ranges
        self._pins: dict[str, ShardRanges | None] = {}
        self.url = url
        self._records = {record.name: record for record in manifest.shards}

    def __repr__(self) -> str:
        return f"<Checkpoint {self.url} step={self.step} shards={len(self._records)}>"

    @property
    def step(self) -> int:
        """The training step this checkpoint was saved at."""
        return self.manifest.step

    @property
    def metadata(self) -> Mapping[str, JSONValue]:
        """The trainer metadata given at save time."""
        return self.manifest.metadata

    @property
    def committed_at(self) -> datetime:
        """When the manifest was sealed, just before publishing (UTC)."""
        return self.manifest.committed_at

    @property
    def shards(self) -> Mapping[str, ShardRecord]:
        """Every shard by name: size, CRC32C and locator."""
        return self._records

    @property
    def names(self) -> list[str]:
        """Shard names, sorted."""
        return sorted(self._records)

    @property
    def size(self) -> int:
        """Total bytes of all shards."""
        return self.manifest.total_size

    def _record(self, name: str) -> ShardRecord:
        record = self._records.get(name)
        if record is None:
            raise ShardNotFoundError(
                f"{self.url}: step {self.step} has no shard {name!r}",
                url=self.url,
                step=self.step,
                key=name,
            )
        return record

    def open(self, name: str, *, checksum_thread: bool = True) -> ShardReader:
        """Open a shard for streaming; the read that reaches its end checks its CRC32C.

        ``checksum_thread``: a large ``readinto`` checksums on a second thread while it reads
        (the fastest way to read one shard); pass False where several shards are read at once,
        by threads of the caller's, so that each checksums in its own thread.
        """
        record = self._record(name)
        where = f"{self.url} step {self.step}"
        raw = self._opener(self.manifest, record)
        return ShardReader(raw, record, where=where, checksum_thread=checksum_thread)

    def read(self, name: str) -> bytes:
        """Return a shard's bytes, verified against the manifest."""
        with self.open(name) as reader:
            return reader.readall()

    def read_into(self, name: str, buffer: BytesLike) -> int:
        """Fill ``buffer`` (exactly the shard's size) with the verified shard; return the size."""
        view = memoryview(buffer).cast("B")
        record = self._record(name)
        if view.nbytes != record.size:
            raise ValueError(f"buffer has {view.nbytes} bytes, shard {name!r} has {record.size}")
        if view.readonly:
            raise ValueError("buffer is read-only")
        if record.size >= 2 * _PIPELINE_PIECE:
            ranges = self._pinned(record)
            if ranges is not None:
                self._read_ranged(record, view, ranges)
                return record.size
            if self._read_in_segments(record, view):
                return record.size
        with self.open(name) as reader:
            got = 0
            while got < record.size:
                got += reader.readinto(view[got:])
            reader.readinto(bytearray(1))  # reaching the end verifies
        return got

    def _pinned(self, record: ShardRecord) -> ShardRanges | None:
        """The shard pinned for ranged reads (one HEAD per shard and checkpoint object: every
        range after it asks for that object by condition), or None where the storage reads
        none; a stored size other than the recorded one is corrupt."""
        if self._ranges is None:
            return None
        if record.name not in self._pins:
            ranges = self._ranges(self.manifest, record)
            if ranges is not None and ranges.size != record.size:
                self._corrupt(
                    record, f"stored with {ranges.size} bytes, manifest says {record.size}"
                )
            self._pins[record.name] = ranges
        return self._pins[record.name]

    def _read_ranged(self, record: ShardRecord, view: memoryview, ranges: ShardRanges) -> None:
        """Read ``ranges`` (whole blocks each) in parallel into ``view``; check each block as
        its range lands, then the shard's CRC32C combined from the ranges'. On an error the
        ranges not started are dropped and those under way finish (they write into ``view``)
        before it is raised."""
        block = record.block_size
        step = max(1, ranges.range_size // block) * block if block else ranges.range_size
        starts = range(0, record.size, step)

        def read(start: int) -> Callable[[], int]:
            def one() -> int:
                end = min(start + step, record.size)
                try:
                    ranges.read(start, view[start:end])
                    return self._check_range(record, view, start, end)
                except IntegrityError:
                    _wipe(view[start:end])  # bytes that failed their check never stay in place
                    raise

            return one

        crcs = _in_parallel([read(start) for start in starts], ranges.concurrency)
        if record.digest:
            return  # every block was checked against its digest as it landed
        whole = crcs[0]
        for start, crc in zip(starts[1:], crcs[1:], strict=True):
            whole = crc32c_combine(whole, crc, min(step, record.size - start))
        if f"{whole:08x}" != record.crc32c:
            self._corrupt(
                record,
                f"CRC32C mismatch: stored bytes have {whole:08x}, manifest says {record.crc32c}",
            )

    def _check_range(self, record: ShardRecord, view: memoryview, start: int, end: int) -> int:
        """The CRC32C of ``view[start:end]``, each whole block in it checked on the way."""
        block = record.block_size
        if not block:
            return crc32c_of(view[start:end])
        if record.digest:
            for first in range(start, end, block):
                self._check_block_digest(
                    record, first // block, view[first : min(first + block, end)]
                )
            return 0
        crc = 0
        for first in range(start, end, block):
            last = min(first + block, end)
            value = crc32c_of(view[first:last])
            index = first // block
            expected = record.block_crc32c[8 * index : 8 * index + 8]
            if f"{value:08x}" != expected:
                self._corrupt(
                    record,
                    f"CRC32C mismatch in block {index} (bytes {first}..{last}): stored bytes "
                    f"have {value:08x}, manifest says {expected}",
                )
            crc = value if first == start else crc32c_combine(crc, value, last - first)
        return crc

    def _check_block_digest(self, record: ShardRecord, index: int, data: memoryview) -> None:
        """ShardCorruptError unless block ``index``'s bytes ``data`` have its recorded digest."""
        algorithm = record.digest_algorithm
        length = digest_length(algorithm)
        expected = record.block_digests[length * index : length * (index + 1)]
        if block_hexdigest(algorithm, data) != expected:
            first = index * record.block_size
            self._corrupt(
                record,
                f"{algorithm} digest mismatch in block {index} (bytes {first}.."
                f"{first + data.nbytes})",
            )

    def _read_in_segments(self, record: ShardRecord, view: memoryview) -> bool:
        """Read a large shard as segments at once (``_READ_SEGMENTS``), each from its own
        stream and checksummed piece by piece while in cache; the segments' CRC32Cs combine
        into the shard's, checked with its size. False (nothing read) if the storage's streams
        cannot seek.

        A verified read costs a copy and a CRC32C (about the same CPU per byte): split over
        two threads, it keeps up with a plain read; more segments were measured slower.
        """
        first = self._opener(self.manifest, record)
        seekable = getattr(first, "seekable", None)
        if seekable is None or not seekable():
            first.close()
            return False
        # Segments of whole blocks where blocks carry digests: each segment checks its own.
        grain = record.block_size if record.digest else _SEGMENT_GRAIN
        count = max(2, min(_READ_SEGMENTS, record.size // _PIPELINE_PIECE))
        length = max(grain, record.size // count // grain * grain)
        starts = list(range(0, record.size, length))
        if len(starts) > 1 and record.size - starts[-1] < length // 2:
            starts.pop()  # a short tail joins the segment before it
        ends = [*starts[1:], record.size]

        def read(raw: BinaryIO, start: int, end: int) -> int:
            with contextlib.closing(raw):
                _skip_to(raw, start)
                crc: _CrcCheck | _DigestCheck = (
                    _DigestCheck(record, start // grain) if record.digest else _CrcCheck()
                )
                while crc.size < end - start:
                    piece = view[start + crc.size : min(start + crc.size + _HOT_PIECE, end)]
                    count = _fill(raw, piece)
                    crc.update(piece[:count])
                    problem = crc.early_problem()
                    if problem is not None:
                        _wipe(view[start : start + crc.size])  # this segment, as far as read
                        self._corrupt(record, problem)
                    if count < piece.nbytes:
                        self._corrupt(record, f"truncated: {start + crc.size} bytes, not {end}")
                if end == record.size and raw.read(1):
                    self._corrupt(record, f"longer than the recorded {record.size} bytes")
                if isinstance(crc, _DigestCheck):
                    crc.finish()
                    if crc.mismatch is not None:
                        _wipe(view[start:end])
                        self._corrupt(record, crc.mismatch)
                    return 0
                return crc.value

        def read_rest(start: int, end: int) -> int:
            return read(self._opener(self.manifest, record), start, end)

        if len(starts) == 1:  # too small to split on this grain: one segment, this thread
            head = read(first, 0, record.size)
            return self._combined(record, [head], starts, ends)
        with ThreadPoolExecutor(len(starts) - 1, thread_name_prefix="ckptstore-read") as helpers:
            rest = [
                helpers.submit(read_rest, a, b) for a, b in zip(starts[1:], ends[1:], strict=True)
            ]
            try:
                head = read(first, starts[0], ends[0])
            finally:
                wait(rest)  # even after a failure: they write ``view``
        crcs = [head, *(future.result() for future in rest)]  # a segment's failure, raised
        return self._combined(record, crcs, starts, ends)

    def _combined(
        self, record: ShardRecord, crcs: list[int], starts: list[int], ends: list[int]
    ) -> bool:
        """True once the segments' CRC32Cs combine into the recorded one (a shard with
        digests: each segment checked its blocks already), else ShardCorruptError."""
        if record.digest:
            return True
        whole = crcs[0]
        for start, end, crc in zip(starts[1:], ends[1:], crcs[1:], strict=True):
            whole = crc32c_combine(whole, crc, end - start)
        combined = f"{whole:08x}"
        if combined != record.crc32c:
            self._corrupt(
                record,
                f"CRC32C mismatch: stored bytes have {combined}, manifest says {record.crc32c}",
            )
        return True

    def read_range(
        self, name: str, offset: int, length: int, into: BytesLike | None = None
    ) -> memoryview:
        """Bytes ``offset`` to ``offset + length`` of a shard, checked; into ``into`` if given.

        Only the blocks the range touches are read (a seek, or a ranged GET), each checked
        against the CRC32C the manifest recorded for it; blocks wholly inside the range go
        straight into the destination. A shard recorded without block checksums (written
        before they were) is read whole and checked against its CRC32C. On a mismatch
        (ShardCorruptError) the destination may hold some of the damaged bytes.
        """
        record = self._record(name)
        if offset < 0 or length < 0 or offset + length > record.size:
            raise InvalidInputError(
                f"range {offset}+{length} is outside shard {name!r} ({record.size} bytes)", key=name
            )
        out = memoryview(bytearray(length) if into is None else into).cast("B")
        if out.nbytes < length or out.readonly:
            raise InvalidInputError(f"destination must be writable and hold {length} bytes")
        out = out[:length]
        if length:
            if record.block_size:
                self._read_blocks(record, offset, out)
            else:
                self._read_through(record, offset, out)
        return out

    def _read_blocks(self, record: ShardRecord, offset: int, out: memoryview) -> None:
        """The blocks ``out`` touches, each checked; wholly wanted blocks land in place."""
        ranges = self._pinned(record)
        if ranges is not None:
            self._read_blocks_ranged(record, offset, out, ranges)
            return
        size, blocks = record.block_size, record.block_range(offset, out.nbytes)
        end = offset + out.nbytes
        scratch: memoryview | None = None
        with contextlib.closing(self._opener(self.manifest, record)) as raw:
            _skip_to(raw, blocks.start * size)
            for index in blocks:
                first, last = index * size, min((index + 1) * size, record.size)
                in_place = offset <= first and last <= end  # wholly wanted: read in place
                if in_place:
                    target = out[first - offset : last - offset]
                else:
                    if scratch is None:
                        scratch = memoryview(bytearray(size))
                    target = scratch[: last - first]
                if _fill(raw, target) != target.nbytes:
                    self._corrupt(record, f"truncated in block {index}")
                self._check_block(record, index, target)
                if not in_place:
                    lo, hi = max(first, offset), min(last, end)
                    out[lo - offset : hi - offset] = target[lo - first : hi - first]

    def _read_blocks_ranged(
        self, record: ShardRecord, offset: int, out: memoryview, ranges: ShardRanges
    ) -> None:
        """The blocks ``out`` touches as bounded ranged reads of the pinned object, no byte
        asked for that is not used: runs of wholly wanted blocks (up to ``range_size`` each)
        straight into ``out``, a block wanted in part (at most the first and the last) into
        its own buffer; in parallel when there are several."""
        size, blocks = record.block_size, record.block_range(offset, out.nbytes)
        end = offset + out.nbytes
        per = max(1, ranges.range_size // size)
        requests: list[tuple[int, int, bool]] = []  # first block, blocks, in place
        for index in blocks:
            first, last = index * size, min((index + 1) * size, record.size)
            in_place = offset <= first and last <= end
            if requests and in_place and requests[-1][2] and requests[-1][1] < per:
                requests[-1] = (requests[-1][0], requests[-1][1] + 1, True)
            else:
                requests.append((index, 1, in_place))

        def read(first_block: int, count: int, in_place: bool) -> Callable[[], None]:
            def one() -> None:
                first = first_block * size
                last = min((first_block + count) * size, record.size)
                target = (
                    out[first - offset : last - offset]
                    if in_place
                    else memoryview(bytearray(last - first))
                )
                ranges.read(first, target)
                try:
                    for index in range(first_block, first_block + count):
                        lo = index * size - first
                        self._check_block(record, index, target[lo : lo + size])
                except IntegrityError:
                    _wipe(target)
                    raise
                if not in_place:
                    lo, hi = max(first, offset), min(last, end)
                    out[lo - offset : hi - offset] = target[lo - first : hi - first]

            return one

        _in_parallel([read(*request) for request in requests], ranges.concurrency)

    def _check_block(self, record: ShardRecord, index: int, data: memoryview) -> None:
        """ShardCorruptError (``data`` zeroed) unless block ``index``'s bytes ``data`` have
        its recorded digest, or else its recorded CRC32C."""
        if record.digest:
            try:
                self._check_block_digest(record, index, data)
            except IntegrityError:
                _wipe(data)
                raise
            return
        crc = Crc32c()
        crc.update(data)
        expected = record.block_crc32c[8 * index : 8 * index + 8]
        if crc.hexdigest() != expected:
            first = index * record.block_size
            self._corrupt(
                record,
                f"CRC32C mismatch in block {index} (bytes {first}..{first + data.nbytes}): "
                f"stored bytes have {crc.hexdigest()}, manifest says {expected}",
            )

    def _read_through(self, record: ShardRecord, offset: int, out: memoryview) -> None:
        """The whole shard streamed and verified; the range copied out on the way."""
        end = offset + out.nbytes
        position = 0
        chunk = memoryview(bytearray(min(_CHUNK, max(record.size, 1))))
        with self.open(record.name) as reader:
            while count := reader.readinto(chunk):
                lo, hi = max(position, offset), min(position + count, end)
                if lo < hi:
                    out[lo - offset : hi - offset] = chunk[lo - position : hi - position]
                position += count

    def _corrupt(self, record: ShardRecord, problem: str) -> NoReturn:
        raise ShardCorruptError(
            f"{self.url} step {self.step}: shard {record.name!r}: {problem}",
            url=self.url,
            step=self.step,
            key=record.name,
        )

    def iter_chunks(self, name: str, chunk_size: int = _CHUNK) -> Iterator[bytes]:
        """Yield a shard in chunks; the last chunk is yielded only after verification."""
        with self.open(name) as reader:
            pending = None
            while True:
                chunk = reader.read(chunk_size)
                if not chunk:
                    break
                if pending is not None:
                    yield pending
                pending = chunk
            if pending is not None:
                yield pending

    def verify(
        self,
        progress: Callable[[int], None] | None = None,
        *,
        checked: Collection[str] = (),
    ) -> VerifyReport:
        """Read every shard and report those whose size or CRC32C differ, or that are missing.

        ``checked``: shards not read again, their stored file already verified against the
        same size and CRC32C in this pass (shared with another checkpoint, incremental saves).
        """
        report = VerifyReport(step=self.step)
        buffer = bytearray(_CHUNK)
        for name in self.names:
            if name in checked:
                report.not_read_again.append(name)
                continue
            try:
                with self.open(name) as reader:
                    while count := reader.readinto(buffer):
                        report.bytes_checked += count
                        if progress is not None:
                            progress(count)
            except IntegrityError as exc:
                report.problems[name] = str(exc)
        return report
