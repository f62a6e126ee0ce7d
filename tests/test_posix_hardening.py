"""file:// under hostile conditions (issue 11): clock skew, planted FIFOs, few descriptors,
a full disk at the manifest, and errors that name what failed."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from ckptstore.backends.posix import PosixDriver
from ckptstore.commit.rename import GC_CLOCK_PREFIX, RenameCommit
from ckptstore.commit.unsynced import HELD_DESCRIPTORS
from ckptstore.conformance.audit import audit_of
from ckptstore.conformance.models.simfs import SimulatedFileSystem
from ckptstore.errors import ManifestCorruptError, ObjectNotFoundError, StorageError
from ckptstore.store import Store

HOUR = 3600.0
GC_GONE = "was removed by garbage collection"


def _posix_store(root: Path, **kwargs: Any) -> Store:
    store = Store(RenameCommit(PosixDriver(str(root))), **kwargs)
    store.strategy.open_root(create=True)
    return store


def _age_tree(path: Path, seconds: float) -> None:
    """Set every mtime under ``path`` ``seconds`` into the past, as if it were idle so long."""
    then = time.time() - seconds
    os.utime(path, (then, then))
    for directory, _dirs, files in os.walk(path):
        for name in files:
            os.utime(os.path.join(directory, name), (then, then))
        os.utime(directory, (then, then))


# -- item 4: GC ages by the file system's clock ---------------------------------------------


def test_gc_ages_by_the_file_systems_clock_when_the_host_clock_is_fast(tmp_path, monkeypatch):
    real_time = time.time

    def fast() -> float:  # this GC host's clock runs two hours ahead
        return real_time() + 2 * HOUR

    monkeypatch.setattr(time, "time", fast)
    store = _posix_store(tmp_path / "store", clock=fast)
    pending = store.begin(1)
    pending.write("a", b"live")
    report = store.gc(grace=timedelta(hours=1))
    assert report.removed == []
    assert [item.kind for item in report.kept_young] == ["staging"]
    pending.write("b", b"still live")
    assert pending.publish().step == 1
    assert store.get(1).read("b") == b"still live"


def test_gc_ages_by_the_file_systems_clock_when_it_is_behind_the_host():
    file_system = SimulatedFileSystem(lambda: time.time() - 2 * HOUR)  # storage 2 h behind
    store = Store(RenameCommit(file_system))  # type: ignore[arg-type]
    pending = store.begin(1)
    pending.write("a", b"live")
    assert store.gc(grace=timedelta(hours=1)).removed == []
    assert pending.publish().step == 1
    assert file_system.listdir("") == ["LATEST", "step-" + "0" * 19 + "1"]  # clock file gone


def test_gc_still_removes_attempts_idle_on_the_file_systems_clock(tmp_path):
    store = _posix_store(tmp_path / "store")
    store.begin(1).write("a", b"dead")
    young = store.begin(2)
    young.write("a", b"young")
    (staging,) = (tmp_path / "store").glob("step-*1.pending-*")
    _age_tree(staging, 2 * HOUR)
    report = store.gc(grace=timedelta(hours=1))
    assert [item.name for item in report.removed] == [staging.name]
    assert report.removed[0].age_s >= 2 * HOUR - 1
    assert [item.kind for item in report.kept_young] == ["staging"]
    assert young.publish().step == 2


def test_gc_clock_files_are_invisible_and_removed_when_left_behind(tmp_path):
    root = tmp_path / "store"
    store = _posix_store(root)
    running = root / f"{GC_CLOCK_PREFIX}0123456789abcdef"  # another gc's, in use
    running.touch()
    assert store.is_empty()
    audit = audit_of(store.strategy)
    assert audit is not None and audit.raw_names() == set()
    report = store.gc(grace=timedelta(hours=1))
    assert report.removed == [] and report.kept_young == []  # not worth a line of the report
    assert sorted(p.name for p in root.iterdir()) == [running.name]  # its own is gone
    _age_tree(running, 2 * HOUR)  # that gc died two hours ago
    assert [item.kind for item in store.gc(grace=timedelta(hours=1)).removed] == ["gc-clock"]
    assert list(root.iterdir()) == []


# -- item 4: a writer whose attempt GC removed is told so ----------------------------------


class StaleHandles(PosixDriver):
    """As NFS does: a write or fsync to a file removed by another client fails (ESTALE)."""

    def write(self, handle: int, data: Any) -> None:
        self._check_not_stale(handle)
        super().write(handle, data)

    def fsync(self, handle: int) -> None:
        self._check_not_stale(handle)
        super().fsync(handle)

    def _check_not_stale(self, handle: int) -> None:
        if not os.path.exists(self._abs(self._paths[handle])):
            raise StorageError(errno.ESTALE, "Stale file handle")


class GcBeforeRename(PosixDriver):
    """A GC, two hours ahead, runs between the manifest's fsyncs and the publishing rename."""

    def rename_noreplace(self, src: str, dst: str) -> None:
        if ".pending-" in src and not dst.startswith(".trash-"):
            _later_gc(self.root)
        super().rename_noreplace(src, dst)


