"""Publish by creating the manifest object only if absent (``If-None-Match: *``).

Layout under the store's prefix (docs/protocol.md §3)::

    LATEST                               hint: the newest published step, moved by If-Match CAS
    manifests/step-<020d>.json           the commit point: created at most once per step
    step-<020d>.<attempt>/<shard name>   data of one attempt, at keys no other attempt uses

Shards are uploaded whole (one put) or in parts (multipart, invisible until completed) under
the attempt's own prefix, so a failed or concurrent attempt can never overwrite data that a
published manifest references. The manifest put is the single atomic, exclusive operation; an
outcome left unknown by a timeout or a refused retry of our own put is resolved by reading the
manifest back and comparing attempt ids (I8).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from datetime import timezone
from typing import Any, BinaryIO, ClassVar, TypeVar

from ckptstore import names
from ckptstore.checksum import crc32c_hex
from ckptstore.commit.base import (
    CommitStrategy,
    FileId,
    GcItem,
    GcReport,
    ShardProblem,
    ShardRanges,
    ShardSink,
    clock_lead,
)
from ckptstore.commit.blob_leases import BLOBS, LIVE, BlobLeases, BlobName, User
from ckptstore.digest import default_algorithm
from ckptstore.driver import (
    Buffer,
    Capability,
    ClosableDriver,
    IdentifiedStorage,
    ObjectInfo,
    ObjectStoreDriver,
    PartInfo,
    PutMode,
    RangedReadDriver,
    UploadInfo,
    UploadProgress,
)
from ckptstore.errors import (
    CapabilityError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    EpochExistsError,
    IntegrityError,
    InvalidInputError,
    InvalidOptionError,
    InvalidShardNameError,
    ManifestCorruptError,
    ObjectNotFoundError,
    PreconditionFailedError,
    PreconditionInferredError,
    ShardCorruptError,
    ShardMissingError,
    StorageAccessDeniedError,
    StorageError,
    StrayEntryError,
    TransientStorageError,
)
from ckptstore.hint import MAX_HINT_BYTES, parse_hint, report_lagging_listing
from ckptstore.lineage import Epoch
from ckptstore.manifest import MAX_MANIFEST_BYTES, Manifest, ShardRecord
from ckptstore.shardbytes import ShardBytes

__all__ = ["ConditionalPutCommit", "ObjectShardSink"]

log = logging.getLogger(__name__)

MANIFESTS = "manifests/"
EPOCHS = "epochs/"
PROBE_PREFIX = ".ckptstore-probe-"
LATEST_KEY = "LATEST"
_MiB = 1024 * 1024
DEFAULT_PART_SIZE = 8 * _MiB
DEFAULT_READ_RANGE_SIZE = 16 * _MiB
"""Bytes per ranged GET of a large shard read in parallel (rounded to whole blocks): large
enough that a request's latency is small beside its transfer, small enough to spread a shard
over ``read_concurrency`` connections."""
PARTS_PER_TIER = 1000
PUBLISH_TRIES = 5
CAS_TRIES = 16
PROBE_TRIES = 4
"""Tries of each request of the conditional-create probe (its key is fresh: safe to retry)."""
PART_TRIES = 4
"""Tries of one multipart part, each a driver call with its own retries: a part is idempotent
(the same part number and bytes, under the attempt's own key), so a transient failure that
outlasted the driver's retries is tried again rather than failing the save."""
GC_WAS_HERE = (
    "Only garbage collection deletes an unpublished attempt's data: GC took it as dead because "
    "it wrote nothing for longer than GC's grace period (default 1 h; `ckptstore gc --grace`, "
    "`Store.gc(grace=...)`), as measured on the storage's clock"
)
T = TypeVar("T")
_UNREADABLE = "<unreadable>"

_host_clock: Callable[[], float] = time.time
"""This host's clock; GC compares it with the caller's clock only (tests patch it)."""


def _unsupported(exc: StorageError) -> bool:
    """The storage does not implement the operation (501 NotImplemented): no retry helps."""
    return exc.http_status == 501 or "NotImplemented" in str(exc)


def _backoff(attempt: int) -> None:
    time.sleep(min(1.0, 0.05 * 2**attempt) * (0.5 + random.random()))


def _before_next_probe_try(attempt: int, exc: TransientStorageError) -> None:
    """Back off before the probe's next try of a request; the last try's error is raised."""
    if attempt == PROBE_TRIES - 1:
        raise exc
    _backoff(attempt)


class _ConditionalCreateChecks:
    """Which storage (driver type, endpoint, bucket) this process has probed, and the outcome.

    A writer verifies conditional create before its first publish, once per process and
    bucket. A refusal is remembered (every later save then fails as fast) only when two
    probes, each on a fresh key, both saw the storage ignore the condition: a verdict from one
    observation (a damaged answer, a race) is never cached for the process.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._locks: dict[tuple[str, str, str], threading.Lock] = {}
        self.outcomes: dict[tuple[str, str, str], CapabilityError | None] = {}

    def ensure(self, driver: ObjectStoreDriver, probe: Callable[[], None]) -> None:
        """Run ``probe`` unless it already passed for this storage; re-raise its refusal."""
        identity = _storage_identity(driver)
        with self._lock:
            lock = self._locks.setdefault(identity, threading.Lock())
        with lock:  # concurrent first saves of one process probe once
            if identity not in self.outcomes:
                try:
                    probe()
                except _IgnoredCondition as first:
                    try:
                        probe()  # a second observation, on a fresh key
                    except _IgnoredCondition as second:
                        self.outcomes[identity] = second
                    else:
                        raise CapabilityError(
                            f"{first} (a second probe saw the condition honoured: this save is "
                            f"refused, and the next one probes again)"
                        ) from first
                except CapabilityError as exc:  # the server answered 501: it says so itself
                    self.outcomes[identity] = exc
                else:
                    self.outcomes[identity] = None
            refusal = self.outcomes[identity]
        if refusal is not None:
            raise CapabilityError(str(refusal))


class _IgnoredCondition(CapabilityError):
    """One probe saw the storage let a second conditional create through."""


def _probe_body(number: int) -> bytes:
    """The body of the probe's ``number``-th create, with its own CRC32C: a read-back that
    was damaged in transit is told from another body."""
    text = f"ckptstore-probe {number}"
    return f"{text} crc32c={crc32c_hex(text.encode())}".encode()


def _probe_intact(data: bytes) -> bool:
    """Whether ``data`` is a probe body whose checksum matches."""
    text, _, crc = data.decode("ascii", "replace").rpartition(" crc32c=")
    return bool(text) and crc == crc32c_hex(text.encode())


def _intact_manifest(step: int, epoch: int) -> Callable[[bytes], bool]:
    """Whether bytes read back are an intact manifest of (``step``, ``epoch``)."""

    def intact(data: bytes) -> bool:
        try:
            Manifest.decode(data, where="read back", expected_step=step, expected_epoch=epoch)
        except IntegrityError:
            return False
        return True

    return intact


def _intact_epoch(epoch: int) -> Callable[[bytes], bool]:
    """Whether bytes read back are an intact record of ``epoch``."""

    def intact(data: bytes) -> bool:
        try:
            Epoch.decode(data, where="read back", expected=epoch)
        except IntegrityError:
            return False
        return True

    return intact


def _blob_locator_problem(record: ShardRecord) -> str | None:
    """What is wrong with a shared shard's locator (None: the key of its blob's generation,
    of the shard's size)."""
    locator = record.locator
    try:
        blob = BlobName.parse(locator["blob"])
        generation = names.check_attempt_id(locator.get("generation", ""))
    except (ValueError, InvalidShardNameError):
        return "a malformed blob locator"
    if blob.size != record.size:
        return f"a blob of {blob.size} bytes for a shard of {record.size}, in the locator"
    if locator.get("key") != blob.generation_key(generation):
        return "a foreign locator"
    return None


def _manifest_entry(key: str) -> list[tuple[int, int]]:
    """The (step, epoch) a manifest key names, if it names one."""
    name = key[len(MANIFESTS) :]
    entry = names.parse_checkpoint_token(name[: -len(".json")]) if name.endswith(".json") else None
    return [] if entry is None else [entry]


def _storage_identity(driver: ObjectStoreDriver) -> tuple[str, str, str]:
    """The storage a driver writes to: its type, and its endpoint and bucket if it declares
    them (``IdentifiedStorage``), else its URL."""
    kind = f"{type(driver).__module__}.{type(driver).__qualname__}"
    if isinstance(driver, IdentifiedStorage):
        endpoint, bucket = driver.storage_identity
        return kind, endpoint, bucket
    return kind, "", driver.url


_CONDITIONAL_CREATE = _ConditionalCreateChecks()
_CAS_REFUSALS: set[str] = set()
_CAS_REFUSALS_LOCK = threading.Lock()


def part_size_for(part_number: int, base: int) -> int:
    """Part size for part ``part_number``: doubles every 1000 parts, so 10,000 parts hold 5 TiB.

    The total size of a streamed shard is not known in advance; growing the parts lets a shard
    of any size up to 10,000 x base x 512 fit in S3's 10,000-part limit.
    """
    return int(base * 2 ** ((part_number - 1) // PARTS_PER_TIER))


class ObjectShardSink(ShardSink):
    """Buffers a shard into parts: one put if it fits in one part, else a multipart upload.

    With ``executor``, up to ``in_flight`` parts upload concurrently; each holds its own copy
    of its bytes, so memory stays bounded by ``in_flight`` parts whatever the shard's size.
    ``metadata`` is stored with the object (the versioned layout names the attempt there).
    """

    def __init__(
        self,
        driver: ObjectStoreDriver,
        key: str,
        part_size: int,
        size_hint: int | None,
        executor: ThreadPoolExecutor | None,
        in_flight: int,
        metadata: Mapping[str, str] | None = None,
    ) -> None:
        self._driver = driver
        self._key = key
        self._metadata = metadata
        self._base = part_size
        needed = -(-size_hint // driver.max_parts) if size_hint is not None else 0
        if needed > part_size:  # known size: fixed parts that fit the part-count limit
            # Rounded to whole MiB only when grown: a part size the caller chose (4 KiB on a
            # test store) is kept, or a small shard would never take a multipart upload.
            self._base = -(-needed // _MiB) * _MiB
        self._fixed = size_hint is not None
        self._buffer = bytearray()
        self._upload_id: str | None = None
        self._parts: list[PartInfo] = []
        self._pending: deque[Future[PartInfo]] = deque()
        self._executor = executor
        self._in_flight = max(1, in_flight)
        self._next_number = 1

    def _next_part_size(self) -> int:
        return self._base if self._fixed else part_size_for(self._next_number, self._base)

    def write(self, data: memoryview) -> None:
        view = data.cast("B") if data.format != "B" else data
        while view.nbytes:
            target = self._next_part_size()
            if not self._buffer and self._upload_id is not None and view.nbytes > target:
                self._upload(view[:target])  # a whole part straight from the caller's buffer
                view = view[target:]
                continue
            room = target - len(self._buffer)
            self._buffer += view[:room]
            view = view[room:]
            if view.nbytes:  # the buffer is full and more follows: it is not the last part
                self._upload(memoryview(self._buffer))
                self._buffer = bytearray()

    def _upload(self, part: memoryview) -> None:
        if self._upload_id is None:
            if self._metadata:
                self._upload_id = self._driver.create_multipart(self._key, metadata=self._metadata)
            else:
                self._upload_id = self._driver.create_multipart(self._key)
        number = self._next_number
        if number > self._driver.max_parts:
            raise StorageError(f"{self._key}: more than {self._driver.max_parts} parts")
        self._next_number += 1
        upload_id = self._upload_id
        if self._executor is None:
            with self._gone_means_collected():
                self._parts.append(self._upload_part(upload_id, number, part))
            return
        while len(self._pending) >= self._in_flight:
            with self._gone_means_collected():
                self._parts.append(self._pending.popleft().result())
        body = bytes(part)  # the caller may reuse its buffer once write() returns
        self._pending.append(self._executor.submit(self._upload_part, upload_id, number, body))

    def _upload_part(self, upload_id: str, number: int, part: Buffer) -> PartInfo:
        """Upload one part, tried again after a transient failure (a reset, a timeout, a 503)
        that outlasted the driver's own retries: sending the same part number with the same
        bytes again replaces the part, whether or not the broken call took effect. Only where
        parts are separate objects (``Capability.MULTIPART``): an fsspec stream appends, and
        a retried write could repeat bytes."""
        tries = PART_TRIES if Capability.MULTIPART in self._driver.capabilities else 1
        for attempt in range(tries):
            try:
                return self._driver.upload_part(self._key, upload_id, number, part)
            except TransientStorageError as exc:
                if attempt == tries - 1:
                    raise
                log.info("%s part %d: %s; uploading the part again", self._key, number, exc)
                _backoff(attempt)
        raise AssertionError("unreachable")  # tries >= 1

    def _drain(self) -> None:
        while self._pending:
            with self._gone_means_collected():
                self._parts.append(self._pending.popleft().result())

    @contextlib.contextmanager
    def _gone_means_collected(self) -> Iterator[None]:
        """Say who removed an upload that vanished under its writer ("No such upload" does not).

        Nothing but GC (or an operator) aborts another process's upload: a writer whose upload
        is gone was idle for longer than GC's grace period.
        """
        try:
            yield
        except ObjectNotFoundError as exc:
            raise ObjectNotFoundError(
                errno.ENOENT,
                f"{self._driver.url}/{self._key}: the multipart upload {self._upload_id} was "
                f"removed by garbage collection; nothing of this attempt can be published. "
                f"{GC_WAS_HERE} ({exc})",
            ) from exc

    def close(self) -> Mapping[str, str]:
        if self._upload_id is None:
            body = bytes(self._buffer)
            if self._metadata:
                info = self._driver.put(self._key, body, metadata=self._metadata)
            else:
                info = self._driver.put(self._key, body)
        else:
            if self._buffer or self._next_number == 1:
                self._upload(memoryview(self._buffer))
            self._drain()
            parts = sorted(self._parts, key=lambda p: p.part_number)
            with self._gone_means_collected():
                info = self._driver.complete_multipart(self._key, self._upload_id, parts)
            self._upload_id = None
        self._buffer = bytearray()
        locator = {"key": self._key, "etag": info.etag}
        if info.version_id is not None:
            locator["version_id"] = info.version_id
        return locator

    def abort(self) -> None:
        self._buffer = bytearray()
        for future in self._pending:
            future.cancel()
        for future in self._pending:
            try:
                future.result()
            except Exception:  # the upload is being abandoned anyway
                log.debug("part upload of %s failed during abort", self._key, exc_info=True)
        self._pending.clear()
        if self._upload_id is not None:
            upload_id, self._upload_id = self._upload_id, None
            try:
                self._driver.abort_multipart(self._key, upload_id)
            except StorageError:
                log.debug("aborting upload of %s failed; GC will", self._key, exc_info=True)


class ConditionalPutCommit(CommitStrategy[ObjectStoreDriver]):
    """The object-store protocol: attempt-unique data keys, manifest created if absent."""

    name = "conditional-put"
    required_capabilities = frozenset({Capability.CONDITIONAL_CREATE})
    keeps_lineages = True
    fixed_names = frozenset({LATEST_KEY})
    leases_blobs: ClassVar[bool] = True
    """Incremental saves share blobs under leases where the storage does compare-and-swap."""

    def __init__(
        self,
        driver: ObjectStoreDriver,
        *,
        part_size: int = DEFAULT_PART_SIZE,
        concurrency: int = 1,
        verify_conditional_writes: bool = True,
        read_concurrency: int | None = None,
        read_range_size: int = DEFAULT_READ_RANGE_SIZE,
    ) -> None:
        if part_size < driver.min_part_size:
            raise InvalidOptionError(
                f"part_size {part_size} is below the storage's minimum part size "
                f"{driver.min_part_size}"
            )
        if concurrency < 1:
            raise InvalidOptionError(f"concurrency must be at least 1, got {concurrency}")
        read_concurrency = concurrency if read_concurrency is None else read_concurrency
        if read_concurrency < 1 or read_range_size < 1:
            raise InvalidOptionError(
                f"read_concurrency and read_range_size must be at least 1, got "
                f"{read_concurrency} and {read_range_size}"
            )
        super().__init__(driver)
        self.part_size = part_size
        self.concurrency = concurrency
        self.read_concurrency = read_concurrency
        """Ranged reads of one large shard at once (drivers with ``read_range``)."""
        self.read_range_size = read_range_size
        self.verify_conditional_writes = verify_conditional_writes
        """Probe conditional create before a writer's first publish (the conformance suite
        turns this off, to measure and report storage that ckptstore would refuse)."""
        self._executor: ThreadPoolExecutor | None = None
        self._executor_lock = threading.Lock()
        self._blobs = (
            BlobLeases(
                driver,
                self._open_blob_sink,
                remove=self._blob_remover(),
                hidden=self._lease_hidden(),
            )
            if self.leases_blobs and Capability.COMPARE_AND_SWAP in driver.capabilities
            else None
        )

    def _blob_remover(self) -> Callable[[str, str | None], None] | None:
        """How the blob area deletes an object (None: a plain DELETE)."""
        return None

    def _lease_hidden(self) -> Callable[[str], bool] | None:
        """How the blob area tells a lease hidden from one absent (None: it cannot)."""
        return None

    def _open_blob_sink(self, key: str, size: int) -> ShardSink:
        return ObjectShardSink(
            self.driver, key, self.part_size, size, self.parts_executor(), self.concurrency
        )

    def parts_executor(self) -> ThreadPoolExecutor | None:
        """The threads that upload parts concurrently (None: one at a time), for shard sinks;
        started on first use, stopped by ``close``."""
        if self.concurrency == 1:
            return None
        with self._executor_lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(
                    self.concurrency, thread_name_prefix="ckptstore-parts"
                )
            return self._executor

    def settings(self) -> dict[str, Any]:
        return {
            "part_size": self.part_size,
            "concurrency": self.concurrency,
            "verify_conditional_writes": self.verify_conditional_writes,
            "read_concurrency": self.read_concurrency,
            "read_range_size": self.read_range_size,
        }

    def close(self) -> None:
        """Wait for part uploads under way, stop the upload threads, then close the driver
        (``ClosableDriver``: its threads, its hold on a shared client's connections)."""
        with self._executor_lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)
        if isinstance(self.driver, ClosableDriver):
            self.driver.close()

    def open_root(self, *, create: bool) -> None:
        """Check the bucket is there; writes nothing (read-only credentials can open).

        Conditional create is verified lazily, before the first save (``begin``/``publish``).
        """
        self.driver.check_bucket()

    def ensure_conditional_create(self) -> None:
        """Refuse to publish on storage that ignores If-None-Match (I5): probed once per
        process and bucket, before the first save; a reader never probes."""
        if self.verify_conditional_writes:
            _CONDITIONAL_CREATE.ensure(self.driver, self._verify_conditional_create)

    def _verify_conditional_create(self) -> None:
        """Refuse storage that ignores If-None-Match on PutObject: publishing would not be
        exclusive there (I5). Four small requests on a fresh key, each retried on a transient
        error, and every version of the probe object deleted after."""
        key = f"{PROBE_PREFIX}{names.new_attempt_id()}"
        versions: set[str] = set()
        try:
            self._probe_create(key, versions)
            if self._probe_second_create(key, versions):
                raise _IgnoredCondition(
                    f"{self.url}: the storage ignored If-None-Match: * on PutObject (conditional "
                    f"create). ckptstore publishes a checkpoint by creating its manifest only if "
                    f"absent; without it two writers could overwrite each other's checkpoints. "
                    f"Use storage with conditional writes (AWS S3, recent MinIO, SeaweedFS, ...)"
                )
        finally:
            self._delete_probe(key, versions)

    def _probe_create(self, key: str, versions: set[str]) -> None:
        """Create the probe object, whose key is fresh: a try whose answer was lost is found."""
        body = _probe_body(1)
        for attempt in range(PROBE_TRIES):
            try:
                self._probe_put(key, body, versions)
            except PreconditionFailedError:
                if self._read_probe(key, versions) != body:  # fresh key: only a try of ours
                    raise
                return
            except TransientStorageError as exc:
                _before_next_probe_try(attempt, exc)
                continue
            return

    def _probe_second_create(self, key: str, versions: set[str]) -> bool:
        """Create the probe key again: True if the storage let it through (it must refuse).

        Only the server's own answer decides: a 412 it sent, or a success. A refusal a driver
        inferred by reading the key back after a broken call (``PreconditionInferredError``)
        would be the same on storage ignoring If-None-Match, so it is tried again like a
        transient error; without any answer, TransientStorageError (no verdict is cached).
        """
        for attempt in range(PROBE_TRIES):
            try:
                self._probe_put(key, _probe_body(2), versions)
            except PreconditionInferredError as exc:
                if attempt == PROBE_TRIES - 1:
                    raise TransientStorageError(
                        errno.EAGAIN,
                        f"{self.url}: the conditional-create probe got no answer from the "
                        f"storage itself in {PROBE_TRIES} tries ({exc}); try again",
                        url=self.url,
                    ) from exc
                _backoff(attempt)
                continue
            except PreconditionFailedError:
                break
            except TransientStorageError as exc:
                _before_next_probe_try(attempt, exc)
                continue
            return True
        # A lost answer may hide an overwrite: what the key holds decides, once it is read
        # intact (each body carries its own checksum).
        return self._read_probe(key, versions) != _probe_body(1)

    def _read_probe(self, key: str, versions: set[str]) -> bytes:
        """The probe object's body, read until it passes its own checksum: a bit flipped in
        transit is read again, never taken for another body (TransientStorageError, and no
        verdict, if no read is intact)."""
        for attempt in range(PROBE_TRIES):
            try:
                data, info = self.driver.get(key)
            except TransientStorageError as exc:
                _before_next_probe_try(attempt, exc)
                continue
            if info.version_id:
                versions.add(info.version_id)
            if _probe_intact(data):
                return data
            log.info("%s: the probe %s read back damaged (%r); reading it again",
                     self.url, key, data[:64])  # fmt: skip
            if attempt < PROBE_TRIES - 1:
                _backoff(attempt)
        raise TransientStorageError(
            errno.EIO,
            f"{self.url}: the conditional-create probe read back damaged {PROBE_TRIES} times "
            f"(its checksum did not match): the storage or the network alters what it returns; "
            f"nothing was decided, try again",
            url=self.url,
        )

    def _probe_put(self, key: str, body: bytes, versions: set[str]) -> None:
        """Create the probe key with ``body``, adding the version it made to ``versions``."""
        try:
            info = self.driver.put(key, body, mode=PutMode.CREATE)
        except PreconditionFailedError:
            raise
        except StorageError as exc:
            if not _unsupported(exc):
                raise
            raise CapabilityError(
                f"{self.url}: the storage does not implement If-None-Match: * on PutObject "
                f"(conditional create): {exc}. ckptstore publishes a checkpoint by creating its "
                f"manifest only if absent; it cannot publish safely there",
                url=self.url,
            ) from exc
        if info.version_id:
            versions.add(info.version_id)

    def _delete_probe(self, key: str, versions: set[str]) -> None:
        """Delete every version of the probe object (a plain DELETE would leave versions)."""
        try:
            if not versions:
                self.driver.delete(key)
                return
            listed = {v.version_id for v in self.driver.list_versions(key) if v.key == key}
            for version_id in sorted(versions | {v for v in listed if v}):
                self.driver.delete(key, version_id=version_id)
        except StorageError as exc:  # a probe left behind is GC's ("probe", after the grace)
            log.warning("%s: could not delete the probe %s: %s", self.url, key, exc)

    # -- writing -------------------------------------------------------------------------

    @staticmethod
    def attempt_prefix(step: int, attempt: str) -> str:
        """The key prefix (ending in '/') under which an attempt writes its shards."""
        return f"{names.step_token(step)}.{attempt}/"

    @staticmethod
    def manifest_key(step: int, epoch: int = 0) -> str:
        """The key of a step's manifest in ``epoch``; its existence is the commit."""
        return f"{MANIFESTS}{names.checkpoint_token(step, epoch)}.json"

    def begin(self, step: int, attempt: str) -> None:
        # Attempt-unique keys need no preparation; a store that cannot publish safely refuses
        # here, before a single shard is written.
        self.ensure_conditional_create()

    def open_shard(
        self, step: int, attempt: str, name: str, size_hint: int | None = None
    ) -> ShardSink:
        key = f"{self.attempt_prefix(step, attempt)}{name}"
        return ObjectShardSink(
            self.driver, key, self.part_size, size_hint, self.parts_executor(), self.concurrency
        )

    # -- incremental saves: blobs shared under leases (docs/protocol.md §12.3) ------------

    @property
    def shares_shards(self) -> bool:
        return self._blobs is not None

    @property
    def sharing_digest(self) -> str | None:
        return default_algorithm() if self._blobs is not None else None

    def share_shard(
        self,
        step: int,
        attempt: str,
        name: str,
        crc32c: str,
        size: int,
        data: ShardBytes,
        digest: str | None = None,
    ) -> Mapping[str, str] | None:
        """The blob of ``data``'s digest, shared by appending the attempt to its lease (its
        bytes uploaded first if no generation holds them, §12.3): its locator, or None."""
        if self._blobs is None or digest is None:
            return None
        algorithm, _, hexdigest = digest.partition(":")
        return self._blobs.share(step, attempt, BlobName(algorithm, hexdigest, size), data)

    def saved_incrementally(self) -> bool:
        if self._blobs is None:
            return False
        try:
            return next(iter(self.driver.list(BLOBS)), None) is not None
        except StorageError:
            return False

    def shard_files(self, manifest: Manifest) -> dict[str, FileId]:
        return {record.name: ("object", record.locator["key"]) for record in manifest.shards}

    def publish(self, manifest: Manifest) -> None:
        self.ensure_conditional_create()
        self._check_sealed(manifest)
        self._check_blobs_held(manifest)
        key = self.manifest_key(manifest.step, manifest.epoch)
        body = manifest.encode()
        for _ in range(PUBLISH_TRIES):
            try:
                self.driver.put(key, body, mode=PutMode.CREATE)
            except PreconditionFailedError:
                owner = self._published_attempt(manifest.step, manifest.epoch)
                if owner == manifest.attempt:
                    return  # an earlier try of ours took effect (I8)
                raise self._exists(manifest, owner) from None
            except TransientStorageError:
                owner = self._published_attempt(manifest.step, manifest.epoch)
                if owner == manifest.attempt:
                    return
                if owner is not None:
                    raise self._exists(manifest, owner) from None
                log.warning("publishing %s: outcome unknown, not published; trying again", key)
            else:
                self._confirm_created(
                    key,
                    body,
                    _intact_manifest(manifest.step, manifest.epoch),
                    self._exists(manifest, None),
                )
                if self._blobs is not None:
                    self._blobs.forget(manifest.step, manifest.attempt)
                return
        raise TransientStorageError(
            f"{self.url}: could not publish step {manifest.step} after {PUBLISH_TRIES} tries; "
            f"nothing was published",
            url=self.url,
            step=manifest.step,
        )

    def _check_sealed(self, manifest: Manifest) -> None:
        """Every shard the manifest lists is stored, complete, at its locator: else no publish.

        Each object the attempt wrote is asked directly (HEAD, by version where pinned), never
        a listing: a listing may lag behind the very writes it would have to confirm.
        """
        problems = self._written_problems(manifest)
        if not problems:
            return
        listed = "; ".join(map(str, problems[:5])) + (
            f" (+{len(problems) - 5} more)" if len(problems) > 5 else ""
        )
        if all(problem.missing for problem in problems):
            began = manifest.created_at.astimezone(timezone.utc).isoformat(timespec="seconds")
            raise ShardMissingError(
                f"{self.url}: step {manifest.step} cannot be published: attempt "
                f"{manifest.attempt} was removed by garbage collection ({listed}); nothing was "
                f"published. {GC_WAS_HERE}; this attempt began at {began}. Save again, with a GC "
                f"grace period longer than a save's longest pause",
                url=self.url,
                step=manifest.step,
            )
        raise ShardMissingError(
            f"{self.url}: step {manifest.step} cannot be published: {listed}; nothing was "
            f"published",
            url=self.url,
            step=manifest.step,
        )

    def _check_blobs_held(self, manifest: Manifest) -> None:
        """Every blob the manifest shares still lists this attempt in its lease, at the
        generation named (§12.3 writer step 5): else GC judged the attempt dead, and
        nothing is published."""
        shared = [record.locator for record in manifest.shards if "blob" in record.locator]
        if not shared or self._blobs is None:
            return
        problems = self._blobs.held_problems(
            manifest.step, manifest.attempt, shared, self.parts_executor()
        )
        if problems:
            texts = [text for text, _ in problems]
            listed = "; ".join(texts[:5]) + (f" (+{len(texts) - 5} more)" if len(texts) > 5 else "")
            why = (
                f"{GC_WAS_HERE}. Save again, with a GC grace period longer than a save's "
                f"longest pause"
                if any(by_gc for _, by_gc in problems)
                else "the blobs' leases do not vouch for them (changed or damaged behind the "
                "store's back?); save again"
            )
            raise ShardMissingError(
                f"{self.url}: step {manifest.step} cannot be published: {listed}; nothing was "
                f"published. {why}",
                url=self.url,
                step=manifest.step,
            )

    def _written_problems(self, manifest: Manifest) -> list[ShardProblem]:
        """What is wrong with the shards of ``manifest``, asked of each object (concurrently)."""
        records: Sequence[ShardRecord] = manifest.shards
        executor = self.parts_executor()
        if executor is None or len(records) < 2:
            found = [self._stored_problem(record) for record in records]
        else:
            found = list(executor.map(self._stored_problem, records))
        return [problem for problem in found if problem is not None]

    def _stored_problem(self, record: ShardRecord) -> ShardProblem | None:
        """What is wrong with one shard's object (None: present, with the recorded size)."""
        try:
            info = self.driver.head(
                record.locator["key"], version_id=record.locator.get("version_id")
            )
        except ObjectNotFoundError:
            return ShardProblem(record.name, missing=True)
        if info.size != record.size:
            return ShardProblem(record.name, False, info.size, record.size)
        return None

    def _check_still_published(self, manifest: Manifest) -> None:
        """Raise CheckpointNotFoundError if ``manifest`` is no longer the published one.

        Unpublishing deletes the manifest before the data: shards missing under a checkpoint
        whose manifest is gone are a race with a deletion, not damage.
        """
        owner = self._published_attempt(manifest.step, manifest.epoch)
        if owner is None:
            raise CheckpointNotFoundError(
                f"{self.url}: step {manifest.step} was unpublished while it was being read",
                url=self.url,
                step=manifest.step,
            )
        if owner not in (manifest.attempt, _UNREADABLE):
            raise CheckpointNotFoundError(
                f"{self.url}: step {manifest.step} was deleted and published again (attempt "
                f"{owner}) while it was being read",
                url=self.url,
                step=manifest.step,
            )

    def _confirm_created(
        self, key: str, body: bytes, intact: Callable[[bytes], bool], lost: Exception
    ) -> None:
        """Read back what a conditional create answered with success just made: it must hold
        ``body``, or this writer did not win (``lost`` is raised, after a warning that names
        the storage's non-atomic create). A gateway that checks, then writes (If-None-Match
        not atomic across its nodes) lets two creators both succeed, the later one
        overwriting. One GET per manifest or epoch record; it cannot catch a rival whose
        overwrite lands after it (such storage is unsafe, docs/protocol.md §2).

        Other bytes decide only once read ``intact`` (their own checksum): a bit flipped in
        transit is read again. A key found gone was deleted since (a delete, a rollback), not
        lost; where no read can be made at all, the create stands as the storage answered it.
        """
        damaged = 0
        for attempt in range(PUBLISH_TRIES):
            try:
                stored, _ = self.driver.get(key)
            except ObjectNotFoundError:
                log.debug("%s: %s was deleted right after it was created", self.url, key)
                return
            except TransientStorageError as exc:
                if attempt == PUBLISH_TRIES - 1 and not damaged:
                    log.warning("%s: %s was created, and could not be read back to confirm "
                                "it: %s", self.url, key, exc)  # fmt: skip
                    return
                _backoff(attempt)
                continue
            if stored == body:
                return
            if intact(stored):
                held = "another writer's bytes"
                break
            damaged += 1
            log.info("%s: %s read back damaged; reading it again", self.url, key)
            _backoff(attempt)
        else:
            held = f"bytes that are not this writer's ({damaged} damaged reads)"
        message = (
            f"{self.url}: the storage answered this writer's conditional create of {key} "
            f"(If-None-Match: *) with success, but the object holds {held}: the storage's "
            f"conditional create is not atomic (a gateway that checks, then writes), and this "
            f"writer did not win. {lost}"
        )
        log.warning("%s", message)
        raise type(lost)(message) from None

    def _epoch_exists(self, epoch: int) -> EpochExistsError:
        return EpochExistsError(f"{self.url}: epoch {epoch} exists already", url=self.url)

    def _exists(
        self, manifest: Manifest, owner: str | None
    ) -> CheckpointExistsError | StrayEntryError:
        """The error for a manifest key found taken by ``owner`` (``_published_attempt``)."""
        if owner == _UNREADABLE:
            return self.name_taken(manifest.step, manifest.epoch)
        return CheckpointExistsError(
            f"{self.url}: step {manifest.step} is already published; the existing checkpoint "
            f"was left intact",
            url=self.url,
            step=manifest.step,
        )

    def name_taken(self, step: int, epoch: int = 0) -> CheckpointExistsError | StrayEntryError:
        """An object at the manifest's key that is not a manifest, read twice (a GET may be
        damaged in transit), is a stray no save could publish beside: named for removal."""
        key = self.manifest_key(step, epoch)
        if all(self._published_attempt(step, epoch) == _UNREADABLE for _ in range(2)):
            return StrayEntryError.in_the_way(
                f"{self.url}/{key}", step, "the object there is not a manifest"
            )
        return CheckpointExistsError(
            f"{self.url}: step {step} is already published; the existing checkpoint was left "
            f"intact",
            url=self.url,
            step=step,
        )

    def _published_attempt(self, step: int, epoch: int = 0) -> str | None:
        try:
            data, _ = self.driver.get(self.manifest_key(step, epoch))
        except ObjectNotFoundError:
            return None
        try:
            return Manifest.decode(data, where=self.manifest_key(step, epoch)).attempt
        except IntegrityError:
            return _UNREADABLE

    def abort(self, step: int, attempt: str) -> None:
        prefix = self.attempt_prefix(step, attempt)
        for upload in self.incomplete_uploads(prefix):
            self.driver.abort_multipart(upload.key, upload.upload_id)
        for info in list(self.driver.list(prefix)):
            self.driver.delete(info.key)

    def incomplete_uploads(self, prefix: str, report: GcReport | None = None) -> list[UploadInfo]:
        """The incomplete multipart uploads under ``prefix``; none where the storage does not
        implement ListMultipartUploads (noted in ``report``, with the remedy)."""
        try:
            return list(self.driver.list_multipart_uploads(prefix))
        except StorageError as exc:
            if not _unsupported(exc):
                raise
            log.debug("%s: ListMultipartUploads is not implemented: %s", self.url, exc)
            if report is not None and "ListMultipartUploads" not in report.missing_operations:
                report.missing_operations.append("ListMultipartUploads")
                report.warnings.append(
                    f"the storage does not implement ListMultipartUploads ({exc}): incomplete "
                    f"multipart uploads of dead attempts were not looked for, and their parts "
                    f"still take space. Install a lifecycle rule that aborts them (`ckptstore "
                    f"lifecycle {self.url}`, or the storage's own equivalent); everything else "
                    f"was collected"
                )
            return []

    # -- reading -------------------------------------------------------------------------

    def published_steps(self, min_step: int = 0) -> list[int]:
        return [step for step, epoch in self.published_checkpoints(min_step) if epoch == 0]

    def published_checkpoints(self, min_step: int = 0) -> list[tuple[int, int]]:
        start_after = None
        if min_step > 0:  # "step-<N>.epoch-..." sorts before "step-<N>.json": both skipped
            start_after = f"{MANIFESTS}{names.step_token(min_step - 1)}.json"
        found = []
        for info in self.driver.list(MANIFESTS, start_after=start_after):
            name = info.key[len(MANIFESTS) :]
            if name.endswith(".json"):
                entry = names.parse_checkpoint_token(name[: -len(".json")])
                if entry is not None and entry[0] >= min_step:
                    found.append(entry)
        return sorted(found)

    def is_published(self, step: int, epoch: int = 0) -> bool:
        try:
            self.driver.head(self.manifest_key(step, epoch))
        except ObjectNotFoundError:
            return False
        return True

    def read_manifest(self, step: int, epoch: int = 0) -> Manifest:
        key = self.manifest_key(step, epoch)
        try:
            with self.driver.open_read(key) as stream:  # one request, bounded in memory
                data = stream.read(MAX_MANIFEST_BYTES + 1)
        except ObjectNotFoundError as exc:
            raise CheckpointNotFoundError(
                f"{self.url}: no published checkpoint at step {step}", url=self.url, step=step
            ) from exc
        manifest = Manifest.decode(
            data, where=f"{self.url}/{key}", expected_step=step, expected_epoch=epoch
        )
        for record in manifest.shards:
            problem = self._locator_problem(manifest, record)
            if problem:
                raise ManifestCorruptError(
                    f"{self.url}/{key}: shard {record.name!r} has {problem} "
                    f"{dict(record.locator)!r}",
                    url=self.url,
                    key=record.name,
                )
        return manifest

    def _locator_problem(self, manifest: Manifest, record: ShardRecord) -> str | None:
        """What is wrong with where ``record`` points (None: where this layout writes it): a
        manifest that points elsewhere, at another step's data or any key of the bucket, is
        refused as corrupt."""
        if "blob" in record.locator:
            return _blob_locator_problem(record)
        prefix = self.attempt_prefix(manifest.step, manifest.attempt)
        if record.locator.get("key") != f"{prefix}{record.name}":
            return "a foreign locator"
        return None

    def open_shard_reader(self, manifest: Manifest, record: ShardRecord) -> BinaryIO:
        key = record.locator["key"]
        try:
            return self.driver.open_read(key, version_id=record.locator.get("version_id"))
        except ObjectNotFoundError as exc:
            raise self._shard_missing(manifest, record, key) from exc

    def _shard_missing(
        self, manifest: Manifest, record: ShardRecord, key: str
    ) -> ShardMissingError:
        """The error for a published shard whose object ``key`` is not found."""
        return self.shard_error(ShardMissingError, manifest, record, f"is missing ({key})")

    def open_shard_ranges(self, manifest: Manifest, record: ShardRecord) -> ShardRanges | None:
        """The shard's object pinned by its ETag (and version, if recorded) from one HEAD;
        None if the driver reads no ranges or the storage gives no ETag to pin by."""
        if not isinstance(self.driver, RangedReadDriver):
            return None
        read_range = self.driver.read_range
        key, version = record.locator["key"], record.locator.get("version_id")
        try:
            info = self.driver.head(key, version_id=version)
        except ObjectNotFoundError as exc:
            raise self._shard_missing(manifest, record, key) from exc
        if not info.etag and not version:
            return None  # nothing pins the ranges to one object: one stream it is
        etag = info.etag or None

        def read(offset: int, view: memoryview) -> None:
            try:
                read_range(key, offset, view, version_id=version, if_match=etag)
            except PreconditionFailedError as exc:
                problem = (
                    f"was replaced while being read (its ETag is no longer {etag}); nothing "
                    f"of the new object was used"
                )
                raise self.shard_error(ShardCorruptError, manifest, record, problem) from exc

        return ShardRanges(info.size, read, self.read_concurrency, self.read_range_size)

    def shard_problems(self, manifest: Manifest) -> list[ShardProblem]:
        """One listing of the attempt; what it does not show as recorded is asked of the object
        itself (a listing may lag or end early). CheckpointNotFoundError, not a problem, when
        the checkpoint was unpublished meanwhile."""
        prefix = self.attempt_prefix(manifest.step, manifest.attempt)
        stored: dict[str, ObjectInfo] = {i.key: i for i in self.driver.list(prefix)}
        problems: list[ShardProblem] = []
        for record in manifest.shards:
            info = stored.get(f"{prefix}{record.name}")
            if info is not None and info.size == record.size:
                continue
            problem = self._stored_problem(record)
            if problem is not None:
                problems.append(problem)
        if problems:
            self._check_still_published(manifest)
        return problems

    # -- LATEST hint ---------------------------------------------------------------------

    def _read_latest(self) -> tuple[int | None, str | None]:
        """The hint's step (None if absent or unreadable) and its etag, for a CAS."""
        where = f"{self.url}/{LATEST_KEY}"
        try:
            data, info = self.driver.get(LATEST_KEY)
        except ObjectNotFoundError:
            return None, None
        return parse_hint(data[:MAX_HINT_BYTES], where=where), info.etag

    def read_latest_hint(self) -> int | None:
        return self._read_latest()[0]

    def advance_latest_hint(self, step: int) -> None:
        """Move the hint forward by compare-and-swap (If-Match), never backward, never blindly.

        Losing to another writer re-reads and tries again. A storage that refuses the
        conditional write itself (501 NotImplemented, a 400 for the header, a 412 although
        the ETag has not changed) is not contention: the hint is left as it is, with a warning
        that says what the storage answered. Readers list past the hint either way. A driver
        that does not declare compare-and-swap (fsspec+) gets a forward-only plain overwrite.
        """
        body = f"{step}\n".encode("ascii")
        if Capability.COMPARE_AND_SWAP not in self.capabilities:
            self._overwrite_latest(step, body)
            return
        transient_left = 3
        for _ in range(CAS_TRIES):
            current, etag = self._read_latest()
            if current is not None and current >= step:
                return
            try:
                if etag is None:
                    self.driver.put(LATEST_KEY, body, mode=PutMode.CREATE)
                else:
                    self.driver.put(LATEST_KEY, body, mode=PutMode.update(etag))
                return
            except PreconditionFailedError as exc:
                if etag is not None and self._read_latest()[1] == etag:
                    self._cas_refused(step, f"412 on the unchanged ETag {etag} ({exc})")
                    return
                continue  # another writer moved it: re-read, and only move forward
            except ObjectNotFoundError:
                continue  # removed meanwhile (a rollback, a delete): re-read
            except StorageError as exc:
                if isinstance(exc, TransientStorageError) and not _unsupported(exc):
                    transient_left -= 1
                    if transient_left >= 0:
                        _backoff(2 - transient_left)
                        continue  # re-read: a lost answer may have moved it already
                    raise
                self._cas_refused(step, str(exc))
                return
        log.warning(
            "%s: LATEST hint not advanced to %d: other writers moved it %d times meanwhile "
            "(contended); readers list past it",
            self.url,
            step,
            CAS_TRIES,
        )

    def _overwrite_latest(self, step: int, body: bytes) -> None:
        """Move the hint forward by a plain overwrite, on storage without compare-and-swap.

        Written only when what was read is older than ``step`` (a step this writer has
        published): the hint never names an unpublished step, and never goes back before what
        was there when racing publishes began, but two writers of different steps at the same
        instant may leave it at the older one, as on a file system. Readers list past the hint
        (I4): it only saves a listing.
        """
        for attempt in range(3):
            current = self._read_latest()[0]
            if current is not None and current >= step:
                return
            try:
                self.driver.put(LATEST_KEY, body)
                return
            except TransientStorageError:
                if attempt == 2:
                    raise
                _backoff(attempt)  # re-read: a lost answer may have moved it already

    def _cas_refused(self, step: int, answer: str) -> None:
        """Say, once per store and then quietly, that the storage refused the hint's CAS."""
        with _CAS_REFUSALS_LOCK:
            first = self.url not in _CAS_REFUSALS
            _CAS_REFUSALS.add(self.url)
        log.log(
            logging.WARNING if first else logging.DEBUG,
            "%s: LATEST hint not advanced to %d: the storage refused the conditional write "
            "itself, which is not contention; it answered: %s. It does not support "
            "compare-and-swap on PutObject (If-Match), so the hint stays where it is; readers "
            "list past it (the hint only saves a listing)",
            self.url,
            step,
            answer,
        )

    def reset_latest_hint(self, step: int | None) -> None:
        if step is None:
            self.driver.delete(LATEST_KEY)
        else:
            self.driver.put(LATEST_KEY, f"{step}\n".encode("ascii"))

    # -- removal -------------------------------------------------------------------------

    def unpublish(self, step: int, epoch: int = 0) -> None:
        try:
            attempt: str | None = self.read_manifest(step, epoch).attempt
        except IntegrityError:
            attempt = None  # its data is unreferenced once the manifest is gone: GC removes it
        self.driver.delete(self.manifest_key(step, epoch))
        if attempt is not None:
            for info in list(self.driver.list(self.attempt_prefix(step, attempt))):
                self.driver.delete(info.key)

    def collect_garbage(self, *, grace_s: float, now: float, dry_run: bool) -> GcReport:
        """Remove attempts that no manifest references and that have been idle for longer than
        ``grace_s`` by the storage's clock, and stale probes; never a published checkpoint's
        data, whatever a listing says.

        Ages are measured on the storage's own clock: a marker object written at the start
        gives the storage's "now", and an attempt's age is that minus the newest LastModified
        of its objects and its uploads' parts, all stamped by the storage. Skew tolerated: any
        offset of the GC host's clock (and of the writers'); what must hold is that the
        storage's clock does not jump forward, nor its nodes' clocks differ, by more than the
        grace period minus a live save's longest pause (S3's LastModified has one-second
        resolution: ages are accurate to about a second). ``now`` is the caller's clock: only
        how far it runs ahead of this host's clock is added (none with the default clock;
        tests move an injected clock forward to age leftovers).

        Listings only say what to look at: before an attempt is judged, its step's manifest is
        read directly; the attempt it names, or every attempt of a step whose manifest is
        unreadable, is left alone. A listing that lags or ends early can leave garbage behind,
        never remove published data.
        """
        report = GcReport(dry_run=dry_run, grace_s=grace_s)
        storage_now = self._storage_now(now, report)
        hint = self._hint_before_listing()
        groups: dict[str, list[ObjectInfo]] = {}
        manifests: set[tuple[int, int]] = set()
        for info in self.driver.list(""):
            if info.key.startswith(MANIFESTS):
                manifests.update(_manifest_entry(info.key))
                continue
            if info.key == LATEST_KEY:
                continue
            if info.key.startswith(PROBE_PREFIX):  # left by a writer that died while probing
                self._collect_probe(report, info, storage_now)
                continue
            head = info.key.split("/", 1)[0] + "/"
            groups.setdefault(head, []).append(info)
        uploads: dict[str, list[UploadInfo]] = {}
        for upload in self.incomplete_uploads("", report):
            uploads.setdefault(upload.key.split("/", 1)[0] + "/", []).append(upload)
        self._check_listing(hint, manifests, report)
        owners: dict[int, set[str | None]] = {}
        epochs: list[int] = []

        def published(step: int, attempt: str) -> bool:
            """Read directly, in every epoch: a listing of manifests may miss it."""
            if step not in owners:
                if not epochs:
                    epochs.extend(self.epoch_numbers())
                owners[step] = {self._published_attempt(step, epoch) for epoch in epochs}
            return bool(owners[step] & {attempt, _UNREADABLE})

        items: dict[str, GcItem] = {}
        markers = {  # liveness markers of attempts that share blobs (§12.3)
            info.key: info.last_modified
            for info in groups.get(BLOBS, [])
            if info.key.startswith(LIVE)
        }
        for prefix in sorted(set(groups) | set(uploads)):
            parsed = names.parse_attempt_name(prefix.removesuffix("/"), ".")  # what an attempt made
            if parsed is None or published(*parsed):
                continue
            objects, pending = groups.get(prefix, []), uploads.get(prefix, [])
            item = items[prefix] = self._attempt_item(prefix, objects, pending, storage_now)
            marker = markers.get(f"{LIVE}{prefix.removesuffix('/')}")
            if marker is not None and storage_now - marker < item.age_s:  # sharing blobs
                item = items[prefix] = replace(item, age_s=max(0.0, storage_now - marker))
            if item.age_s <= grace_s:
                report.kept_young.append(item)
                continue
            report.removed.append(item)
            if not dry_run:
                for upload in pending:
                    self._abort_quietly(upload.key, upload.upload_id)
                for info in objects:
                    self.driver.delete(info.key)
        if BLOBS in groups:
            self._collect_blob_area(report, storage_now, items, epochs)
        return report

    def _collect_blob_area(
        self, report: GcReport, now: float, items: Mapping[str, GcItem], epochs: list[int]
    ) -> None:
        """GC of the blob area (§12.3): ``now`` on the storage's clock; ``items``: this
        pass's attempts (their newest writes say whether they are alive); ``epochs``: the
        epochs known to the pass (grown as new ones are found)."""
        if self._blobs is None:
            return

        def user_published(user: User) -> bool:
            """Read afresh for each judgement, after the lease read that named the user
            (never from this pass's earlier reads: a user may have published since), in
            every epoch, one created since the pass began included."""
            if not epochs:
                epochs.extend(self.epoch_numbers())
            while self.read_epoch(epochs[-1] + 1) is not None:
                epochs.append(epochs[-1] + 1)
            return any(
                self._published_attempt(user.step, epoch) in (user.attempt, _UNREADABLE)
                for epoch in epochs
            )

        self._blobs.collect(
            report,
            now=now,
            published=user_published,
            last_activity=lambda user: self._last_activity(user, items, now),
        )

    def _last_activity(self, user: User, items: Mapping[str, GcItem], now: float) -> float | None:
        """When a user of a blob last wrote, on the storage's clock: its liveness marker, read
        directly, or the newest object of its attempt this pass listed (None: neither)."""
        newest = None
        item = items.get(self.attempt_prefix(user.step, user.attempt))
        if item is not None:
            newest = now - item.age_s
        assert self._blobs is not None
        try:
            marker = self.driver.head(self._blobs.live_key(user.step, user.attempt))
        except ObjectNotFoundError:
            return newest
        return max(marker.last_modified, newest or marker.last_modified)

    def _hint_before_listing(self) -> int | None:
        """The LATEST hint, read before a listing it is to cross-check (None if unreadable)."""
        try:
            return self.read_latest_hint()
        except (StorageError, InvalidInputError):
            return None

    def _check_listing(
        self, hint: int | None, listed: set[tuple[int, int]], report: GcReport
    ) -> bool:
        """Cross-check a listing of manifests (``listed``, (step, epoch)) against the LATEST
        hint read before it: False, with a warning in ``report``, if the hinted step's
        manifest is there when read directly but the listing did not show it (it lags or was
        cut short: nothing may be deleted on its word)."""
        if hint is None or any(step == hint for step, _ in listed):
            return True
        if not any(self.is_published(hint, epoch) for epoch in self.epoch_numbers()):
            return True  # deleted since the hint was read: the listing may be right
        report_lagging_listing(self.url, hint, "the LATEST hint")
        report.warnings.append(
            f"the listing of manifests did not show step {hint}, which the LATEST hint names "
            f"and whose manifest a direct read found: this storage's listings lag or end "
            f"early. Nothing was deleted on such a listing's word: every removal was first "
            f"confirmed by reading manifests directly"
        )
        return False

    # -- lineages (docs/protocol.md §8.1) ------------------------------------------------

    @staticmethod
    def epoch_key(epoch: int) -> str:
        """The key of an epoch's record; created if absent, never changed."""
        return f"{EPOCHS}{names.epoch_token(epoch)}.json"

    def create_epoch(self, epoch: int, record: bytes) -> None:
        self.ensure_conditional_create()
        key = self.epoch_key(epoch)
        for _ in range(PUBLISH_TRIES):
            try:
                self.driver.put(key, record, mode=PutMode.CREATE)
            except PreconditionFailedError:
                if self.read_epoch(epoch) == record:
                    return  # an earlier try of ours took effect (I8)
                raise EpochExistsError(
                    f"{self.url}: epoch {epoch} exists already", url=self.url
                ) from None
            except TransientStorageError:
                stored = self.read_epoch(epoch)
                if stored == record:
                    return
                if stored is not None:
                    raise EpochExistsError(
                        f"{self.url}: epoch {epoch} exists already", url=self.url
                    ) from None
                log.warning("creating %s: outcome unknown, not created; trying again", key)
            else:
                self._confirm_created(key, record, _intact_epoch(epoch), self._epoch_exists(epoch))
                return
        raise TransientStorageError(
            f"{self.url}: could not create epoch {epoch} after {PUBLISH_TRIES} tries", url=self.url
        )

    def read_epoch(self, epoch: int) -> bytes | None:
        try:
            data, _ = self.driver.get(self.epoch_key(epoch))
        except ObjectNotFoundError:
            return None
        return data

    def listed_epochs(self) -> list[int]:
        found = []
        for info in self.driver.list(EPOCHS):
            name = info.key[len(EPOCHS) :]
            if name.endswith(".json"):
                epoch = names.parse_epoch_token(name[: -len(".json")])
                if epoch is not None:
                    found.append(epoch)
        return sorted(found)

    def epoch_numbers(self) -> list[int]:
        """Every epoch a manifest can name: 0, then each record a listing shows and each next
        number read directly until one is missing (a listing may lag)."""
        newest = max(self.listed_epochs(), default=0)
        while self.read_epoch(newest + 1) is not None:
            newest += 1
        return list(range(newest + 1))

    def _storage_now(self, now: float, report: GcReport) -> float:
        """The storage's clock now: the LastModified of a marker object written for the purpose
        (and deleted), plus how far the caller's clock ``now`` runs ahead of this host's."""
        ahead = clock_lead(now, _host_clock())  # a caller's clock behind this host's: none
        key = f"{PROBE_PREFIX}clock-{names.new_attempt_id()}"
        try:
            written = self.driver.put(key, b"")
        except StorageAccessDeniedError as exc:
            if not report.dry_run:
                raise
            report.warnings.append(
                f"could not write GC's clock marker ({exc}): ages were measured by this host's "
                f"clock, which may differ from the storage's"
            )
            return now
        try:
            stamp = self.driver.head(key, version_id=written.version_id).last_modified
        finally:
            self._delete_probe(key, {written.version_id} if written.version_id else set())
        return stamp + ahead

    def _attempt_item(
        self, prefix: str, objects: list[ObjectInfo], pending: list[UploadInfo], now: float
    ) -> GcItem:
        """An attempt as GC reports it: its age by its newest write, and every byte it holds."""
        newest = max([info.last_modified for info in objects], default=0.0)
        size = sum(info.size for info in objects)
        for upload in pending:  # parts uploaded lately keep an attempt alive; their bytes count
            progress = self._upload_progress(upload)
            newest = max(newest, upload.initiated, progress.last_activity)
            size += progress.size
        return GcItem(kind="attempt", name=prefix, age_s=max(0.0, now - newest), size=size)

    def _collect_probe(self, report: GcReport, info: ObjectInfo, now: float) -> None:
        item = GcItem("probe", info.key, max(0.0, now - info.last_modified), info.size)
        if item.age_s <= report.grace_s:
            report.kept_young.append(item)
            return
        report.removed.append(item)
        if not report.dry_run:
            self.driver.delete(info.key)

    def _upload_progress(self, upload: UploadInfo) -> UploadProgress:
        try:
            return self.driver.upload_progress(upload)
        except ObjectNotFoundError:
            return UploadProgress(upload.initiated, 0, 0)  # completed or aborted meanwhile

    def _abort_quietly(self, key: str, upload_id: str) -> None:
        try:
            self.driver.abort_multipart(key, upload_id)
        except ObjectNotFoundError:
            return  # completed or aborted meanwhile

    def _no_uploads(self) -> bool:
        return not self.incomplete_uploads("")

    def is_empty(self) -> bool:
        return next(iter(self.driver.list("")), None) is None and self._no_uploads()
