"""The conformance suite drives the reflink publish (``publish_directory(clone=True)``): the
state machine's push clones, through each ``FICLONE`` a machine may meet, and dies before and
after a clone; the power-loss layer pushes with clones on a simulated file system that makes
them, and a clone committed without its fsync is caught there (``UnsyncedCloneCommit`` in
``test_conformance_variants.py``)."""

from __future__ import annotations

import errno
import fcntl
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ckptstore.backends import posix
from ckptstore.backends.memory import drop_bucket
from ckptstore.backends.posix import PosixDriver
from ckptstore.commit.rename import RenameCommit
from ckptstore.conformance.faults import CrashMode, FaultInjector
from ckptstore.conformance.layers.power_loss import PUSHED_STEP, pushed, run_power_loss
from ckptstore.conformance.location import Clock, LocationFactory
from ckptstore.conformance.machine import make_state_machine
from ckptstore.conformance.machine.state_machine import CLONES
from ckptstore.conformance.models.simfs import CrashState, SimulatedFileSystem
from ckptstore.conformance.reflinks import FICLONE, REFUSED, STAND_IN, reflinks

STAND_IN_CLONE = "cloned by a stand-in FICLONE"
FILE_SYSTEMS_CLONE = "cloned by the file system"


def _clones_here(directory: Path) -> bool:
    """Whether the file system at ``directory`` makes clones (XFS, btrfs; not ext4, tmpfs)."""
    with tempfile.TemporaryDirectory(dir=directory) as scratch:
        source, clone = Path(scratch) / "a", Path(scratch) / "b"
        source.write_bytes(b"x" * 4096)
        with open(source, "rb") as a, open(clone, "wb") as b:
            try:
                fcntl.ioctl(b.fileno(), FICLONE, a.fileno())
            except OSError:
                return False
    return True


