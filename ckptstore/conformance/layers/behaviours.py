"""Probes of what every store relies on and no driver declares: names starting with ``.`` or
``_``, incomplete uploads listed, listings past one page, reads after a delete, sizes as
written, and one clock for every timestamp GC reads (docs/conformance.md, "Probes").

Each gives ``held``, ``violated`` (with what the storage does, and what it costs a store) or
``not measured`` (with why); a row that is violated is a capability missing, and the report
names it first under every invariant violation it can explain (``CONSEQUENCES``): a storage
that is wrong is blamed before the protocol is.
"""

from __future__ import annotations

import contextlib
import secrets
import time
from collections.abc import Callable
from typing import Any

from ckptstore.conformance.location import UNSUPPORTED
from ckptstore.conformance.settling import settled
from ckptstore.driver import Capability, DriverFamily, driver_family
from ckptstore.errors import CkptStoreError, ObjectNotFoundError, StorageError

__all__ = [
    "ACCEPTED",
    "CLOCK",
    "CONSEQUENCES",
    "HELD",
    "HIDDEN_NAMES",
    "LISTED_UPLOADS",
    "MEASURED_ONLY",
    "NOT_MEASURED",
    "PAGINATION",
    "READ_AFTER_DELETE",
    "SIZES",
    "STALE_READS",
    "TOLERATED",
    "VIOLATED",
    "behaviour_probes",
    "probe_name",
]

HELD, VIOLATED, NOT_MEASURED = "held", "violated", "not measured"


def probe_name() -> str:
    """A fresh name for a probe's object or file (not hidden: see ``_probe_hidden_names``)."""
    return f"probe-{secrets.token_hex(6)}"


ACCEPTED = "the store accepts this storage"
"""The report's row for a refusal of the storage no probe explains (``runner``)."""
HIDDEN_NAMES = "names starting with . or _"
"""The report's row for ``_probe_hidden_names``: not a capability a driver declares, but one
every store needs (trainers write such names: torch DCP's ``.metadata``, ``__0_0.distcp``)."""
LISTED_UPLOADS = "incomplete uploads listed"
"""The report's row for ``_probe_listed_uploads``: GC finds a crashed save's upload so."""
PAGINATION = "listings past one page"
"""The report's row for ``_probe_pagination``: a store of many keys is listed in pages."""
READ_AFTER_DELETE = "gone after delete"
"""The report's row for ``_probe_read_after_delete``."""
SIZES = "sizes as written"
"""The report's row for ``_probe_sizes``: what HEAD (stat) and a listing say of a size."""
CLOCK = "one clock for timestamps"
"""The report's row for ``_probe_clock``: GC ages leftovers on the storage's timestamps."""
STALE_READS = "reads after overwrite"
"""The report's row for ``_probe_reads_after_overwrite``: measured, and tolerated."""

MEASURED_ONLY = frozenset(
    {ACCEPTED, HIDDEN_NAMES, LISTED_UPLOADS, PAGINATION, READ_AFTER_DELETE, SIZES, CLOCK,
     STALE_READS}
)  # fmt: skip
"""Rows no driver declares: what every store needs, measured (the report words them so)."""
TOLERATED = frozenset({STALE_READS})
"""Rows whose misbehaviour the protocol tolerates: measured and reported, never missing."""

