"""A checkpoint being written: shards stream to staging, and nothing is visible until publish.

``PendingCheckpoint`` computes each shard's size and CRC32C on the way through, refuses unsafe
or clashing names before touching storage, and either publishes (one atomic commit) or aborts.
Used as a context manager it publishes on a clean exit and aborts on an exception.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, Protocol, cast

from ckptstore.checksum import BlockCrc32c
from ckptstore.commit.base import ShardSink
from ckptstore.digest import BlockDigests
from ckptstore.driver import BytesLike
from ckptstore.errors import (
    CheckpointExistsError,
    CheckpointStateError,
    CoverageError,
    InvalidInputError,
    LineageError,
    ShardExistsError,
    StorageError,
    StrayEntryError,
)
from ckptstore.manifest import JSONValue, Manifest, ReplicaSource, ShardRecord, WriterInfo
from ckptstore.names import check_shard_name
from ckptstore.shardbytes import ShardBytes

if TYPE_CHECKING:
    from ckptstore.checkpoint import Checkpoint

__all__ = [
    "AttemptOwner",
    "CommitStamp",
    "PendingCheckpoint",
    "PendingState",
    "ShardData",
    "ShardSharing",
    "ShardWriter",
    "save_shards",
    "shard_checksums",
    "shard_record",
]

_READ_CHUNK = 8 * 1024 * 1024


class _Readable(Protocol):
    def read(self, size: int = -1, /) -> bytes: ...


ShardData = BytesLike | _Readable | Iterable[BytesLike] | ShardBytes
"""What a shard can be written from: any buffer (bytes, bytearray, memoryview, a NumPy
array), a binary file (anything with ``read``), an iterable of buffers (chunks), or
``ShardBytes`` (bytes known whole before they are written: an incremental save shares them
where it can, as it does a buffer or a list of buffers)."""


class PendingState(str, enum.Enum):
    """Where a pending checkpoint is in its life; equal to its name as a string ("open")."""

    OPEN = "open"
    """Shards may be written."""
    SEALING = "sealing"
    """The shards written so far are being made durable; none may start."""
    SEALED = "sealed"
    """Every shard is durable; the manifest is next."""
    PUBLISHING = "publishing"
    """The manifest is being committed: the outcome is the storage's to decide."""
    PUBLISHED = "published"
    """Committed: visible to every reader."""
    FAILED = "failed"
    """Not published; what was staged is left for GC (the outcome may be unknown)."""
    ABORTED = "aborted"
    """Given up; what was staged was removed (or is left for GC)."""


_NEXT: dict[PendingState, frozenset[PendingState]] = {
    PendingState.OPEN: frozenset({PendingState.SEALING, PendingState.ABORTED, PendingState.FAILED}),
    PendingState.SEALING: frozenset(
        {PendingState.OPEN, PendingState.SEALED, PendingState.ABORTED, PendingState.FAILED}
    ),
    PendingState.SEALED: frozenset({PendingState.PUBLISHING, PendingState.FAILED}),
    PendingState.PUBLISHING: frozenset({PendingState.PUBLISHED, PendingState.FAILED}),
    PendingState.PUBLISHED: frozenset(),
    PendingState.FAILED: frozenset(),
    PendingState.ABORTED: frozenset(),
}
"""The legal transitions. ``seal()`` alone goes SEALING -> OPEN (more shards may follow);
``publish()`` goes OPEN -> SEALING -> SEALED -> PUBLISHING -> PUBLISHED."""


@dataclass(frozen=True)
class CommitStamp:
    """What the store records in a manifest it commits: its backend, the epoch the attempt
    writes in, and the commit time on the store's clock."""

    backend: str
    epoch: int
    committed_at: datetime


