"""The races layer and the racing probes: true concurrency catches a check that is not atomic
with its write, and the probes report what the server did, not what the driver worked around."""

from __future__ import annotations

import os
import re
import secrets
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import pytest
from s3_proxy import Forward, Request, Respond, Rewrite, S3Proxy, blank_etag, not_implemented

from ckptstore.backends.memory import MemoryDriver, get_bucket
from ckptstore.backends.posix import PosixDriver
from ckptstore.commit.conditional_put import ConditionalPutCommit
from ckptstore.commit.rename import RenameCommit
from ckptstore.conformance import runner
from ckptstore.conformance.layers import probes
from ckptstore.conformance.layers.layer import SuiteRun
from ckptstore.conformance.layers.probes import HELD, VIOLATED, run_probes
from ckptstore.conformance.layers.races import (
    POINTER,
    Crew,
    Outcome,
    RaceProfile,
    RaceResult,
    Round,
    _Judge,
    run_races,
)
from ckptstore.conformance.location import Location, LocationFactory
from ckptstore.conformance.report import BackendReport, render_text
from ckptstore.driver import Buffer, ObjectInfo, PutMode
from ckptstore.errors import EpochExistsError, TargetExistsError
from ckptstore.store import Store

SMALL = RaceProfile(threads=Crew(4, 2, 2, 0.0), processes=Crew(2, 1, 1, 0.0))
GAP_S = 0.2
"""The broken drivers' widened window: how long a writer that passed the check waits for a
second one to pass it too. The racers are released together, so the second comes at once."""


class _Gap:
    """Between a check and its write: wait until another writer of the same name is in the gap
    too (both passed the check before either wrote), or ``GAP_S`` for a lone writer."""

    def __init__(self) -> None:
        self._inside: dict[str, list[list[bool]]] = {}
        self._changed = threading.Condition()

    def passed(self, name: str) -> None:
        paired = [False]
        with self._changed:
            inside = self._inside.setdefault(name, [])
            inside.append(paired)
            if len(inside) >= 2:
                for other in inside:
                    other[0] = True
                self._changed.notify_all()
            self._changed.wait_for(lambda: paired[0], timeout=GAP_S)
            inside.remove(paired)


class CheckThenWriteDriver(MemoryDriver):
    """An S3 clone whose conditional put checks, then writes: not atomically."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.gap = _Gap()

    def put(
        self,
        key: str,
        data: Buffer,
        *,
        mode: PutMode = PutMode.OVERWRITE,
        metadata: Mapping[str, str] | None = None,
    ) -> ObjectInfo:
        if not mode.conditional:
            return super().put(key, data, metadata=metadata)
        with self.bucket.lock:
            self.bucket.check_conditions(self.prefix + key, mode)
        self.gap.passed(key)
        return super().put(key, data, metadata=metadata)


class CheckThenRenameDriver(PosixDriver):
    """A file system driver whose no-replace rename is ``if not exists: rename``."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.gap = _Gap()

    def rename_noreplace(self, src: str, dst: str) -> None:
        target = os.path.join(self.root, dst)
        if os.path.lexists(target):
            raise TargetExistsError(17, f"{dst} exists")
        self.gap.passed(dst)
        self.rename_replace(src, dst)


def _broken_memory() -> Location:
    location = Location(f"memory://races-{secrets.token_hex(4)}/store?min_part_size=4096")
    bucket = get_bucket(location.url.split("/")[2].partition("?")[0])
    driver = CheckThenWriteDriver(bucket, "store")
    location.base = ConditionalPutCommit(driver, part_size=4096, verify_conditional_writes=False)
    location.base.open_root(create=True)
    return location


def _broken_posix(tmp_path: Any) -> Callable[[], Location]:
    def make() -> Location:
        location = Location(f"file://{tmp_path}/store-{secrets.token_hex(4)}")
        location.base = RenameCommit(CheckThenRenameDriver(location.base.driver.root))
        return location

    return make


def _probe(results: list[Any], capability: str) -> Any:
    return next(r for r in results if r.capability == capability)


# -- the broken variants are caught ------------------------------------------------------


