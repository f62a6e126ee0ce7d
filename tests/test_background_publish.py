"""Directory checkpoints published in the background (issue 27 item 1): the trainer waits only
for hard links; rotation, deletion and a kill never publish a partial directory."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import ckptstore
import ckptstore.directory
from ckptstore.adapters import background
from ckptstore.adapters.background import (
    SNAPSHOT_PREFIX,
    BackgroundPublisher,
    remove_stale_snapshots,
    snapshot_directory,
)
from ckptstore.errors import CheckpointExistsError, InvalidInputError

HERE = Path(__file__).parent
CHECKOUT = HERE.parent
FILES = {"model.safetensors": b"w" * 100_000, "optimizer.pt": b"o" * 50_000, "sub/rng.pth": b"r"}


def _checkpoint(root: Path, step: int) -> Path:
    directory = root / f"checkpoint-{step}"
    for name, data in FILES.items():
        path = directory / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data + bytes([step]))
    return directory


class _Gate:
    """Holds every file's publish until released: a publish kept in flight."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.reached = threading.Event()
        self.release = threading.Event()
        publish_file = ckptstore.directory._publish_file

        def held(pending: Any, file: Any, *rest: Any) -> None:
            self.reached.set()
            assert self.release.wait(30), "the gate was never released"
            publish_file(pending, file, *rest)

        monkeypatch.setattr(ckptstore.directory, "_publish_file", held)


def _snapshots(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith(SNAPSHOT_PREFIX))


