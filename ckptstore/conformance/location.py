"""Fresh, empty places in the storage under test, and raw access to what they hold.

The suite never reaches storage except through a store URL and the commit strategy (and its
driver) that the URL opens; a ``Location`` is one sub-directory or sub-prefix of the URL under
test, opened as often as a restarted trainer would open it.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

from ckptstore.commit.base import CommitStrategy
from ckptstore.commit.conditional_put import ConditionalPutCommit
from ckptstore.commit.rename import MANIFEST_NAME
from ckptstore.conformance.audit import StorageAudit, audit_of
from ckptstore.conformance.faults import FaultInjector, FaultPlan
from ckptstore.conformance.faults.strays import Stray
from ckptstore.conformance.settling import settled
from ckptstore.driver import Capability, DriverFamily, UploadInfo, driver_family
from ckptstore.errors import (
    CapabilityError,
    CheckpointNotFoundError,
    IntegrityError,
    ObjectNotFoundError,
    StorageError,
)
from ckptstore.names import checkpoint_token, step_token
from ckptstore.registry import resolve
from ckptstore.retention import RetentionPolicy
from ckptstore.signing import SigningKey, Trust
from ckptstore.store import Store
from ckptstore.urls import parse_url, redact

__all__ = [
    "Clock",
    "Location",
    "LocationFactory",
    "StrategyLocation",
    "child_url",
    "open_for_measuring",
    "refused_at_open",
]

_ids = itertools.count()


def child_url(base: str, segment: str) -> str:
    """``base`` with one more path segment, before any query string (a bare path has none:
    a ``?`` in it is part of a name)."""
    if "://" not in base:
        return os.path.join(base, segment)
    path, sep, query = base.partition("?")
    return f"{path.rstrip('/')}/{segment}{sep}{query}"


def open_for_measuring(url: str, options: dict[str, Any]) -> CommitStrategy[Any]:
    """Open a store to measure it: created if missing, and never refused where ckptstore
    refuses a writer (the suite reports what is missing instead, and the probes measure it).

    Every refusal a strategy makes when a store is opened, or before its first save, is
    turned off: the check of the driver's declared capabilities (``Store`` calls
    ``check_capabilities``), a ``CapabilityError`` from ``open_root`` (a versioned store on a
    bucket without versioning), kept in ``refused_at_open`` for the report, and the probe of
    conditional create before the first publish. A store the strategy hands out afterwards
    (``with_driver``) is measured alike.
    """
    parsed = parse_url(url)
    strategy = resolve(parsed.scheme)(parsed, {**parsed.query, **options})
    strategy.__class__ = _measured(type(strategy))
    if isinstance(strategy, ConditionalPutCommit):
        strategy.verify_conditional_writes = False
    strategy.open_root(create=True)
    return strategy


def refused_at_open(strategy: CommitStrategy[Any]) -> list[str]:
    """What ``open_root`` refused the store for (empty: nothing), once opened to measure."""
    return list(getattr(strategy, "_refused_at_open", []))


def measuring_class(cls: type[CommitStrategy[Any]]) -> type[CommitStrategy[Any]]:
    """``cls`` as ``open_for_measuring`` makes it: refusing nothing at open."""
    return _measured(original_class(cls))


def original_class(cls: type[CommitStrategy[Any]]) -> type[CommitStrategy[Any]]:
    """The strategy class that ``open_for_measuring`` derived ``cls`` from (or ``cls``): the
    one that can be pickled, by its module and name."""
    while cls.__dict__.get("_measured", False):
        cls = cls.__bases__[0]
    return cls


@functools.cache
def _measured(cls: type[CommitStrategy[Any]]) -> type[CommitStrategy[Any]]:
    """``cls``, refusing nothing at open: a subclass of the same name (idempotent)."""
    if getattr(cls, "_measured", False):
        return cls

    def check_capabilities(self: CommitStrategy[Any]) -> None:
        """Refuse nothing: the probes report what is missing."""

    def open_root(self: CommitStrategy[Any], *, create: bool) -> None:
        try:
            cls.open_root(self, create=create)
        except CapabilityError as exc:
            self._refused_at_open = [str(exc)]  # type: ignore[attr-defined]

    namespace = {
        "check_capabilities": check_capabilities,
        "open_root": open_root,
        "_measured": True,
        "__module__": cls.__module__,
        "__qualname__": cls.__qualname__,
        "__doc__": cls.__doc__,
    }
    return type(cls.__name__, (cls,), namespace)


def _follow(driver: Any, clock: Clock) -> bool:
    """Make ``driver`` stamp its writes with ``clock`` where it can (a ``clock`` attribute, as
    the memory driver has); whether it does."""
    if not hasattr(driver, "clock") or isinstance(getattr(type(driver), "clock", None), property):
        return False
    driver.clock = clock
    return True


class Clock:
    """Wall-clock time plus an offset the tests move forward (to age leftovers past the grace)."""

    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.time() + self.offset

    def advance(self, seconds: float) -> None:
        """Move this clock forward."""
        self.offset += seconds


class StrategyLocation:
    """The one location of a store made from a strategy directly (a simulated file system, a
    traced real one), as the standard workload uses a location: each ``open`` puts a fault
    injector under a new store of it."""

    def __init__(self, strategy: CommitStrategy[Any], clock: Clock | None = None) -> None:
        self.base = strategy
        self.clock = clock or Clock()

    def open(
        self, plan: FaultPlan | None = None, retention: RetentionPolicy | None = None
    ) -> tuple[Store, FaultInjector]:
        injector = FaultInjector(self.base.driver, plan)
        store = Store(self.base.with_driver(injector), retention=retention, clock=self.clock)
        return store, injector


class Location:
    """One fresh, empty store location under the URL being tested."""

    def __init__(
        self,
        url: str,
        options: dict[str, Any] | None = None,
        cleanup_problems: list[str] | None = None,
    ) -> None:
        self.url = url
        self.options = dict(options or {})
        self.cleanup_problems = [] if cleanup_problems is None else cleanup_problems
        """What ``destroy`` could not remove, and why (shared with the factory's other
        locations: the report's ``cleanup`` line)."""
        self.clock = Clock()
        self.base = open_for_measuring(url, self.options)
        self.storage_follows_clock = _follow(self.base.driver, self.clock)
        """The storage stamps its writes with ``clock`` (memory://): time the suite makes pass
        passes for the storage too, so that an upload can outlive the grace period on the
        storage's own clock while its parts keep arriving."""
        self.changes = 0
        """Calls made through ``open``'s stores that may have changed the storage, and
        corruptions: while it stays the same, what the storage holds does too."""
        self._touched: set[str] | None = set()
        self.strays: list[Stray] = []
        """Foreign entries the suite planted here: never leftovers of the protocol's."""
        self.uploads_begun: dict[tuple[str, str], None] = {}
        """Multipart uploads (key, id) begun through ``open``'s stores and not seen completed
        or aborted: ``leftovers`` asks the storage for each one it does not list."""

    def open(
        self,
        plan: FaultPlan | None = None,
        retention: RetentionPolicy | None = None,
        *,
        signing_key: SigningKey | None = None,
        trust: Trust | None = None,
        incremental: bool = False,
    ) -> tuple[Store, FaultInjector]:
        """A fresh Store over this location, its driver wrapped in a fault injector (that
        signs with ``signing_key``, reads only what ``trust`` trusts, and saves incrementally
        (``incremental``), if given)."""
        injector = FaultInjector(
            self.base.driver, plan, on_change=self.changed, on_upload=self._upload_call
        )
        strategy: CommitStrategy[Any] = self.base.with_driver(injector)
        store = Store(
            strategy,
            retention=retention,
            clock=self.store_clock,
            signing_key=signing_key,
            trust=trust,
            incremental=incremental,
        )
        return store, injector

    @property
    def store_clock(self) -> Callable[[], float]:
        """The clock a store here runs on: ``clock``, unless the storage itself follows it
        (then the store's own clock is this host's, and the storage's stamps carry the time
        the suite made pass; GC, which measures ages on the storage's clock, would otherwise
        count it twice)."""
        return time.time if self.storage_follows_clock else self.clock

    def changed(self, names: tuple[str, ...] | None = None) -> None:
        """Note a change of the storage (of ``names``; None: of anything) made some way other
        than through ``open``'s stores: the next invariant check must not skip it."""
        self.changes += 1
        if names is None:
            self._touched = None
        elif self._touched is not None:
            self._touched.update(names)

    def _upload_call(self, name: str, args: tuple[Any, ...], result: Any) -> None:
        """Track the uploads begun here (``FaultInjector.on_upload``)."""
        if name == "create_multipart":
            self.uploads_begun[(str(args[0]), str(result))] = None
        elif len(args) > 1:
            self.uploads_begun.pop((str(args[0]), str(args[1])), None)

    def unlisted_uploads(self, listed: set[str]) -> set[str]:
        """The uploads begun here that the storage still holds and does not list (not in
        ``listed``, the raw names): found by asking for each one (``upload_progress``: S3's
        ListParts), a route GC does not take. An upload gone is forgotten."""
        found: set[str] = set()
        driver = self.base.driver
        for key, upload_id in list(self.uploads_begun):
            if f"{key} (upload {upload_id})" in listed:
                continue
            try:
                driver.upload_progress(UploadInfo(key, upload_id, 0.0))
            except ObjectNotFoundError:
                self.uploads_begun.pop((key, upload_id), None)
                continue
            except StorageError as exc:
                if exc.http_status in UNSUPPORTED:
                    return found  # no route to ask by: the probes say what is missing
                raise
            found.add(f"{key} (upload {upload_id}, not listed by ListMultipartUploads)")
        return found

    def take_touched(self) -> set[str] | None:
        """The raw names changed since the last call (None: some change's names are unknown)."""
        touched, self._touched = self._touched, set()
        return touched

    @property
    def audit(self) -> StorageAudit:
        """The raw view of the strategy's storage; CapabilityError if there is none."""
        audit = audit_of(self.base)
        if audit is None:
            raise CapabilityError(
                f"{type(self.base).__name__} has no StorageAudit (ckptstore.conformance.audit: "
                f"implement it, or register_audit one): the suite cannot look for what a crash "
                f"left behind"
            )
        return audit

    def raw_names(self) -> set[str]:
        """Everything the location holds, as the strategy's raw listing names it."""
        return self.audit.raw_names()

    def leftovers(self) -> set[str]:
        """Raw names that belong to no published checkpoint (nor to the store itself), apart
        from the foreign entries the suite planted (``faults.strays``)."""
        owned: set[str] = set(self.audit.fixed_names) | self.audit.lineage_names()
        for step, epoch in self.base.published_checkpoints():
            try:
                owned |= self.audit.stored_names(self.base.read_manifest(step, epoch))
            except CheckpointNotFoundError:
                continue  # a stray named like a step, or unpublished since the listing
            except IntegrityError:
                owned |= {n for n in self.raw_names() if step_token(step) in n}
        raw = self.raw_names()
        if self.uploads_begun and driver_family(self.base.driver) is DriverFamily.OBJECT_STORE:
            raw |= self.unlisted_uploads(raw)
        return {name for name in raw - owned if not any(stray.owns(name) for stray in self.strays)}

    def corrupt(self, step: int, name: str, how: str, epoch: int = 0) -> str | None:
        """Damage one shard of checkpoint (``step``, ``epoch``) behind the store's back;
        return the damage done.

        ``how`` is ``bitflip`` or ``truncate``. A version-pinned object cannot be changed, so
        there the pinned version is deleted instead (``missing``). None: nothing was done.
        """
        manifest = self.base.read_manifest(step, epoch) if epoch else self.base.read_manifest(step)
        record = manifest.shard(name)
        if record is None:
            return None
        self.changed((step_token(step),))
        driver = self.base.driver
        if "version_id" in record.locator:
            if Capability.VERSION_DELETE not in driver.capabilities:
                return None  # a pinned version that cannot be deleted cannot be damaged
            driver.delete(record.locator["key"], version_id=record.locator["version_id"])
            return "missing"
        with self.base.open_shard_reader(manifest, record) as stream:
            data = stream.read()
        altered = _flip_a_bit(data) if how == "bitflip" else data[:-1]
        if "path" in record.locator:
            path = f"{checkpoint_token(step, epoch)}/{record.locator['path']}"
            driver.unlink(path)
            handle = driver.create(path)
            try:
                driver.write(handle, altered)
            finally:
                driver.close(handle)
        else:
            key = record.locator["key"]
            driver.put(key, altered)
            settled(lambda: driver.get(key)[0], lambda read: read == altered)  # a stale read
        return how

    def replace_manifest(self, step: int, data: bytes, epoch: int = 0) -> None:
        """Overwrite the stored manifest of checkpoint (``step``, ``epoch``) with ``data``,
        behind the store's back (a forger with write access to the storage)."""
        self.changed((step_token(step),))
        driver = self.base.driver
        if isinstance(self.base, ConditionalPutCommit):
            key = self.base.manifest_key(step, epoch)
            driver.put(key, data)
            settled(lambda: driver.get(key)[0], lambda read: read == data)  # a stale read
            return
        path = f"{checkpoint_token(step, epoch)}/{MANIFEST_NAME}"
        driver.unlink(path)
        handle = driver.create(path)
        try:
            driver.write(handle, memoryview(data))
        finally:
            driver.close(handle)

    def destroy(self) -> None:
        """Remove everything at this location, by every route the storage supports: a step
        the storage refuses (405 to ListObjectVersions, 501 to ListMultipartUploads) does
        not stop the others; what could not be removed is noted in ``cleanup_problems``."""
        driver = self.base.driver
        if driver_family(driver) is DriverFamily.FILE_SYSTEM:
            with self._noting("files"):
                for name in sorted(self.raw_names(), key=lambda n: -n.count("/")):
                    if driver.stat(name).is_dir:
                        driver.rmdir(name)
                    else:
                        driver.unlink(name)
                driver.rmdir("")
            return
        with self._noting("incomplete multipart uploads"):
            for upload in list(driver.list_multipart_uploads("")):
                driver.abort_multipart(upload.key, upload.upload_id)
        versioned = Capability.VERSIONING in driver.capabilities
        with self._noting("old object versions", unsupported_is_fine=not versioned):
            for info in list(driver.list_versions("")):
                driver.delete(info.key, version_id=info.version_id)
        with self._noting("objects"):  # current versions: also where versions cannot be listed
            for info in list(driver.list("")):
                driver.delete(info.key)

    @contextlib.contextmanager
    def _noting(self, what: str, *, unsupported_is_fine: bool = False) -> Iterator[None]:
        """Run one route of ``destroy``; a storage error ends it, noted (once per kind),
        unless the storage does not support the route and nothing needs it
        (``unsupported_is_fine``: no versions to list on a server without versioning)."""
        try:
            yield
        except ObjectNotFoundError:
            pass  # removed meanwhile
        except StorageError as exc:
            if unsupported_is_fine and exc.http_status in UNSUPPORTED:
                return
            problem = f"{what} under {redact(self.url)}: {exc}"
            if not any(p.startswith(f"{what} under ") for p in self.cleanup_problems):
                self.cleanup_problems.append(problem)


UNSUPPORTED = (400, 405, 501)
"""A server's answers to a request it does not implement (NotImplemented, MethodNotAllowed,
or a 400 for an unknown parameter such as ``?versions``)."""


class LocationFactory:
    """Makes fresh locations under a base URL: ``<base>/conformance-<pid>-<n>``."""

    def __init__(self, base_url: str, options: dict[str, Any] | None = None) -> None:
        self.base_url = base_url
        self.options = dict(options or {})
        self.cleanup_problems: list[str] = []
        """What its locations' ``destroy`` could not remove (the report's ``cleanup``)."""

    def __call__(self) -> Location:
        return Location(
            child_url(self.base_url, f"conformance-{os.getpid()}-{next(_ids)}"),
            self.options,
            self.cleanup_problems,
        )


def _flip_a_bit(data: bytes) -> bytes:
    changed = bytearray(data)
    changed[len(changed) // 2] ^= 0x04
    return bytes(changed)
