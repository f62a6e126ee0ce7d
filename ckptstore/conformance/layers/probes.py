"""Capability probes: measure on the real system what its driver declares (docs/protocol.md §2).

Each probe works in a fresh location, through the driver alone, and reports ``held``,
``violated`` or ``not measured`` with a detail a storage engineer can act on; or ``storage
error`` when the storage failed the probe on every try (see ``outcomes``), which measures
nothing. Some systems that
claim S3 compatibility ignore ``If-None-Match`` on some calls, or reject quoted ETags in
``If-Match``: that is what these probes exist to find.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from ckptstore.conformance.layers.behaviours import (
    ACCEPTED,
    HELD,
    HIDDEN_NAMES,
    LISTED_UPLOADS,
    MEASURED_ONLY,
    NOT_MEASURED,
    TOLERATED,
    VIOLATED,
    behaviour_probes,
    probe_name,
)
from ckptstore.conformance.layers.layer import Findings, SuiteRun
from ckptstore.conformance.layers.workload import MANY_PARTS, big_shard_size, pattern
from ckptstore.conformance.location import UNSUPPORTED, Location, refused_at_open
from ckptstore.conformance.outcomes import STORAGE_ERROR, retry_storage_failures, storage_failure
from ckptstore.conformance.settling import settled
from ckptstore.driver import Capability, DriverFamily, PutMode, driver_family
from ckptstore.errors import (
    CkptStoreError,
    ObjectNotFoundError,
    PreconditionFailedError,
    StorageError,
    TargetExistsError,
)

__all__ = [
    "ACCEPTED",
    "HELD",
    "HIDDEN_NAMES",
    "LISTED_UPLOADS",
    "MEASURED_ONLY",
    "NOT_MEASURED",
    "STORAGE_ERROR",
    "VIOLATED",
    "ProbeResult",
    "run_layer",
    "run_probes",
]

RACE_ROUNDS = 3
RACERS = 8
"""Racing probes: this many threads, released together, in this many rounds."""


@dataclass(frozen=True)
class ProbeResult:
    """One capability: declared by the driver, and what the probe measured."""

    capability: str
    declared: bool
    measured: str
    detail: str = ""
    required: bool = False
    """The store's commit protocol needs it: ckptstore refuses storage whose driver does not
    declare it (the suite measures such storage all the same, and reports it missing)."""


def run_layer(run: SuiteRun, found: Findings) -> None:
    """The probes on a fresh location of ``run``'s target; it measures the multipart size the
    later layers use."""
    location = run.locations()
    try:
        found.capabilities.extend(run_probes(location))
        run.multipart_size = big_shard_size(location)
    finally:
        location.destroy()


def run_probes(location: Location) -> list[ProbeResult]:
    """Probe every capability of the driver behind ``location``, as the storage answers single
    requests (a driver's fallbacks, such as retrying in the other ETag quoting, are off)."""
    driver = location.base.driver
    with _raw_requests(driver):
        return _run_probes(location, driver)


@contextlib.contextmanager
def _raw_requests(driver: Any) -> Iterator[None]:
    """Turn off the driver's workarounds for conditional requests while it is measured."""
    if not hasattr(driver, "raw_conditionals"):
        yield
        return
    before = driver.raw_conditionals
    driver.raw_conditionals = True
    try:
        yield
    finally:
        driver.raw_conditionals = before


def _run_probes(location: Location, driver: Any) -> list[ProbeResult]:
    declared = location.base.capabilities
    required = location.base.required_capabilities
    file_system = driver_family(driver) is DriverFamily.FILE_SYSTEM
    probes = _FILE_SYSTEM_PROBES if file_system else _OBJECT_STORE_PROBES
    results = []
    for capability in Capability:
        probe = probes.get(capability)
        needed = capability in required
        if probe is None:
            if capability in declared or needed:  # nothing here can measure it
                results.append(
                    ProbeResult(
                        capability.value, capability in declared, NOT_MEASURED, "no probe", needed
                    )
                )
            continue
        (measured, detail), _ = retry_storage_failures(
            functools.partial(_measure, probe, driver),
            lambda outcome: outcome[0] == STORAGE_ERROR,
        )
        results.append(
            ProbeResult(capability.value, capability in declared, measured, detail, needed)
        )
    for row, probe in behaviour_probes(driver, declared):
        (measured, detail), _ = retry_storage_failures(
            functools.partial(_measure, probe, driver),
            lambda outcome: outcome[0] == STORAGE_ERROR,
        )
        results.append(ProbeResult(row, False, measured, detail, row not in TOLERATED))
    results.extend(
        ProbeResult("opening the store", True, VIOLATED, refusal, True)
        for refusal in refused_at_open(location.base)
    )
    return results


def _measure(probe: Callable[[Any], tuple[str, str]], driver: Any) -> tuple[str, str]:
    try:
        return probe(driver)
    except CkptStoreError as exc:
        failure = storage_failure(exc)
        if failure is not None:  # the storage failed: the capability is neither there nor not
            return STORAGE_ERROR, f"the storage failed the probe on every try: {failure!r}"
        return VIOLATED, f"probe failed: {exc}"


# -- file systems ------------------------------------------------------------------------


def _probe_rename_noreplace(fs: Any) -> tuple[str, str]:
    source, target = probe_name(), probe_name()
    fs.mkdir(source)
    fs.mkdir(target)
    handle = fs.create(f"{target}/keep")
    fs.close(handle)
    try:
        fs.rename_noreplace(source, target)
    except TargetExistsError:
        outcome = (HELD, "rename onto an existing directory refused; target intact")
    else:
        outcome = (VIOLATED, "rename replaced an existing directory")
    if outcome[0] == HELD:
        raced = _race_renames(fs)
        if raced is not None:
            outcome = (VIOLATED, f"{raced}: the check is not atomic with the rename")
        else:
            outcome = (HELD, f"{outcome[1]}; {RACERS} racing renames onto one name: exactly "
                       f"one succeeded, {RACE_ROUNDS} rounds")  # fmt: skip
    for path in (f"{target}/keep", f"{source}/keep"):
        try:
            fs.unlink(path)
        except ObjectNotFoundError:
            pass
    for path in (source, target):
        try:
            fs.rmdir(path)
        except ObjectNotFoundError:
            pass
    return outcome


def _race(
    racers: int,
    attempt: Callable[[int], None],
    refused: type[Exception],
    losers: Counter[str] | None = None,
) -> list[int]:
    """Run ``attempt(i)`` for every racer at once (released by a barrier); return the racers
    whose attempt was not ``refused``. With ``losers``, a racer the storage answered with an
    error status (a 500 instead of a 412) lost, its status counted there, provided one racer
    won the round (else the storage failed it: raised). Anything else an attempt raised is
    raised here, unless two or more racers won (a violation, whatever the others got)."""
    barrier = threading.Barrier(racers)
    won: list[int] = []
    errors: list[BaseException] = []
    statuses: list[str] = []

    def run(index: int) -> None:
        try:
            barrier.wait(60)
            attempt(index)
            won.append(index)
        except refused:
            pass
        except StorageError as exc:
            if losers is None or exc.http_status is None or storage_failure(exc) is None:
                errors.append(exc)
            else:
                statuses.append(str(exc.http_status))
                errors.append(exc)
        except BaseException as exc:  # handed to the caller, which judges it
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(racers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if losers is not None and len(won) == 1 and len(statuses) == len(errors):
        losers.update(statuses)  # the others lost, told so by an error status
    elif errors and len(won) < 2:  # two winners are a violation, whatever the others got
        raise errors[0]
    return sorted(won)


def _losers_note(what: str, losers: Counter[str]) -> str:
    """The racers that lost with an error status instead of a 412, for a probe's detail."""
    if not losers:
        return ""
    told = ", ".join(f"{count} got {status}" for status, count in sorted(losers.items()))
    return (
        f"; losers of racing {what} are told by an error status, not 412 ({told} over "
        f"{RACE_ROUNDS} rounds; ckptstore reads back after a 5xx, and learns it lost)"
    )


def _race_verdict(what: str, won: list[int], round_: int, holder: int | None) -> str | None:
    """What is wrong with one round of ``RACERS`` racing ``what`` (None: nothing)."""
    if len(won) > 1:
        return f"{len(won)} of {RACERS} racing {what} succeeded on one key in round {round_}"
    if not won:
        return f"none of {RACERS} racing {what} succeeded in round {round_}"
    if holder != won[0]:
        return (f"in round {round_} of racing {what}, racer {won[0]} was told it won, but the "
                f"key holds racer {holder}'s bytes")  # fmt: skip
    return None


def _race_renames(fs: Any) -> str | None:
    """Racing no-replace renames of files onto one absent name: exactly one may succeed."""
    for round_ in range(1, RACE_ROUNDS + 1):
        target = probe_name()
        sources = [probe_name() for _ in range(RACERS)]
        for index, source in enumerate(sources):
            handle = fs.create(source)
            try:
                fs.write(handle, f"racer {index}".encode())
            finally:
                fs.close(handle)
        try:
            won = _race(RACERS, functools.partial(_rename_one, fs, sources, target),
                        TargetExistsError)  # fmt: skip
            with fs.open_read(target) as stream:
                text = stream.read().decode()
            holder = int(text.split()[-1]) if text.startswith("racer ") else None
        finally:
            for path in [target, *sources]:
                try:
                    fs.unlink(path)
                except ObjectNotFoundError:
                    pass
        wrong = _race_verdict("no-replace renames", won, round_, holder)
        if wrong is not None:
            return wrong
    return None


def _probe_fsync(fs: Any) -> tuple[str, str]:
    name = probe_name()
    handle = fs.create(name)
    try:
        fs.write(handle, b"probe")
        fs.fsync(handle)
    finally:
        fs.close(handle)
    fs.fsync_dir("")
    fs.unlink(name)
    return HELD, "fsync of files and directories succeeds (power loss itself is simulated)"


def _probe_list_after_write(fs: Any) -> tuple[str, str]:
    name = probe_name()
    fs.close(fs.create(name))
    seen = name in fs.listdir("")
    fs.unlink(name)
    gone = name not in fs.listdir("")
    if seen and gone:
        return HELD, "a new or removed entry is listed at once"
    return VIOLATED, "a listing missed a completed create or unlink"


_FILE_SYSTEM_PROBES: dict[Capability, Callable[[Any], tuple[str, str]]] = {
    Capability.RENAME_NOREPLACE: _probe_rename_noreplace,
    Capability.DURABLE_FSYNC: _probe_fsync,
    Capability.STRONG_LIST_AFTER_WRITE: _probe_list_after_write,
}


# -- object stores -----------------------------------------------------------------------


def _probe_conditional_create(store: Any) -> tuple[str, str]:
    key = probe_name()
    try:
        try:
            store.put(key, b"first", mode=PutMode.CREATE)
            try:
                store.put(key, b"second", mode=PutMode.CREATE)
                answered = "200"
            except PreconditionFailedError:
                answered = "412"
        except StorageError as exc:
            refused = _refusal(exc)
            if refused is None:
                raise
            return VIOLATED, f"the server answered {refused} to PutObject If-None-Match: *"
        kept = store.get(key)[0] == b"first"
    finally:
        store.delete(key)
    if answered == "200" and kept:
        return (
            VIOLATED,
            "the server answered 200 to a refused conditional put and kept the old object",
        )
    if answered == "200":
        return (
            VIOLATED,
            "PutObject with If-None-Match: * answered 200 and replaced an existing object",
        )
    if not kept:
        return VIOLATED, "the server answered 412 to a conditional put, yet replaced the object"
    losers: Counter[str] = Counter()
    raced = _race_creates(store, losers)
    if raced is not None:
        return VIOLATED, f"{raced}: the check is not atomic with the write"
    return HELD, (f"PutObject If-None-Match: * refuses an existing key (412); {RACERS} racing "
                  f"creates of one key: exactly one succeeded, {RACE_ROUNDS} rounds"
                  f"{_losers_note('conditional creates', losers)}")  # fmt: skip


def _race_creates(store: Any, losers: Counter[str]) -> str | None:
    """Racing conditional creates of one key: exactly one may succeed, and it holds its
    bytes (losers told by an error status other than 412 are counted in ``losers``)."""
    for round_ in range(1, RACE_ROUNDS + 1):
        key = probe_name()
        try:
            won = _race(RACERS, functools.partial(_create_one, store, key, round_),
                        PreconditionFailedError, losers)  # fmt: skip
            holder = _holder(store, key, won)
        finally:
            store.delete(key)
        wrong = _race_verdict("conditional creates", won, round_, holder)
        if wrong is not None:
            return wrong
    return None


def _racer(index: int, round_: int) -> bytes:
    # Unique per round: a swap to the bytes already there keeps the ETag, and a second swap
    # from it would rightly succeed.
    return f"round {round_} racer {index}".encode()


def _rename_one(fs: Any, sources: list[str], target: str, index: int) -> None:
    fs.rename_noreplace(sources[index], target)


def _create_one(store: Any, key: str, round_: int, index: int) -> None:
    store.put(key, _racer(index, round_), mode=PutMode.CREATE)


def _swap_one(store: Any, key: str, etag: str, round_: int, index: int) -> None:
    store.put(key, _racer(index, round_), mode=PutMode.update(etag))


def _holder(store: Any, key: str, won: list[int]) -> int | None:
    """The racer whose bytes ``key`` holds (None: none's), read until it is the one winner
    in ``won`` for a moment (a stale read is tolerated: ``settling``)."""

    def read() -> int | None:
        try:
            text = store.get(key)[0].decode()
        except ObjectNotFoundError:
            return None
        return int(text.split()[-1]) if " racer " in text else None

    return settled(read, lambda holder: len(won) != 1 or holder == won[0])


def _probe_conditional_complete(store: Any) -> tuple[str, str]:
    key = probe_name()
    store.put(key, b"first")
    upload = store.create_multipart(key)
    try:
        part = store.upload_part(key, upload, 1, b"second")
        try:
            store.complete_multipart(key, upload, [part], mode=PutMode.CREATE)
        except PreconditionFailedError:
            return HELD, "CompleteMultipartUpload If-None-Match: * refuses an existing key (412)"
        kept = store.get(key)[0] == b"first"
        what = "kept the old object" if kept else "replaced the object"
        return (
            VIOLATED,
            f"the server answered 200 to CompleteMultipartUpload If-None-Match: * on an "
            f"existing key and {what} (ckptstore does not need it)",
        )
    finally:
        try:
            store.abort_multipart(key, upload)
        except CkptStoreError:
            pass
        store.delete(key)


REFUSALS = (400, 501)
"""Answers of a server that does not take a conditional header at all (a 400 for the header,
501 NotImplemented): the capability is missing, not the storage failing."""


def _refusal(exc: StorageError) -> str | None:
    """The status of a server's refusal of the conditional header itself (None: another
    error, which is the storage's failure)."""
    return str(exc.http_status) if exc.http_status in REFUSALS else None


def _if_match(store: Any, key: str, body: bytes, etag: str) -> str:
    """One PutObject If-Match: ``200``, ``412``, ``404``, ``400`` or ``501`` as answered."""
    try:
        store.put(key, body, mode=PutMode.update(etag))
    except PreconditionFailedError:
        return "412"
    except ObjectNotFoundError:
        return "404"
    except StorageError as exc:
        refused = _refusal(exc)
        if refused is None:
            raise
        return refused
    return "200"


def _probe_compare_and_swap(store: Any) -> tuple[str, str]:
    key = probe_name()
    try:
        return _measure_compare_and_swap(store, key)
    finally:
        store.delete(key)


def _measure_compare_and_swap(store: Any, key: str) -> tuple[str, str]:
    first = store.put(key, b"1")
    bare = first.etag.strip('"')
    quoted = _if_match(store, key, b"2", f'"{bare}"')
    # The current ETag as the put that made it answered: a HEAD may read a stale answer for
    # a moment (tolerated: ``settling``), and a stale ETag would be refused rightly.
    current = store.put(key, b"2").etag.strip('"')
    unquoted = _if_match(store, key, b"3", current)
    notes = [f"If-Match with the current ETag: quoted {quoted}, unquoted {unquoted}"]
    if "200" not in (quoted, unquoted):
        return VIOLATED, (f"the server refused If-Match with the object's current ETag in both "
                          f"quotings (quoted: {quoted}, unquoted: {unquoted})")  # fmt: skip
    form = (lambda etag: f'"{etag}"') if quoted == "200" else (lambda etag: etag)
    stale = _if_match(store, key, b"4", form(bare))
    if stale == "200":
        kept = store.get(key)[0] != b"4"
        what = "kept the object" if kept else "replaced the object"
        return (
            VIOLATED,
            f"the server answered 200 to PutObject If-Match with a stale ETag and {what}",
        )
    notes.append(f"a stale ETag: {stale}")
    missing = _if_match(store, probe_name(), b"x", form(bare))
    if missing == "200":
        return VIOLATED, "PutObject If-Match on a missing key created it (200)"
    notes.append(f"If-Match on a missing key: {missing}")
    losers: Counter[str] = Counter()
    raced = _race_swaps(store, key, form, losers)
    if raced is not None:
        return VIOLATED, f"{raced}: the check is not atomic with the write"
    notes.append(
        f"{RACERS} racing swaps from one ETag: exactly one succeeded, {RACE_ROUNDS} rounds"
    )
    return HELD, "; ".join(notes) + _losers_note("compare-and-swaps", losers)


def _race_swaps(
    store: Any, key: str, form: Callable[[str], str], losers: Counter[str]
) -> str | None:
    """Racing compare-and-swaps from one ETag: exactly one may succeed, holding its bytes
    (losers told by an error status other than 412 are counted in ``losers``)."""
    for round_ in range(1, RACE_ROUNDS + 1):
        etag = form(store.put(key, f"round {round_} start".encode()).etag.strip('"'))
        won = _race(RACERS, functools.partial(_swap_one, store, key, etag, round_),
                    PreconditionFailedError, losers)  # fmt: skip
        wrong = _race_verdict("compare-and-swaps", won, round_, _holder(store, key, won))
        if wrong is not None:
            return wrong
    return None


NO_VERSIONS = "puts return no distinct version ids (versioning off?)"


@contextlib.contextmanager
def _two_versions(store: Any) -> Iterator[tuple[str, str | None]]:
    """A fresh key written twice (b"1", then b"2"): the key, and the first write's version id
    (None unless the writes got distinct ids); every version of the key is deleted after."""
    key = probe_name()
    first = store.put(key, b"1")
    second = store.put(key, b"2")
    try:
        distinct = first.version_id is not None and first.version_id != second.version_id
        yield key, first.version_id if distinct else None
    finally:
        try:
            for version in list(store.list_versions(key)):
                store.delete(key, version_id=version.version_id)
        except StorageError as exc:  # no versions to list (405, 501): the key goes plainly
            if exc.http_status not in UNSUPPORTED:
                raise
            with contextlib.suppress(ObjectNotFoundError):
                store.delete(key)


def _probe_versioning(store: Any) -> tuple[str, str]:
    with _two_versions(store) as (key, old):
        if old is None:
            return VIOLATED, NO_VERSIONS
        if store.get(key, version_id=old)[0] != b"1":
            return VIOLATED, "reading an old version by id returned other bytes"
        store.delete(key)
        try:
            markers = [v for v in store.list_versions(key) if v.is_delete_marker]
        except StorageError as exc:
            if exc.http_status not in UNSUPPORTED:
                raise
            return VIOLATED, (
                f"the server answers {exc.http_status} to ListObjectVersions: old versions "
                f"cannot be listed, so neither found nor freed"
            )
        if not markers:
            return VIOLATED, "a plain DELETE removed the object instead of adding a delete marker"
        return HELD, "version ids on put, read by version after overwrite, delete markers"


def _probe_version_delete(store: Any) -> tuple[str, str]:
    """Delete an old version by its id: exactly it must go, and the current one stay."""
    with _two_versions(store) as (key, old):
        if old is None:
            return NOT_MEASURED, NO_VERSIONS
        store.delete(key, version_id=old)
        try:
            store.get(key, version_id=old)
            gone = False
        except ObjectNotFoundError:
            gone = True
        try:
            current = store.get(key)[0] == b"2"
        except ObjectNotFoundError:
            current = False
        if gone and current:
            return HELD, "deleting an old version by id removed it, and only it"
        return VIOLATED, (
            f"deleting an old version by id: {'removed it' if gone else 'it is still readable'}"
            f"; the current version {'stayed' if current else 'is gone'} (old versions cannot "
            f"be freed: GC and retention leave them)"
        )


def _probe_multipart(store: Any) -> tuple[str, str]:
    """``MANY_PARTS`` parts, each of the minimum part size and its own bytes but the last
    (short), uploaded in an order of their own (last first, then the rest from the first): a
    server that loses a part, or assembles them by name (1, 10, 11, ...) or by arrival rather
    than by number, is caught when the object is read back byte for byte."""
    key = probe_name()
    size = store.min_part_size
    parts_data = [pattern(size, n) for n in range(1, MANY_PARTS)] + [b"last part"]
    # Part numbers as uploaded: the last first, unless the driver streams them in order.
    in_order = bool(getattr(store, "parts_in_order", False))
    order = list(range(1, len(parts_data) + 1))
    if not in_order:
        order = [len(parts_data), *order[:-1]]
    upload = store.create_multipart(key)
    how = "in order: the driver streams them" if in_order else "out of order"
    uploaded = {n: store.upload_part(key, upload, n, parts_data[n - 1]) for n in order}
    parts = [uploaded[n] for n in sorted(uploaded)]
    try:
        visible = any(info.key == key for info in store.list(""))
        try:
            store.get(key)
            readable = True
        except ObjectNotFoundError:
            readable = False
        info = store.complete_multipart(key, upload, parts)
        if visible or readable:
            return VIOLATED, "an incomplete multipart upload was visible"
        stored, expected = store.get(key)[0], b"".join(parts_data)
        if stored != expected:
            return VIOLATED, (
                f"the object completed from {len(parts)} parts ({len(expected)} bytes, "
                f"uploaded {how}) {_assembled(stored, parts_data)}"
            )
        if info.size != len(expected):
            return VIOLATED, (
                f"the object completed from {len(parts)} parts reads back exact, but "
                f"CompleteMultipartUpload says it holds {info.size} bytes, not {len(expected)}"
            )
        detail = (
            f"parts invisible until completion; completed object exact ({len(parts)} parts, "
            f"uploaded {how})"
        )
        if not info.etag:
            detail += "; CompleteMultipartUpload returns an empty ETag (the driver reads it back)"
        return HELD, detail
    finally:
        store.delete(key)


def _assembled(stored: bytes, parts_data: list[bytes]) -> str:
    """How ``stored`` was assembled from ``parts_data``, as far as it can be told."""
    if len(stored) != sum(map(len, parts_data)):
        return f"holds {len(stored)} bytes"
    found, offset = [], 0
    for _ in parts_data:
        number = next(
            (n for n, data in enumerate(parts_data, 1) if stored.startswith(data, offset)), None
        )
        if number is None:
            return "holds other bytes than its parts"
        found.append(number)
        offset += len(parts_data[number - 1])
    return f"holds its parts in the order {', '.join(map(str, found))}, not by part number"


def _probe_object_list_after_write(store: Any) -> tuple[str, str]:
    key = probe_name()
    store.put(key, b"x")
    try:
        seen = any(info.key == key for info in store.list(key))
        read = store.get(key)[0] == b"x"
    finally:
        store.delete(key)
    gone = not any(info.key == key for info in store.list(key))
    if seen and read and gone:
        return HELD, "read-after-write and list-after-write (put and delete) are immediate"
    return VIOLATED, f"listed after put: {seen}; read after put: {read}; gone after delete: {gone}"


_OBJECT_STORE_PROBES: dict[Capability, Callable[[Any], tuple[str, str]]] = {
    Capability.CONDITIONAL_CREATE: _probe_conditional_create,
    Capability.CONDITIONAL_MULTIPART_COMPLETE: _probe_conditional_complete,
    Capability.COMPARE_AND_SWAP: _probe_compare_and_swap,
    Capability.VERSIONING: _probe_versioning,
    Capability.VERSION_DELETE: _probe_version_delete,
    Capability.MULTIPART: _probe_multipart,
    Capability.STRONG_LIST_AFTER_WRITE: _probe_object_list_after_write,
}
