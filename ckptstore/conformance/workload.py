"""Exhaustive crash points: a fixed workload, crashed at every storage call, in both modes.

The standard workload saves two checkpoints of several shards (one multipart-sized where the
storage has multipart uploads), leaves a dead attempt behind, lets it age past the grace
period, runs a retention pass that deletes, a GC that removes the dead attempt, and reads the
latest checkpoint back. It is run once to count its storage calls; then, for every call k, it
is run again with the process dying before call k, and again with it dying after call k took
effect. After each crash a fresh store (a restarted trainer) is checked against the model,
cleaned by GC, checked again, audited for leftovers, and used for one more save.

A case that the storage itself fails (see ``outcomes``) is run again from a fresh location; if
the storage keeps failing it, the case is reported as a storage error, never as a failure.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta

from ckptstore.conformance.faults import (
    CallRecord,
    CrashMode,
    FaultInjector,
    FaultPlan,
    SimulatedCrash,
)
from ckptstore.conformance.location import Location
from ckptstore.conformance.model import InvariantViolation, Model, Saved, check_invariants
from ckptstore.conformance.outcomes import (
    STORAGE_ERROR,
    retry_storage_failures,
    storage_failure,
)
from ckptstore.driver import Capability
from ckptstore.errors import CheckpointExistsError, CkptStoreError
from ckptstore.manifest import Manifest
from ckptstore.retention import KeepLast
from ckptstore.store import Store

__all__ = [
    "GRACE",
    "CaseFailure",
    "CrashPointResult",
    "crash_cases",
    "run_crash_points",
    "run_indeterminate_outcomes",
    "standard_workload",
]

GRACE = timedelta(hours=1)
_AGE = 2 * GRACE.total_seconds()
LocationMaker = Callable[[], Location]


def pattern(size: int, seed: int) -> bytes:
    """Deterministic, position-dependent bytes (a shifted copy is never equal)."""
    block = bytes((seed * 131 + i * 7) % 251 for i in range(251))
    return (block * (size // 251 + 1))[:size]


def big_shard_size(location: Location) -> int:
    """A size that takes a multipart upload of three parts where the storage has them."""
    strategy = location.base
    if Capability.MULTIPART not in strategy.capabilities:
        return 0
    part_size = int(getattr(strategy, "part_size", 0) or 0)
    return 2 * part_size + 123 if part_size else 0


def _shards(step: int, big: int) -> dict[str, bytes]:
    shards = {
        "model/rank00000.bin": pattern(3000, step),
        "model/rank00001.bin": pattern(2000, step + 1),
        "trainer.json": f'{{"step": {step}}}'.encode(),
        "empty.bin": b"",
    }
    if big:
        shards["optimizer/big.bin"] = pattern(big, step + 2)
    return shards


def save(store: Store, model: Model, saved: Saved) -> None:
    """Save ``saved`` through the store, telling the model when it is in doubt and committed.

    The checkpoint counts as committed the moment the strategy's publish returns (before the
    LATEST hint and retention run), the strictest reading of "when commit() returns".
    """
    model.save_started(saved)
    strategy = store.strategy
    publish = strategy.publish

    def publish_and_tell(manifest: Manifest) -> None:
        publish(manifest)
        model.save_committed(saved)

    strategy.publish = publish_and_tell  # type: ignore[method-assign]
    try:
        store.save(saved.step, saved.shards, saved.metadata)
    finally:
        del strategy.publish
    model.save_committed(saved)


def standard_workload(location: Location, plan: FaultPlan, model: Model, big: int) -> Store:
    """Run the standard workload once with faults from ``plan``; return the store it used."""
    store, _ = location.open(plan)
    for step in (1, 2):
        save(store, model, Saved(step, _shards(step, big), {"step": step}))
    dead = Saved(3, {"model/rank00000.bin": pattern(1000, 3)}, {"step": 3})
    model.save_started(dead)
    pending = store.begin(3, dead.metadata)
    pending.write("model/rank00000.bin", dead.shards["model/rank00000.bin"])
    del pending  # its writer "dies": the attempt is never published nor aborted
    location.clock.advance(_AGE)
    model.removal_started(set(store.steps()) - {max(store.steps())}, explicit=False)
    store.apply_retention(KeepLast(1))
    model.gc_started()
    store.gc(grace=GRACE)
    latest = store.latest()
    if latest is not None:
        for name in latest.names:
            latest.read(name)
    return store


@dataclass
class CaseFailure:
    """One crash case whose recovery broke an invariant."""

    case: str
    invariant: str
    message: str


@dataclass
class CrashPointResult:
    """What the exhaustive crash-point layer covered and what it found."""

    calls: int = 0
    cases: int = 0
    failures: list[CaseFailure] = field(default_factory=list)
    invariants_checked: set[str] = field(default_factory=set)
    storage_errors: list[CaseFailure] = field(default_factory=list)
    """Cases the storage failed on every run: undecided, neither passed nor failed."""
    retried: int = 0
    """Runs of cases that were run again because the storage failed them."""
    overlapped: bool = False
    """The workload made storage calls concurrently: a crash after call k differs from one
    before call k + 1, so both are run."""
    reads: int = 0
    """How many of the workload's calls only read (no crash of their own: see crash_cases)."""
    records: list[CallRecord] = field(default_factory=list)
    """The baseline's calls, with what the model and clock were before each."""
    slow_cleanups: int = 0
    """Cases where GC kept dead attempts past the grace period, collecting them only later."""

    def add(self, other: CrashPointResult) -> None:
        """Count the cases of ``other`` in this result too."""
        self.cases += other.cases
        self.failures.extend(other.failures)
        self.invariants_checked |= other.invariants_checked
        self.storage_errors.extend(other.storage_errors)
        self.retried += other.retried
        self.slow_cleanups += other.slow_cleanups