def _later_gc(root: str) -> None:
    later = Store(RenameCommit(PosixDriver(root)), clock=lambda: time.time() + 2 * HOUR)
    assert [item.kind for item in later.gc(grace=timedelta(hours=1)).removed] == ["staging"]


# Where the writer finds out: the driver it runs on, and what it does next.
STAGES: dict[str, tuple[type[PosixDriver], Callable[[Any, Any], Any]]] = {
    "shard-open": (PosixDriver, lambda pending, writer: pending.write("b", b"x")),
    "write": (StaleHandles, lambda pending, writer: writer.write(b"more")),
    "seal": (StaleHandles, lambda pending, writer: pending.seal()),
    "manifest": (PosixDriver, lambda pending, writer: pending.publish()),
    "rename": (GcBeforeRename, lambda pending, writer: pending.publish()),
}


@pytest.mark.parametrize("stage", STAGES)
def test_a_writer_whose_attempt_gc_removed_is_told_so(tmp_path, stage):
    root = tmp_path / "store"
    driver_class, next_step = STAGES[stage]
    store = Store(RenameCommit(driver_class(str(root))))
    store.strategy.open_root(create=True)
    pending = store.begin(7)
    pending.write("a", b"closed, waiting for its fsync")
    writer = pending.open_shard("open")
    if stage == "rename":
        writer.close()
    else:
        _later_gc(str(root))
    with pytest.raises(ObjectNotFoundError, match=GC_GONE) as caught:
        next_step(pending, writer)
    message = str(caught.value)
    assert f"attempt {pending.attempt} of step 7" in message
    assert "grace period must exceed" in message
    assert store.steps() == []
    writer.abort()
    pending.abort()
    assert list(root.iterdir()) == []


# -- item 5: only regular files are read, and never by waiting -----------------------------


