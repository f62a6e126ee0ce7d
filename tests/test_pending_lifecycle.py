"""A pending checkpoint owns its lifecycle: explicit states, legal moves only."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

import ckptstore
from ckptstore.backends.memory import drop_bucket
from ckptstore.errors import CheckpointExistsError, CheckpointStateError, CoverageError
from ckptstore.pending import PendingState


@pytest.fixture
def store() -> Iterator[ckptstore.Store]:
    bucket = f"lifecycle-{os.getpid()}"
    yield ckptstore.open(f"memory://{bucket}/run")
    drop_bucket(bucket)


def test_a_publish_goes_through_every_state_in_order(
    store: ckptstore.Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[PendingState] = []
    pending = store.begin(1)
    strategy: Any = store.strategy
    seal, publish = strategy.seal, strategy.publish
    monkeypatch.setattr(strategy, "seal", lambda *a: (seen.append(pending.state), seal(*a))[1])
    monkeypatch.setattr(strategy, "publish", lambda m: (seen.append(pending.state), publish(m))[1])
    assert pending.state is PendingState.OPEN and pending.state == "open"
    pending.write("a", b"x")
    checkpoint = pending.publish()
    assert seen == [PendingState.SEALING, PendingState.PUBLISHING]
    assert pending.state is PendingState.PUBLISHED and pending.checkpoint is checkpoint
    with pytest.raises(CheckpointStateError, match="is published"):
        pending.publish()
    with pytest.raises(CheckpointStateError, match="is published"):
        pending.write("b", b"y")
    pending.abort()  # too late to abort: nothing happens
    assert store.latest().step == 1


def test_an_illegal_move_names_both_states(store: ckptstore.Store) -> None:
    assert store.save(1, {"a": b"x"}).step == 1
    attempt = store.begin(2)
    attempt.abort()
    with pytest.raises(CheckpointStateError, match="cannot go from aborted to publishing"):
        attempt._move(PendingState.PUBLISHING)
    assert attempt.state is PendingState.ABORTED


def test_sealing_alone_keeps_the_checkpoint_open(store: ckptstore.Store) -> None:
    with store.begin(3) as pending:
        pending.write("a", b"x")
        assert [r.name for r in pending.seal()] == ["a"]
        assert pending.state is PendingState.OPEN
        pending.write("b", b"y")  # more shards may follow a seal
    assert store.latest().names == ["a", "b"]


def test_refused_coverage_aborts_and_a_lost_race_fails(store: ckptstore.Store) -> None:
    pending = store.begin(4, expected_shards=["a", "b"])
    pending.write("a", b"x")
    with pytest.raises(CoverageError, match="missing shards \\['b'\\]"):
        pending.publish()
    assert pending.state is PendingState.ABORTED
    first, second = store.begin(5), store.begin(5)
    first.write("a", b"1")
    second.write("a", b"2")
    first.publish()
    with pytest.raises(CheckpointExistsError):
        second.publish()
    assert second.state is PendingState.FAILED
    assert store.get(5).read("a") == b"1"
