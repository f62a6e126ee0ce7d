"""Rollback is a takeover, a takeover can be undone, and no deleter can empty the history
(issue 24 items 3 and 4; docs/protocol.md §6, §8.2, §8.4, §8.5).

End to end through the public API and the CLI on file:// and S3 (moto), and a deterministic
interleaving of a retention pass (and a delete, and GC) with a rollback at each of the other's
storage calls, with a reader checking before every call that the history is never empty.
"""

from __future__ import annotations

import io
import json
import threading
import time
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from conftest import BackendUnderTest, extended

from ckptstore.cli import main
from ckptstore.conformance.faults.operators import CallHook
from ckptstore.driver import storage_calls
from ckptstore.errors import (
    CheckpointNotFoundError,
    LineageCorruptError,
    RefusedError,
    SupersededError,
)
from ckptstore.lineage import Epoch, Lineage
from ckptstore.manifest import WriterInfo
from ckptstore.names import step_token
from ckptstore.retention import KeepLast
from ckptstore.store import Store

PAUSED_ON_S3 = pytest.param("s3", marks=pytest.mark.slow)  # a minute each: every call, on moto
both = pytest.mark.parametrize("backend", ["file", "s3"], indirect=True)


def _save(store: Store, step: int, tag: str = "") -> None:
    store.save(step, {"w.bin": f"{tag}{step}".encode() * 10}, metadata={"tag": tag})


