"""Shared shards on an object store: a blob is deleted only after its lease was doomed by a
compare-and-swap from a state in which no user was published or alive (I10).

An object has no link count, and a listing may lag, so who uses a blob is written where GC
reads it directly: in the blob's *lease* (``blobs/<alg>/<digest>-<size>.lease``), a small
JSON object changed only by compare-and-swap (``If-Match`` on its ETag; ``If-None-Match: *``
to create it). The bytes live in ``blobs/<alg>/<digest>-<size>.g<generation>``; a generation
is a fresh unique id, named by the CAS that reserves it, and only after the one before was
doomed, so a generation that is not a lease's current one is never used again (not even
after a doomed lease is deleted: ids are never reused). A writer appends
itself (its step and attempt) to the lease before it names the blob in its manifest, and
checks at the seal that it is still there; GC dooms a lease only by a CAS from the state it
judged, each user by direct reads (its manifest; its attempt's liveness marker), never by a
listing. docs/protocol.md §12.3 has the proof.
"""

from __future__ import annotations

import json
import logging
import random
import re
import secrets
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

from ckptstore import names
from ckptstore.commit.base import GcItem, GcReport, ShardSink
from ckptstore.digest import BlockDigests
from ckptstore.driver import ObjectInfo, ObjectStoreDriver, PutMode, UploadInfo
from ckptstore.errors import (
    InvalidInputError,
    ObjectNotFoundError,
    PreconditionFailedError,
    StorageError,
    TransientStorageError,
)
from ckptstore.shardbytes import ShardBytes

__all__ = [
    "BLOBS",
    "BlobLeases",
    "BlobName",
    "Lease",
    "LeaseCorruptError",
    "User",
]

log = logging.getLogger(__name__)

BLOBS = "blobs/"
"""The key prefix of the blob area (leases, generations, liveness markers)."""
LIVE = f"{BLOBS}live/"
"""``LIVE + step-<N>.<attempt>``: written by an attempt that shares, again every
``ALIVE_EVERY_S`` while it shares; GC judges an unpublished user alive by its age."""
ALIVE_EVERY_S = 60.0
MAX_LEASE_BYTES = 1024 * 1024
MAX_USERS = 4096
"""A lease lists at most this many users (about 200 KiB): a writer that would make it longer
writes its shard unshared (a store that keeps thousands of checkpoints sharing one blob)."""
CAS_TRIES = 16
SHARE_WAIT_S = 120.0
"""How long, at most, a writer waits for another rank (or shard) of its own attempt to
finish uploading a blob that attempt reserved, before it writes its shard unshared. A
reservation of another attempt is never waited for."""
UPLOADING_EVERY_S = 10.0
"""A reserver writes its liveness marker again at least this often while it uploads."""
_UPLOAD_PIECE = 64 * 1024 * 1024
"""A reserver uploads a blob this much at a time, its marker refreshed in between."""
_LEASE_FORMAT = "ckptstore-blob-lease"
_BLOB = re.compile(r"(blake3|sha256):([0-9a-f]{64})-(0|[1-9][0-9]{0,18})", re.ASCII)
_KEY = re.compile(
    r"blobs/(blake3|sha256)/([0-9a-f]{64})-(0|[1-9][0-9]{0,18})(?:\.g([0-9a-z]{8,64})|(\.lease))",
    re.ASCII,
)


class LeaseCorruptError(StorageError):
    """A lease object that is not a lease ckptstore wrote: its blob is neither shared nor
    collected (left for an operator)."""


@dataclass(frozen=True, order=True)
class User:
    """An attempt that names (or is about to name) a blob in its manifest."""

    step: int
    attempt: str

    def encode(self) -> dict[str, object]:
        return {"step": self.step, "attempt": self.attempt}


