"""The conformance suite covers incremental saves on file systems (docs/protocol.md §12.6):
the state machine's sharing saves, crashed at every storage call, and its GC without grace;
power loss with a shared shard."""

from __future__ import annotations

from pathlib import Path

import pytest

import ckptstore
from ckptstore.commit.conditional_put import ConditionalPutCommit
from ckptstore.commit.rename import RenameCommit
from ckptstore.conformance.faults import CrashMode
from ckptstore.conformance.layers.power_loss import run_power_loss
from ckptstore.conformance.layers.unknown_outcomes import run_indeterminate_outcomes
from ckptstore.conformance.location import LocationFactory
from ckptstore.conformance.machine import make_state_machine
from ckptstore.conformance.machine.state_machine import RACE_POINTS

GIVEN = ("buffers", "chunks", "push")
"""How a sharing save is given its shards, in turn: buffers, lists of buffers, files."""


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
        state.save_incrementally(reuse=[False, False], crash=None, given="push")
        state.save_incrementally(reuse=[True, True], crash=None, given="chunks")  # both shared
        state.invariants_hold()
        assert len(shares) == 2
        for index in range(30):  # a crash before and after each call of a sharing save
            for mode in (CrashMode.BEFORE, CrashMode.AFTER):
                given = GIVEN[index % len(GIVEN)]
                state.save_incrementally(
                    reuse=[True, False, True], crash=(index, mode), given=given
                )
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


@pytest.mark.parametrize("where", ["memory", "memory+versioned", "s3"])
def test_the_machine_shares_blobs_under_leases_through_crashes_and_gc(
    where: str, request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same on object stores (§12.3): sharing saves crashed before and after each call
    (the lease's reads and CASes, the blob's upload, the liveness marker), retention, GC;
    on a versioned bucket too, where manifests pin versions and GC deletes by version."""
    if where.startswith("memory"):
        url, options = f"{where}://machine-{tmp_path.name}/run", {}
    else:
        server = request.getfixturevalue("moto_s3")
        url, options = server.url(f"machine/{tmp_path.name}"), dict(server.options)
    shares: list[str] = []
    real = ConditionalPutCommit.share_shard

    def counted(self: ConditionalPutCommit, *args: object, **kwargs: object) -> object:
        locator = real(self, *args, **kwargs)  # type: ignore[arg-type]
        if locator is not None:
            shares.append(str(args[2]))
        return locator

    monkeypatch.setattr(ConditionalPutCommit, "share_shard", counted)
    state = make_state_machine(LocationFactory(url, options))()
    try:
        state.save_incrementally(reuse=[False, False], crash=None, given="chunks")
        state.save_incrementally(reuse=[True, True], crash=None, given="push")
        state.invariants_hold()
        assert len(shares) == 4  # every shard of an incremental save is a blob here
        rounds = 24 if where.startswith("memory") else 12
        for index in range(rounds):
            for mode in (CrashMode.BEFORE, CrashMode.AFTER):
                given = GIVEN[index % len(GIVEN)]
                state.save_incrementally(
                    reuse=[True, False, True], crash=(index, mode), given=given
                )
                state.invariants_hold()
            if index % 5 == 0:
                state.retention(keep=2)
                state.gc(age=True)
                state.gc_without_grace()
                state.invariants_hold()
        for at in RACE_POINTS:  # a sharing save and GC, each at the other's decision
            state.share_racing_gc(at=at)
            state.invariants_hold()
        state.gc(age=True)
        state.invariants_hold()
        assert len(shares) > 10
    finally:
        state.teardown()


@pytest.mark.parametrize("where", ["memory", "memory+versioned", "s3"])
def test_unknown_outcomes_of_the_lease_writes_lose_no_shared_blob(
    where: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """The unknown-outcomes layer on two incremental saves that share a blob (§12.3): each
    lease CAS, blob upload and publish failed with a 503 before it and a timeout after it;
    what the saves report matches what they published (I8), and every checkpoint reads back
    whole (I10)."""
    if where.startswith("memory"):
        url, options = f"{where}://outcomes-{tmp_path.name}/run", {}
    else:
        server = request.getfixturevalue("moto_s3")
        url, options = server.url(f"outcomes/{tmp_path.name}"), dict(server.options)
    result = run_indeterminate_outcomes(LocationFactory(url, options), incremental=True)
    assert not result.failures, result.failures[:3]
    assert not result.storage_errors, result.storage_errors[:3]
    assert result.cases > 50
    for when in ("before", "after"):  # the leases' creation and their CAS appends
        assert result.faulted[f"{when} If-None-Match put blobs/blake3/<blob>"] > 0
        assert result.faulted[f"{when} If-Match put blobs/blake3/<blob>"] > 0


def test_a_store_without_leases_has_no_incremental_outcome_cases(tmp_path: Path) -> None:
    result = run_indeterminate_outcomes(LocationFactory(f"file://{tmp_path}/fs"), incremental=True)
    assert result.calls == 0 and result.cases == 0