LONG_AGE = 14 * 24 * 3600.0
"""How much further dead attempts are aged when GC kept them past the grace period: a storage
whose clock is ahead (its mtimes in the future) keeps them longer, which is allowed; GC that
still keeps them after this never collects them (I7)."""


def recover_and_check(location: Location, model: Model) -> bool:
    """A restarted trainer: check, GC the dead process's leftovers, check, audit, save again.

    Returns whether GC kept dead attempts past the grace period and collected them only when
    they were much older (a slower cleanup, allowed: e.g. the storage's clock is ahead).
    """
    store, _ = location.open()
    check_invariants(store, model)
    location.clock.advance(_AGE)
    model.gc_started()
    store.gc(grace=GRACE)
    check_invariants(store, model)
    slower = bool(location.leftovers())
    if slower:  # kept longer than the grace: allowed, if they go when much older
        location.clock.advance(LONG_AGE)
        model.gc_started()
        store.gc(grace=GRACE)
        check_invariants(store, model)
        leftovers = location.leftovers()
        if leftovers:
            raise InvariantViolation(
                "I7",
                f"GC never collected dead attempts' data, even {LONG_AGE / 86400:.0f} days "
                f"past the grace period: {sorted(leftovers)[:5]}",
            )
    steps = store.steps()
    following = (steps[-1] if steps else 0) + 10
    save(store, model, Saved(following, {"after-recovery": pattern(100, following)}, {}))
    latest = store.latest()
    if latest is None or latest.step != following:
        raise InvariantViolation("I4", f"a save after recovery is not the latest: {latest}")
    return slower