@dataclass(frozen=True)
class BlobName:
    """A blob: its bytes' strong digest (``<alg>:<hex>``) and their size."""

    algorithm: str
    hexdigest: str
    size: int

    @classmethod
    def parse(cls, text: str) -> BlobName:
        """The blob ``<alg>:<hex>-<size>`` (ValueError if it is not one)."""
        found = _BLOB.fullmatch(text)
        if found is None:
            raise ValueError(f"not a blob name: {text!r}")
        return cls(found.group(1), found.group(2), int(found.group(3)))

    def __str__(self) -> str:
        return f"{self.algorithm}:{self.hexdigest}-{self.size}"

    @property
    def base(self) -> str:
        return f"{BLOBS}{self.algorithm}/{self.hexdigest}-{self.size}"

    @property
    def lease_key(self) -> str:
        return f"{self.base}.lease"

    def generation_key(self, generation: str) -> str:
        return f"{self.base}.g{generation}"


def parse_blob_key(key: str) -> tuple[BlobName, str | None] | None:
    """(blob, generation) of a generation's key, (blob, None) of a lease's, else None."""
    found = _KEY.fullmatch(key)
    if found is None:
        return None
    blob = BlobName(found.group(1), found.group(2), int(found.group(3)))
    return blob, (None if found.group(5) else found.group(4))


@dataclass(frozen=True)
class Lease:
    """Who uses a blob's current generation; ``doomed``: GC judged it unused and will delete
    it (a writer then reserves ``next``)."""

    generation: str
    doomed: bool
    users: tuple[User, ...]
    reserver: User | None = None
    """The user that reserved ``generation`` and uploads its bytes."""
    etag: str | None = None
    """The generation object's ETag as its reserver uploaded it (recorded at the reserver's
    seal): a writer shares the object only while it still has it (not replaced since)."""
    retired: bool = False
    """Doomed, and its generations deleted: nothing is ever reserved in it again; GC deletes
    it (only a retired lease is deleted, and only GC retires one, by CAS from doomed)."""
    serial: int = 0
    """Grows by one with every change (``BlobLeases._swap``): no change writes the bytes it
    replaces, so every change moves the ETag, even where an ETag is the content's MD5."""
    lineage: str | None = None
    """Drawn when the lease is created, kept by every change, and the first characters of
    every generation reserved in it: GC deletes an old generation only of its own lineage,
    never one a lost lease of the same blob reserved (a lease removed behind a writer that
    published with it, or deleted by hand), which a published checkpoint may still name.
    None in leases written before lineages: every generation is then taken as theirs."""

    def new_generation(self) -> str:
        """A new, unique generation id of this lease's lineage."""
        return f"{self.lineage or ''}{names.new_attempt_id()}"

    def owns(self, generation: str) -> bool:
        """Whether ``generation`` was reserved in this lease (of its lineage)."""
        return self.lineage is None or generation.startswith(self.lineage)

    def encode(self) -> bytes:
        body: dict[str, object] = {
            "format": _LEASE_FORMAT,
            "version": 1 if self.lineage is None else 2,  # code that knows no lineage: corrupt
            "generation": self.generation,
            "doomed": self.doomed,
            "users": [user.encode() for user in self.users],
            "serial": self.serial,
        }
        if self.reserver is not None:
            body["reserver"] = self.reserver.encode()
        if self.etag is not None:
            body["etag"] = self.etag
        if self.retired:
            body["retired"] = True
        if self.lineage is not None:
            body["lineage"] = self.lineage
        return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, data: bytes, where: str) -> Lease:
        """The lease ``data`` holds (LeaseCorruptError, naming ``where``, if it is not one)."""
        try:
            body = json.loads(data)
            if not isinstance(body, dict):
                raise ValueError("not a JSON object")
            if body.get("format") != _LEASE_FORMAT or body.get("version") not in (1, 2):
                raise ValueError("not a ckptstore blob lease of version 1 or 2")
            generation = names.check_attempt_id(body["generation"])
            if type(body["doomed"]) is not bool:
                raise ValueError("doomed must be a boolean")
            users = tuple(_user(entry) for entry in body["users"])
            reserver = _user(body["reserver"]) if "reserver" in body else None
            serial = body.get("serial", 0)
            if type(serial) is not int or serial < 0:
                raise ValueError(f"serial must be a non-negative integer: {serial!r}")
            etag = body.get("etag")
            if etag is not None and (type(etag) is not str or not etag):
                raise ValueError(f"etag must be a non-empty string: {etag!r}")
            retired = body.get("retired", False)
            if type(retired) is not bool or (retired and not body["doomed"]):
                raise ValueError("retired must be a boolean, and only a doomed lease retired")
            lineage = body.get("lineage")
            if body["version"] == 2 and (
                type(lineage) is not str or not _LINEAGE.fullmatch(lineage)
            ):
                raise ValueError(f"lineage must be {LINEAGE_LENGTH} hex digits: {lineage!r}")
            if body["version"] == 1 and lineage is not None:
                raise ValueError("a lease of version 1 has no lineage")
            if lineage is not None and not generation.startswith(lineage):
                raise ValueError(f"generation {generation!r} is not of lineage {lineage!r}")
        except (ValueError, TypeError, KeyError, AttributeError, RecursionError) as exc:
            raise LeaseCorruptError(f"{where}: not a blob lease: {exc}") from None
        return cls(generation, body["doomed"], users, reserver, etag, retired, serial, lineage)