CONSEQUENCES: dict[str, tuple[tuple[str, ...], str]] = {
    HIDDEN_NAMES: (
        ("I1", "I2", "I4", "I7"),
        "listings of this storage hide names starting with . or _",
    ),
    LISTED_UPLOADS: (("I7",), "this storage does not list incomplete multipart uploads"),
    PAGINATION: (
        ("I1", "I2", "I4", "I5", "I7"),
        "listings of this storage omit or repeat keys past the first page",
    ),
    READ_AFTER_DELETE: (
        ("I2", "I4", "I7"),
        "a deleted object or file is still found after its delete was answered (deletes linger)",
    ),
    SIZES: (("I1", "I3", "I7", "I8"), "this storage reports other sizes than it stores"),
    CLOCK: (
        ("I7",),
        "this storage's timestamps disagree with each other (a time zone, or nodes' clocks)",
    ),
    Capability.STRONG_LIST_AFTER_WRITE.value: (
        ("I2", "I4", "I7"),
        "listings of this storage lag behind its writes",
    ),
    Capability.COMPARE_AND_SWAP.value: (
        ("I4", "I5"),
        "this storage's compare-and-swap (PutObject If-Match) is missing or not atomic",
    ),
    Capability.CONDITIONAL_CREATE.value: (
        ("I1", "I5", "I9"),
        "this storage's conditional create (If-None-Match: *) is missing or not atomic",
    ),
    Capability.RENAME_NOREPLACE.value: (
        ("I1", "I5", "I9"),
        "this file system's no-replace rename is missing or not atomic",
    ),
    Capability.MULTIPART.value: (
        ("I1", "I3", "I8"),
        "this storage's multipart uploads are visible early or assembled wrong",
    ),
    Capability.VERSIONING.value: (("I1", "I2"), "this bucket's versioning is off or broken"),
    Capability.VERSION_DELETE.value: (("I7",), "this storage cannot delete an old version"),
}
"""For each probe row: the invariants its failure can break, and what the storage does, as
the report says it first under each such violation (``report``)."""

PAGE_SIZE = 2
PAGED_KEYS = 7
"""The pagination probe lists this many keys in pages of ``PAGE_SIZE``."""
CLOCK_TOLERANCE_S = 60.0
"""Timestamps of one storage that differ by more than this are from different clocks: GC's
grace periods are hours, and a time zone is an hour or more."""


def behaviour_probes(
    driver: Any, declared: frozenset[Capability]
) -> list[tuple[str, Callable[[Any], tuple[str, str]]]]:
    """The rows and probes of the behaviours every store relies on, for ``driver``'s family
    and the capabilities its store ``declared``."""
    file_system = driver_family(driver) is DriverFamily.FILE_SYSTEM
    probes: list[tuple[str, Callable[[Any], tuple[str, str]]]] = [
        (HIDDEN_NAMES, _probe_hidden_names),
        (READ_AFTER_DELETE, _probe_read_after_delete),
        (SIZES, _probe_sizes),
        (CLOCK, _probe_clock),
    ]
    if not file_system:
        probes.insert(1, (PAGINATION, _probe_pagination))
        probes.append((STALE_READS, _probe_reads_after_overwrite))
        if Capability.MULTIPART in declared:
            probes.insert(1, (LISTED_UPLOADS, _probe_listed_uploads))
    return probes


def _probe_listed_uploads(store: Any) -> tuple[str, str]:
    """An incomplete multipart upload with a part, listed by ``ListMultipartUploads``: the
    one way GC finds the uploads of saves that crashed (a server answering 501 or an empty
    200 leaks every one of them)."""
    key = probe_name()
    upload = store.create_multipart(key)
    try:
        store.upload_part(key, upload, 1, b"a part")
        try:
            listed = any(u.upload_id == upload for u in store.list_multipart_uploads(""))
        except StorageError as exc:
            if exc.http_status not in UNSUPPORTED:
                raise
            return (
                VIOLATED,
                f"the server answers {exc.http_status} to ListMultipartUploads: {_LEAK}",
            )
        if not listed:
            return VIOLATED, f"ListMultipartUploads does not list an incomplete upload: {_LEAK}"
        return HELD, "an incomplete upload is listed: GC finds the uploads of saves that crashed"
    finally:
        with contextlib.suppress(CkptStoreError):
            store.abort_multipart(key, upload)


_LEAK = (
    "GC cannot find the uploads of saves that crashed, whose parts then stay (and are billed) "
    "until a lifecycle rule (AbortIncompleteMultipartUpload) removes them"
)