def run_crash_points(
    new_location: LocationMaker, *, limit: int | None = None, workers: int = 4
) -> CrashPointResult:
    """Crash the standard workload at every storage call, before and after it took effect.

    Cases are independent (each has a location of its own), so ``workers`` run at once: on
    networked storage most of a case is waiting for answers.
    """
    result = CrashPointResult()
    baseline = _retried(functools.partial(_baseline, new_location))
    result.add(baseline)
    if baseline.storage_errors:  # the workload never ran through: no call to crash at
        return result
    result.calls = baseline.calls
    result.overlapped = baseline.overlapped
    result.records = baseline.records
    result.reads = sum(record.reads_only for record in baseline.records)
    reached = baseline.calls if limit is None else min(baseline.calls, limit)
    cases = crash_cases(baseline.records[:reached], overlapped=baseline.overlapped)
    with ThreadPoolExecutor(max(1, workers), thread_name_prefix="crash-case") as pool:
        outcomes = pool.map(
            lambda case: _retried(functools.partial(_crash_case, new_location, *case)), cases
        )
        for outcome in outcomes:  # in case order, so that reports are deterministic
            result.add(outcome)
    return result


def crash_cases(records: list[CallRecord], *, overlapped: bool) -> list[tuple[int, CrashMode]]:
    """The crashes that leave distinct states: (call index, before or after it).

    Calls made concurrently: a crash before and after each. Calls made one at a time: dying
    after call k leaves the storage exactly as dying before call k + 1 does (nothing happens in
    between), so each state is run once, as a crash before each call and one after the last.
    And a call that only reads changes nothing: a crash before it leaves what a crash before
    the next call leaves, unless the workload told the model something (or moved the clock)
    in between, so it is skipped then.
    """
    if overlapped:
        return [(record.index, mode) for record in records for mode in CrashMode]
    cases = []
    for record, following in itertools.pairwise(records):
        if record.reads_only and record.context == following.context:
            continue
        cases.append((record.index, CrashMode.BEFORE))
    if records:
        last = records[-1]
        if not last.reads_only:
            cases.append((last.index, CrashMode.BEFORE))
        cases.append((last.index, CrashMode.AFTER))
    return cases


def _retried(run_once: Callable[[], CrashPointResult]) -> CrashPointResult:
    """Run a case again, afresh, while the storage fails it; say so if it always did."""
    outcome, retries = retry_storage_failures(run_once, lambda done: bool(done.storage_errors))
    outcome.retried += retries
    for error in outcome.storage_errors:
        error.message += f" (the storage failed all {retries + 1} runs of this case)"
    return outcome


def _undecided(
    result: CrashPointResult, name: str, error: CkptStoreError, invariant: str = "I1"
) -> CrashPointResult:
    """Record a case that failed before its check: a storage error if the storage failed it,
    else a failure of ``invariant`` (ckptstore raised, with no crash or fault to excuse it)."""
    result.cases += 1
    failure = storage_failure(error)
    if failure is None:
        result.failures.append(CaseFailure(name, invariant, f"the workload failed: {error!r}"))
    else:
        result.storage_errors.append(CaseFailure(name, STORAGE_ERROR, f"{failure!r}"))
    return result


def _baseline(new_location: LocationMaker) -> CrashPointResult:
    """The workload without a crash, then checked: counts the storage calls to crash at."""
    result = CrashPointResult()
    try:
        location = new_location()
    except CkptStoreError as exc:
        return _undecided(result, "no crash", exc)
    try:
        model = Model()
        clock = location.clock
        plan = FaultPlan(observe=lambda: (model.events, clock.offset))
        try:
            store = standard_workload(location, plan, model, big_shard_size(location))
        except CkptStoreError as exc:
            return _undecided(result, "no crash", exc)
        injector = store.strategy.driver
        assert isinstance(injector, FaultInjector)  # Location.open puts one under every store
        result.calls = len(injector.calls)
        result.records = list(injector.calls)
        result.overlapped = injector.overlapped
        _run_case(result, "no crash", lambda: _recover(result, location, model))
    finally:
        location.destroy()
    return result


def _crash_case(new_location: LocationMaker, index: int, mode: CrashMode) -> CrashPointResult:
    result = CrashPointResult()
    name = f"crash {mode.value} call {index}"
    try:
        location = new_location()
    except CkptStoreError as exc:
        return _undecided(result, name, exc)
    try:
        model = Model()
        plan = FaultPlan(crash_at=index, crash_mode=mode)
        try:
            standard_workload(location, plan, model, big_shard_size(location))
            name += " (not reached)"
        except SimulatedCrash as crash:
            name = f"{name}: {crash}"
        except CkptStoreError as exc:  # before the crash point: the storage failed the workload
            return _undecided(result, name, exc)
        _run_case(result, name, lambda: _recover(result, location, model))
    finally:
        location.destroy()
    return result


