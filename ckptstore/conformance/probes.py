"""Capability probes: measure on the real system what its driver declares (docs/protocol.md §2).

Each probe works in a fresh location, through the driver alone, and reports ``held``,
``violated`` or ``not measured`` with a detail a storage engineer can act on; or ``storage
error`` when the storage failed the probe on every try (see ``outcomes``), which measures
nothing. Some systems that
claim S3 compatibility ignore ``If-None-Match`` on some calls, or reject quoted ETags in
``If-Match``: that is what these probes exist to find.
"""

from __future__ import annotations

import functools
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ckptstore.conformance.location import Location, refused_at_open
from ckptstore.conformance.outcomes import STORAGE_ERROR, retry_storage_failures, storage_failure
from ckptstore.driver import Capability, DriverFamily, PutMode, driver_family
from ckptstore.errors import (
    CkptStoreError,
    ObjectNotFoundError,
    PreconditionFailedError,
    TargetExistsError,
)

__all__ = ["HELD", "NOT_MEASURED", "STORAGE_ERROR", "VIOLATED", "ProbeResult", "run_probes"]

HELD, VIOLATED, NOT_MEASURED = "held", "violated", "not measured"


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


def run_probes(location: Location) -> list[ProbeResult]:
    """Probe every capability of the driver behind ``location``."""
    driver = location.base.driver
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


def _name() -> str:
    return f".probe-{secrets.token_hex(6)}"


# -- file systems ------------------------------------------------------------------------


def _probe_rename_noreplace(fs: Any) -> tuple[str, str]:
    source, target = _name(), _name()
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


def _probe_fsync(fs: Any) -> tuple[str, str]:
    name = _name()
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
    name = _name()
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
    key = _name()
    try:
        store.put(key, b"first", mode=PutMode.CREATE)
        try:
            store.put(key, b"second", mode=PutMode.CREATE)
        except PreconditionFailedError:
            pass
        else:
            return VIOLATED, "PutObject with If-None-Match: * overwrote an existing object"
        if store.get(key)[0] != b"first":
            return VIOLATED, "a refused conditional put changed the object"
        return HELD, "PutObject If-None-Match: * refuses an existing key (412)"
    finally:
        store.delete(key)


def _probe_conditional_complete(store: Any) -> tuple[str, str]:
    key = _name()
    store.put(key, b"first")
    upload = store.create_multipart(key)
    try:
        part = store.upload_part(key, upload, 1, b"second")
        try:
            store.complete_multipart(key, upload, [part], mode=PutMode.CREATE)
        except PreconditionFailedError:
            return HELD, "CompleteMultipartUpload If-None-Match: * refuses an existing key"
        return (
            VIOLATED,
            "CompleteMultipartUpload ignored If-None-Match (ckptstore does not need it)",
        )
    finally:
        try:
            store.abort_multipart(key, upload)
        except CkptStoreError:
            pass
        store.delete(key)


def _probe_compare_and_swap(store: Any) -> tuple[str, str]:
    key = _name()
    first = store.put(key, b"1")
    notes = []
    try:
        second = store.put(key, b"2", mode=PutMode.update(first.etag))
        try:
            store.put(key, b"3", mode=PutMode.update(first.etag))
        except PreconditionFailedError:
            pass
        else:
            return VIOLATED, "PutObject If-Match with a stale ETag overwrote the object"
        try:
            store.put(key, b"4", mode=PutMode.update(second.etag.strip('"')))
            notes.append("unquoted ETags accepted")
        except PreconditionFailedError:
            notes.append("unquoted ETags refused (ckptstore sends them as given)")
        try:
            store.put(_name(), b"x", mode=PutMode.update(first.etag))
            return VIOLATED, "If-Match on a missing key created it"
        except ObjectNotFoundError:
            notes.append("If-Match on a missing key: 404")
        except PreconditionFailedError:
            notes.append("If-Match on a missing key: 412")
        return HELD, "; ".join(["stale ETag refused", *notes])
    finally:
        store.delete(key)


def _probe_versioning(store: Any) -> tuple[str, str]:
    key = _name()
    first = store.put(key, b"1")
    second = store.put(key, b"2")
    try:
        if first.version_id is None or first.version_id == second.version_id:
            return VIOLATED, "puts return no distinct version ids (versioning off?)"
        if store.get(key, version_id=first.version_id)[0] != b"1":
            return VIOLATED, "reading an old version by id returned other bytes"
        store.delete(key)
        markers = [v for v in store.list_versions(key) if v.is_delete_marker]
        if not markers:
            return VIOLATED, "a plain DELETE removed the object instead of adding a delete marker"
        return HELD, "version ids on put, read by version after overwrite, delete markers"
    finally:
        for version in list(store.list_versions(key)):
            store.delete(key, version_id=version.version_id)


def _probe_multipart(store: Any) -> tuple[str, str]:
    key = _name()
    upload = store.create_multipart(key)
    part = store.upload_part(key, upload, 1, b"part")
    try:
        visible = any(info.key == key for info in store.list(""))
        try:
            store.get(key)
            readable = True
        except ObjectNotFoundError:
            readable = False
        info = store.complete_multipart(key, upload, [part])
        if visible or readable:
            return VIOLATED, "an incomplete multipart upload was visible"
        if store.get(key)[0] != b"part" or info.size != 4:
            return VIOLATED, "the completed object differs from its parts"
        return HELD, "parts invisible until completion; completed object exact"
    finally:
        store.delete(key)


def _probe_object_list_after_write(store: Any) -> tuple[str, str]:
    key = _name()
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
    Capability.MULTIPART: _probe_multipart,
    Capability.STRONG_LIST_AFTER_WRITE: _probe_object_list_after_write,
}