def test_probes_catch_a_conditional_check_not_atomic_with_the_write() -> None:
    location = _broken_memory()
    report = BackendReport(url="memory://broken", strategy="conditional put")
    report.capabilities = run_probes(location)
    create = _probe(report.capabilities, "conditional-create")
    swap = _probe(report.capabilities, "compare-and-swap")
    assert create.measured == VIOLATED
    assert "of 8 racing conditional creates succeeded on one key in round 1" in create.detail
    assert swap.measured == VIOLATED
    assert "racing compare-and-swaps succeeded on one key in round 1" in swap.detail
    text = render_text([report])
    assert "conditional-create" in text and "MISSING (declared, not found)" in text
    assert report.outcome == "violated"


def test_races_catch_two_writers_publishing_one_step() -> None:
    result = run_races(_broken_memory, SMALL)
    i5 = [f for f in result.failures if f.invariant == "I5"]
    assert i5, result.failures
    # the first publish race's step: after the takeover and rollback races' 4 steps each
    assert "writers racing for step 9 were told they published it" in i5[0].message
    assert i5[0].case.startswith("publish race 0 (4 threads)")
    assert "keeps its data in one process" in result.processes_skipped


def test_the_runner_reports_races_as_invariants_and_coverage() -> None:
    report = BackendReport(url="memory://broken", strategy="conditional put")
    runner.run_layer(report, "parallel races", SuiteRun(_broken_memory))  # type: ignore[arg-type]
    assert report.invariants["I5"].status == "violated"
    text = render_text([report])
    assert "were told they published it" in text
    assert "parallel races: " in text and "writers (threads)" in text


def test_probe_catches_a_rename_that_checks_then_renames(tmp_path: Any) -> None:
    results = run_probes(_broken_posix(tmp_path)())
    rename = _probe(results, "rename-noreplace")
    assert rename.measured == VIOLATED
    assert "of 8 racing no-replace renames succeeded on one key in round 1" in rename.detail


@pytest.mark.parametrize(
    ("before", "hint", "invariant", "message"),
    [
        (1, 3, "I4", "it names step 3: an update was lost"),  # a swap let two writers through
        (5, 4, "I4", "LATEST went back from step 5 to 4"),
        (1, 9, "I1", "LATEST names step 9, which is not published"),
    ],
)
def test_pointer_race_checks(before: int, hint: int, invariant: str, message: str) -> None:
    location = LocationFactory(f"memory://races-{secrets.token_hex(4)}/store")()
    store = Store(location.base)
    for step in range(1, 5):  # the round: writers of steps 1..4 raced to move LATEST
        store.save(step, {"a.bin": b"x"})
    location.base.reset_latest_hint(hint)
    result = RaceResult()
    judge = _Judge(location, 4, "threads", result)
    judge.hint = before
    # writers 0 and 1 swapped LATEST from one ETag, both let through
    swapped = [Outcome(i, "published", hint_writes=("if-match e1",) if i < 2 else ())
               for i in range(4)]  # fmt: skip
    judge.judge(Round(0, POINTER, 1), swapped)
    found = [f for f in result.failures if f.invariant == invariant]
    assert found and message in found[0].message, result.failures


# -- the real backends pass --------------------------------------------------------------


def test_file_store_holds_in_threads_and_processes(tmp_path: Any) -> None:
    result = run_races(LocationFactory(f"file://{tmp_path}/store"), SMALL)
    assert result.failures == [] and result.storage_errors == []
    assert result.coverage() == (
        "2 rounds of 4 writers (threads) + 1 rounds of 2 (processes); takeover races: 2 "
        "(takers released at the epoch record); rollback races: 2 (rollers released at the "
        "epoch record)"
    )
    rename = _probe(run_probes(LocationFactory(f"file://{tmp_path}/probe")()), "rename-noreplace")
    assert rename.measured == HELD and "exactly one succeeded" in rename.detail


def test_memory_store_holds_and_is_not_raced_in_processes() -> None:
    factory = LocationFactory(f"memory://races-{secrets.token_hex(4)}/store")
    result = run_races(factory, SMALL)
    assert result.failures == [] and result.thread_rounds == 2
    assert "not applicable" in result.coverage()
    results = run_probes(factory())
    for capability in ("conditional-create", "compare-and-swap"):
        assert _probe(results, capability).measured == HELD


