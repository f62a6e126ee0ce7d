"""The base of the object-store drivers: everything but what an SDK makes different.

A driver on an object store's SDK subclasses ``ObjectStoreBase`` and writes the calls its SDK
makes (a put, a ranged get, a listing page, a multipart completion); the base carries, once:

- the settings every driver takes (``DriverSettings``), and keys under the store's prefix
  (``full``, ``relative``);
- the retry policy (``ckptstore.backends.retry_policy``), and the one place where a conditional
  create whose answer was lost is resolved by reading the key back (``resolve_create``, I8): a
  conditional write is never retried blindly, a compare-and-swap in doubt is sent once and
  surfaces as ``IndeterminateOutcomeError`` for the protocol to read back;
- error translation through the driver's table of rules (``ckptstore.backends.error_table``);
- listings page by page, each page retried on its own;
- whole-object reads that start again when the object is replaced between two reads, and
  reads pinned to one object that fail as ``ObjectReplacedError`` when it is (``pinned_read``);
- what a driver holds (reader threads, a lease on a shared client), released by ``close``.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import logging
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, ClassVar, TypedDict, TypeVar

from ckptstore.backends.error_table import Rules, naming, translating
from ckptstore.backends.retry_policy import bucket_check_policy, retry_policy
from ckptstore.driver import (
    Buffer,
    Capability,
    ObjectInfo,
    ObjectStoreDriver,
    PartInfo,
    PutMode,
    multipart_mode,
)
from ckptstore.errors import (
    ObjectNotFoundError,
    PreconditionFailedError,
    PreconditionInferredError,
    StorageError,
    StoreNotFoundError,
    TransientStorageError,
)

__all__ = [
    "S3_LIKE",
    "DriverSettings",
    "Holder",
    "ObjectReplacedError",
    "ObjectStoreBase",
    "PutRequest",
    "pinned_read",
]

log = logging.getLogger(__name__)
T = TypeVar("T")
R = TypeVar("R")


S3_LIKE = frozenset(
    {
        Capability.CONDITIONAL_CREATE,
        Capability.COMPARE_AND_SWAP,
        Capability.MULTIPART,
        Capability.STRONG_LIST_AFTER_WRITE,
    }
)
"""What an object store with S3's conditional writes offers: creates and compare-and-swaps that
either take effect or are refused, multipart uploads, listings that show every completed write."""


class ObjectReplacedError(ObjectNotFoundError):
    """The object was replaced or deleted while being read: the bytes being read are gone."""


@contextlib.contextmanager
def pinned_read(where: str, offset: int) -> Iterator[None]:
    """A read pinned to one object (its ETag, generation or version) from byte ``offset``: a
    refusal of the pin (PreconditionFailedError) or a missing object becomes
    ``ObjectReplacedError``, so that two objects' bytes are never spliced."""
    try:
        yield
    except (PreconditionFailedError, ObjectNotFoundError) as exc:
        raise ObjectReplacedError(
            errno.ESTALE,
            f"{where}: the object was replaced or deleted while being read (at byte {offset})",
        ) from exc


class Holder(enum.Enum):
    """Who holds a key, as a read-back after a conditional create in doubt finds it."""

    NOBODY = "nobody"
    """Nothing is there: the create did not take effect and is safe to send again."""
    ANOTHER_WRITER = "another writer"
    """Something that is not ours is there: another writer created it first."""


@dataclass(frozen=True)
class PutRequest:
    """One put as the driver's SDK sends it: ``what`` names it in errors and logs, ``send``
    makes the one request and returns what the store says of the object."""

    what: str
    send: Callable[[], ObjectInfo]


class DriverSettings(TypedDict, total=False):
    """The settings every object-store driver takes as keywords and hands to
    ``ObjectStoreBase`` unchanged (its ``__init__`` gives their meanings and defaults)."""

    url: str | None
    min_part_size: int
    checksums: bool
    max_attempts: int
    max_delay_s: float | None
    max_wait_s: float
    read_concurrency: int