def _promptly(call: Callable[[], Any], fifo: Path) -> Any:
    """Run ``call``; fail (not hang) if it blocks on ``fifo``, which it must not open to wait."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = call()
        except BaseException as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout=30)  # a bound on a hang, not a measurement: it returns at once
    if thread.is_alive():
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)  # let the blocked reader go
        os.close(fd)
        thread.join(timeout=30)
        pytest.fail(f"blocked on the FIFO {fifo}")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


@pytest.mark.parametrize("kind", ["fifo", "directory", "symlink"])
def test_the_driver_opens_only_regular_files(tmp_path, kind):
    driver = PosixDriver(str(tmp_path))
    (tmp_path / "target").write_bytes(b"7\n")
    planted = tmp_path / "LATEST"
    if kind == "fifo":
        os.mkfifo(planted)
    elif kind == "directory":
        planted.mkdir()
    else:
        planted.symlink_to(tmp_path / "target")
    with pytest.raises(StorageError, match="not a regular file") as caught:
        _promptly(lambda: driver.open_read("LATEST"), planted)
    assert not isinstance(caught.value, ObjectNotFoundError)
    assert caught.value.errno == (errno.EISDIR if kind == "directory" else errno.EINVAL)
    with driver.open_read("target") as stream:
        assert os.get_blocking(stream.fileno())  # O_NONBLOCK was cleared for the reads
        assert stream.read() == b"7\n"


def test_a_fifo_planted_as_latest_or_as_a_manifest_never_blocks_a_reader(tmp_path):
    root = tmp_path / "store"
    store = _posix_store(root)
    store.save(1, {"a": b"one"})
    store.save(2, {"a": b"two"})
    (root / "LATEST").unlink()
    os.mkfifo(root / "LATEST")
    latest = _promptly(store.latest, root / "LATEST")  # the hint is ignored
    assert latest is not None and latest.step == 2
    manifest = root / ("step-" + "0" * 19 + "2") / "manifest.json"
    manifest.unlink()
    os.mkfifo(manifest)
    with pytest.raises(ManifestCorruptError, match="not a regular file"):
        _promptly(lambda: store.get(2), manifest)
    latest = _promptly(lambda: store.latest(verified=True), manifest)
    assert latest is not None and latest.step == 1


# -- item 12: held descriptors stay within the process's limit -----------------------------

FEW_DESCRIPTORS = textwrap.dedent(
    """
    import os, resource, sys
    import ckptstore
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (40, hard))
    store = ckptstore.open(sys.argv[1])
    store.save(1, {f"s{i:03d}": b"x" * 100 for i in range(60)})
    baseline = len(os.listdir("/proc/self/fd"))
    saves = [store.begin(step) for step in range(2, 6)]  # four saves in flight at once
    for i in range(20):
        for pending in saves:
            pending.write(f"s{i:03d}", b"y" * 100)
    held = len(os.listdir("/proc/self/fd")) - baseline
    assert held <= 40 // 4, f"{held} files held open by the saves in flight"
    for pending in saves:
        pending.publish()
    print(store.steps())
    """
)


def test_saves_hold_at_most_a_share_of_the_descriptor_limit(tmp_path):
    result = subprocess.run(
        [sys.executable, "-c", FEW_DESCRIPTORS, f"file://{tmp_path}/store"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[1, 2, 3, 4, 5]"


def test_held_descriptors_are_given_back_whatever_ends_the_attempt(tmp_path):
    store = _posix_store(tmp_path / "store")
    before = HELD_DESCRIPTORS.held
    published, aborted, dropped = store.begin(1), store.begin(2), store.begin(3)
    for pending in (published, aborted, dropped):
        for i in range(5):
            pending.write(f"s{i}", b"z")
    assert HELD_DESCRIPTORS.held == before + 15
    published.publish()
    aborted.abort()
    store.strategy.release(3, dropped.attempt)
    assert HELD_DESCRIPTORS.held == before


# -- item 13: errors on an open file name its path ------------------------------------------


@pytest.mark.parametrize("call", ["write", "fsync"])
def test_errors_on_an_open_file_name_its_path(tmp_path, call):
    driver = PosixDriver(str(tmp_path))
    driver.mkdir("staging")
    handle = driver.create("staging/shard.bin")
    os.close(handle)  # the descriptor fails (EBADF) from now on
    with pytest.raises(StorageError) as caught:
        if call == "write":
            driver.write(handle, b"data")
        else:
            driver.fsync(handle)
    assert caught.value.strerror == f"{call} {tmp_path}/staging/shard.bin: Bad file descriptor"
    with pytest.raises(StorageError, match=f"close {tmp_path}/staging/shard.bin: Bad file"):
        driver.close(handle)


# -- item 14: a failure before the publishing rename leaves nothing behind ------------------


class FullDisk(SimulatedFileSystem):
    """A file system that runs out of space at one call on the manifest or its directories."""

    def __init__(self, failing: str) -> None:
        super().__init__(time.time)
        self.failing = failing
        self.paths: dict[int, str] = {}

    def create(self, path: str) -> int:
        self._fail_if("create", path)
        handle = super().create(path)
        self.paths[handle] = path
        return handle

    def write(self, handle: int, data: Any) -> None:
        self._fail_if("write", self.paths[handle])
        super().write(handle, data)

    def fsync(self, handle: int) -> None:
        self._fail_if("fsync", self.paths[handle])
        super().fsync(handle)

    def fsync_dir(self, path: str) -> None:
        self._fail_if("fsync_dir", path)
        super().fsync_dir(path)

    def _fail_if(self, call: str, path: str) -> None:
        if call == self.failing and (path.endswith("manifest.json") or call == "fsync_dir"):
            raise StorageError(errno.ENOSPC, f"{call} {path}: No space left on device")


@pytest.mark.parametrize("failing", ["create", "write", "fsync", "fsync_dir"])
def test_a_failure_writing_the_manifest_removes_the_staging_directory(failing):
    file_system = FullDisk(failing)
    store = Store(RenameCommit(file_system))  # type: ignore[arg-type]
    with pytest.raises(StorageError, match="No space left") as caught:
        store.save(1, {"model/a.bin": b"a" * 1000, "b": b"b"})
    assert caught.value.errno == errno.ENOSPC
    assert file_system.listdir("") == []  # no staging directory left for gc
    assert store.steps() == []
    file_system.failing = ""
    assert store.save(1, {"a": b"again"}).step == 1


@pytest.fixture(autouse=True)
def _no_descriptor_leaks() -> Iterator[None]:
    before = HELD_DESCRIPTORS.held
    yield
    assert HELD_DESCRIPTORS.held == before