class AttemptOwner(Protocol):
    """The one committer of a pending checkpoint's attempt: where its shards are staged and
    its manifest committed (``ckptstore.publisher``)."""

    url: str

    def open_sink(self, name: str, size_hint: int | None) -> ShardSink:
        """Start staging one shard of the attempt."""

    def seal(self) -> None:
        """Make durable every shard of the attempt closed so far."""

    def stamp(self) -> CommitStamp:
        """What the manifest records of the store (CheckpointStateError if this process may
        not publish the attempt)."""

    def commit(self, manifest: Manifest) -> Checkpoint:
        """Commit ``manifest`` (the commit point); return the checkpoint."""

    def published(self, checkpoint: Checkpoint) -> None:
        """What follows a publish and cannot undo it: the LATEST hint, retention."""

    def abort(self) -> None:
        """Remove what the attempt staged, as far as possible (GC removes the rest)."""


_CLONE_READ = 8 * 1024 * 1024
"""A cloned shard is read back and checksummed this much at a time."""
_OVERLAP_FROM = 16 * 1024 * 1024
"""A write at least this large is checksummed on another thread while the sink writes it."""


class ShardSharing(Protocol):
    """Where an incremental save shares shards with earlier checkpoints (docs/protocol.md
    §12): ``share`` makes a shard a link to a sealed file holding exactly its bytes, or
    returns None (then the shard is written); ``index`` makes an attempt's sealed shards
    found by their CRC32C and size."""

    digest_algorithm: str | None
    """The strong digest ``share`` needs of a shard (object stores), or None."""

    def share(
        self, name: str, crc32c: str, size: int, data: ShardBytes, digest: str | None = None
    ) -> Mapping[str, str] | None: ...

    def index(self, step: int, attempt: str, shards: Mapping[str, tuple[str, int]]) -> None: ...


