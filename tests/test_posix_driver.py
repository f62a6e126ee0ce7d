"""The POSIX driver and the rename protocol's order of durable operations (DESIGN §4.1)."""

from __future__ import annotations

import os
from typing import Any

import pytest

from ckptstore import CheckpointExistsError, StoreNotFoundError
from ckptstore.backends.posix import PosixDriver
from ckptstore.commit.rename import RenameCommit
from ckptstore.errors import ObjectNotFoundError, TargetExistsError
from ckptstore.store import Store


class RecordingDriver:
    """Delegates to a real PosixDriver and records every call with its path arguments."""

    def __init__(self, inner: PosixDriver) -> None:
        self.inner = inner
        self.calls: list[tuple[str, ...]] = []
        self.paths: dict[int, str] = {}
        self.url = inner.url
        self.capabilities = inner.capabilities

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.inner, name)

        def call(*args: Any) -> Any:
            result = method(*args)
            if name == "create":
                self.paths[result] = args[0]
            shown = tuple(
                self.paths.get(a, a) if name in ("write", "fsync", "close") else a
                for a in args
                if isinstance(a, (str, int))
            )
            self.calls.append((name, *map(str, shown)))
            return result

        return call


@pytest.fixture
def recorded(tmp_path):
    driver = RecordingDriver(PosixDriver(str(tmp_path / "store")))
    store = Store(RenameCommit(driver))  # type: ignore[arg-type]
    store.strategy.open_root(create=True)
    return store, driver


def test_publish_makes_everything_durable_before_and_after_the_rename(recorded):
    store, driver = recorded
    with store.begin(7) as pending:
        pending.write("model/layer0/w.bin", b"w" * 10)
        pending.write("trainer.json", b"{}")
        driver.calls.clear()
    calls = driver.calls
    staging = next(c[1] for c in calls if c[0] == "rename_noreplace")
    index = {c: i for i, c in enumerate(calls)}
    manifest = f"{staging}/manifest.json"
    assert calls[0] == ("create", manifest)
    assert index[("fsync", manifest)] < index[("close", manifest)]
    for directory in ("data/model/layer0", "data/model", "data", ""):
        path = f"{staging}/{directory}".rstrip("/")
        assert (
            index[("fsync_dir", path)]
            < index[("rename_noreplace", staging, "step-" + "0" * 19 + "7")]
        )
    # deepest first: an entry is durable before the directory holding its parent is
    assert (
        index[("fsync_dir", f"{staging}/data/model/layer0")]
        < index[("fsync_dir", f"{staging}/data/model")]
    )
    rename = index[("rename_noreplace", staging, "step-" + "0" * 19 + "7")]
    assert calls[rename + 1] == ("fsync_dir", "")  # the rename itself is made durable
    latest_tmp = next(c[1] for c in calls[rename:] if c[0] == "create")
    assert latest_tmp.startswith(".LATEST.tmp-")
    assert calls[-3:] == [
        ("close", latest_tmp),
        ("rename_replace", latest_tmp, "LATEST"),
        ("fsync_dir", ""),
    ]


def test_every_shard_is_fsynced_before_it_counts(recorded):
    store, driver = recorded
    pending = store.begin(1)
    writer = pending.open_shard("a")
    writer.write(b"123")
    assert not any(c[0] == "fsync" for c in driver.calls)
    writer.close()
    path = next(c[1] for c in driver.calls if c[0] == "create")
    assert driver.calls[-2:] == [("fsync", path), ("close", path)]
    pending.abort()


def test_rename_noreplace_never_replaces(tmp_path):
    driver = PosixDriver(str(tmp_path))
    driver.mkdir("a")
    driver.mkdir("b")
    with open(tmp_path / "b" / "keep", "w") as f:
        f.write("x")
    with pytest.raises(TargetExistsError):
        driver.rename_noreplace("a", "b")
    assert os.listdir(tmp_path / "b") == ["keep"]
    with pytest.raises(ObjectNotFoundError):
        driver.rename_noreplace("missing", "c")


def test_fallback_without_renameat2_refuses_to_replace(tmp_path, monkeypatch):
    monkeypatch.setattr(PosixDriver, "_renameat2", None)
    store = Store(RenameCommit(PosixDriver(str(tmp_path / "store"))))
    store.strategy.open_root(create=True)
    first, second = store.begin(1), store.begin(1)
    first.write("a", b"first")
    second.write("a", b"second")
    first.publish()
    with pytest.raises(CheckpointExistsError):
        second.publish()
    assert store.get(1).read("a") == b"first"
    assert store.gc(grace=0).removed == []


def test_store_root_must_exist_for_readers(tmp_path):
    from ckptstore import open as open_store

    with pytest.raises(StoreNotFoundError, match="no such directory"):
        open_store(f"file://{tmp_path}/nothing", create=False)
    (tmp_path / "file").write_text("x")
    with pytest.raises(StoreNotFoundError, match="not a directory"):
        open_store(f"file://{tmp_path}/file")
    store = open_store(f"file://{tmp_path}/deep/new/store")
    assert store.is_empty()
