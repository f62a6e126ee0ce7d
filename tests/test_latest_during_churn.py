"""``latest()`` while checkpoints are published and deleted around its listing.

A listing is no snapshot: a directory read during renames (POSIX leaves it unspecified whether
an entry added or removed meanwhile shows) and a paginated object listing may show none of the
checkpoints that come and go while they run. ``latest()`` must still answer with the newest
checkpoint: never None while one exists, never an older step than the newest it listed (I4).
Found by tests/test_concurrency.py on posix: a reader got None just after a rollback, and once
an older step than one it had read. Each test here makes that interleaving happen on purpose.
"""

from __future__ import annotations

import errno
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import ckptstore
from ckptstore.errors import TransientStorageError

FAMILIES = ["file", "memory", "memory+versioned"]
"""Rename, conditional put and version pin: each lists its checkpoints its own way."""


@pytest.fixture(params=FAMILIES)
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "file":
        return f"file://{tmp_path}/store"
    return f"{request.param}://{tmp_path.name}-{request.param.replace('+', '-')}/store"


def _save(store: ckptstore.Store, step: int) -> None:
    store.save(step, {"model.bin": f"step {step}".encode()})


def _once(real: Callable[..., Any], meanwhile: Callable[[], None]) -> Callable[..., Any]:
    """``real``, which runs ``meanwhile`` after its first call returns."""
    calls = 0

    def call(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        answer = real(*args, **kwargs)
        if calls == 1:
            meanwhile()
        return answer

    return call


def test_a_listing_that_missed_every_checkpoint_in_flux_is_not_taken_for_none(
    url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reader reads the hint (2); the operator rolls back to step 1; while the reader lists
    every step, the restarted run saves 3 and 4 and its retention deletes 1, and the listing
    shows none of them. The only step it shows is 2, which the rollback superseded."""
    writer = ckptstore.open(url)
    _save(writer, 1)
    _save(writer, 2)
    reader = ckptstore.open(url)
    if not reader.strategy.keeps_lineages:
        pytest.skip("a store without lineages rolls back by deleting")

    def rollback() -> None:
        ckptstore.open(url).rollback(1)

    def restarted_run_saves() -> None:
        run = ckptstore.open(url)
        run.join_epoch(1)
        _save(run, 3)
        _save(run, 4)
        run.delete(1)

    real_listing = reader.strategy.published_checkpoints
    full_listings = 0

    def listing(min_step: int = 0) -> list[tuple[int, int]]:
        nonlocal full_listings
        if min_step > 0:
            return list(real_listing(min_step))
        full_listings += 1
        if full_listings > 1:
            return list(real_listing(min_step))
        before = real_listing(0)
        restarted_run_saves()
        after = set(real_listing(0))
        return [entry for entry in before if entry in after]  # what came and went: not shown

    monkeypatch.setattr(reader._history, "read_hint", _once(reader._history.read_hint, rollback))
    monkeypatch.setattr(reader.strategy, "published_checkpoints", listing)
    latest = reader.latest()
    assert full_listings >= 1, "the interleaving did not happen"
    assert latest is not None, "latest() said no checkpoint exists; steps 3 and 4 do"
    assert latest.step == 4
    assert latest.read("model.bin") == b"step 4"


def test_an_older_step_is_not_returned_when_newer_ones_went_after_the_listing(
    url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reader lists steps 1 to 3 (its hint lags at 1); then 4 and 5 are saved and
    retention deletes 2 and 3 before the reader opens them. Step 1, still there, is older than
    step 3, which the reader listed: the answer is 5, the newest."""
    writer = ckptstore.open(url)
    for step in (1, 2, 3):
        _save(writer, step)
    writer.strategy.reset_latest_hint(1)  # writers that died before moving it on

    def newer_saves_and_retention() -> None:
        _save(writer, 4)
        _save(writer, 5)
        writer.delete(2)
        writer.delete(3)

    reader = ckptstore.open(url)
    monkeypatch.setattr(
        reader._history, "steps", _once(reader._history.steps, newer_saves_and_retention)
    )
    latest = reader.latest()
    assert latest is not None and latest.step == 5, latest and latest.step
    assert reader.latest() is not None


def test_a_hint_naming_the_same_step_after_a_rollback_is_read_again(
    url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The hint reads 3 before the listing and 3 after it, but not the same checkpoint: the
    operator rolled back to 1, and the restarted run saved 2 (its retention deleting 1) while
    the listing missed both, then saved 3 again. A checkpoint existed at every instant."""
    writer = ckptstore.open(url)
    for step in (1, 2, 3):
        _save(writer, step)
    reader = ckptstore.open(url)
    if not reader.strategy.keeps_lineages:
        pytest.skip("a store without lineages rolls back by deleting")
    run: list[ckptstore.Store] = []

    def rollback() -> None:
        ckptstore.open(url).rollback(1)
        run.append(ckptstore.open(url))
        run[0].join_epoch(1)

    real_hint = reader._history.read_hint
    hint_reads = 0

    def read_hint(**options: Any) -> int | None:
        nonlocal hint_reads
        hint_reads += 1
        if hint_reads == 2:  # after the listing that missed everything: the run reaches 3
            _save(run[0], 3)
        return real_hint(**options)

    real_listing = reader.strategy.published_checkpoints
    full_listings = 0

    def listing(min_step: int = 0) -> list[tuple[int, int]]:
        nonlocal full_listings
        if min_step > 0:
            return list(real_listing(min_step))
        full_listings += 1
        if full_listings > 1:
            return list(real_listing(min_step))
        before = real_listing(0)
        _save(run[0], 2)
        run[0].delete(1)
        after = set(real_listing(0))
        return [entry for entry in before if entry in after]

    monkeypatch.setattr(reader._history, "read_hint", _once(read_hint, rollback))
    monkeypatch.setattr(reader.strategy, "published_checkpoints", listing)
    latest = reader.latest()
    assert hint_reads >= 2 and full_listings >= 1, "the interleaving did not happen"
    assert latest is not None and latest.step == 3, latest and latest.step
    assert latest.read("model.bin") == b"step 3"


def test_newer_steps_no_listing_showed_are_found_through_the_hint(
    url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Steps 100 and 150 (retention keeps the newest and every hundredth). While the reader
    lists from its hint, 160 is saved and 150 deleted; while it lists every step, 170 is saved
    and 160 deleted; neither listing shows what came and went. Step 100, which it does see,
    was never the newest during the call: the answer is 170."""
    writer = ckptstore.open(url)
    for step in (100, 150):
        _save(writer, step)
    reader = ckptstore.open(url)
    real_listing = reader.strategy.published_checkpoints
    churn = iter([(160, 150), (170, 160)])

    def listing(min_step: int = 0) -> list[tuple[int, int]]:
        before = real_listing(min_step)
        new, old = next(churn, (None, None))
        if new is None:
            return list(before)
        _save(writer, new)
        writer.delete(old)
        after = set(real_listing(min_step))
        return [entry for entry in before if entry in after]

    monkeypatch.setattr(reader.strategy, "published_checkpoints", listing)
    latest = reader.latest()
    assert next(churn, None) is None, "the interleaving did not happen"
    assert latest is not None and latest.step == 170, latest and latest.step


def test_latest_verified_checks_each_checkpoint_once_however_often_it_lists(
    url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Newer candidates go under the reader round after round: it lists again each time, but
    reads the shards of the older checkpoint it falls back to only once."""
    writer = ckptstore.open(url)
    for step in (1, 2):
        _save(writer, step)
    reader = ckptstore.open(url)
    real_steps = reader._history.steps
    rounds = 0

    def steps(*args: Any, **kwargs: Any) -> list[int]:
        nonlocal rounds
        rounds += 1
        listed = real_steps(*args, **kwargs)
        if rounds <= 3:  # a newer step every round, gone again before it is read
            phantom = 10 + rounds
            _save(writer, phantom)
            writer.delete(phantom, force=True)
            return sorted({*listed, phantom})
        return listed

    verifies: list[int] = []
    real_verify = ckptstore.Checkpoint.verify

    def verify(self: ckptstore.Checkpoint, *args: Any, **kwargs: Any) -> Any:
        verifies.append(self.step)
        return real_verify(self, *args, **kwargs)

    monkeypatch.setattr(reader._history, "steps", steps)
    monkeypatch.setattr(ckptstore.Checkpoint, "verify", verify)
    latest = reader.latest(verified=True)
    assert latest is not None and latest.step == 2
    assert rounds >= 4 and verifies.count(2) == 1, (rounds, verifies)


def test_the_last_round_answers_with_what_it_read_when_the_hinted_step_went_too(
    url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every round but the last lists a newer step gone before it is read; on the last, the
    hint names a step gone too. Step 1, read on every round, is the answer, not an error."""
    from ckptstore import store as store_module

    writer = ckptstore.open(url)
    _save(writer, 1)
    reader = ckptstore.open(url)
    real_steps = reader._history.steps
    rounds = store_module._LATEST_ROUNDS
    calls = 0

    def steps(*args: Any, **kwargs: Any) -> list[int]:
        nonlocal calls
        calls += 1
        listed = real_steps(*args, **kwargs)
        if calls < rounds:
            return sorted({*listed, 1000 + calls})  # listed, and gone before it is read
        if calls == rounds:
            return listed
        return sorted({*listed, 999})  # the hinted step, gone before it is read

    def read_hint(**_: Any) -> int | None:
        return 999 if calls >= rounds else None

    monkeypatch.setattr(reader._history, "steps", steps)
    monkeypatch.setattr(reader._history, "read_hint", read_hint)
    latest = reader.latest()
    assert calls == rounds + 1, calls
    assert latest is not None and latest.step == 1


def test_a_hint_that_cannot_be_read_after_an_empty_listing_is_an_error_not_none(
    url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a listing that showed no checkpoint, the hint is what could still name one: a
    transient error reading it is raised, never taken for "no checkpoint"."""
    writer = ckptstore.open(url)
    _save(writer, 1)
    reader = ckptstore.open(url)
    real_read = reader.strategy.read_latest_hint
    reads = 0

    def read_latest_hint() -> int | None:
        nonlocal reads
        reads += 1
        if reads == 1:
            return None  # no hint yet when the call began
        raise TransientStorageError(errno.ECONNRESET, "connection reset", url=url)

    monkeypatch.setattr(reader.strategy, "read_latest_hint", read_latest_hint)
    monkeypatch.setattr(reader.strategy, "published_checkpoints", lambda min_step=0: [])
    with pytest.raises(TransientStorageError):
        reader.latest()
    monkeypatch.setattr(reader.strategy, "read_latest_hint", real_read)
    latest = reader.latest()  # the same empty listing; the hint, read, names step 1
    assert latest is not None and latest.step == 1