class ShardWriter:
    """Streams one shard into its attempt; ``close`` finishes and records it (durable at seal)."""

    def __init__(
        self,
        name: str,
        sink: ShardSink,
        *,
        closed: Callable[[ShardRecord], None],
        failed: Callable[[str], None],
        digest_algorithm: str | None = None,
    ) -> None:
        """``closed`` counts the shard's record once it is finished, ``failed`` its name if
        it is given up (the pending checkpoint's own bookkeeping). ``digest_algorithm``: also
        record the shard's cryptographic digests (``ckptstore.digest``), in the same pass."""
        self.name = name
        self._sink = sink
        self._closed_to = closed
        self._failed_to = failed
        self._crc = BlockCrc32c()
        self._digests = None if digest_algorithm is None else BlockDigests(digest_algorithm)
        self._ahead = 0
        self._record: ShardRecord | None = None
        self._closed = False

    def write(self, data: BytesLike) -> int:
        """Append bytes (any C-contiguous buffer); return the number of bytes written."""
        if self._closed:
            raise CheckpointStateError(f"shard {self.name!r} is already closed", key=self.name)
        view = _as_view(data)
        if view.nbytes < _OVERLAP_FROM:
            self._checksum(view)
            self._sink.write(view)
            return view.nbytes
        failure: list[BaseException] = []

        def checksum() -> None:
            try:
                self._checksum(view)
            except BaseException as exc:  # raised below, in the writer's thread
                failure.append(exc)

        checksumming = threading.Thread(target=checksum, name="ckptstore-crc-write")
        checksumming.start()  # while the sink writes
        try:
            self._sink.write(view)
        finally:
            checksumming.join()  # the caller may reuse its buffer once this returns
        if failure:
            raise failure[0]
        return view.nbytes

    def write_ahead(self, data: BytesLike) -> int:
        """Append bytes whose checksums the caller computes elsewhere and hands over with
        ``adopt`` before ``close`` (an incremental save hashes a shard while it is written)."""
        if self._closed or self.size:  # several calls may add bytes ahead, in order
            raise CheckpointStateError(
                f"shard {self.name!r}: bytes ahead of their checksums go into an empty shard",
                key=self.name,
            )
        view = _as_view(data)
        self._sink.write(view)
        self._ahead += view.nbytes
        return view.nbytes

    def adopt(self, crc: BlockCrc32c, digests: BlockDigests | None) -> None:
        """The checksums of exactly the bytes ``write_ahead`` wrote (``digests``: recorded
        in the manifest, so only where the store records digests)."""
        if crc.size != self._ahead or (digests is not None) != (self._digests is not None):
            raise ValueError(f"shard {self.name!r}: checksums of other bytes")
        self._crc, self._digests, self._ahead = crc, digests, 0

    def clone_from(self, source: int) -> bool:
        """Make this (still empty) shard a copy-on-write clone of the whole open file
        ``source`` where the storage can (a reflink: no byte copied), then checksum the clone
        as stored; False where it cannot (nothing written: write the bytes instead)."""
        if self._closed or self.size:
            raise CheckpointStateError(
                f"shard {self.name!r}: only an empty, open shard is cloned", key=self.name
            )
        stream = self._sink.clone_from(source)
        if stream is None:
            return False
        with stream:
            chunk = memoryview(bytearray(_CLONE_READ))
            while count := stream.readinto(chunk):  # type: ignore[attr-defined]
                self._checksum(chunk[:count])
        return True

    def _checksum(self, view: memoryview) -> None:
        self._crc.update(view)
        if self._digests is not None:
            self._digests.update(view)

    @property
    def size(self) -> int:
        """Bytes written so far."""
        return self._crc.size

    @property
    def crc32c(self) -> str:
        """The CRC32C of the bytes written so far (8 hex digits)."""
        return self._crc.hexdigest()

    def close(self) -> ShardRecord:
        """Finish the shard and add it to the checkpoint; return its record.

        The shard is durable once the checkpoint is sealed (``publish`` seals first).
        """
        if self._record is not None:
            return self._record
        if self._closed:
            raise CheckpointStateError(f"shard {self.name!r} was aborted", key=self.name)
        if self._ahead:
            raise CheckpointStateError(
                f"shard {self.name!r}: {self._ahead} bytes written without their checksums",
                key=self.name,
            )
        self._closed = True
        try:
            locator = self._sink.close()
        except BaseException:
            self._failed_to(self.name)
            raise
        record = shard_record(self.name, locator, self._crc, self._digests)
        self._closed_to(record)
        self._record = record
        return record

    def abort(self) -> None:
        """Drop the shard; the checkpoint cannot be published without rewriting it."""
        if not self._closed:
            self._closed = True
            self._sink.abort()
            self._failed_to(self.name)

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def shard_checksums(
    data: memoryview | ShardBytes, algorithm: str | None
) -> tuple[BlockCrc32c, BlockDigests | None]:
    """The CRC32Cs (and, with ``algorithm``, the digests) of a whole shard's bytes; a large
    shard's two on two threads (both hash without holding the GIL)."""
    whole = ShardBytes.of(data)
    crc = BlockCrc32c()
    digests = None if algorithm is None else BlockDigests(algorithm)
    if digests is None or whole.nbytes < _OVERLAP_FROM:
        for piece in whole.pieces():
            crc.update(piece)
            if digests is not None:
                digests.update(piece)
        return crc, digests
    failure: list[BaseException] = []

    def crc_all() -> None:
        try:
            for piece in whole.pieces():
                crc.update(piece)
        except BaseException as exc:  # raised below, in the caller's thread
            failure.append(exc)

    summing = threading.Thread(target=crc_all, name="ckptstore-crc-share")
    summing.start()
    try:
        for piece in whole.pieces():
            digests.update(piece)
    finally:
        summing.join()
    if failure:
        raise failure[0]
    return crc, digests