def _probe_hidden_names(driver: Any) -> tuple[str, str]:
    """Names that start with ``.`` or ``_``, at the top and a directory down, stored, listed
    and read back like any other: some S3 gateways and FUSE file systems hide them."""
    folder = probe_name()
    names = [f".{folder}", f"_{folder}", f"{folder}/.metadata", f"{folder}/__0_0.distcp"]
    file_system = driver_family(driver) is DriverFamily.FILE_SYSTEM
    listed: set[str] = set()
    unread: list[str] = []
    try:
        if file_system:
            driver.mkdir(folder)
        for name in names:
            write_small(driver, name, name.encode(), file_system)
        if file_system:
            listed = set(driver.listdir("")) | {f"{folder}/{n}" for n in driver.listdir(folder)}
        else:
            listed = {info.key for info in driver.list("")}
        for name in names:
            if read_small(driver, name, file_system) != name.encode():
                unread.append(name)
    finally:
        remove_small(driver, names, folder if file_system else None)
    hidden = [name for name in names if name not in listed]
    if not hidden and not unread:
        return HELD, "stored, listed and read back like any other name (.metadata, __0_0.distcp)"
    said = [f"not listed: {', '.join(hidden)}"] if hidden else []
    said += [f"not read back: {', '.join(unread)}"] if unread else []
    return VIOLATED, (
        f"{'; '.join(said)} (trainers write such names, torch DCP's .metadata and "
        f"__0_0.distcp among them; a listing that hides them hides leftovers from GC)"
    )


def write_small(driver: Any, name: str, data: bytes, file_system: bool) -> None:
    if not file_system:
        driver.put(name, data)
        return
    handle = driver.create(name)
    try:
        driver.write(handle, data)
    finally:
        driver.close(handle)


def read_small(driver: Any, name: str, file_system: bool) -> bytes | None:
    try:
        if not file_system:
            data: bytes = driver.get(name)[0]
            return data
        with driver.open_read(name) as stream:
            read: bytes = stream.read()
            return read
    except ObjectNotFoundError:
        return None


def remove_small(driver: Any, names: list[str], folder: str | None) -> None:
    """Remove the objects, or the files and then their ``folder``, that a probe made; what
    is gone already (or was never made) is fine."""
    for name in names:
        with contextlib.suppress(ObjectNotFoundError):
            driver.unlink(name) if folder is not None else driver.delete(name)
    if folder is not None:
        with contextlib.suppress(ObjectNotFoundError):
            driver.rmdir(folder)


def _probe_pagination(store: Any) -> tuple[str, str]:
    """``PAGED_KEYS`` keys listed in pages of ``PAGE_SIZE`` (the driver's ``list_page_size``),
    whole and from a start key: a server (or a proxy) that drops the continuation token, or
    repeats a page, shows with a few keys what a store shows past its 1000th."""
    if not getattr(store, "pages_listings", False):
        return NOT_MEASURED, (
            "the driver cannot ask for small pages: its client library pages listings in "
            "pages of its own"
        )
    folder = probe_name()
    keys = [f"{folder}/key-{n:02d}" for n in range(PAGED_KEYS)]
    before = store.list_page_size
    try:
        for key in keys:
            store.put(key, key.encode())
        store.list_page_size = PAGE_SIZE
        whole = [info.key for info in store.list(f"{folder}/")]
        later = [info.key for info in store.list(f"{folder}/", start_after=keys[2])]
    finally:
        store.list_page_size = before
        for key in keys:
            with contextlib.suppress(ObjectNotFoundError):
                store.delete(key)
    if whole == keys and later == keys[3:]:
        return HELD, (
            f"{PAGED_KEYS} keys listed in pages of {PAGE_SIZE}: each once, in order (and from "
            f"a start key)"
        )
    wrong = [
        f"{what}: {_listed_wrong(listed, expected)}"
        for what, listed, expected in (("whole", whole, keys), ("from a key", later, keys[3:]))
        if listed != expected
    ]
    return VIOLATED, (
        f"{PAGED_KEYS} keys listed in pages of {PAGE_SIZE}: {'; '.join(wrong)} (ckptstore finds "
        f"checkpoints, LATEST's candidates and leftovers by listing: in a store of more keys "
        f"than a page, what is past the first page is lost to it)"
    )


def _listed_wrong(listed: list[str], expected: list[str]) -> str:
    if listed == expected[: len(listed)]:
        return f"only the first {len(listed)} of {len(expected)} keys (the first page and no more)"
    if len(set(listed)) < len(listed):
        return f"{len(listed) - len(set(listed))} key(s) listed twice"
    if sorted(listed) == sorted(expected):
        return "every key, out of order"
    return f"{len(set(listed) & set(expected))} of {len(expected)} keys"


