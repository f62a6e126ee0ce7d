"""The POSIX driver and the rename protocol's order of durable operations (docs/protocol.md §4)."""

from __future__ import annotations

import os
from typing import Any

import pytest

import ckptstore
from ckptstore import CheckpointExistsError
from ckptstore.backends.posix import PosixDriver
from ckptstore.commit.rename import RenameCommit
from ckptstore.errors import (
    CheckpointStateError,
    ObjectNotFoundError,
    StorageError,
    StoreNotFoundError,
    TargetExistsError,
)
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
            by_handle = name in ("write", "fsync", "close", "start_writeback")
            shown = tuple(
                self.paths.get(a, a) if by_handle else a for a in args if isinstance(a, (str, int))
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
        shards = [c[1] for c in driver.calls if c[0] == "create"]
        driver.calls.clear()
    calls = driver.calls
    staging = next(c[1] for c in calls if c[0] == "rename_noreplace")
    index = {c: i for i, c in enumerate(calls)}
    manifest = f"{staging}/manifest.json"
    for shard in shards:  # sealed: every shard durable before the manifest exists
        assert index[("fsync", shard)] < index[("close", shard)] < index[("create", manifest)]
    assert index[("fsync", manifest)] < index[("close", manifest)]
    for directory in ("data/model/layer0", "data/model", "data", ""):
        path = f"{staging}/{directory}".rstrip("/")
        assert index[("close", manifest)] < index[("fsync_dir", path)]
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


def test_a_closed_shard_starts_its_writeback_and_is_fsynced_at_the_seal(recorded):
    store, driver = recorded
    pending = store.begin(1)
    writer = pending.open_shard("a")
    writer.write(b"123")
    writer.close()
    path = next(c[1] for c in driver.calls if c[0] == "create")
    assert driver.calls[-1] == ("start_writeback", path)
    assert not any(c[0] in ("fsync", "close") for c in driver.calls)
    assert [r.name for r in pending.seal()] == ["a"]
    assert driver.calls[-2:] == [("fsync", path), ("close", path)]
    pending.abort()


def test_at_most_64_closed_shards_wait_for_their_fsync(recorded):
    store, driver = recorded
    pending = store.begin(1)
    for i in range(70):
        pending.write(f"s{i:02d}", b"x")
    fsynced = [c[1].rsplit("/", 1)[1] for c in driver.calls if c[0] == "fsync"]
    assert fsynced == [f"s{i:02d}" for i in range(6)]  # the oldest first
    pending.abort()
    closed = {c[1] for c in driver.calls if c[0] == "close"}
    assert len(closed) == 70  # an abort closes what it held open


def _open_fds(under: Any) -> int:
    """Descriptors this process holds on files under ``under``: counting every descriptor
    would count a socket that a thread left by an earlier test opens or closes meanwhile."""
    held = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed since the listing (the listing's own descriptor among them)
            continue
        held += target.startswith(str(under))
    return held


class FailingFsync(RecordingDriver):
    """fsync fails (EIO) for every file named ``bad``."""

    def __getattr__(self, name: str) -> Any:
        if name != "fsync":
            return super().__getattr__(name)

        def fsync(handle: int) -> None:
            if self.paths[handle].endswith("/bad"):
                raise StorageError(5, "fsync: Input/output error")
            self.inner.fsync(handle)

        return fsync


def test_a_failed_fsync_fails_the_publish_and_every_later_seal(tmp_path):
    driver = FailingFsync(PosixDriver(str(tmp_path / "store")))
    store = Store(RenameCommit(driver))  # type: ignore[arg-type]
    store.strategy.open_root(create=True)
    before = _open_fds(tmp_path)
    pending = store.begin(1)
    pending.write("bad", b"lost")
    pending.write("good", b"kept")
    with pytest.raises(StorageError, match="Input/output"):
        pending.publish()
    assert pending.state == "aborted"
    assert store.steps() == []
    assert os.listdir(tmp_path / "store") == []  # the attempt was removed
    assert _open_fds(tmp_path) == before
    coordinator = store.begin(2)
    joined = store.join(2, coordinator.attempt)
    joined.write("bad", b"lost")
    with pytest.raises(StorageError):
        joined.seal()
    with pytest.raises(CheckpointStateError, match="failed"):
        joined.write("late", b"x")  # the attempt is done: the first shard's data may be gone
    with pytest.raises(CheckpointStateError, match="failed"):
        joined.seal()
    joined.abort()
    coordinator.abort()
    assert _open_fds(tmp_path) == before


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


def test_a_store_root_another_process_makes_meanwhile_opens(tmp_path, monkeypatch):
    """The ranks of a job open one new store at once: a root that appears between the
    checks of ``open`` is the store, not "exists but is not a directory"."""
    import ckptstore.backends.posix as posix

    root = tmp_path / "store"
    real_isdir = os.path.isdir
    checks = []

    def isdir(path):
        answer = real_isdir(path)
        if not checks and os.fspath(path) == str(root):
            checks.append(path)
            root.mkdir()  # the other rank, right after this process's first check
        return answer

    monkeypatch.setattr(posix.os.path, "isdir", isdir)
    store = ckptstore.open(f"file://{root}")
    monkeypatch.undo()
    assert checks and store.is_empty()
    store.begin(1).publish()
    assert ckptstore.open(f"file://{root}").steps() == [1]


def test_a_dropped_pending_checkpoint_closes_the_files_it_held(tmp_path):
    import gc

    store = ckptstore.open(str(tmp_path / "store"))
    before = _open_fds(tmp_path)
    for step in range(1, 300):
        store.begin(step).write("a", b"abandoned")  # never published nor aborted
    gc.collect()
    assert _open_fds(tmp_path) == before
    held = store.begin(300)
    held.write("a", b"held")
    assert _open_fds(tmp_path) > before  # the measure sees what a live pending one holds
    del held
    gc.collect()
    assert _open_fds(tmp_path) == before
    assert store.steps() == []
