"""Exhaustive crash points: a fixed workload, crashed at every storage call, in both modes.

The standard workload saves two checkpoints of several shards (one multipart-sized where the
storage has multipart uploads), leaves a dead attempt behind, lets it age past the grace
period, runs a retention pass that deletes, a GC that removes the dead attempt, and reads the
latest checkpoint back. It is run once to count its storage calls; then, for every call k, it
is run again with the process dying before call k, and again with it dying after call k took
effect. After each crash a fresh store (a restarted trainer) is checked against the model,
cleaned by GC, checked again, audited for leftovers, and used for one more save.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta

from ckptstore.conformance.faults import CrashMode, FaultPlan, SimulatedCrash
from ckptstore.conformance.location import Location
from ckptstore.conformance.model import InvariantViolation, Model, Saved, check_invariants
from ckptstore.driver import Capability
from ckptstore.errors import CheckpointExistsError, CkptStoreError
from ckptstore.manifest import Manifest
from ckptstore.retention import KeepLast
from ckptstore.store import Store

__all__ = [
    "GRACE",
    "CaseFailure",
    "CrashPointResult",
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


def recover_and_check(location: Location, model: Model) -> None:
    """A restarted trainer: check, GC the dead process's leftovers, check, audit, save again."""
    store, _ = location.open()
    check_invariants(store, model)
    location.clock.advance(_AGE)
    model.gc_started()
    store.gc(grace=GRACE)
    check_invariants(store, model)
    leftovers = location.leftovers()
    if leftovers:
        raise InvariantViolation("I7", f"GC left dead attempts' data: {sorted(leftovers)[:5]}")
    steps = store.steps()
    following = (steps[-1] if steps else 0) + 10
    save(store, model, Saved(following, {"after-recovery": pattern(100, following)}, {}))
    latest = store.latest()
    if latest is None or latest.step != following:
        raise InvariantViolation("I4", f"a save after recovery is not the latest: {latest}")


def run_crash_points(
    new_location: LocationMaker, *, limit: int | None = None, workers: int = 4
) -> CrashPointResult:
    """Crash the standard workload at every storage call, before and after it took effect.

    Cases are independent (each has a location of its own), so ``workers`` run at once: on
    networked storage most of a case is waiting for answers.
    """
    result = CrashPointResult()
    location = new_location()
    try:
        big = big_shard_size(location)
        model = Model()
        plan = FaultPlan()
        store = standard_workload(location, plan, model, big)
        calls = len(store.strategy.driver.calls)
        _run_case(result, "no crash", lambda: recover_and_check(location, model))
    finally:
        location.destroy()
    result.calls = calls
    cases = [
        (index, mode)
        for index in range(calls if limit is None else min(calls, limit))
        for mode in (CrashMode.BEFORE, CrashMode.AFTER)
    ]
    with ThreadPoolExecutor(max(1, workers), thread_name_prefix="crash-case") as pool:
        outcomes = pool.map(lambda case: _crash_case(new_location, big, *case), cases)
        for outcome in outcomes:  # in case order, so that reports are deterministic
            result.cases += outcome.cases
            result.failures.extend(outcome.failures)
    return result


def _crash_case(
    new_location: LocationMaker, big: int, index: int, mode: CrashMode
) -> CrashPointResult:
    result = CrashPointResult()
    location = new_location()
    model = Model()
    plan = FaultPlan(crash_at=index, crash_mode=mode)
    name = f"crash {mode.value} call {index}"
    try:
        try:
            standard_workload(location, plan, model, big)
            name += " (not reached)"
        except SimulatedCrash as crash:
            name = f"{name}: {crash}"
        _run_case(result, name, lambda: recover_and_check(location, model))
    finally:
        location.destroy()
    return result


def _run_case(result: CrashPointResult, name: str, body: Callable[[], None]) -> None:
    result.cases += 1
    try:
        body()
    except InvariantViolation as violation:
        result.failures.append(CaseFailure(name, violation.invariant, violation.detail))
    except CkptStoreError as exc:
        result.failures.append(CaseFailure(name, "I1", f"recovery failed: {exc!r}"))


def run_indeterminate_outcomes(new_location: LocationMaker) -> CrashPointResult:
    """Time out every call of a save after it took effect, and after each: read back (I8).

    A save whose publish took effect must not report failure, and above all must not mistake
    its own earlier write for another writer's (CheckpointExistsError).
    """
    result = CrashPointResult()
    location = new_location()
    try:
        store, injector = location.open()
        save(store, Model(), Saved(1, _shards(1, 0), {}))
        calls = injector.count
    finally:
        location.destroy()
    for index in range(calls):
        location = new_location()
        try:
            _indeterminate_case(result, location, index)
        finally:
            location.destroy()
    return result


def _indeterminate_case(result: CrashPointResult, location: Location, index: int) -> None:
    model = Model()
    store, injector = location.open(FaultPlan(transient={index: CrashMode.AFTER}))
    saved = Saved(1, _shards(1, 0), {})
    name = f"timeout after call {index}"
    try:
        save(store, model, saved)
    except CheckpointExistsError as exc:
        record = injector.transient_injected[0] if injector.transient_injected else None
        result.failures.append(
            CaseFailure(f"{name} {record}", "I8", f"own publish taken for another's: {exc}")
        )
        return
    except CkptStoreError:
        pass
    record = injector.transient_injected[0] if injector.transient_injected else None
    if record is not None:
        name = f"{name}: {record}"
        if record.conditional:
            result.invariants_checked.add("I8")
    clean, _ = location.open()
    failed_but_published = bool(model.in_doubt.get(1)) and clean.steps() == [1]
    if failed_but_published and record is not None and record.conditional:
        result.failures.append(
            CaseFailure(name, "I8", "the publish took effect but the save reported failure")
        )
        return
    _run_case(result, name, lambda: check_invariants(clean, model))