def _probe_read_after_delete(driver: Any) -> tuple[str, str]:
    """A small object (file) written, read, deleted: a read, a HEAD (stat) and a listing
    right after the delete was answered must find nothing."""
    file_system = driver_family(driver) is DriverFamily.FILE_SYSTEM
    name = probe_name()
    write_small(driver, name, b"to be deleted", file_system)
    try:
        if read_small(driver, name, file_system) != b"to be deleted":
            return VIOLATED, "a small object just written reads back other bytes"
    finally:
        with contextlib.suppress(ObjectNotFoundError):
            driver.unlink(name) if file_system else driver.delete(name)
    found = []
    if read_small(driver, name, file_system) is not None:
        found.append("read")
    try:
        driver.stat(name) if file_system else driver.head(name)
        found.append("stat" if file_system else "HEAD")
    except ObjectNotFoundError:
        pass
    listed = (
        name in driver.listdir("")
        if file_system
        else any(info.key == name for info in driver.list(name))
    )
    if listed:
        found.append("listed")
    if not found:
        what = "file" if file_system else "object"
        return HELD, (
            f"a deleted {what} is gone at once: not read, not found by "
            f"{'stat' if file_system else 'HEAD'}, not listed"
        )
    return VIOLATED, (
        f"deletes linger: right after its delete was answered, the object is still "
        f"{', '.join(found)} (GC and retention would see what they removed, and a reader "
        f"what was deleted)"
    )


def _probe_sizes(driver: Any) -> tuple[str, str]:
    """What HEAD (stat) and a listing say of an object's size: exact for a small one, and
    (object stores) for one completed from two parts, the first of the minimum part size."""
    file_system = driver_family(driver) is DriverFamily.FILE_SYSTEM
    name = probe_name()
    wrong = []
    try:
        if file_system:
            handle = driver.create(name)
            try:
                driver.write(handle, b"x" * 1000)
                driver.write(handle, b"y" * 24)
            finally:
                driver.close(handle)
            said = {"stat": driver.stat(name).size}
            expected = 1024
        else:
            expected = _multipart_object(driver, name)
            said = {"HEAD": driver.head(name).size}
            listed = next((i.size for i in driver.list(name) if i.key == name), None)
            if listed is not None:  # not listed yet: the list-after-write probe's to say
                said["listing"] = listed
        wrong = [f"{how} says {size}" for how, size in said.items() if size != expected]
    finally:
        with contextlib.suppress(ObjectNotFoundError):
            driver.unlink(name) if file_system else driver.delete(name)
    what = "a file written in two writes" if file_system else "an object completed from parts"
    if not wrong:
        return HELD, (
            f"{what} ({expected} bytes): {' and '.join(said)} "
            f"{'says' if len(said) == 1 else 'say'} so"
        )
    return VIOLATED, (
        f"{what} holds {expected} bytes, but {'; '.join(wrong)} (ckptstore checks a shard's "
        f"size against its manifest, and GC reports sizes so)"
    )


def _multipart_object(store: Any, key: str) -> int:
    """An object completed from two parts (a plain put where the driver has no multipart
    uploads); its size."""
    if Capability.MULTIPART not in store.capabilities:
        store.put(key, b"z" * 1024)
        return 1024
    data = [b"a" * max(1, store.min_part_size), b"tail of the object"]
    upload = store.create_multipart(key)
    try:
        parts = [store.upload_part(key, upload, n, chunk) for n, chunk in enumerate(data, 1)]
        store.complete_multipart(key, upload, parts)
    except BaseException:
        with contextlib.suppress(CkptStoreError):
            store.abort_multipart(key, upload)
        raise
    return sum(map(len, data))


