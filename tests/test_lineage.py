"""Lineages (docs/protocol.md §8): a run that takes the store over and its zombie never mix.

In-process: the zombie is a Store handle that joined the old epoch by saving before the
takeover. tests/test_lineage_processes.py runs them as two processes.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
from conftest import BackendUnderTest, FileBackend

import ckptstore
from ckptstore.errors import (
    CapabilityError,
    CheckpointExistsError,
    EpochNotFoundError,
    EpochRequiredError,
    LineageCorruptError,
    ManifestCorruptError,
    RefusedError,
    StepOutsideEpochError,
    SupersededError,
)
from ckptstore.history import History
from ckptstore.lineage import Epoch, Lineage
from ckptstore.manifest import WriterInfo
from ckptstore.store import Store

BACKENDS = ["file", "memory", "memory+versioned", "s3", "gs", "az"]
lineage_backends = pytest.mark.parametrize("backend", BACKENDS, indirect=True)


def _save(store: Store, step: int, tag: str = "") -> None:
    store.save(step, {"w.bin": f"{tag}{step}".encode() * 10}, metadata={"tag": tag})


def _tag(store: Store, step: int) -> str:
    return str(store.get(step).manifest.metadata["tag"])


def _epoch(number: int, parent: int | None) -> Epoch:
    return Epoch(number, parent, _now(), WriterInfo("h", 1))


def _now() -> Any:
    from datetime import datetime, timezone

    return datetime(2026, 1, 1, tzinfo=timezone.utc)


def test_the_owner_of_a_step_is_the_newest_epoch_whose_parent_is_below_it() -> None:
    lineage = Lineage.of([_epoch(1, 950), _epoch(2, 700), _epoch(3, None)])
    assert Lineage().owner(5) == 0
    assert Lineage.of([_epoch(1, 950)]).owner(950) == 0  # the parent itself: old history
    assert Lineage.of([_epoch(1, 950)]).owner(951) == 1
    assert lineage.owner(0) == 3  # a fresh start owns every step
    two = Lineage.of([_epoch(1, 950), _epoch(2, 700)])
    assert [two.owner(s) for s in (700, 701, 950, 951)] == [0, 2, 2, 2]
    assert two.in_history(800, 2) and not two.in_history(800, 1)
    assert not two.in_history(800, 3)  # an epoch with no record is never the history
    with pytest.raises(LineageCorruptError, match="epoch 2 is missing"):
        Lineage.of([_epoch(1, 5), _epoch(3, 6)])


def test_an_epoch_record_that_does_not_parse_is_corrupt() -> None:
    good = _epoch(1, 950).encode()
    assert Epoch.decode(good, where="x", expected=1).parent == 950
    with pytest.raises(LineageCorruptError, match="stored as epoch 2"):
        Epoch.decode(good, where="x", expected=2)
    with pytest.raises(LineageCorruptError, match="checksum"):
        Epoch.decode(good.replace(b"950", b"951"), where="x", expected=1)
    for broken in (b"", b"{", good[:-5], b"[]", b'{"format": "ckptstore.epoch"}'):
        with pytest.raises(LineageCorruptError):
            Epoch.decode(broken, where="x", expected=1)


@lineage_backends
def test_a_zombie_and_its_restart_never_mix(backend: BackendUnderTest) -> None:
    zombie = backend.open()
    for step in (100, 200, 300):
        _save(zombie, step, "old")
    assert zombie.epoch == 0
    late = zombie.begin(400, metadata={"tag": "old"})  # begun before the takeover
    late.write("w.bin", b"old400")

    restarted = backend.open()
    epoch = restarted.take_over(resumed_from=200, note="job 7 attempt 2")
    assert (epoch.number, epoch.parent, epoch.note) == (1, 200, "job 7 attempt 2")
    # The zombie's step 300 (above the parent) left the history at once, for every reader.
    assert backend.open().steps() == [100, 200]
    latest = backend.open().latest()
    assert latest is not None and latest.step == 200

    with pytest.raises(SupersededError, match="superseded by epoch 1") as raised:
        late.publish()
    assert "resumed from step 200" in str(raised.value)
    if isinstance(backend, FileBackend):  # the refused attempt's staging went at once
        assert not [n for n in os.listdir(backend.root) if ".pending-" in n]
    with pytest.raises(SupersededError):
        _save(zombie, 500, "old")

    for step in (300, 400):  # step 300 is the name the zombie's checkpoint still holds
        _save(restarted, step, "new")
    reader = backend.open()
    assert reader.steps() == [100, 200, 300, 400]
    assert [_tag(reader, s) for s in (100, 200, 300, 400)] == ["old", "old", "new", "new"]
    assert reader.get(300).manifest.epoch == 1
    assert [(s.step, s.epoch, s.owner) for s in reader.superseded()] == [(300, 0, 1)]

    kept = reader.gc(grace=3600)  # the takeover is younger than the superseded grace
    assert [(item.kind, item.name) for item in kept.kept_young if item.kind == "superseded"] == [
        ("superseded", "step 300 of epoch 0 (superseded by epoch 1)")
    ]
    assert [(s.step, s.epoch) for s in reader.superseded()] == [(300, 0)]
    report = reader.gc(grace=3600, superseded_grace=0)
    assert [(item.kind, item.name) for item in report.removed if item.kind == "superseded"] == [
        ("superseded", "step 300 of epoch 0 (superseded by epoch 1)")
    ]
    assert reader.superseded() == []
    assert reader.steps() == [100, 200, 300, 400] and _tag(reader, 300) == "new"


@lineage_backends
def test_a_publish_that_races_past_the_check_is_never_in_the_history(
    backend: BackendUnderTest, monkeypatch: pytest.MonkeyPatch
) -> None:
    zombie = backend.open()
    _save(zombie, 1, "old")
    pending = zombie.begin(2, metadata={"tag": "old"})
    pending.write("w.bin", b"old2")
    backend.open().take_over(resumed_from=1)
    # The takeover lands between the zombie's last check and its commit point.
    monkeypatch.setattr(History, "check_writable", lambda *args, **kwargs: None)
    pending.publish()  # published under epoch 0's name...
    monkeypatch.undo()
    reader = backend.open()
    assert reader.steps() == [1]  # ...but never part of the history
    assert reader.latest() is not None and reader.latest().step == 1  # type: ignore[union-attr]
    with pytest.raises(ckptstore.CheckpointNotFoundError):
        reader.get(2)
    assert [s.step for s in reader.superseded()] == [2]


@lineage_backends
def test_a_fresh_start_supersedes_every_step(backend: BackendUnderTest) -> None:
    old = backend.open()
    for step in (1, 2):
        _save(old, step, "old")
    fresh = backend.open()
    with pytest.raises(RefusedError, match="refusing a fresh start: the history holds 2"):
        fresh.take_over(resumed_from=None)  # a history is discarded only on an explicit word
    assert fresh.lineage().newest == 0
    assert fresh.take_over(resumed_from=None, discard_history=True).parent is None
    assert fresh.latest() is None and fresh.steps() == []
    _save(fresh, 1, "new")
    assert _tag(backend.open(), 1) == "new"
    assert sorted(s.step for s in backend.open().superseded()) == [1, 2]


@lineage_backends
def test_a_step_at_or_below_the_parent_belongs_to_the_history_resumed_from(
    backend: BackendUnderTest,
) -> None:
    store = backend.open()
    for step in (1, 2, 3):
        _save(store, step)
    restarted = backend.open()
    restarted.take_over(resumed_from=2)
    for step in (1, 2):
        with pytest.raises(StepOutsideEpochError, match="epoch 1 resumed from"):
            _save(restarted, step)
    _save(restarted, 3)  # the old history's 3 is above the parent: superseded, not a clash
    with pytest.raises(CheckpointExistsError):  # within the epoch, a step is still exclusive
        _save(restarted, 3)


@lineage_backends
def test_processes_of_one_run_share_its_epoch(backend: BackendUnderTest) -> None:
    rank0 = backend.open()
    epoch = rank0.take_over(resumed_from=None).number
    rank1 = backend.open(epoch=epoch)  # handed the number by its launcher
    late_joiner = backend.open()  # told no epoch: it cannot be told from a zombie (§8.3)
    _save(rank0, 1)
    _save(rank1, 2)
    with pytest.raises(EpochRequiredError, match=f"join the run's epoch .*epoch={epoch}"):
        _save(late_joiner, 3)
    assert late_joiner.epoch is None  # refused, not joined to anything
    late_joiner.join_epoch(epoch)
    _save(late_joiner, 3)
    assert {rank1.epoch, late_joiner.epoch} == {epoch}
    assert backend.open().steps() == [1, 2, 3]
    with pytest.raises(EpochNotFoundError, match="epoch 5 was never taken"):
        backend.open(epoch=5)


@lineage_backends
def test_concurrent_takers_get_distinct_epochs(backend: BackendUnderTest) -> None:
    first, second = backend.open(), backend.open()
    assert second.lineage().newest == 0  # it has read the epochs: none yet
    assert first.take_over(resumed_from=None).number == 1
    assert second.take_over(resumed_from=None).number == 2  # epoch 1 was taken: the next
    with pytest.raises(SupersededError, match="superseded by epoch 2"):
        _save(first, 1)
    _save(second, 1)


@lineage_backends
def test_retention_counts_only_the_history(backend: BackendUnderTest) -> None:
    zombie = backend.open()
    for step in (1, 2, 3):
        _save(zombie, step, "old")
    restarted = backend.open(retention=ckptstore.KeepLast(2))
    restarted.take_over(resumed_from=1)
    _save(restarted, 2, "new")  # the zombie's 2 and 3 are not counted as kept...
    assert restarted.steps() == [1, 2]
    _save(restarted, 3, "new")
    assert restarted.steps() == [2, 3]  # ...and the history's oldest goes
    assert [_tag(restarted, s) for s in (2, 3)] == ["new", "new"]


@lineage_backends
def test_a_store_never_taken_over_keeps_its_layout(backend: BackendUnderTest) -> None:
    store = backend.open()
    _save(store, 7)
    assert store.get(7).manifest.epoch == 0
    assert not any("epoch" in name for name in backend.raw_names())
    assert store.lineage().newest == 0


def test_an_unreadable_epoch_record_stops_readers_and_spares_gc(tmp_path: Any) -> None:
    backend = FileBackend(tmp_path)
    zombie = backend.open()
    for step in (1, 2):
        _save(zombie, step)
    backend.open().take_over(resumed_from=1)
    record = os.path.join(backend.root, "epochs", "epoch-00000000000000000001", "record.json")
    with open(record, "r+b") as handle:
        handle.write(b"#")
    reader = backend.open()
    with pytest.raises(LineageCorruptError, match="epoch-00000000000000000001"):
        reader.latest()
    report = reader.gc(grace=3600)
    assert not [item for item in report.removed if item.kind == "superseded"]
    assert any("superseded checkpoints were not collected" in w for w in report.warnings)
    assert os.path.isdir(os.path.join(backend.root, "step-00000000000000000002"))


def test_a_manifest_under_another_epochs_name_is_corrupt(tmp_path: Any) -> None:
    backend = FileBackend(tmp_path)
    store = backend.open()
    store.take_over(resumed_from=None)
    _save(store, 1)
    os.rename(
        os.path.join(backend.root, "step-00000000000000000001.epoch-00000000000000000001"),
        os.path.join(backend.root, "step-00000000000000000001"),
    )
    with pytest.raises(ManifestCorruptError, match="of epoch 1, stored as epoch 0"):
        backend.open().strategy.read_manifest(1)


def test_a_strategy_without_lineages_cannot_be_taken_over(tmp_path: Any) -> None:
    from ckptstore.commit.base import CommitStrategy

    store = FileBackend(tmp_path).open()
    monkey = type(store.strategy)
    original = monkey.create_epoch
    try:
        monkey.create_epoch = CommitStrategy.create_epoch  # type: ignore[method-assign]
        with pytest.raises(CapabilityError, match="does not keep lineages"):
            store.take_over(resumed_from=None)
    finally:
        monkey.create_epoch = original  # type: ignore[method-assign]