def test_the_trainer_may_delete_its_directory_while_the_publish_is_in_flight(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = ckptstore.open(f"file://{tmp_path}/store")
    publisher = BackgroundPublisher(store)
    gate = _Gate(monkeypatch)
    directory = _checkpoint(tmp_path / "out", 3)
    publisher.publish(3, directory, {"directory": directory.name})  # returns: links made
    assert gate.reached.wait(30)
    assert publisher.in_flight == 3 and store.steps() == []
    shutil.rmtree(directory)  # save_total_limit rotated it away
    gate.release.set()
    checkpoint = publisher.wait()
    assert checkpoint is not None and checkpoint.step == 3
    assert checkpoint.verify().ok
    assert {n: checkpoint.read(n) for n in checkpoint.names} == {
        name: data + bytes([3]) for name, data in FILES.items()
    }
    assert checkpoint.metadata == {"directory": "checkpoint-3"}
    assert _snapshots(tmp_path / "out") == []  # the links are gone, the publish kept the data
    publisher.close()


def test_at_most_one_publish_is_in_flight(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = ckptstore.open(f"file://{tmp_path}/store")
    publisher = BackgroundPublisher(store)
    gate = _Gate(monkeypatch)
    publisher.publish(1, _checkpoint(tmp_path / "out", 1))
    assert gate.reached.wait(30)
    second = threading.Thread(target=publisher.publish, args=(2, _checkpoint(tmp_path / "out", 2)))
    second.start()
    second.join(0.5)
    assert second.is_alive()  # the next save waits while the previous publish goes on
    assert len(_snapshots(tmp_path / "out")) == 1
    gate.release.set()
    second.join(30)
    assert not second.is_alive()
    publisher.close()
    assert store.steps() == [1, 2]


def test_a_failed_background_publish_is_raised_at_the_next_save_and_published_nothing(
    tmp_path: Path,
) -> None:
    store = ckptstore.open(f"file://{tmp_path}/store")
    store.save(4, {"other.bin": b"another run's"})
    publisher = BackgroundPublisher(store)
    publisher.publish(4, _checkpoint(tmp_path / "out", 4))  # the step exists: refused
    with pytest.raises(CheckpointExistsError):
        publisher.publish(5, _checkpoint(tmp_path / "out", 5))
    assert store.get(4).names == ["other.bin"]
    publisher.publish(5, _checkpoint(tmp_path / "out", 5))  # the next one goes on
    publisher.close()
    assert store.steps() == [4, 5] and _snapshots(tmp_path / "out") == []


def test_without_hard_links_the_directory_is_published_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def no_links(*args: Any, **kwargs: Any) -> None:
        raise OSError(errno.EPERM, "Operation not permitted")  # as on some FUSE file systems

    monkeypatch.setattr(background.os, "link", no_links)
    store = ckptstore.open(f"file://{tmp_path}/store")
    publisher = BackgroundPublisher(store)
    publisher.publish(1, _checkpoint(tmp_path / "out", 1))
    assert store.steps() == [1]  # published before publish() returned
    assert publisher.in_flight is None and _snapshots(tmp_path / "out") == []
    assert "this file system makes no hard links: checkpoints are published on the" in caplog.text


def test_a_snapshot_refuses_what_a_publish_refuses_and_leaves_nothing(tmp_path: Path) -> None:
    directory = _checkpoint(tmp_path / "out", 1)
    os.mkfifo(directory / "pipe")
    with pytest.raises(InvalidInputError, match="not a regular file"):
        snapshot_directory(directory)
    assert _snapshots(tmp_path / "out") == []


def test_stale_snapshots_are_removed_and_look_alikes_are_not(tmp_path: Path) -> None:
    out = tmp_path / "out"
    links = snapshot_directory(_checkpoint(out, 1))
    assert links is not None and (links / "model.safetensors").exists()
    look_alike = out / f"{SNAPSHOT_PREFIX}mine"
    look_alike.mkdir()
    (look_alike / "notes.txt").write_text("the user's")
    assert remove_stale_snapshots(out) == [links.parent]
    assert (look_alike / "notes.txt").read_text() == "the user's"
    assert (out / "checkpoint-1" / "model.safetensors").exists()  # links removed, not files


@pytest.mark.slow
def test_rotation_racing_a_slow_publish_never_publishes_a_partial_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """save_total_limit=1 deletes checkpoint-3 while it is still being published."""
    pytest.importorskip("transformers")
    monkeypatch.syspath_prepend(str(HERE))
    from hf_training import train

    publish_file = ckptstore.directory._publish_file

    def slow(pending: Any, file: Any, *rest: Any) -> None:
        time.sleep(0.2)  # a slow store: the next save's rotation comes first
        publish_file(pending, file, *rest)

    monkeypatch.setattr(ckptstore.directory, "_publish_file", slow)
    url = f"file://{tmp_path}/store"
    train(url, str(tmp_path / "out"), save_total_limit=1)
    store = ckptstore.open(url)
    assert store.steps() == [3, 6, 9]
    last = tmp_path / "out" / "checkpoint-9"
    names = sorted(p.relative_to(last).as_posix() for p in last.rglob("*") if p.is_file())
    for step in (3, 6, 9):
        checkpoint = store.get(step)
        assert checkpoint.verify().ok, step
        assert checkpoint.names == names, step
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["checkpoint-9"]


@pytest.mark.slow
def test_a_trainer_killed_while_a_background_publish_is_in_flight_resumes_in_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Killed mid-publish of step 6 on the training node, restarted on the same node: the
    links the kill left are removed, step 6 is not published, the run resumes from step 3."""
    pytest.importorskip("transformers")
    store = f"file://{tmp_path}/store"
    out = tmp_path / "node"
    killed = subprocess.run(
        [sys.executable, str(HERE / "hf_training.py"), "--store", store,
         "--output-dir", str(out), "--die-publishing", "6"],
        capture_output=True, text=True, timeout=300, check=False,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(CHECKOUT), str(HERE)])},
    )  # fmt: skip
    assert killed.returncode == -9, killed.stderr[-3000:]
    assert _snapshots(out) != []  # the kill left its links
    assert ckptstore.open(store).steps() == [3]
    monkeypatch.syspath_prepend(str(HERE))
    from hf_training import train

    _, callback = train(store, str(out))
    assert callback.restored is not None and callback.restored.step == 3
    assert _snapshots(out) == []
    assert ckptstore.open(store).steps() == [3, 6, 9]
    assert all(ckptstore.open(store).get(s).verify().ok for s in (3, 6, 9))


def test_a_read_only_output_dir_is_published_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    mkdir = os.mkdir

    def read_only(path: Any, *args: Any, **kwargs: Any) -> None:
        if Path(path).name.startswith(SNAPSHOT_PREFIX):
            raise OSError(errno.EROFS, "Read-only file system")
        mkdir(path, *args, **kwargs)

    monkeypatch.setattr(background.os, "mkdir", read_only)
    store = ckptstore.open(f"file://{tmp_path}/store")
    publisher = BackgroundPublisher(store)
    publisher.publish(1, _checkpoint(tmp_path / "out", 1))
    assert store.steps() == [1] and publisher.in_flight is None
    assert "Read-only file system: checkpoints are published on the training thread" in caplog.text


def test_a_file_rewritten_in_place_during_the_publish_publishes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The snapshot shares the trainer's inodes: a trainer that writes a saved file again in
    place (same size, new bytes) while it is published must not get a checkpoint that mixes
    the two versions."""
    store = ckptstore.open(f"file://{tmp_path}/store")
    publisher = BackgroundPublisher(store)
    gate = _Gate(monkeypatch)
    directory = _checkpoint(tmp_path / "out", 3)
    publisher.publish(3, directory)
    assert gate.reached.wait(30)
    weights = directory / "model.safetensors"
    listed = weights.stat()
    with open(weights, "r+b") as same_inode:  # torch.save or safetensors into the old dir
        same_inode.write(b"X" * listed.st_size)
    os.utime(weights, ns=(listed.st_atime_ns, listed.st_mtime_ns + 1_000_000))  # its tick
    gate.release.set()
    with pytest.raises(InvalidInputError, match=r"model\.safetensors changed while it was"):
        publisher.wait()
    assert store.steps() == [] and _snapshots(tmp_path / "out") == []
    assert "checkpoint 3 was not published" in caplog.text
    publisher.publish(4, _checkpoint(tmp_path / "out", 4))  # the next save goes on
    publisher.close()
    assert store.steps() == [4]


def test_a_directory_file_rewritten_after_it_was_listed_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same on the training thread: ``publish_directory`` (ckptstore push)."""
    from ckptstore.adapters import directory as adapter

    store = ckptstore.open(f"file://{tmp_path}/store")
    folder = _checkpoint(tmp_path / "out", 1)
    opened = adapter._opened

    def rewritten_after_open(file: Any) -> Any:
        context = opened(file)
        if file.name == "optimizer.pt":
            listed = file.path.stat()
            file.path.write_bytes(b"Y" * listed.st_size)  # truncates and writes: same inode
            os.utime(file.path, ns=(listed.st_atime_ns, listed.st_mtime_ns + 1_000_000))
        return context

    monkeypatch.setattr(adapter, "_opened", rewritten_after_open)
    with pytest.raises(InvalidInputError, match=r"optimizer\.pt changed while it was published"):
        ckptstore.directory.publish_directory(store, 1, folder)
    assert store.steps() == []