def test_s3_holds_in_threads_and_processes(moto_s3: Any) -> None:
    url = moto_s3.url(f"races-{secrets.token_hex(4)}", part_size=4096, concurrency=1)
    profile = RaceProfile(threads=Crew(3, 1, 1, 0.0), processes=Crew(2, 1, 1, 0.0))
    result = run_races(LocationFactory(url, moto_s3.options), profile)
    assert result.failures == [] and result.storage_errors == []
    assert result.process_rounds == 1


# -- probes measure the server, through a proxy that changes its answers -----------------


@pytest.fixture
def one_race_round(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests are about single requests: one round of racing probes is enough."""
    monkeypatch.setattr(probes, "RACE_ROUNDS", 1)


def _probes_through(moto_s3: Any, rule: Callable[[Request], Any]) -> list[Any]:
    with S3Proxy(moto_s3, rule) as proxy:
        server = proxy.through(moto_s3)
        url = server.url(f"probe-{secrets.token_hex(4)}", part_size=4096, concurrency=1)
        return run_probes(LocationFactory(url, server.options)())


def _precondition_failed() -> Respond:
    body = b"<Error><Code>PreconditionFailed</Code><Message>refused</Message></Error>"
    return Respond(412, body, {"Content-Type": "application/xml"})


def test_cas_probe_reports_a_server_that_refuses_quoted_etags(
    moto_s3: Any, one_race_round: None
) -> None:
    def rule(request: Request) -> Any:
        if request.operation == "PutObject" and (request.header("If-Match") or "").startswith('"'):
            return _precondition_failed()
        return Forward()

    swap = _probe(_probes_through(moto_s3, rule), "compare-and-swap")
    assert swap.measured == HELD  # unquoted ETags work: compare-and-swap is there
    assert "If-Match with the current ETag: quoted 412, unquoted 200" in swap.detail
    assert "If-Match on a missing key: 404" in swap.detail


@pytest.mark.parametrize(
    ("answer", "status"), [(_precondition_failed, 412), (not_implemented, 501)]
)
def test_cas_probe_reports_a_server_that_refuses_if_match(
    moto_s3: Any, answer: Callable[[], Respond], status: int, one_race_round: None
) -> None:
    def rule(request: Request) -> Any:
        if request.operation == "PutObject" and request.header("If-Match"):
            return answer()
        return Forward()

    swap = _probe(_probes_through(moto_s3, rule), "compare-and-swap")
    assert swap.measured == VIOLATED
    assert swap.detail == (
        "the server refused If-Match with the object's current ETag in both quotings "
        f"(quoted: {status}, unquoted: {status})"
    )


def test_create_probe_reports_a_server_without_if_none_match(
    moto_s3: Any, one_race_round: None
) -> None:
    def rule(request: Request) -> Any:
        if request.operation == "PutObject" and request.header("If-None-Match"):
            return not_implemented()
        return Forward()

    create = _probe(_probes_through(moto_s3, rule), "conditional-create")
    assert create.measured == VIOLATED
    assert create.detail == "the server answered 501 to PutObject If-None-Match: *"


def test_create_probe_reports_a_200_that_kept_the_old_object(
    moto_s3: Any, one_race_round: None
) -> None:
    seen: set[str] = set()
    lock = threading.Lock()

    def rule(request: Request) -> Any:
        if request.operation == "PutObject" and request.header("If-None-Match"):
            with lock:
                again = request.path in seen
                seen.add(request.path)
            if again:  # answers success, stores nothing
                return Respond(200, b"", {"ETag": '"0123456789abcdef0123456789abcdef"'})
        return Forward()

    create = _probe(_probes_through(moto_s3, rule), "conditional-create")
    assert create.measured == VIOLATED
    assert create.detail == (
        "the server answered 200 to a refused conditional put and kept the old object"
    )


def test_multipart_probe_notices_an_empty_etag(moto_s3: Any, one_race_round: None) -> None:
    def rule(request: Request) -> Any:
        if request.operation == "CompleteMultipartUpload":
            return Rewrite(blank_etag)
        return Forward()

    multipart = _probe(_probes_through(moto_s3, rule), "multipart")
    assert "CompleteMultipartUpload returns an empty ETag" in multipart.detail


# -- takeovers raced against each other (issue 26, item 6) -----------------------------------


class CheckThenWriteEpochCommit(ConditionalPutCommit):
    """A takeover that looks for the epoch record, then writes it plainly: a launcher's "is a
    run already active" marker taken by check-then-write. Restarted runs that race all pass
    the check, and all take epoch N."""

    def create_epoch(self, epoch: int, record: bytes) -> None:
        if self.read_epoch(epoch) is not None:
            raise EpochExistsError(f"{self.url}: epoch {epoch} exists already", url=self.url)
        time.sleep(GAP_S)  # the others pass the check meanwhile
        self.driver.put(self.epoch_key(epoch), record)


def _epoch_checking_memory() -> Location:
    location = Location(f"memory://takers-{secrets.token_hex(4)}/store?min_part_size=4096")
    location.base = CheckThenWriteEpochCommit(location.base.driver, part_size=4096)
    return location


def test_takers_racing_past_a_checked_epoch_record_are_caught_as_i9() -> None:
    """Takeovers were only raced against a zombie writer, never against another taker."""
    result = run_races(_epoch_checking_memory, SMALL, processes=False)
    i9 = [f for f in result.failures if f.invariant == "I9"]
    assert i9, result.failures
    assert re.search(r"takers [0-9, ]+ were all told they took epoch 1", i9[0].message)
    assert i9[0].case == "takeover race 0 (4 threads)"
    assert "takeover races: 1" in result.coverage()


class CheckThenWriteRollbackCommit(ConditionalPutCommit):
    """Rollbacks written by a path of their own (an operator's rollback script beside the
    trainer's takeover): its epoch record is checked for, then put plainly, while takeovers
    create theirs exclusively. Only rollbacks raced against each other show it."""

    def create_epoch(self, epoch: int, record: bytes) -> None:
        if b"rollback to step" not in record:
            super().create_epoch(epoch, record)
            return
        if self.read_epoch(epoch) is not None:
            raise EpochExistsError(f"{self.url}: epoch {epoch} exists already", url=self.url)
        time.sleep(GAP_S)  # the other rollers pass the check meanwhile
        self.driver.put(self.epoch_key(epoch), record)


def _rollback_checking_memory() -> Location:
    location = Location(f"memory://rollers-{secrets.token_hex(4)}/store?min_part_size=4096")
    location.base = CheckThenWriteRollbackCommit(location.base.driver, part_size=4096)
    return location


def test_rollers_racing_past_a_checked_epoch_record_are_caught_as_i9() -> None:
    """Issue 26 item 6: concurrent rollbacks (takeovers from a step) were never raced."""
    result = run_races(_rollback_checking_memory, SMALL, processes=False)
    i9 = [f for f in result.failures if f.invariant == "I9"]
    assert i9, result.failures
    assert all(f.case == "rollback race 0 (4 threads)" for f in i9), i9
    assert re.search(r"takers [0-9, ]+ were all told they took epoch \d+", i9[0].message)
    assert "takeover races: 1" in result.coverage()  # takeovers hold: their path is sound


class FreshlyProbingCommit(ConditionalPutCommit):
    """A sound strategy of its own class, opened afresh: its one-time conditional-create
    probe has not run when the racers start (a third-party strategy, or a new process)."""


def _freshly_probing_memory() -> Location:
    location = Location(f"memory://probing-{secrets.token_hex(4)}/store?min_part_size=4096")
    location.base = FreshlyProbingCommit(location.base.driver, part_size=4096)
    return location


def test_a_strategy_probing_at_its_first_create_is_raced_at_its_commit_point() -> None:
    """The racers' first conditional create was the strategy's probe, held at the gate while
    the other racers waited on the probe's lock: the round hung, then broke its barrier."""
    result = run_races(_freshly_probing_memory, SMALL, processes=False)
    assert result.failures == [] and result.storage_errors == [], result.failures
    assert result.takeovers == result.rollbacks == 1


@pytest.mark.parametrize("scheme", ["file", "memory", "memory+versioned"])
def test_racing_takers_get_one_epoch_each_and_readers_one_history(
    scheme: str, tmp_path: Any
) -> None:
    url = (
        f"file://{tmp_path}/store"
        if scheme == "file"
        else f"{scheme}://takers-{secrets.token_hex(4)}/store"
    )
    result = run_races(LocationFactory(url), SMALL)
    assert result.failures == [] and result.storage_errors == [], result.failures
    assert result.takeovers == (2 if scheme == "file" else 1)  # threads, and processes
    assert result.rollbacks == result.takeovers  # a rollback race last, the same way