LINEAGE_LENGTH = 8
_LINEAGE = re.compile(rf"[0-9a-f]{{{LINEAGE_LENGTH}}}", re.ASCII)


def new_lineage() -> str:
    """A fresh lineage for a lease created now: 8 hex digits (32 random bits; generation ids
    made before lineages start with base-36 milliseconds, never with 8 hex digits alone)."""
    return secrets.token_hex(LINEAGE_LENGTH // 2)


def _user(entry: Mapping[str, object]) -> User:
    step, attempt = entry["step"], entry["attempt"]
    if type(step) is not int or step < 0:
        raise ValueError(f"a user's step must be a non-negative integer: {step!r}")
    return User(step, names.check_attempt_id(attempt))


def _holds(user: User, generation: str) -> Callable[[Lease], bool]:
    """Whether a lease read back shows ``user`` holding ``generation`` (its CAS took)."""
    return lambda lease: lease.generation == generation and not lease.doomed and user in lease.users


def _dooms(generation: str) -> Callable[[Lease], bool]:
    """Whether a lease read back shows ``generation`` doomed (GC's CAS took)."""
    return lambda lease: lease.doomed and lease.generation == generation


def _backoff(attempt: int) -> None:
    """A short, jittered pause before a contended lease is read again."""
    time.sleep(min(0.25, 0.01 * 2**attempt) * (0.5 + random.random()))


class BlobLeases:
    """The blob area of one object store that does compare-and-swap (docs/protocol.md §12.3)."""

    def __init__(
        self,
        driver: ObjectStoreDriver,
        open_sink: Callable[[str, int], ShardSink],
        *,
        share_wait_s: float = SHARE_WAIT_S,
        remove: Callable[[str, str | None], None] | None = None,
        hidden: Callable[[str], bool] | None = None,
    ) -> None:
        """``open_sink(key, size)``: a sink that uploads a generation's bytes (whole or in
        parts) to ``key``. ``remove(key, etag)``: how an object of the area is deleted (by
        default a DELETE; on a versioned bucket, every version of the key, and a lease's only
        while its current version is still the one of ETag ``etag`` that GC wrote last).
        ``hidden(key)``: whether an absent lease is only hidden (a versioned bucket: a foreign
        DELETE's marker over its versions), which makes the lease damaged, not absent."""
        self.driver = driver
        self.open_sink = open_sink
        self._remove = remove
        self._hidden = hidden
        self.share_wait_s = share_wait_s
        self._alive: dict[tuple[int, str], float] = {}
        self._alive_lock = threading.Lock()
        self._uploading: dict[tuple[str, str], threading.Event] = {}
        """Generations this process is uploading now (by blob and generation), each with an
        event set when the upload ends, however it ends."""

    @property
    def url(self) -> str:
        return self.driver.url

    # -- writers -------------------------------------------------------------------------

    @staticmethod
    def live_key(step: int, attempt: str) -> str:
        return f"{LIVE}{names.step_token(step)}.{attempt}"

    def touch(self, step: int, attempt: str, every: float = ALIVE_EVERY_S) -> bool:
        """Write the attempt's liveness marker if this process has not in ``every`` seconds
        (whether it did): before any lease names the attempt, so that GC, reading the lease,
        finds it alive; more often while it uploads a blob it reserved."""
        now = time.monotonic()
        with self._alive_lock:
            last = self._alive.get((step, attempt))
            if last is not None and now - last < every:
                return False
            self._alive[(step, attempt)] = now
        try:
            self.driver.put(self.live_key(step, attempt), b"")
        except BaseException:
            with self._alive_lock:
                self._alive.pop((step, attempt), None)
            raise
        return True

    def forget(self, step: int, attempt: str) -> None:
        """Stop keeping the attempt's marker fresh (published or abandoned)."""
        with self._alive_lock:
            self._alive.pop((step, attempt), None)

    def read(self, blob: BlobName) -> tuple[Lease | None, str | None]:
        """The blob's lease and its ETag; (None, None) if it has none."""
        try:
            size = self.driver.head(blob.lease_key).size  # never download a planted giant
            if size > MAX_LEASE_BYTES:
                raise LeaseCorruptError(
                    f"{self.url}/{blob.lease_key}: not a blob lease: {size} bytes, more than a "
                    f"lease can hold"
                )
            data, info = self.driver.get(blob.lease_key)
        except ObjectNotFoundError:
            if self._hidden is not None and self._hidden(blob.lease_key):
                raise LeaseCorruptError(
                    f"{self.url}/{blob.lease_key}: the lease is hidden by a delete marker (a "
                    f"DELETE that ckptstore did not make), its versions kept"
                ) from None
            return None, None
        if len(data) > MAX_LEASE_BYTES:
            raise LeaseCorruptError(f"{self.url}/{blob.lease_key}: larger than a lease can be")
        return Lease.decode(data, f"{self.url}/{blob.lease_key}"), info.etag

    def _swap(
        self, blob: BlobName, new: Lease, etag: str | None, took: Callable[[Lease], bool]
    ) -> bool:
        """CAS the lease from ``etag`` (None: create it) to ``new``: whether it took effect.
        An unknown outcome (a timeout, a reset) is decided by reading the lease back: ``took``
        says whether what is stored is this change (I8)."""
        mode = PutMode.CREATE if etag is None else PutMode.update(etag)
        new = replace(new, serial=new.serial + 1)
        try:
            self.driver.put(blob.lease_key, new.encode(), mode=mode)
        except (PreconditionFailedError, ObjectNotFoundError):
            return False
        except TransientStorageError as exc:
            log.info("%s: lease %s: %s; reading it back", self.url, blob.lease_key, exc)
            try:
                stored, _ = self.read(blob)
            except StorageError:
                return False
            return stored is not None and took(stored)
        return True

    def share(
        self, step: int, attempt: str, blob: BlobName, data: ShardBytes
    ) -> Mapping[str, str] | None:
        """Name ``blob`` (whose bytes are ``data``) in attempt ``attempt`` of ``step``: the
        locator of its current generation, appended to by this attempt, uploading the bytes
        first if no generation holds them; None where it could not be shared (a contended,
        full, retired or corrupt lease, another attempt's upload not finished): then write
        the shard.

        A writer appends itself only to a generation whose bytes it has seen (a HEAD of the
        blob's size and of the ETag its reserver recorded, after the lease read whose ETag
        its CAS names): a doom between the two fails the CAS, and no lease lists a user of
        bytes that never came."""
        self.touch(step, attempt)
        me = User(step, attempt)
        refused = contended = 0
        while contended < CAS_TRIES:
            try:
                lease, etag = self.read(blob)
            except LeaseCorruptError as exc:
                log.warning("%s; the shard is written unshared", exc)
                return None
            if lease is None and refused >= 2:  # 412s to creating an object that is absent
                log.warning(
                    "%s: creating lease %s was refused (412) although no lease exists: the "
                    "storage does not honour If-None-Match; the shard is written unshared",
                    self.url, blob.lease_key,
                )  # fmt: skip
                return None
            if lease is not None and lease.retired:
                log.info("%s: lease %s is being removed: not shared", self.url, blob.lease_key)
                return None
            if lease is None or lease.doomed:
                lineage = new_lineage() if lease is None else lease.lineage
                serial = 0 if lease is None else lease.serial
                generation = Lease("", False, (), lineage=lineage).new_generation()  # unique
                reserved = Lease(generation, False, (me,), me, None, False, serial, lineage)
                if not self._swap(blob, reserved, etag, _holds(me, generation)):
                    refused += lease is None
                    contended += 1
                    _backoff(contended)
                    continue
                return self._upload(step, attempt, blob, generation, data)
            key = blob.generation_key(lease.generation)
            info = self._generation_object(blob, lease.generation)
            if info is None and lease.reserver == me and me in lease.users:
                # This attempt's own reservation, its bytes not there: an upload of this
                # process under way (wait for its end), or one lost to a failure or to an
                # unknown outcome of the reserving CAS (upload them now: it is ours).
                if self._wait_for_own_upload(blob, lease.generation):
                    continue
                return self._upload(step, attempt, blob, lease.generation, data)
            if info is None:
                log.info("%s: %s not uploaded (yet): not shared", self.url, key)
                return None  # another attempt's upload, under way or dead: never waited for
            if not self._holds_the_blob(info, blob, lease):
                log.warning(
                    "%s/%s is not the blob its name says (%d bytes, ETag %s; the blob has %d "
                    "bytes, its reserver uploaded ETag %s): the shard is written unshared",
                    self.url, key, info.size, info.etag, blob.size, lease.etag,
                )  # fmt: skip
                return None
            if me not in lease.users:
                if len(lease.users) >= MAX_USERS:
                    log.warning(
                        "%s: lease %s lists %d users, as many as a lease holds: the shard is "
                        "written unshared", self.url, blob.lease_key, len(lease.users),
                    )  # fmt: skip
                    return None
                appended = replace(lease, users=(*lease.users, me))
                if not self._swap(blob, appended, etag, _holds(me, lease.generation)):
                    contended += 1
                    _backoff(contended)
                    continue
            return self.locator(blob, lease.generation, info)
        log.warning(
            "%s: lease %s changed %d times while this save tried to share it (contended); "
            "the shard is written unshared", self.url, blob.lease_key, CAS_TRIES,
        )  # fmt: skip
        return None

    def _generation_object(self, blob: BlobName, generation: str) -> ObjectInfo | None:
        try:
            return self.driver.head(blob.generation_key(generation))
        except ObjectNotFoundError:
            return None

    def _wait_for_own_upload(self, blob: BlobName, generation: str) -> bool:
        """Wait (up to ``share_wait_s``) for this process's upload of the generation to end:
        True if one was under way (look again), False if none is."""
        with self._alive_lock:
            ended = self._uploading.get((str(blob), generation))
        if ended is None:
            return False
        ended.wait(self.share_wait_s)
        return True

    @staticmethod
    def _holds_the_blob(info: ObjectInfo, blob: BlobName, lease: Lease) -> bool:
        """Whether a generation's object can hold the blob, whatever its name says: the
        blob's size, and the ETag its reserver recorded (a truncated or replaced object is
        not the blob)."""
        return info.size == blob.size and lease.etag in (None, info.etag)

    def _upload(
        self, step: int, attempt: str, blob: BlobName, generation: str, data: ShardBytes
    ) -> Mapping[str, str]:
        """Upload a reserved generation's bytes, the reserver's marker written again at least
        every ``UPLOADING_EVERY_S`` (GC sees it uploading)."""
        key = blob.generation_key(generation)
        ended = threading.Event()
        with self._alive_lock:
            self._uploading[str(blob), generation] = ended
        try:
            sink = self.open_sink(key, blob.size)
            check = None if data.stable else BlockDigests(blob.algorithm)
            try:
                for piece in data.pieces(_UPLOAD_PIECE):
                    self.touch(step, attempt, every=UPLOADING_EVERY_S)
                    sink.write(piece)
                    if check is not None:
                        check.update(piece)
                if check is not None:  # a file that changed since it was hashed: not the blob
                    check.finish()
                    if check.hexdigest() != blob.hexdigest:
                        raise InvalidInputError(
                            f"{data.name()} changed while it was published (its bytes no "
                            f"longer have the digest computed from them moments before): "
                            f"publish a directory only once its writer is done"
                        )
                sink.close()
            except BaseException:
                sink.abort()
                raise
            info = self.driver.head(key)
        finally:
            with self._alive_lock:
                self._uploading.pop((str(blob), generation), None)
            ended.set()
        return self.locator(blob, generation, info)

    @staticmethod
    def locator(blob: BlobName, generation: str, info: ObjectInfo) -> Mapping[str, str]:
        """A shared shard's locator: the generation's key, ETag, blob and generation, and on
        a versioned bucket the generation's version (readers read that version)."""
        locator = {
            "key": blob.generation_key(generation),
            "etag": info.etag,
            "blob": str(blob),
            "generation": generation,
        }
        if info.version_id:
            locator["version_id"] = info.version_id
        return locator

    def held_problems(
        self,
        step: int,
        attempt: str,
        locators: Sequence[Mapping[str, str]],
        executor: ThreadPoolExecutor | None = None,
    ) -> list[tuple[str, bool]]:
        """At the seal: what says the attempt no longer holds a blob it names, each with
        whether GC's judgement says it (the attempt was judged dead: dropped from a lease,
        its generation doomed, its lease removed). Empty: it holds them all.

        Each verdict is on a lease read *and confirmed current*: the lease is written back
        by CAS on the ETag read, its serial grown (a read may return an older version for a
        moment after an overwrite, on some storage; a CAS is decided by the server on the
        object as it is), which also fails the doom of any GC that read the lease before
        it. The write records the generation's ETag where its reserver's upload gave it and
        the lease has none yet. ``executor``: checks blobs concurrently."""
        me = User(step, attempt)
        held: dict[tuple[str, str], str] = {}
        for locator in locators:
            held.setdefault((locator["blob"], locator["generation"]), locator.get("etag", ""))

        def problem(item: tuple[tuple[str, str], str]) -> tuple[str, bool] | None:
            (blob_text, generation), etag = item
            return self._held_problem(me, BlobName.parse(blob_text), generation, etag)

        items = sorted(held.items())
        found = list(map(problem, items) if executor is None else executor.map(problem, items))
        return [problem for problem in found if problem is not None]

    def _held_problem(
        self, me: User, blob: BlobName, generation: str, etag_uploaded: str
    ) -> tuple[str, bool] | None:
        for attempt_number in range(CAS_TRIES):
            try:
                lease, etag = self.read(blob)
            except LeaseCorruptError as exc:
                return str(exc), False
            if lease is None or etag is None:
                if attempt_number < 3:  # a read that lags behind the lease's creation
                    _backoff(attempt_number)
                    continue
                return f"the lease of blob {blob} was removed (by GC, or by hand)", True
            problem: tuple[str, bool] | None = None
            if lease.doomed or lease.generation != generation:
                problem = f"generation {generation} of blob {blob} was doomed by GC", True
            elif me not in lease.users:
                problem = f"GC dropped this attempt from the lease of blob {blob}", True
            confirmed = lease
            if problem is None and lease.etag is None and lease.reserver == me and etag_uploaded:
                confirmed = replace(lease, etag=etag_uploaded)
            if self._swap(blob, confirmed, etag, lambda stored: False):  # confirmed current
                return problem
            _backoff(attempt_number)
        return f"the lease of blob {blob} changed {CAS_TRIES} times while it was checked", False

    # -- GC ------------------------------------------------------------------------------

    def collect(
        self,
        report: GcReport,
        *,
        now: float,
        published: Callable[[User], bool],
        last_activity: Callable[[User], float | None],
    ) -> None:
        """Doom and delete the blobs no user is published for or alive in (§12.3); delete
        generations no lease names as current, and liveness markers no one needs.

        ``now``: the storage's clock; ``published(user)``: its attempt's manifest, read
        directly, and afresh at each call (a judgement must read after the lease read that
        named the user); ``last_activity(user)``: the newest write of its attempt's own objects
        (None: none), whose age against ``report.grace_s`` says alive."""
        area: dict[BlobName, dict[str, ObjectInfo]] = {}
        leases: dict[BlobName, ObjectInfo] = {}
        markers: list[ObjectInfo] = []
        for info in self.driver.list(BLOBS):
            if info.key.startswith(LIVE):
                markers.append(info)
                continue
            parsed = parse_blob_key(info.key)
            if parsed is None:
                continue  # not a name this area gives: left alone
            blob, generation = parsed
            if generation is None:
                leases[blob] = info
            else:
                area.setdefault(blob, {})[generation] = info
        uploads: dict[BlobName, list[tuple[str, UploadInfo]]] = {}
        for upload in self._uploads(report):
            parsed = parse_blob_key(upload.key)
            if parsed is not None and parsed[1] is not None:
                uploads.setdefault(parsed[0], []).append((parsed[1], upload))

        def alive(user: User) -> bool:
            newest = last_activity(user)
            return newest is not None and now - newest <= report.grace_s

        for blob in sorted(leases.keys() | area.keys() | uploads.keys(), key=str):
            # Read after the listing: a generation listed before the read was reserved before
            # it, so it is garbage unless the read shows it current and not doomed.
            self._collect_blob(
                report, blob, leases.get(blob), area.get(blob, {}), uploads.get(blob, []),
                now, published, alive,
            )  # fmt: skip
        for info in markers:
            self._collect_marker(report, info, now, published)

    def _collect_blob(
        self,
        report: GcReport,
        blob: BlobName,
        listed: ObjectInfo | None,
        generations: Mapping[str, ObjectInfo],
        uploads: Sequence[tuple[str, UploadInfo]],
        now: float,
        published: Callable[[User], bool],
        alive: Callable[[User], bool],
    ) -> None:
        for attempt_number in range(CAS_TRIES):
            try:
                lease, etag = self.read(blob)
            except LeaseCorruptError as exc:
                report.warnings.append(f"{exc}: its blob was left alone")
                return
            if lease is None or etag is None:
                if generations:  # its lease removed or deleted behind a save: left alone
                    report.warnings.append(
                        f"{self.url}/{blob.base}: {len(generations)} generation(s) without a "
                        f"lease (removed or deleted behind a save that may have published "
                        f"with it): left alone; remove them once no checkpoint names them"
                    )
                return
            if not lease.doomed:
                uploading = lease.reserver is not None and any(  # its reserver, still at it
                    self._upload_moved(upload, now, report.grace_s)
                    for generation, upload in uploads
                    if generation == lease.generation
                )
                keep = tuple(
                    user
                    for user in lease.users
                    if published(user) or alive(user) or (uploading and user == lease.reserver)
                )
                if keep:
                    if len(keep) < len(lease.users) and not report.dry_run:
                        self._swap(blob, replace(lease, users=keep), etag, lambda s: False)
                    break
                if not report.dry_run:
                    doomed = replace(lease, doomed=True, users=())
                    if not self._swap(blob, doomed, etag, _dooms(lease.generation)):
                        _backoff(attempt_number)
                        continue  # a writer (or another GC) changed it: judge again
                lease = replace(lease, doomed=True)
                listed = None  # doomed just now: not yet for longer than the grace period
            break
        else:
            report.warnings.append(f"the lease of blob {blob} was contended: judged next time")
            return
        for generation, info in sorted(generations.items()):
            if generation == lease.generation and not lease.doomed:
                continue
            if not lease.owns(generation):  # reserved in a lease of this blob since lost
                report.warnings.append(
                    f"{self.url}/{info.key}: a generation no lease of this blob's lineage "
                    f"reserved (its own lease was removed or deleted behind a save that may "
                    f"have published with it): left alone"
                )
                continue
            why = (
                "no published checkpoint and no live save uses it (its lease is doomed)"
                if generation == lease.generation
                else f"an old generation: its lease names generation {lease.generation}"
            )
            age = max(0.0, now - info.last_modified)
            report.removed.append(GcItem("blob", info.key, age, info.size, why=why))
            if not report.dry_run:
                self._delete(info.key)
        for generation, upload in uploads:
            if (generation == lease.generation and not lease.doomed) or not lease.owns(generation):
                continue
            age = max(0.0, now - upload.initiated)
            why = "an upload of a generation no lease names as current"
            report.removed.append(GcItem("blob upload", upload.key, age, why=why))
            if not report.dry_run:
                try:
                    self.driver.abort_multipart(upload.key, upload.upload_id)
                except ObjectNotFoundError:
                    pass
        # Doomed longer than the grace period, its generations gone: it protects nothing.
        # Retired by CAS from the state read (a writer that reserved in it since fails this,
        # and the lease stays), then removed: a retired lease is never reserved in. A lease
        # found retired already (its remover died, or another GC removes it now) is claimed
        # by a CAS of its own first: a lease created anew after another GC removed it fails
        # that CAS, and is not removed.
        old_enough = listed is not None and now - listed.last_modified > report.grace_s
        if lease.retired or (lease.doomed and old_enough):
            self._remove_lease(report, blob, lease, etag, listed, now)

    def _remove_lease(
        self,
        report: GcReport,
        blob: BlobName,
        lease: Lease,
        etag: str,
        listed: ObjectInfo | None,
        now: float,
    ) -> None:
        age = 0.0 if listed is None else max(0.0, now - listed.last_modified)
        size = 0 if listed is None else listed.size
        why = "doomed longer than the grace period, retired"
        if report.dry_run:
            report.removed.append(GcItem("blob lease", blob.lease_key, age, size, why=why))
            return
        claimed = self._claim_removal(blob, lease, etag)
        if claimed is None:
            return  # changed since it was read (a writer, another GC): judged next time
        report.removed.append(GcItem("blob lease", blob.lease_key, age, size, why=why))
        self._delete(blob.lease_key, claimed)

    def _claim_removal(self, blob: BlobName, lease: Lease, etag: str) -> str | None:
        """Write the lease retired, by CAS from ``etag``: the new ETag, or None where the CAS
        failed or its outcome is unknown (the lease is then left for a later pass)."""
        retired = replace(lease, doomed=True, retired=True, serial=lease.serial + 1)
        try:
            info = self.driver.put(blob.lease_key, retired.encode(), mode=PutMode.update(etag))
        except (PreconditionFailedError, ObjectNotFoundError, TransientStorageError):
            return None
        return info.etag

    def _upload_moved(self, upload: UploadInfo, now: float, grace_s: float) -> bool:
        """Whether an upload received a part (or began) within the grace period."""
        try:
            progress = self.driver.upload_progress(upload)
        except ObjectNotFoundError:
            return False  # completed or aborted meanwhile: its object, or nothing, says
        except StorageError:
            return True  # cannot tell: taken as moving (garbage may stay, nothing is lost)
        return now - max(upload.initiated, progress.last_activity) <= grace_s

    def _collect_marker(
        self, report: GcReport, info: ObjectInfo, now: float, published: Callable[[User], bool]
    ) -> None:
        parsed = names.parse_attempt_name(info.key[len(LIVE) :], ".")
        if parsed is None:
            return
        age = max(0.0, now - info.last_modified)
        if age <= report.grace_s and not published(User(*parsed)):
            return
        why = "its attempt published" if age <= report.grace_s else "its attempt is idle"
        report.removed.append(GcItem("liveness marker", info.key, age, info.size, why=why))
        if not report.dry_run:
            self._delete(info.key)

    def _delete(self, key: str, etag: str | None = None) -> None:
        """Delete an object of the area (``etag``: a lease's, as GC's claim wrote it)."""
        try:
            if self._remove is not None:
                self._remove(key, etag)
            else:
                self.driver.delete(key)
        except ObjectNotFoundError:
            pass

    def _uploads(self, report: GcReport) -> Iterator[UploadInfo]:
        try:
            yield from self.driver.list_multipart_uploads(BLOBS)
        except StorageError as exc:  # not implemented: said once by the attempts' pass
            log.debug("%s: blob uploads not listed: %s", self.url, exc)