class ObjectStoreBase(ObjectStoreDriver):
    """Object-store primitives under one bucket (container) and key prefix; a subclass adds
    its SDK's calls (see the module's docstring for what the base does)."""

    scheme: ClassVar[str] = ""
    """The URL scheme, for messages (``s3``)."""
    rules: ClassVar[Rules] = ()
    """How the SDK's exceptions become ckptstore's (``ckptstore.backends.error_table``)."""
    store_noun: ClassVar[str] = "bucket"
    store_hint: ClassVar[str] = "create it, or check the name and endpoint"
    """What to check when the bucket is missing."""
    refusal_status: ClassVar[int] = 412
    """The status of the storage's refusal of a conditional create."""
    reader_threads: ClassVar[str] = "ckptstore-read"
    """The name of the threads that read ahead (``executor``)."""
    parts_in_order: ClassVar[bool] = False
    """Its multipart uploads take their parts one after another, by number (a stream): only
    ``upload_part`` of the next part is accepted."""
    pages_listings: ClassVar[bool] = True
    """Its listings honour ``list_page_size`` (False: the client library pages them itself,
    in pages of its own size, and the suite's pagination probe cannot make a page small)."""
    reads_back_creates: ClassVar[bool] = True
    """A create whose outcome is unknown is resolved here by reading back (``resolve_create``);
    False: it is sent once, and its IndeterminateOutcomeError left to the protocol (I8)."""

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint: str = "",
        url: str | None = None,
        min_part_size: int = 1,
        checksums: bool = True,
        max_attempts: int = 6,
        max_delay_s: float | None = 60.0,
        max_wait_s: float = 5.0,
        read_concurrency: int = 8,
    ) -> None:
        """``url``: the store's, for messages (default: ``scheme://bucket/prefix``);
        ``min_part_size``: of every multipart part but the last; ``checksums``: send each
        upload's checksum for the storage to check; ``max_attempts``, ``max_delay_s``,
        ``max_wait_s``: the retry policy's; ``read_concurrency``: the threads that read ahead."""
        self.bucket_name = bucket
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        self.url = url or f"{self.scheme}://{bucket}/{self.prefix}".rstrip("/")
        self.min_part_size = min_part_size
        self.checksums = checksums
        self.max_attempts = max_attempts
        self.read_concurrency = max(1, read_concurrency)
        self.list_page_size: int | None = None
        """The entries one listing request asks for (None: the storage's default, 1000 on
        S3): the conformance suite's pagination probe makes it small, so that a listing of a
        few keys takes several pages."""
        self.storage_identity = (endpoint, bucket)
        """Which storage this is, whatever the prefix (``ckptstore.driver.IdentifiedStorage``)."""
        self._retrying = retry_policy(
            max_attempts, max_delay_s=max_delay_s, max_wait_s=max_wait_s, name=self.scheme
        )
        self.raw_conditionals = False
        """Send each conditional put, and a conditional completion, as one request and return
        what the server answered: no read-back, no workaround. For measuring the server (the
        conformance probes); never for saving."""
        self._executor: ThreadPoolExecutor | None = None
        self._on_close: list[Callable[[], None]] = []
        self._executor_lock = threading.Lock()

    # -- keys ----------------------------------------------------------------------------

    def full(self, key: str) -> str:
        """The storage's name of ``key``: under the prefix."""
        return self.prefix + key

    def relative(self, full: str) -> str:
        """The key of a storage name under the prefix."""
        return full[len(self.prefix) :]

    # -- calls: translated, retried ------------------------------------------------------

    def where(self) -> str:
        """The storage, as errors name it."""
        return f"{self.scheme}://{self.bucket_name}"

    def once(self, what: str, call: Callable[[], T], *, key: str | None = None) -> T:
        """``call()`` once, its errors translated (naming ``what``, the bucket, the store's
        URL and the object's ``key`` if it has one)."""
        with (
            naming(self.url, key),
            translating(self.rules, f"{what} {self.where()}", self.bucket_name),
        ):
            return call()

    def retried(self, what: str, call: Callable[[], T], *, key: str | None = None) -> T:
        """``call()`` retried on transient errors (an idempotent call only)."""
        result: T = self._retrying(self.once, what, call, key=key)
        return result

    def retrying(self, call: Callable[[], T]) -> T:
        """``call()`` (which translates its own errors) retried on transient errors."""
        result: T = self._retrying(call)
        return result

    def pages(
        self, what: str, fetch: Callable[[R | None], tuple[Iterable[T], R | None]]
    ) -> Iterator[T]:
        """Every item of a listing: ``fetch(marker)`` gives a page's items and the marker of
        the next page (None: the last). Each page request is retried on its own: an iterator
        that failed cannot be resumed, retrying it would end the listing early, and a short
        listing would mislead GC and discovery."""
        marker: R | None = None
        while True:
            items, following = self.retried(what, lambda at=marker: fetch(at))  # type: ignore[misc]
            yield from items
            if following is None:
                return
            if following == marker:
                raise StorageError(f"{self.url}: {what} repeats its continuation marker")
            marker = following

    # -- the driver interface ------------------------------------------------------------

    def probe_bucket(self) -> tuple[str, Callable[[], object]]:
        """The call that checks the bucket is there, and its name (the subclass's)."""
        raise NotImplementedError

    def check_bucket(self) -> None:
        what, call = self.probe_bucket()
        try:
            bucket_check_policy()(self.once, what, call)
        except ObjectNotFoundError as exc:  # some answer a bare 404, without a code
            noun = self.store_noun
            raise StoreNotFoundError(
                f"{self.url}: {noun} {self.bucket_name!r} does not exist (ckptstore never creates "
                f"{noun}s; {self.store_hint})"
            ) from exc

    def put_request(
        self, key: str, body: bytes, mode: PutMode, metadata: Mapping[str, str] | None
    ) -> PutRequest:
        """The one request that puts ``body`` at ``key`` as ``mode`` says (the subclass's)."""
        raise NotImplementedError

    def put(
        self,
        key: str,
        data: Buffer,
        *,
        mode: PutMode = PutMode.OVERWRITE,
        metadata: Mapping[str, str] | None = None,
    ) -> ObjectInfo:
        """A plain put retried; a create resolved by reading back; an update sent once (a CAS
        whose answer was lost surfaces as IndeterminateOutcomeError: the protocol reads back)."""
        body = bytes(data)
        request = self.put_request(key, body, mode, metadata)
        with naming(self.url, key):
            if mode.kind == "create" and self.reads_back_creates and not self.raw_conditionals:
                return self.resolve_create(
                    request.what, request.send, lambda: self.read_back(key, body)
                )
            if mode.conditional:
                return self.once(request.what, request.send)
            return self.retried(request.what, request.send)

    def resolve_create(
        self, what: str, send: Callable[[], T], read_back: Callable[[], T | Holder]
    ) -> T:
        """A conditional create (``send``) retried until its outcome is known (I8).

        After a transient failure, and after a refusal that follows one (our earlier try may
        be what is there), ``read_back`` says who holds the key: nobody, and the create is
        safe to send again; us, and it took effect; another writer, who created it first:
        ``PreconditionFailedError`` if the server refused this try, ``PreconditionInferredError``
        if it answered nothing (a storage ignoring the condition gets the same verdict: it must
        not pass for a refusal).
        """
        in_doubt = False

        def attempt() -> T:
            nonlocal in_doubt
            refused = False
            try:
                return self.once(what, send)
            except PreconditionFailedError:
                if not in_doubt:
                    raise
                refused = True
            except TransientStorageError as exc:
                in_doubt = True
                log.debug("%s: %s; reading back", what, exc)
            held = read_back()
            if held is Holder.NOBODY:  # a late copy of the lost create can only be refused
                raise TransientStorageError(errno.EAGAIN, f"{what}: not created; trying again")
            if held is Holder.ANOTHER_WRITER:
                if refused:
                    raise PreconditionFailedError(
                        f"{what}: another writer created it first", http_status=self.refusal_status
                    )
                raise PreconditionInferredError(
                    f"{what}: another writer created it first (read back; no refusal received)"
                )
            log.info("%s: the outcome of a broken call was read back: created", what)
            return held

        return self.retrying(attempt)

    def read_back(self, key: str, body: bytes) -> ObjectInfo | Holder:
        """Who holds ``key`` after a create of ``body`` in doubt, from its bytes. Identical
        bytes count as ours: callers create keys or contents unique to the writer (a fresh
        probe key, a manifest naming its attempt)."""
        try:
            stored, info = self.read_whole(key, None)
        except ObjectNotFoundError:
            return Holder.NOBODY
        return info if stored == body else Holder.ANOTHER_WRITER

    def read_whole(self, key: str, version_id: str | None) -> tuple[bytes, ObjectInfo]:
        """The whole object and its info, in one go (the subclass's)."""
        raise NotImplementedError

    def get(self, key: str, *, version_id: str | None = None) -> tuple[bytes, ObjectInfo]:
        """The whole object: the bytes are always one object's, read again whole if it was
        replaced between two reads (not a version: a version gone stays gone)."""
        for tries_left in reversed(range(self.max_attempts)):
            try:
                with naming(self.url, key):
                    return self.read_whole(key, version_id)
            except ObjectReplacedError:
                if not tries_left or version_id is not None:
                    raise
        raise AssertionError("unreachable")  # max_attempts >= 1

    def complete(
        self, key: str, upload_id: str, parts: Sequence[PartInfo], *, create: bool
    ) -> ObjectInfo:
        """Assemble the parts into ``key``; ``create``: only if it holds nothing (the
        subclass's)."""
        raise NotImplementedError

    def complete_multipart(
        self,
        key: str,
        upload_id: str,
        parts: Sequence[PartInfo],
        *,
        mode: PutMode = PutMode.OVERWRITE,
    ) -> ObjectInfo:
        with naming(self.url, key):
            return self.complete(
                key, upload_id, parts, create=multipart_mode(mode).kind == "create"
            )

    def bucket_versioning(self) -> str:
        """Never on, unless the subclass says otherwise."""
        return ""

    # -- what a driver holds -------------------------------------------------------------

    def executor(self) -> ThreadPoolExecutor:
        """The threads that read ahead for streams and run calls side by side (started on
        first use, stopped by ``close``)."""
        with self._executor_lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(
                    self.read_concurrency, thread_name_prefix=self.reader_threads
                )
            return self._executor

    def each(self, call: Callable[[Any], T], items: Sequence[Any]) -> Sequence[T]:
        """``call`` on every item, on the driver's threads when there are several; every
        call is waited for, and the first failure raised."""
        if len(items) < 2 or self.read_concurrency == 1:
            return [call(item) for item in items]
        futures = [self.executor().submit(call, item) for item in items]
        return [future.result() for future in futures]

    def on_close(self, release: Callable[[], None]) -> None:
        """Have ``close`` call ``release`` (a lease on a shared client, say)."""
        self._on_close.append(release)

    def close(self) -> None:
        """Release what the driver holds: its threads, its hold on its client's connections.

        The driver may be used again afterwards: it starts threads and connections afresh.
        """
        with self._executor_lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)
        releases, self._on_close = self._on_close, []
        for release in releases:
            release()