def shard_record(
    name: str, locator: Mapping[str, str], crc: BlockCrc32c, digests: BlockDigests | None
) -> ShardRecord:
    """The record of a finished shard of these checksums (``digests`` is finished here)."""
    digest, block_digests = "", ""
    if digests is not None:
        digests.finish()
        digest = f"{digests.algorithm}:{digests.hexdigest()}"
        block_digests = digests.block_hexdigests()
    return ShardRecord(
        name,
        crc.size,
        crc.hexdigest(),
        dict(locator),
        block_size=crc.block_size,
        block_crc32c=crc.block_hexdigests(),
        digest=digest,
        block_digests=block_digests,
    )


def _as_view(data: Any) -> memoryview:
    if isinstance(data, str):
        raise InvalidInputError("shard data must be bytes-like, not str (encode it first)")
    try:
        view = memoryview(data)
    except TypeError as exc:
        raise InvalidInputError(
            f"shard data must be a bytes-like object, got {type(data).__name__}"
        ) from exc
    if not view.c_contiguous:
        raise InvalidInputError(
            "shard data must be C-contiguous (use numpy.ascontiguousarray or .contiguous())"
        )
    if not view.nbytes:
        return memoryview(b"")  # an array with a 0 in its shape cannot be cast: no bytes
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


