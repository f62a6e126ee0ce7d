"""Driver families are declared, not guessed, and the fault injector wraps exactly the calls
the driver protocols declare."""

from __future__ import annotations

import inspect
import os
from typing import Any

import pytest

import ckptstore
from ckptstore.backends.lustre import LayoutFileSystemDriver, LustreDriver
from ckptstore.backends.memory import MemoryDriver
from ckptstore.backends.posix import PosixDriver
from ckptstore.backends.s3 import S3Driver
from ckptstore.conformance.faults import FaultInjector
from ckptstore.conformance.models.simfs import SimulatedFileSystem
from ckptstore.driver import (
    CloningDriver,
    DriverFamily,
    FileSystemDriver,
    LinkingDriver,
    ObjectStoreDriver,
    RangedReadDriver,
    driver_family,
    storage_calls,
)

DRIVERS = [
    (PosixDriver, DriverFamily.FILE_SYSTEM, (CloningDriver, LinkingDriver)),
    (
        LustreDriver,
        DriverFamily.FILE_SYSTEM,
        (LayoutFileSystemDriver, CloningDriver, LinkingDriver),
    ),
    (SimulatedFileSystem, DriverFamily.FILE_SYSTEM, (CloningDriver, LinkingDriver)),
    (MemoryDriver, DriverFamily.OBJECT_STORE, (ObjectStoreDriver,)),
    (S3Driver, DriverFamily.OBJECT_STORE, (RangedReadDriver,)),
]


def _declared(*protocols: type) -> set[str]:
    return {
        name
        for protocol in protocols
        for klass in protocol.__mro__
        if klass.__module__.startswith("ckptstore")
        for name, member in vars(klass).items()
        if inspect.isfunction(member) and not name.startswith("_")
    }


@pytest.mark.parametrize(("driver", "family", "protocol"), DRIVERS)
def test_every_driver_declares_its_family_and_implements_every_call(
    driver: type, family: DriverFamily, protocol: tuple[type, ...]
) -> None:
    assert driver.family is family  # type: ignore[attr-defined]
    calls = storage_calls(object.__new__(driver))
    assert calls == _declared(*protocol)
    for name in calls:  # its own code, never a protocol's empty stub
        owner = next(k for k in driver.__mro__ if name in vars(k))
        assert owner.__module__ != "ckptstore.driver", f"{driver.__name__}.{name} is a stub"
        assert owner is not LayoutFileSystemDriver, f"{driver.__name__}.{name} is a stub"


def test_the_calls_are_the_protocols_own() -> None:
    assert {"start_writeback", "fsync_dir", "rename_noreplace"} <= _declared(FileSystemDriver)
    assert "create_with_layout" in _declared(LayoutFileSystemDriver)
    assert {"put", "complete_multipart", "upload_progress"} <= _declared(ObjectStoreDriver)
    assert not _declared(FileSystemDriver) & _declared(ObjectStoreDriver) - {"open_read"}


class _Structural:
    """A third-party driver that implements a protocol without subclassing it."""

    def __init__(self, family: Any) -> None:
        self.family = family


def test_a_driver_that_declares_no_family_is_refused_clearly() -> None:
    with pytest.raises(TypeError, match="declares no driver family"):
        driver_family(_Structural(None))
    with pytest.raises(TypeError, match="declares no driver family"):
        driver_family(_Structural("object store"))  # the enum, not its value
    structural = _Structural(DriverFamily.OBJECT_STORE)
    assert driver_family(structural) is DriverFamily.OBJECT_STORE
    assert storage_calls(structural) == _declared(ObjectStoreDriver)


@pytest.fixture
def recorded_posix_save(tmp_path: Any) -> FaultInjector:
    store = ckptstore.open(f"file://{tmp_path}/store")
    injector = FaultInjector(store.strategy.driver)
    faulted = ckptstore.Store(store.strategy.with_driver(injector))
    faulted.save(1, {"a": os.urandom(1000), "b": b"x"})
    return injector


def test_the_injector_counts_every_storage_call_the_save_made(
    recorded_posix_save: FaultInjector,
) -> None:
    names = {record.name for record in recorded_posix_save.calls}
    assert "start_writeback" in names  # missing from the injector's old hand-written list
    assert {"create", "write", "fsync", "fsync_dir", "rename_noreplace"} <= names
    assert recorded_posix_save.family is DriverFamily.FILE_SYSTEM


@pytest.mark.filterwarnings("ignore::ckptstore.backends.lustre.LustreStripingWarning")
@pytest.mark.parametrize(
    "url",
    [
        "file://{tmp}/s",
        "lustre://{tmp}/s",
        "memory://with-driver-{pid}/s?concurrency=4",
        "memory+versioned://with-driver-v-{pid}/s",
    ],
)
def test_with_driver_builds_a_fresh_strategy_sharing_no_state(tmp_path: Any, url: str) -> None:
    store = ckptstore.open(url.format(tmp=tmp_path, pid=os.getpid()))
    strategy = store.strategy
    clone = strategy.with_driver(FaultInjector(strategy.driver))
    assert type(clone) is type(strategy) and clone.settings() == strategy.settings()
    assert isinstance(clone.driver, FaultInjector) and clone.driver.inner is strategy.driver
    for name, value in vars(strategy).items():
        if name != "driver" and not isinstance(value, (int, str, bool, float, type(None))):
            assert vars(clone)[name] is not value, f"{name} is shared with the original"