def _recover(result: CrashPointResult, location: Location, model: Model) -> None:
    if recover_and_check(location, model):
        result.slow_cleanups += 1


def _run_case(result: CrashPointResult, name: str, body: Callable[[], None]) -> None:
    result.cases += 1
    try:
        body()
    except (InvariantViolation, CkptStoreError) as exc:
        failure = storage_failure(exc)
        if failure is not None:  # the storage failed the check: it decided nothing
            result.storage_errors.append(CaseFailure(name, STORAGE_ERROR, f"{failure!r}"))
        elif isinstance(exc, InvariantViolation):
            result.failures.append(CaseFailure(name, exc.invariant, exc.detail))
        else:
            result.failures.append(CaseFailure(name, "I1", f"recovery failed: {exc!r}"))


def run_indeterminate_outcomes(new_location: LocationMaker) -> CrashPointResult:
    """Time out every call of a save after it took effect, and after each: read back (I8).

    A save whose publish took effect must not report failure, and above all must not mistake
    its own earlier write for another writer's (CheckpointExistsError).
    """
    result = CrashPointResult()
    baseline = _retried(functools.partial(_count_save_calls, new_location))
    result.add(baseline)
    if baseline.storage_errors:
        return result
    for index in range(baseline.calls):
        result.add(_retried(functools.partial(_indeterminate_case, new_location, index)))
    return result


def _count_save_calls(new_location: LocationMaker) -> CrashPointResult:
    """One save without faults, to count its storage calls (not itself a case)."""
    result = CrashPointResult()
    try:
        location = new_location()
    except CkptStoreError as exc:
        return _undecided(result, "a save without faults", exc)
    try:
        store, injector = location.open()
        save(store, Model(), Saved(1, _shards(1, 0), {}))
        result.calls = injector.count
    except CkptStoreError as exc:
        return _undecided(result, "a save without faults", exc)
    finally:
        location.destroy()
    return result


def _indeterminate_case(new_location: LocationMaker, index: int) -> CrashPointResult:
    result = CrashPointResult()
    name = f"timeout after call {index}"
    try:
        location = new_location()
    except CkptStoreError as exc:
        return _undecided(result, name, exc)
    try:
        _time_out_after(result, location, index, name)
    except CkptStoreError as exc:
        return _undecided(result, name, exc, "I8")
    finally:
        location.destroy()
    return result


def _time_out_after(result: CrashPointResult, location: Location, index: int, name: str) -> None:
    model = Model()
    store, injector = location.open(FaultPlan(transient={index: CrashMode.AFTER}))
    saved = Saved(1, _shards(1, 0), {})
    try:
        save(store, model, saved)
    except CheckpointExistsError as exc:
        record = injector.transient_injected[0] if injector.transient_injected else None
        result.cases += 1
        result.failures.append(
            CaseFailure(f"{name} {record}", "I8", f"own publish taken for another's: {exc}")
        )
        return
    except CkptStoreError as exc:
        if storage_failure(exc) is not None:
            raise  # the storage failed the save, not the injected timeout: nothing to judge
    record = injector.transient_injected[0] if injector.transient_injected else None
    if record is not None:
        name = f"{name}: {record}"
        if record.conditional:
            result.invariants_checked.add("I8")
    clean, _ = location.open()
    failed_but_published = bool(model.in_doubt.get(1)) and clean.steps() == [1]
    if failed_but_published and record is not None and record.conditional:
        result.cases += 1
        result.failures.append(
            CaseFailure(name, "I8", "the publish took effect but the save reported failure")
        )
        return
    _run_case(result, name, lambda: check_invariants(clean, model))
