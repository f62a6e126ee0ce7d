"""Where the fencing's holds and intents live on a file system, and what GC removes of them
(docs/protocol.md §3, §8.5): a store never taken over keeps its layout, and only markers named
exactly as the protocol names them are removed, once older than their lifetime."""

from __future__ import annotations

import os
import time
from datetime import timedelta
from pathlib import Path

import ckptstore
from ckptstore.fencing import INTENT_STALE_S, is_file_marker
from ckptstore.retention import KeepLast


def _save(store: ckptstore.Store, step: int) -> None:
    store.save(step, {"w.bin": str(step).encode() * 8})


def test_retention_delete_and_gc_leave_a_store_never_taken_over_as_it_was(tmp_path: Path) -> None:
    root = tmp_path / "store"
    store = ckptstore.open(f"file://{root}")
    for step in range(1, 6):
        _save(store, step)
    store.apply_retention(KeepLast(2))
    store.delete(4)
    store.gc(grace=timedelta(0))
    assert sorted(p.name for p in root.iterdir()) == ["LATEST", "step-00000000000000000005"]


def test_gc_removes_a_dead_deleters_intent_and_leaves_an_operators_look_alikes(
    tmp_path: Path,
) -> None:
    root = tmp_path / "store"
    store = ckptstore.open(f"file://{root}")
    _save(store, 1)
    dead = root / ".intent-step-00000000000000000001"
    mine = [root / ".hold-mine", root / ".intent-step-1", root / ".hold-step-00000000000000000001x"]
    for path in [dead, *mine]:
        path.touch()
        old = time.time() - 2 * INTENT_STALE_S
        os.utime(path, (old, old))
    assert is_file_marker(dead.name) and not any(is_file_marker(p.name) for p in mine)
    report = store.gc(grace=timedelta(0))
    assert [(item.kind, item.name) for item in report.removed] == [("marker", dead.name)]
    assert not dead.exists() and all(path.exists() for path in mine)
    assert store.latest() is not None and store.latest().step == 1  # type: ignore[union-attr]


def test_a_live_takers_hold_outlives_a_zero_grace(tmp_path: Path) -> None:
    root = tmp_path / "store"
    store = ckptstore.open(f"file://{root}")
    _save(store, 1)
    hold = root / ".hold-step-00000000000000000001"
    hold.touch()  # a taker that is creating its epoch now
    assert not [item for item in store.gc(grace=timedelta(0)).removed if item.kind == "marker"]
    assert hold.exists()


def test_gc_reads_the_markers_clock_only_when_there_are_markers() -> None:
    """A GC pass wrote, read and removed ``epochs/clock-<id>`` every time, markers or not:
    three requests per pass on an object store, for nothing."""
    from ckptstore.conformance.faults import FaultInjector
    from ckptstore.store import Store

    base = ckptstore.open(f"memory://fencing-clock-{os.getpid()}/run")
    injector = FaultInjector(base.strategy.driver)
    store = Store(base.strategy.with_driver(injector))
    store.save(1, {"a": b"1"})
    store.take_over(1)
    store.save(2, {"a": b"2"})
    before = len(injector.calls)
    store.gc()
    clock = [c for c in injector.calls[before:] if c.args and "epochs/clock-" in c.args[0]]
    assert clock == []
    store.strategy.driver.put("epochs/intent-step-00000000000000000001", b"")  # a dead deleter's
    before = len(injector.calls)
    store.gc()
    assert [c.name for c in injector.calls[before:] if c.args and "epochs/clock-" in c.args[0]]