class PendingCheckpoint:
    """One attempt at saving a step; invisible to readers until ``publish`` returns."""

    def __init__(
        self,
        *,
        step: int,
        attempt: str,
        metadata: dict[str, JSONValue],
        expected: frozenset[str] | None,
        writer: WriterInfo,
        owner: AttemptOwner,
        digest_algorithm: str | None = None,
        sharing: ShardSharing | None = None,
    ) -> None:
        """``digest_algorithm``: every shard written here also records its cryptographic
        digests (a store that signs, or that was opened with ``digests``). ``sharing`` (an
        incremental save, which needs digests): a shard written whole from a buffer whose
        bytes an earlier checkpoint holds is shared with it, not written again."""
        self.step = step
        self.digest_algorithm = digest_algorithm
        self._sharing = sharing
        self._written_here: set[str] = set()
        """Shards this process wrote (not receipts of other ranks): the ones it indexes."""
        self._shared_names: set[str] = set()
        self._indexed: set[str] = set()
        """Shards made of bytes an earlier checkpoint holds (indexed already)."""
        self.attempt = attempt
        self.metadata = metadata
        self.expected = expected
        self.writer = writer
        self.checkpoint: Checkpoint | None = None
        self.started = time.time()
        self.started_perf = time.perf_counter()
        self.timings: dict[str, float] = {}
        self.source: ReplicaSource | None = None
        """Set by a replicator (``ckptstore.replication``): the manifest records where the
        checkpoint was first published."""
        self._owner = owner
        self._lock = threading.Lock()
        self._records: dict[str, ShardRecord] = {}
        self._claimed: set[str] = set()
        self._directories: set[str] = set()
        self._failed: set[str] = set()
        self._state = PendingState.OPEN

    def __repr__(self) -> str:
        return f"<PendingCheckpoint step={self.step} attempt={self.attempt} {self._state.value}>"

    @property
    def shares(self) -> bool:
        """True in an incremental save: a shard given whole (a buffer, a list of buffers,
        ``ShardBytes``) is shared where an earlier save stored the same bytes."""
        return self._sharing is not None

    @property
    def state(self) -> PendingState:
        """Where this checkpoint is in its life (see PendingState)."""
        return self._state

    def _move(self, to: PendingState) -> None:
        """Change state; CheckpointStateError naming both states if the move is not legal."""
        if to not in _NEXT[self._state]:
            raise CheckpointStateError(
                f"checkpoint step {self.step} attempt {self.attempt}: cannot go from "
                f"{self._state.value} to {to.value}",
                step=self.step,
            )
        self._state = to

    @property
    def records(self) -> list[ShardRecord]:
        """The shards written and closed so far, sorted by name."""
        with self._lock:
            return [self._records[name] for name in sorted(self._records)]

    @property
    def failed_shards(self) -> set[str]:
        """Shards whose writing was aborted."""
        with self._lock:
            return set(self._failed)

    def _check_open(self) -> None:
        if self._state is not PendingState.OPEN:
            raise CheckpointStateError(
                f"checkpoint step {self.step} attempt {self.attempt} is {self._state.value}",
                step=self.step,
            )

    def _claim(self, name: str) -> None:
        check_shard_name(name)
        segments = name.split("/")
        parents = {"/".join(segments[:depth]) for depth in range(1, len(segments))}
        with self._lock:
            self._check_open()
            if name in self._claimed:
                raise ShardExistsError(
                    f"shard {name!r} was already written in this checkpoint", key=name
                )
            if name in self._directories:
                raise ShardExistsError(
                    f"shard {name!r} clashes with shards under {name + '/'!r}", key=name
                )
            clash = parents & self._claimed
            if clash:
                raise ShardExistsError(
                    f"shard {name!r} clashes with shard {min(clash)!r}", key=name
                )
            self._claimed.add(name)
            self._written_here.add(name)
            self._directories |= parents

    def _shard_closed(self, record: ShardRecord) -> None:
        """Count a shard its writer finished (``ShardWriter.close`` calls it)."""
        with self._lock:
            self._records[record.name] = record

    def _shard_failed(self, name: str) -> None:
        """Count a shard as failed: this checkpoint cannot publish (``ShardWriter`` calls it)."""
        with self._lock:
            self._failed.add(name)

    def discard(self, name: str) -> None:
        """Count shard ``name``, already written, as failed (its source was found to have
        changed while it was read): this attempt can no longer publish."""
        self._shard_failed(name)

    def open_shard(self, name: str, size_hint: int | None = None) -> ShardWriter:
        """Start streaming a shard; close the writer (or leave its ``with`` block) to finish.

        ``size_hint`` (the shard's size, if known) lets object stores choose the part size.
        """
        self._claim(name)
        return self._open_claimed(name, size_hint)

    def _open_claimed(self, name: str, size_hint: int | None) -> ShardWriter:
        try:
            sink = self._owner.open_sink(name, size_hint)
        except BaseException:
            self._shard_failed(name)
            raise
        return ShardWriter(
            name,
            sink,
            closed=self._shard_closed,
            failed=self._shard_failed,
            digest_algorithm=self.digest_algorithm,
        )

    def write(self, name: str, data: ShardData) -> ShardRecord:
        """Write a whole shard from bytes, a buffer (numpy, memoryview), a file or chunks."""
        if isinstance(data, str):
            raise InvalidInputError("shard data must be bytes-like, not str (encode it first)")
        if not (
            hasattr(data, "read") or _is_buffer(data) or isinstance(data, (Iterable, ShardBytes))
        ):
            raise InvalidInputError(
                f"shard data must be bytes-like, a binary file or an iterable of chunks, "
                f"got {type(data).__name__}"
            )
        view = None if hasattr(data, "read") or not _is_buffer(data) else _as_view(data)
        if self._sharing is not None:
            whole = _whole_shard(data, view)
            if whole is not None:
                return self._write_shared(name, whole, self._sharing)
        if isinstance(data, ShardBytes):
            data = data.pieces()  # each piece written before the next is read
        with self.open_shard(name, None if view is None else view.nbytes) as writer:
            if view is not None:
                writer.write(view)
            elif hasattr(data, "read"):
                while chunk := data.read(_READ_CHUNK):
                    if isinstance(chunk, str):
                        raise InvalidInputError(
                            f"shard {name!r}: file is open in text mode", key=name
                        )
                    writer.write(chunk)
            else:
                for chunk in cast(Iterable[BytesLike], data):  # neither a buffer nor a file
                    writer.write(chunk)
        return writer.close()

    def _write_shared(self, name: str, view: ShardBytes, sharing: ShardSharing) -> ShardRecord:
        """Write a whole shard of an incremental save, or share it where a sealed file of
        an earlier save holds exactly its bytes: its CRC32Cs (and digests, where the store
        records them) are computed first, the candidates of its CRC32C and size compared
        byte for byte, and only then is it written, from the same buffers, not read again."""
        self._claim(name)
        try:
            algorithm = self.digest_algorithm or sharing.digest_algorithm
            crc, digests = shard_checksums(view, algorithm)
            digest = None
            if digests is not None and sharing.digest_algorithm is not None:
                digests.finish()
                digest = f"{digests.algorithm}:{digests.hexdigest()}"
            if self.digest_algorithm is None:
                digests = None  # computed to name the blob; this store records none
            locator = sharing.share(name, crc.hexdigest(), view.nbytes, view, digest)
        except BaseException:
            self._shard_failed(name)
            raise
        if locator is not None:
            with self._lock:
                self._shared_names.add(name)
            record = shard_record(name, locator, crc, digests)
            self._shard_closed(record)
            return record
        with self._open_claimed(name, view.nbytes) as writer:
            if view.stable:  # the same bytes as were checksummed: not checksummed again
                for piece in view.pieces():
                    writer.write_ahead(piece)
                writer.adopt(crc, digests)
            else:  # checksummed as written, and refused if they are other bytes now
                for piece in view.pieces():
                    writer.write(piece)
                if writer.crc32c != crc.hexdigest():
                    raise InvalidInputError(
                        f"{view.name()} changed while it was published (its bytes no longer "
                        f"have the CRC32C computed from them moments before)",
                        key=name,
                    )
        return writer.close()

    def seal(self) -> list[ShardRecord]:
        """Make every shard closed so far durable; return their records (the receipts).

        ``publish`` seals by itself. A process that joined another's attempt (``Store.join``)
        seals before it sends its receipts to the coordinator; more shards may follow.
        """
        self._check_open()
        records = self._sealed_records(on_storage_error=PendingState.FAILED)
        self._move(PendingState.OPEN)
        return records

    def _sealed_records(self, on_storage_error: PendingState) -> list[ShardRecord]:
        """OPEN -> SEALING, then the records of every shard, made durable. A storage error
        moves to ``on_storage_error`` (a shard's data may be lost: this attempt cannot
        publish), any other failure to FAILED."""
        self._move(PendingState.SEALING)  # no shard may start now
        records = self.records
        try:
            self._owner.seal()  # makes durable every shard recorded before it started
        except StorageError:
            self._move(on_storage_error)
            raise
        except BaseException:
            self._move(PendingState.FAILED)
            raise
        if self._sharing is not None:  # durable now: later saves may share these shards
            with self._lock:
                written = {
                    r.name: (r.crc32c, r.size)
                    for r in records
                    if r.name in self._written_here
                    and r.name not in self._shared_names
                    and r.name not in self._indexed
                }
                self._indexed |= written.keys()  # a seal, then the publish's: once
            self._sharing.index(self.step, self.attempt, written)
        return records

    def _coverage_problem(self) -> str | None:
        failed = self.failed_shards
        if failed:
            return f"shard(s) {', '.join(sorted(failed))} failed to write"
        if self.expected is None:
            return None
        written = {record.name for record in self.records}
        missing, extra = self.expected - written, written - self.expected
        if missing or extra:
            return f"missing shards {sorted(missing)[:10]}, unexpected shards {sorted(extra)[:10]}"
        return None

    def add_receipts(self, records: Iterable[ShardRecord]) -> None:
        """Add shards that other processes wrote into this attempt (multi-rank saves).

        Each receipt is a ShardRecord from a ``Store.join`` of the same attempt. A name already
        present is a CoverageError: no shard may be written twice.
        """
        with self._lock:
            self._check_open()
            for record in records:
                check_shard_name(record.name)
                if record.name in self._records or record.name in self._claimed:
                    raise CoverageError(
                        f"step {self.step}: shard {record.name!r} was written twice "
                        f"(by two ranks?); nothing will be published",
                        step=self.step,
                        key=record.name,
                    )
                self._claimed.add(record.name)
                self._records[record.name] = record

    def add_timing(self, name: str, seconds: float) -> None:
        """Record a measured duration in the manifest's timings (e.g. ``blocked_s``)."""
        self.timings[name] = float(seconds)

    def publish(self) -> Checkpoint:
        """Commit atomically and durably; return the published checkpoint.

        Seals every shard, then commits the manifest. Refused shard coverage or a storage
        error while sealing: aborted, nothing published. The step published meanwhile by
        another attempt: CheckpointExistsError, and a writer superseded by a takeover:
        SupersededError, this attempt's data removed in both cases. Any other failure
        of the commit leaves the outcome to read back: the state is FAILED and the staged data
        stays for GC (a late commit may reference it).
        """
        self._check_open()
        problem = self._coverage_problem()
        if problem is not None:
            self.abort()
            raise CoverageError(
                f"{self._owner.url}: step {self.step}: {problem}; nothing was published",
                step=self.step,
            )
        try:
            shards = tuple(self._sealed_records(on_storage_error=PendingState.ABORTED))
        except StorageError:
            self._discard()  # a shard may not be durable: nothing can publish this attempt
            raise
        self._move(PendingState.SEALED)
        self._move(PendingState.PUBLISHING)
        try:
            checkpoint = self._owner.commit(self._manifest(shards))
        except (CheckpointExistsError, LineageError, StrayEntryError, InvalidInputError):
            # certain: nothing
            # was published
            self._move(PendingState.FAILED)
            self._discard()
            raise
        except BaseException:
            self._move(PendingState.FAILED)
            raise
        self.checkpoint = checkpoint
        self._move(PendingState.PUBLISHED)
        self._owner.published(checkpoint)
        return checkpoint

    def _manifest(self, shards: tuple[ShardRecord, ...]) -> Manifest:
        """This attempt's manifest, of its sealed ``shards``, stamped by its store now."""
        write_s = time.perf_counter() - self.started_perf
        stamp = self._owner.stamp()
        return Manifest(
            step=self.step,
            attempt=self.attempt,
            shards=shards,
            writer=self.writer,
            created_at=datetime.fromtimestamp(self.started, timezone.utc),
            committed_at=stamp.committed_at,
            timings={"write_s": write_s, **self.timings},
            metadata=self.metadata,
            backend=stamp.backend,
            epoch=stamp.epoch,
            source=self.source,
        )

    def abort(self) -> None:
        """Give up on this attempt and remove what it staged (GC removes anything left)."""
        if self._state is PendingState.OPEN:
            self._move(PendingState.ABORTED)
            self._discard()

    def _discard(self) -> None:
        self._owner.abort()

    def __enter__(self) -> PendingCheckpoint:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        if exc_type is None:
            if self._state is PendingState.OPEN:
                self.publish()
        elif self._state is PendingState.OPEN:
            self.abort()


def save_shards(pending: PendingCheckpoint, shards: Mapping[str, ShardData]) -> Checkpoint:
    """Write every shard into ``pending`` and publish it; on any error nothing is published."""
    with pending:
        for name, data in shards.items():
            pending.write(name, data)
    assert pending.checkpoint is not None
    return pending.checkpoint


def _whole_shard(data: object, view: memoryview | None) -> ShardBytes | None:
    """The bytes of a shard known whole before it is written (a buffer, a list or tuple of
    buffers such as a snapshot's chunks, ShardBytes), or None for a file or a stream."""
    if isinstance(data, ShardBytes):
        return data
    if view is not None:
        return ShardBytes([view])
    if isinstance(data, (list, tuple)) and all(_is_buffer(item) for item in data):
        return ShardBytes([_as_view(item) for item in data])
    return None


def _is_buffer(data: object) -> bool:
    try:
        memoryview(data)  # type: ignore[arg-type]
    except TypeError:
        return False
    return True