@pytest.fixture
def clones(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """What each ``PosixDriver.clone`` answered (True: a clone; False: refused, copied)."""
    answered: list[bool] = []
    clone = PosixDriver.clone

    def recorded(self: PosixDriver, handle: int, source: int) -> bool:
        answered.append(clone(self, handle, source))
        return answered[-1]

    monkeypatch.setattr(PosixDriver, "clone", recorded)
    return answered


@pytest.fixture
def machine(tmp_path: Path) -> Iterator[Any]:
    """The state machine on ``file://``, the store taken over (a push needs a takeover),
    every fault injector it opens kept in ``opened``."""
    state = make_state_machine(LocationFactory(f"file://{tmp_path}/machine"))()
    state.opened = []
    open_location = state.location.open

    def kept(*args: Any, **kwargs: Any) -> Any:
        store, injector = open_location(*args, **kwargs)
        state.opened.append(injector)
        return store, injector

    state.location.open = kept
    try:
        state.save(shard_sizes=[100], crash=None, skip=0)
        state.take_over(data=None, fresh=True, zombie="idle")
        state.invariants_hold()
        yield state
    finally:
        state.teardown()


def test_the_stand_ins_answer_ficlone_only_and_go_away(tmp_path: Path) -> None:
    assert FICLONE == posix._FICLONE
    source, target = tmp_path / "source", tmp_path / "target"
    source.write_bytes(b"trainer" * 1000)
    with open(source, "rb") as a, open(target, "wb") as b:
        with reflinks(STAND_IN):
            assert PosixDriver(str(tmp_path)).clone(b.fileno(), a.fileno())
            assert posix.fcntl.F_GETFL == fcntl.F_GETFL  # the rest of fcntl is fcntl's
        assert a.tell() == 0 and b.tell() == 0  # as FICLONE: neither position moved
        with reflinks(REFUSED):
            assert not PosixDriver(str(tmp_path)).clone(b.fileno(), a.fileno())
            with pytest.raises(OSError, match=os.strerror(errno.EOPNOTSUPP)) as refused:
                posix.fcntl.ioctl(b.fileno(), FICLONE, a.fileno())
            assert refused.value.errno == errno.EOPNOTSUPP
    assert target.read_bytes() == source.read_bytes()
    assert posix.fcntl is fcntl


@pytest.mark.parametrize("cloning", list(CLONES))
def test_the_push_rule_publishes_through_each_ficlone(
    machine: Any, clones: list[bool], cloning: str, tmp_path: Path
) -> None:
    """Copied, no clone is asked for; cloned, one per (non-empty) file: made by the stand-in
    on every machine, refused (then copied) by the refusing one, and by the file system as
    it can (a clone on XFS or btrfs, a refusal on ext4)."""
    machine.push_a_directory(how="its epoch", cloning=cloning, crash=None)
    machine.invariants_hold()  # the pushed step is committed: read back exactly as written
    expected = {
        "copied": [],
        FILE_SYSTEMS_CLONE: [_clones_here(tmp_path)] * 2,
        STAND_IN_CLONE: [True, True],
        "cloned, FICLONE refused": [False, False],
    }[cloning]
    assert clones == expected
    pushed_step = max(machine.model.committed)
    assert machine.model.committed[pushed_step].metadata["pushed"] == "its epoch"
    assert posix.fcntl is fcntl  # the stand-in is gone


@pytest.mark.parametrize("cloning", [STAND_IN_CLONE, FILE_SYSTEMS_CLONE])
@pytest.mark.parametrize("mode", list(CrashMode))
def test_a_push_dies_before_and_after_its_clone(
    machine: Any, clones: list[bool], cloning: str, mode: CrashMode
) -> None:
    """A crash point at the clone, like any other call's: before it, the shard's file stays
    empty; after it, the file holds the clone. Either way nothing of the push is published,
    recovery holds the invariants, and GC leaves nothing of it once it is old."""
    machine.push_a_directory(how="its epoch", cloning=cloning, crash=("clone", mode))
    died = next(injector for injector in machine.opened if injector.crashed)
    assert died.death.record.name == "clone" and died.death.mode is mode
    assert len(clones) == (0 if mode is CrashMode.BEFORE else 1)
    machine.invariants_hold()
    machine.gc(age=True)
    machine.invariants_hold()
    assert machine.location.leftovers() == set()
    machine.push_a_directory(how="its epoch", cloning=cloning, crash=None)  # the rerun
    machine.invariants_hold()


def test_on_an_object_store_every_push_copies() -> None:
    bucket = f"reflinks-{os.getpid()}"
    state = make_state_machine(LocationFactory(f"memory://{bucket}/run"))()
    try:
        state.take_over(data=None, fresh=True, zombie="idle")
        for cloning in CLONES:
            state.push_a_directory(how="its epoch", cloning=cloning, crash=None)
            state.invariants_hold()
        assert len(state.model.committed) == len(CLONES)
    finally:
        state.teardown()
        drop_bucket(bucket)


def test_a_simulated_clone_is_the_source_as_it_was_durable_once_fsynced(
    tmp_path: Path,
) -> None:
    simulated = SimulatedFileSystem(Clock())
    simulated.mkdir("d")
    source = tmp_path / "trainer.bin"
    source.write_bytes(b"before" * 100)
    handle = simulated.create("d/shard")
    with open(source, "rb") as trainer:
        assert simulated.clone(handle, trainer.fileno())
    source.write_bytes(b"rewritten by the trainer")  # the clone is the file as it was
    assert simulated.stat("d/shard").size == 600
    with simulated.open_read("d/shard") as stream:
        assert stream.read() == b"before" * 100
    simulated.fsync_dir("d")
    (inode,) = simulated.dirty_files()  # cloned, not yet durable
    variants = {
        variant: simulated.materialise(CrashState(frozenset(), ((inode, variant),)))
        for variant in ("lost", "torn", "zeroed")
    }
    assert variants["lost"].stat("d/shard").size == 0
    assert variants["torn"].stat("d/shard").size == 300
    with variants["zeroed"].open_read("d/shard") as stream:
        assert stream.read() == bytes(600)
    simulated.fsync(handle)
    assert simulated.dirty_files() == []


def test_a_clone_names_its_target_only(tmp_path: Path) -> None:
    """A clone's source is a descriptor outside the storage: a number a closed handle of the
    store may have had is not taken for that handle's path."""
    touched: list[tuple[str, ...] | None] = []
    injector = FaultInjector(PosixDriver(str(tmp_path / "store")), on_change=touched.append)
    injector.ensure_root(True)
    handle = injector.create("shard")
    stale = injector.create("stale")
    injector.close(stale)
    (tmp_path / "trainer.bin").write_bytes(b"x" * 10)
    source = os.open(tmp_path / "trainer.bin", os.O_RDONLY)
    try:
        assert source == stale  # the lowest free number: the premise of the test
        with reflinks(STAND_IN):
            assert injector.clone(handle, source)
    finally:
        os.close(source)
        injector.close(handle)
    assert touched[-1] == ("shard",)
    assert (tmp_path / "store" / "shard").read_bytes() == b"x" * 10


def test_power_loss_covers_a_push_of_clones(tmp_path: Path) -> None:
    result = run_power_loss(RenameCommit(PosixDriver(str(tmp_path))))
    assert result.failures == []
    cloned = [name for name, blob in pushed(PUSHED_STEP).shards.items() if blob]
    assert result.clones == len(cloned) == 2  # the empty file is copied