def _probe_clock(driver: Any) -> tuple[str, str]:
    """The timestamps GC compares, by the routes it reads them, within ``CLOCK_TOLERANCE_S``
    of each other: its "now" (a fresh object's HEAD) against an object's listed LastModified
    and an incomplete upload's newest stamp (its start or its part's, the later: object
    stores); a file's mtime against its directory's (file systems). How far the storage's
    clock is from this host's is reported, not judged (GC never uses this host's)."""
    file_system = driver_family(driver) is DriverFamily.FILE_SYSTEM
    name = probe_name()
    host = time.time()
    stamps, notes = (_fs_stamps(driver, name), []) if file_system else _object_stamps(driver, name)
    spread = max(stamps.values()) - min(stamps.values())
    told = ", ".join(f"{how} {round(stamp - host):+d} s" for how, stamp in stamps.items())
    if spread <= CLOCK_TOLERANCE_S:
        first = next(iter(stamps.values()))
        return HELD, "; ".join([
            f"{', '.join(stamps)} agree within {spread:.0f} s; the storage's clock is "
            f"{round(first - host):+d} s from this host's (GC ages on the storage's clock: a "
            f"skew of this host's does not matter)",
            *notes,
        ])  # fmt: skip
    return VIOLATED, (
        f"the storage's timestamps of one moment differ by {spread:.0f} s ({told}, from this "
        f"host's clock): GC ages leftovers by them, and would remove a live save's data or "
        f"keep a dead one's"
    )


def _fs_stamps(fs: Any, name: str) -> dict[str, float]:
    fs.mkdir(name)
    try:
        fs.close(fs.create(f"{name}/file"))
        try:
            return {"a file's mtime": fs.stat(f"{name}/file").mtime,
                    "its directory's mtime": fs.stat(name).mtime}  # fmt: skip
        finally:
            fs.unlink(f"{name}/file")
    finally:
        fs.rmdir(name)


def _object_stamps(store: Any, key: str) -> tuple[dict[str, float], list[str]]:
    """The stamps GC compares (as ``_probe_clock`` says), and notes on stamps GC reads but
    does not depend on (an upload's start, where its part's is later)."""
    store.put(key, b"clock")
    try:
        stamps = {"HEAD": store.head(key).last_modified}
        listed = next((i.last_modified for i in store.list(key) if i.key == key), None)
        if listed is not None:  # not listed yet: the list-after-write probe's to say
            stamps["listing"] = listed
    finally:
        store.delete(key)
    notes: list[str] = []
    if Capability.MULTIPART not in store.capabilities:
        return stamps, notes
    upload = store.create_multipart(key)
    try:
        store.upload_part(key, upload, 1, b"a part")
        with contextlib.suppress(StorageError, StopIteration):  # no listed uploads: its probe
            info = next(u for u in store.list_multipart_uploads(key) if u.upload_id == upload)
            progress = store.upload_progress(info)
            stamps["an upload's newest stamp"] = max(info.initiated, progress.last_activity)
            if abs(info.initiated - stamps["HEAD"]) > CLOCK_TOLERANCE_S:
                notes.append(
                    f"an upload's start is stamped {round(info.initiated - stamps['HEAD']):+d} s "
                    f"from HEAD's clock (GC ages an upload by its newest part: harmless while "
                    f"parts are stamped right)"
                )
    finally:
        with contextlib.suppress(CkptStoreError):
            store.abort_multipart(key, upload)
    return stamps, notes


def _probe_reads_after_overwrite(store: Any) -> tuple[str, str]:
    """An object overwritten (after a read of its first bytes, which a cache would keep),
    then read until it reads its new bytes (for at most ``settling.SETTLE_S``): how many
    reads, for how long, were stale. ckptstore tolerates stale reads: it never overwrites
    data, and cross-checks the LATEST hint with a listing; the suite waits them out."""
    key = probe_name()
    reads = 0

    def read() -> bytes:
        nonlocal reads
        reads += 1
        data: bytes = store.get(key)[0]
        return data

    store.put(key, b"old bytes")
    try:
        store.get(key)
        store.put(key, b"new bytes")
        started = time.monotonic()
        final = settled(read, lambda data: data == b"new bytes")
        took = time.monotonic() - started
    finally:
        with contextlib.suppress(ObjectNotFoundError):
            store.delete(key)
    if reads == 1:
        return HELD, "an overwritten object reads its new bytes at once"
    tolerated = (
        "tolerated: ckptstore never overwrites data and cross-checks the LATEST hint with a "
        "listing; the suite waits such reads out"
    )
    if final != b"new bytes":
        return VIOLATED, (
            f"stale reads measured: an overwritten object still read its old bytes after "
            f"{took:.1f} s ({reads} reads; {tolerated})"
        )
    return VIOLATED, (
        f"stale reads measured: an overwritten object read its old bytes {reads - 1} time(s), "
        f"for {took * 1000:.0f} ms ({tolerated})"
    )
