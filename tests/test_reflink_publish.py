"""A directory published into a file-system store without copying its bytes: each shard a
copy-on-write clone (reflink) of the trainer's file, where the file system makes them (issue
27 item 1). The clone is the checkpoint's own: the trainer may delete or rewrite its file.

Real clones need XFS (``mkfs.xfs -m reflink=1``), btrfs or the like: the tests that need
them run in ``CKPTSTORE_TEST_REFLINK_DIR`` (or the temporary directory, if it has them) and
are skipped elsewhere; the rest run everywhere, with a stand-in ``FICLONE`` where a clone
must be made."""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import ckptstore
from ckptstore.adapters.background import BackgroundPublisher
from ckptstore.backends import posix
from ckptstore.directory import publish_directory
from ckptstore.errors import StorageError

FILES = {"model.safetensors": os.urandom(3 << 20) + b"w", "optimizer.pt": b"o" * 70_000}


def _directory(root: Path) -> Path:
    directory = root / "checkpoint-1"
    directory.mkdir(parents=True)
    for name, data in FILES.items():
        (directory / name).write_bytes(data)
    return directory


def _clones_here(directory: str) -> bool:
    with tempfile.TemporaryDirectory(dir=directory) as scratch:
        source, clone = Path(scratch) / "a", Path(scratch) / "b"
        source.write_bytes(b"x" * 4096)
        with open(source, "rb") as a, open(clone, "wb") as b:
            try:
                fcntl.ioctl(b.fileno(), posix._FICLONE, a.fileno())
            except OSError:
                return False
    return True


@pytest.fixture
def reflink_dir() -> Iterator[Path]:
    """A fresh directory on a file system that makes clones, or the test is skipped."""
    where = os.environ.get("CKPTSTORE_TEST_REFLINK_DIR") or tempfile.gettempdir()
    if not os.path.isdir(where) or not _clones_here(where):
        pytest.skip(
            f"{where}: no copy-on-write clones on this file system; set "
            f"CKPTSTORE_TEST_REFLINK_DIR to a directory on XFS (mkfs.xfs -m reflink=1) or btrfs"
        )
    directory = Path(tempfile.mkdtemp(prefix="ckptstore-reflink-", dir=where))
    try:
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _free(path: Path) -> int:
    info = os.statvfs(path)
    return info.f_bavail * info.f_frsize


def test_a_reflinked_publish_copies_no_bytes_and_outlives_the_trainers_files(
    reflink_dir: Path,
) -> None:
    big = {"model.safetensors": os.urandom(64 << 20), "optimizer.pt": os.urandom(16 << 20)}
    directory = reflink_dir / "out" / "checkpoint-7"
    directory.mkdir(parents=True)
    for name, data in big.items():
        (directory / name).write_bytes(data)
        os.sync()
    store = ckptstore.open(f"file://{reflink_dir}/store")
    before = _free(reflink_dir)
    checkpoint = publish_directory(store, 7, directory, clone=True)
    os.sync()
    assert before - _free(reflink_dir) < 8 << 20  # 80 MiB published, extents shared
    with open(directory / "optimizer.pt", "r+b") as same_inode:  # rewritten in place
        same_inode.write(b"X" * (16 << 20))
    shutil.rmtree(directory)  # and the rest rotated away
    assert checkpoint.verify().ok
    assert {n: store.get(7).read(n) for n in checkpoint.names} == big


def test_the_background_publisher_reflinks_from_its_snapshot(reflink_dir: Path) -> None:
    store = ckptstore.open(f"file://{reflink_dir}/store")
    publisher = BackgroundPublisher(store)
    directory = _directory(reflink_dir / "out")
    publisher.publish(1, directory)
    publisher.close()
    shutil.rmtree(directory)
    assert {n: store.get(1).read(n) for n in store.get(1).names} == FILES


def _stand_in_ficlone(monkeypatch: pytest.MonkeyPatch, calls: list[int]) -> None:
    """``FICLONE`` as a copy of the whole file (what a clone holds, without sharing)."""
    ioctl = fcntl.ioctl

    def ficlone(fd: int, request: int, argument: Any = 0, *rest: Any) -> Any:
        if request != posix._FICLONE:
            return ioctl(fd, request, argument, *rest)
        calls.append(fd)
        size = os.fstat(argument).st_size
        copied = 0
        while copied < size:
            copied += os.copy_file_range(argument, fd, size - copied, copied, copied)
        return 0

    monkeypatch.setattr(posix.fcntl, "ioctl", ficlone)


def test_cloned_shards_are_checksummed_as_stored_and_published_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []
    _stand_in_ficlone(monkeypatch, calls)
    store = ckptstore.open(f"file://{tmp_path}/store")
    checkpoint = publish_directory(store, 1, _directory(tmp_path / "out"), clone=True)
    assert len(calls) == len(FILES)  # every file cloned, none copied
    assert checkpoint.verify().ok
    assert {n: checkpoint.read(n) for n in checkpoint.names} == FILES
    plain = ckptstore.open(f"file://{tmp_path}/plain")
    copied = publish_directory(plain, 1, tmp_path / "out" / "checkpoint-1")
    assert [(r.name, r.size, r.crc32c, r.block_crc32c) for r in checkpoint.manifest.shards] == [
        (r.name, r.size, r.crc32c, r.block_crc32c) for r in copied.manifest.shards
    ]


def test_without_clones_the_bytes_are_copied(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refused(*args: Any) -> Any:
        raise OSError(errno.EOPNOTSUPP, "Operation not supported")  # ext4, tmpfs

    monkeypatch.setattr(posix.fcntl, "ioctl", refused)
    store = ckptstore.open(f"file://{tmp_path}/store")
    checkpoint = publish_directory(store, 1, _directory(tmp_path / "out"), clone=True)
    assert {n: checkpoint.read(n) for n in checkpoint.names} == FILES


def test_a_clone_that_fails_publishes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*args: Any) -> Any:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(posix.fcntl, "ioctl", broken)
    store = ckptstore.open(f"file://{tmp_path}/store")
    with pytest.raises(StorageError, match="Input/output error"):
        publish_directory(store, 1, _directory(tmp_path / "out"), clone=True)
    assert store.steps() == []
    assert [p.name for p in (tmp_path / "store").iterdir() if "pending" in p.name] == []


def test_a_store_on_an_object_store_copies(tmp_path: Path) -> None:
    store = ckptstore.open(f"memory://reflink-{os.getpid()}/store")
    checkpoint = publish_directory(store, 1, _directory(tmp_path / "out"), clone=True)
    assert {n: checkpoint.read(n) for n in checkpoint.names} == FILES
