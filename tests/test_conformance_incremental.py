"""The conformance suite covers incremental saves on file systems (docs/protocol.md §12.6):
the state machine's sharing saves, crashed at every storage call, and its GC without grace;
power loss with a shared shard."""

from __future__ import annotations

from pathlib import Path

import pytest

import ckptstore
from ckptstore.commit.rename import RenameCommit
from ckptstore.conformance.faults import CrashMode
from ckptstore.conformance.layers.power_loss import run_power_loss
from ckptstore.conformance.location import LocationFactory
from ckptstore.conformance.machine import make_state_machine


def test_the_machine_shares_shards_and_keeps_them_through_crashes_and_gc(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shares: list[str] = []
    real = RenameCommit.share_shard

    def counted(self: RenameCommit, *args: object, **kwargs: object) -> object:
        locator = real(self, *args, **kwargs)  # type: ignore[arg-type]
        if locator is not None:
            shares.append(str(args[2]))
        return locator

    monkeypatch.setattr(RenameCommit, "share_shard", counted)
    state = make_state_machine(LocationFactory(f"file://{tmp_path}/machine"))()
    try:
        state.save_incrementally(reuse=[False, False], crash=None)
        state.save_incrementally(reuse=[True, True], crash=None)  # both shared
        state.invariants_hold()
        assert len(shares) == 2
        for index in range(30):  # a crash before and after each call of a sharing save
            for mode in (CrashMode.BEFORE, CrashMode.AFTER):
                state.save_incrementally(reuse=[True, False, True], crash=(index, mode))
                state.invariants_hold()
            if index % 7 == 0:
                state.retention(keep=2)
                state.gc_without_grace()
                state.invariants_hold()
        state.gc_without_grace()
        state.invariants_hold()
        assert len(shares) > 20
    finally:
        state.teardown()


def test_power_loss_checks_a_shared_shard(tmp_path: Path) -> None:
    store = ckptstore.open(f"file://{tmp_path}/power")
    result = run_power_loss(store.strategy)
    assert result.shared == 1 and not result.failures, result.failures[:3]