def _run(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    status = main(list(argv), out)
    return status, out.getvalue()


@pytest.fixture
def s3_env(
    backend: BackendUnderTest, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    """The CLI reads S3 credentials from the environment, like any AWS tool."""
    if backend.name == "s3":
        for key, value in request.getfixturevalue("moto_s3").credentials_env().items():
            monkeypatch.setenv(key, value)


# -- the readers' rule with parent epochs (§8.2) --------------------------------------------


def _epoch(number: int, parent: int | None, base: int | None = None) -> Epoch:
    at = datetime(2026, 1, 1, tzinfo=timezone.utc)
    return Epoch(number, parent, at, WriterInfo("h", 1), parent_epoch=base)


def _old_owner(parents: list[int | None], step: int) -> int:
    """The rule before parent epochs: the newest epoch whose parent is below the step."""
    for number in range(len(parents), 0, -1):
        floor = parents[number - 1]
        if (-1 if floor is None else floor) < step:
            return number
    return 0


def test_records_without_a_parent_epoch_follow_the_old_rule_exactly() -> None:
    import random

    chooser = random.Random(24)
    for _ in range(300):
        parents: list[int | None] = [
            None if chooser.random() < 0.15 else chooser.randint(0, 30)
            for _ in range(chooser.randint(0, 6))
        ]
        lineage = Lineage.of(_epoch(n, p) for n, p in enumerate(parents, start=1))
        for step in range(0, 33):
            assert lineage.owner(step) == _old_owner(parents, step), (parents, step)


def test_a_parent_epoch_is_recorded_only_where_it_is_not_the_epoch_before() -> None:
    implicit = _epoch(3, 5, base=2)
    assert b"parent_epoch" not in implicit.encode()
    assert implicit.encode() == _epoch(3, 5).encode()  # byte for byte as before
    explicit = _epoch(3, 5, base=0)
    decoded = Epoch.decode(explicit.encode(), where="x", expected=3)
    assert decoded.base == 0 and decoded.parent_epoch == 0
    # An undo: epoch 2 (a mistaken fresh start) is undone by epoch 3, from step 5 of epoch 0.
    lineage = Lineage.of([_epoch(1, 2), _epoch(2, None), _epoch(3, 5, base=1)])
    assert [lineage.owner(s) for s in (1, 2, 3, 5, 6)] == [0, 0, 1, 1, 3]
    forward = _epoch(2, 5, base=2)
    with pytest.raises(LineageCorruptError, match="not an older one"):
        Epoch.decode(forward.encode(), where="x", expected=2)


# -- item 3: a mistaken takeover needs a word, is kept for a grace period, can be undone ---


@both
def test_a_fresh_start_over_a_history_is_refused_kept_and_undone(
    backend: BackendUnderTest, s3_env: None
) -> None:
    store = backend.open()
    for step in (1, 2, 3):
        _save(store, step, "old")
    url = backend.url
    taker = backend.open()
    with pytest.raises(RefusedError, match="discard_history=True"):
        taker.take_over(None)
    status, text = _run("take-over", url, "--json")
    assert status != 0 and "--discard-history" in text
    assert taker.lineage().newest == 0

    status, text = _run("take-over", url, "--discard-history", "--json")
    assert status == 0, text
    assert json.loads(text)["parent"] is None
    reader = backend.open()
    assert reader.latest() is None and reader.steps() == []

    # The routine gc of the issue: the checkpoints stay, and ls says when they go.
    status, text = _run("gc", url, "--json")
    assert status == 0, text
    assert [i["kind"] for i in json.loads(text)["removed"]] == []
    status, text = _run("ls", url, "--json")
    listed = json.loads(text)["superseded"]
    assert [(e["step"], e["epoch"]) for e in listed] == [(1, 0), (2, 0), (3, 0)]
    for entry in listed:
        goes = datetime.fromisoformat(entry["collected_after"])
        assert goes - datetime.fromisoformat(entry["superseded_at"]) == timedelta(hours=24)
    status, text = _run("ls", url)
    assert status == 0 and "gc removes it from" in text

    # The undo: a takeover from the old newest step of the old epoch brings it all back.
    status, text = _run("take-over", url, "3", "--from-epoch", "0", "--json")
    assert status == 0, text
    reader = backend.open()
    assert reader.steps() == [1, 2, 3] and reader.superseded() == []
    latest = reader.latest()
    assert latest is not None and latest.step == 3
    assert latest.manifest.metadata["tag"] == "old"
    reader.join_epoch(reader.lineage().newest)  # the undo's epoch: a fresh handle names it
    _save(reader, 4, "new")
    assert backend.open().steps() == [1, 2, 3, 4]


@pytest.mark.parametrize(
    "backend", ["file", "memory", "memory+versioned", "s3", "gs", "az"], indirect=True
)
def test_gc_collects_superseded_checkpoints_only_after_the_grace(
    backend: BackendUnderTest,
) -> None:
    store = backend.open()
    for step in (1, 2, 3):
        _save(store, step)
    backend.open().take_over(1)
    report = backend.open().gc()
    assert [i.name for i in report.kept_young if i.kind == "superseded"] == [
        "step 2 of epoch 0 (superseded by epoch 1)",
        "step 3 of epoch 0 (superseded by epoch 1)",
    ]
    assert len(backend.open().superseded()) == 2
    # A day later by the store's clock (its lead over this host's counts, as GC's ages do).
    later = backend.open(clock=lambda: time.time() + 25 * 3600)
    report = later.gc(superseded_grace=timedelta(hours=24))
    assert sorted(i.name for i in report.removed if i.kind == "superseded") == [
        "step 2 of epoch 0 (superseded by epoch 1)",
        "step 3 of epoch 0 (superseded by epoch 1)",
    ]
    assert backend.open().superseded() == []
    with pytest.raises(CheckpointNotFoundError):  # gone: the undo is refused, cleanly
        backend.open().take_over(3, from_epoch=0)
    assert backend.open().lineage().newest == 1


# -- item 4: rollback is a takeover from its target ------------------------------------------


@both
def test_rollback_keeps_the_newer_checkpoints_until_gc_and_can_be_undone(
    backend: BackendUnderTest, s3_env: None
) -> None:
    writer = backend.open()
    for step in (1, 2, 3, 4, 5):
        _save(writer, step, "old")
    url = backend.url
    status, text = _run("rollback", url, "2", "--json")
    assert status == 0, text
    done = json.loads(text)
    assert done["left_history"] == [3, 4, 5] and done["latest"] == 2
    assert done["epoch"] == 1 and done["collected_after"] is not None
    status, text = _run("rollback", url, "1")
    assert status == 0, text
    assert "left the history: 2" in text and "undo: ckptstore take-over" in text

    reader = backend.open()
    assert reader.steps() == [1]
    assert [(s.step, s.epoch) for s in reader.superseded()] == [(2, 0), (3, 0), (4, 0), (5, 0)]
    with pytest.raises(SupersededError):  # the old run's writer is fenced
        _save(writer, 6, "old")

    # Undo both: a takeover from the old newest step of epoch 0.
    undo = backend.open().take_over(5, from_epoch=0, note="undo")
    assert undo.base == 0 and undo.number == 3
    reader = backend.open()
    assert reader.steps() == [1, 2, 3, 4, 5] and reader.superseded() == []
    assert reader.gc().removed == [] or all(i.kind != "superseded" for i in reader.gc().removed)
    assert [reader.get(s).manifest.metadata["tag"] for s in (1, 5)] == ["old", "old"]


@both
def test_rollback_through_the_api_says_what_left_and_when_it_goes(
    backend: BackendUnderTest,
) -> None:
    store = backend.open()
    for step in (10, 20, 30):
        _save(store, step)
    done = backend.open().rollback(10)
    assert done.left == [20, 30] and done.epoch is not None and done.epoch.parent == 10
    assert done.collected_after is not None
    now = datetime.now(timezone.utc)
    assert timedelta(hours=23) < done.collected_after - now < timedelta(hours=25)
    nothing = backend.open().rollback(10)
    assert nothing.left == [] and nothing.epoch is None
    assert backend.open().lineage().newest == 1


# -- item 4/5: no deleter racing a rollback can empty the history ----------------------------


class _Recorder:
    """A driver wrapper that records each storage call: its name and the names it touches."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self._calls = storage_calls(inner)
        self.family = getattr(inner, "family", None)
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._inner, name)
        if name not in self._calls:
            return attribute

        def call(*args: Any, **kwargs: Any) -> Any:
            named = " ".join(a for a in args if isinstance(a, str))
            self.calls.append(f"{name} {named}")
            return attribute(*args, **kwargs)

        return call


def _pause_points(
    backend: BackendUnderTest,
    open_operator: Callable[[], Store],
    run: Callable[[Store], Any],
    target: int,
) -> list[int]:
    """The storage calls of ``run`` to pause before (and one past the last call).

    On file:// and memory:// (the object-store protocol in process) every call. On S3 (moto,
    where each point costs seconds) the calls of the fencing on ``target`` (its hold, its
    intent, its manifest's delete, the epoch record's create) and the call after each.
    """
    operator = open_operator()
    recorder = _Recorder(operator.strategy.driver)
    run(Store(operator.strategy.with_driver(recorder)))
    calls = recorder.calls
    if backend.name != "s3":
        return list(range(len(calls) + 1))
    token = step_token(target)
    fencing = (f"hold-{token}", f"intent-{token}", f"delete manifests/{token}", "put epochs/epoch-")
    chosen = {len(calls)}
    for index, call in enumerate(calls):
        if any(mark in call for mark in fencing):
            chosen.update((index, index + 1))
    assert len(chosen) > 4, calls  # the fencing's calls were found
    return sorted(chosen)


class _Watch:
    """A driver wrapper that checks, before every storage call, that a fresh reader finds a
    checkpoint: the history is never empty, not even for one call."""

    def __init__(self, inner: Any, check: Callable[[str], None]) -> None:
        self._inner = inner
        self._calls = storage_calls(inner)
        self.family = getattr(inner, "family", None)
        self._check = check

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._inner, name)
        if name not in self._calls:
            return attribute

        def call(*args: Any, **kwargs: Any) -> Any:
            self._check(name)
            return attribute(*args, **kwargs)

        return call


def _interleave(
    backend: BackendUnderTest,
    deleter: Callable[[Store], Any],
    target: int,
    at: int,
    rollback_first: bool,
) -> str:
    """Publish 1..5; run ``deleter`` and a rollback to ``target``, one paused at storage call
    ``at`` while the other runs (in a thread: a rollback waits for a deletion intent to
    clear); a reader checks before every call of both that the history holds a checkpoint."""
    setup = backend.open()
    for step in (1, 2, 3, 4, 5):
        _save(setup, step)
    problems: list[str] = []
    lock = threading.Lock()
    reader = backend.open()

    def check(where: str) -> None:
        with lock:
            if reader.latest() is None:
                problems.append(f"the history was empty before a {where} call")

    def watched() -> Store:
        store = backend.open()
        return Store(store.strategy.with_driver(_Watch(store.strategy.driver, check)))

    outcome: dict[str, BaseException | None] = {}

    def rollback() -> None:
        try:
            watched().rollback(target)
            outcome["rollback"] = None
        except (CheckpointNotFoundError, RefusedError) as exc:
            outcome["rollback"] = exc

    def delete() -> None:
        try:
            deleter(watched())
            outcome["deleter"] = None
        except (CheckpointNotFoundError, RefusedError) as exc:
            outcome["deleter"] = exc

    second = delete if rollback_first else rollback
    thread = threading.Thread(target=second)

    def start_second() -> None:
        thread.start()
        thread.join(timeout=1.0)  # finishes, or waits on the first's intent: let it go on

    first_store = watched()
    hook = CallHook(first_store.strategy.driver, at, start_second)
    first = Store(first_store.strategy.with_driver(hook))
    try:
        if rollback_first:
            first.rollback(target)
        else:
            deleter(first)
    except (CheckpointNotFoundError, RefusedError):
        pass
    hook.run("after the last call")
    thread.join(timeout=60)
    assert not thread.is_alive()
    final = backend.open()
    latest = final.latest()
    assert not problems, problems[:3]
    assert latest is not None, f"the store was left without a checkpoint (call {at})"
    if final.lineage().newest:  # the rollback took its epoch: its target is the newest
        assert latest.step == target, (at, latest.step)
    return hook.where or ""


def _retention(store: Store) -> None:
    store.apply_retention(KeepLast(2))


def _delete_target(target: int) -> Callable[[Store], None]:
    def delete(store: Store) -> None:
        store.delete(target)

    return delete


@pytest.mark.parametrize(
    ("backend", "target"),
    [
        *[(kind, target) for kind in ("file", "memory") for target in (1, 3)],
        pytest.param(*PAUSED_ON_S3.values, 1, marks=PAUSED_ON_S3.marks),
        pytest.param(
            *PAUSED_ON_S3.values,
            3,
            marks=[
                *PAUSED_ON_S3.marks,
                extended("the calls paused for target 1 on s3; target 3 on file and memory"),
            ],
        ),
    ],
    indirect=["backend"],
)
def test_a_retention_pass_paused_at_each_call_never_empties_a_rollback(
    backend: BackendUnderTest, target: int, tmp_path: Any
) -> None:
    for at in _retention_points(backend, target):
        _fresh(backend, tmp_path, at)
        _interleave(backend, _retention, target, at, rollback_first=False)


@pytest.mark.parametrize(
    "backend",
    [
        "file",
        "memory",
        pytest.param(
            *PAUSED_ON_S3.values,
            marks=[
                *PAUSED_ON_S3.marks,
                extended(
                    "the same interleavings run on memory://, whose commit strategy is s3's "
                    "(conditional put); the retention pass paused on s3 stays in CI"
                ),
            ],
        ),
    ],
    indirect=True,
)
def test_a_rollback_paused_at_each_call_never_loses_its_target_to_a_deleter(
    backend: BackendUnderTest, tmp_path: Any
) -> None:
    for deleter in (_retention, _delete_target(1)):
        _fresh(backend, tmp_path, -1)
        setup = backend.open()
        for step in (1, 2, 3, 4, 5):
            _save(setup, step)
        for at in _pause_points(backend, backend.open, lambda store: store.rollback(1), 1):
            _fresh(backend, tmp_path, at)
            _interleave(backend, deleter, 1, at, rollback_first=True)


def _retention_points(backend: BackendUnderTest, target: int) -> list[int]:
    setup = backend.open()
    for step in (1, 2, 3, 4, 5):
        _save(setup, step)
    return _pause_points(backend, backend.open, _retention, target)


_generation = [0]


def _fresh(backend: BackendUnderTest, tmp_path: Any, at: int) -> None:
    """Point ``backend`` at a new empty location (each interleaving starts from scratch)."""
    _generation[0] += 1
    origin = backend.__dict__.setdefault("origin", backend.url)
    suffix = f"g{_generation[0]}"
    if backend.name == "file":
        backend.root = str(tmp_path / suffix)  # type: ignore[attr-defined]
        backend.url = f"file://{backend.root}"
    else:
        base, _, query = origin.partition("?")
        backend.url = f"{base.rstrip('/')}/{suffix}?{query}"
