"""Exhaustive crash points: a fixed workload, crashed at every storage call, in both modes.

The standard workload saves two checkpoints of several shards (one multipart-sized where the
storage has multipart uploads), leaves a dead attempt behind, lets it age past the grace
period, runs a retention pass that deletes, a GC that removes the dead attempt, and reads the
latest checkpoint back. It is run once to count its storage calls; then, for every call k, it
is run again with the process dying before call k, and again with it dying after call k took
effect. After each crash a fresh store (a restarted trainer) is checked against the model,
cleaned by GC, checked again, audited for leftovers, and used for one more save.

Unknown outcomes (object stores): two saves, with one storage call failed per case, a 503
before it reached storage or a timeout after it took effect, at every commit point; the save
must retry or fail cleanly, and what it reports must match what it published (I8).

Takeovers (I9): a run taking the store over from an older step, crashed before and after each
storage call of the epoch record's creation, with the old writer still alive
(``run_takeover_crash_points``).

A case that the storage itself fails (see ``outcomes``) is run again from a fresh location; if
the storage keeps failing it, the case is reported as a storage error, never as a failure.
"""

from __future__ import annotations

import functools
import itertools
import re
from collections import Counter
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
from ckptstore.errors import CheckpointExistsError, CkptStoreError, SupersededError
from ckptstore.manifest import Manifest
from ckptstore.retention import KeepLast
from ckptstore.store import Store

__all__ = [
    "GRACE",
    "MULTIPART_COMPLETION",
    "CaseFailure",
    "CrashPointResult",
    "commit_point_label",
    "crash_cases",
    "run_crash_points",
    "run_indeterminate_outcomes",
    "run_takeover_crash_points",
    "standard_workload",
]

GRACE = timedelta(hours=1)
MULTIPART_COMPLETION = "complete_multipart"
_AGE = 2 * GRACE.total_seconds()
LocationMaker = Callable[[], Location]


def pattern(size: int, seed: int) -> bytes:
    """Deterministic, position-dependent bytes (a shifted copy is never equal)."""
    block = bytes((seed * 131 + i * 7) % 251 for i in range(251))
    return (block * (size // 251 + 1))[:size]


def big_shard_size(location: Location) -> int:
    """A size that takes a multipart upload of two parts (the last one short) where the
    storage has them: each crash case runs the whole workload, so each part costs twice."""
    strategy = location.base
    if Capability.MULTIPART not in strategy.capabilities:
        return 0
    part_size = int(getattr(strategy, "part_size", 0) or 0)
    return part_size + 123 if part_size else 0


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
    call_names: list[str] = field(default_factory=list)
    """The name of each storage call of the workload without a crash, in order."""
    first_save_calls: int = 0
    """Unknown outcomes: how many of the calls the first of the two saves made."""
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
    faulted: Counter[str] = field(default_factory=Counter)
    """Commit points failed on purpose, by mode and label (``before If-Match put LATEST``)."""
    completions: int = 0
    """Multipart completions the workload made (without a crash)."""
    not_applicable: str = ""
    """Why the layer did not run (a strategy that keeps no lineages has no takeover)."""
    completions_before: set[int] = field(default_factory=set)
    completions_after: set[int] = field(default_factory=set)
    """The multipart completions (by call number) that a case died before, and just after,
    as the fault injector recorded the crash."""

    @property
    def completions_crashed_around(self) -> int:
        """Multipart completions that a case died before and another died just after."""
        return len(self.completions_before & self.completions_after)

    def add(self, other: CrashPointResult) -> None:
        """Count the cases of ``other`` in this result too."""
        self.cases += other.cases
        self.failures.extend(other.failures)
        self.invariants_checked |= other.invariants_checked
        self.storage_errors.extend(other.storage_errors)
        self.retried += other.retried
        self.slow_cleanups += other.slow_cleanups
        self.completions_before |= other.completions_before
        self.completions_after |= other.completions_after
        self.faulted.update(other.faulted)

    def crashed_at(self, crash: SimulatedCrash) -> None:
        """Note the multipart completion ``crash`` died before or after, if any."""
        record, previous = crash.record, crash.previous
        if record is not None and record.name == MULTIPART_COMPLETION:
            died = crash.mode is CrashMode.BEFORE
            (self.completions_before if died else self.completions_after).add(record.index)
        if previous is not None and previous.name == MULTIPART_COMPLETION:
            self.completions_after.add(previous.index)  # dying before the next call


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
        capabilities = location.base.driver.capabilities
        if Capability.VERSIONING in capabilities and Capability.VERSION_DELETE not in capabilities:
            leftovers = set()  # old versions cannot be freed here: the probe reports it
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
    new_location: LocationMaker,
    *,
    limit: int | None = None,
    workers: int = 4,
    around: str | None = None,
) -> CrashPointResult:
    """Crash the standard workload at every storage call, before and after it took effect.

    Cases are independent (each has a location of its own), so ``workers`` run at once: on
    networked storage most of a case is waiting for answers. ``limit``: only the first calls;
    ``around``: only just before and just after the calls of that name (a cheap test).
    """
    result = CrashPointResult()
    baseline = _retried(functools.partial(_baseline, new_location))
    result.add(baseline)
    if baseline.storage_errors:  # the workload never ran through: no call to crash at
        return result
    result.calls = baseline.calls
    result.call_names = baseline.call_names
    result.overlapped = baseline.overlapped
    result.records = baseline.records
    result.reads = sum(record.reads_only for record in baseline.records)
    result.completions = baseline.completions
    reached = baseline.calls if limit is None else min(baseline.calls, limit)
    names = baseline.call_names
    cases = [
        (index, mode)
        for index, mode in crash_cases(baseline.records[:reached], overlapped=baseline.overlapped)
        if around is None or around in names[max(0, index - 1) : index + 1]
    ]
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
    previous: CallRecord | None = None
    for record, following in itertools.pairwise(records):
        after_completion = previous is not None and previous.name == MULTIPART_COMPLETION
        previous = record
        if record.reads_only and record.context == following.context and not after_completion:
            continue  # (a crash just after a multipart completion is kept: it is counted)
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
        result.call_names = [call.name for call in injector.calls]
        result.overlapped = injector.overlapped
        result.completions = result.call_names.count(MULTIPART_COMPLETION)
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
            # Named by where the process died, even if a later call (in an ``except`` or
            # ``finally``) was the one that noticed it.
            death = f"crash at call {crash.record}" if crash.record is not None else str(crash)
            name = f"{name}: {death}"
            result.crashed_at(crash)
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


def run_indeterminate_outcomes(
    new_location: LocationMaker, *, before_every_call: bool = False
) -> CrashPointResult:
    """Fail storage calls of two saves, one per case; then read back (I8) and check.

    The first save creates LATEST, the second moves it by compare-and-swap. Every commit point
    of both (a conditional call, a multipart completion) fails with a 503 before it reached
    storage, and times out after it took effect; every other call of the first save times out
    after it took effect; with ``before_every_call``, every call of both fails both ways. A
    save whose publish took effect must not report failure, nor mistake its own earlier write
    for another writer's (CheckpointExistsError); a save that reports success must have
    published; whatever the saves left must satisfy the invariants.
    """
    result = CrashPointResult()
    baseline = _retried(functools.partial(_count_save_calls, new_location))
    result.add(baseline)
    if baseline.storage_errors:
        return result
    result.calls, result.first_save_calls = baseline.calls, baseline.first_save_calls
    for index, label in enumerate(baseline.call_names):
        commit_point = commit_point_label(label) is not None
        every = before_every_call or commit_point
        modes = [CrashMode.BEFORE] if every else []
        if every or index < baseline.first_save_calls:
            modes.append(CrashMode.AFTER)
        for mode in modes:
            saves = 1 if index < baseline.first_save_calls else 2
            case = functools.partial(_transient_case, new_location, index, mode, saves)
            result.add(_retried(case))
    return result


def commit_point_label(record: CallRecord | str) -> str | None:
    """How the report names a commit point (``If-Match put LATEST``), or None for another
    call. ``record`` may be a label from ``_call_label`` already."""
    label = record if isinstance(record, str) else _call_label(record)
    if label.startswith(("If-None-Match ", "If-Match ")) or MULTIPART_COMPLETION in label:
        return label
    return None


def _call_label(record: CallRecord) -> str:
    """A call's name, condition and key, with step numbers and attempt ids left out."""
    key = _STEP_DIGITS.sub("step-N", record.args[0]) if record.args else ""
    key = _ATTEMPT_TAIL.sub(".<attempt>/", key)
    condition = f"{record.condition} " if record.condition else ""
    return f"{condition}{record.name} {key}".rstrip()


_STEP_DIGITS = re.compile(r"step-\d+")
_ATTEMPT_TAIL = re.compile(r"\.[0-9a-z]{6,}/")


def _count_save_calls(new_location: LocationMaker) -> CrashPointResult:
    """The two saves without faults, to list their storage calls (not itself a case)."""
    result = CrashPointResult()
    try:
        location = new_location()
    except CkptStoreError as exc:
        return _undecided(result, "two saves without faults", exc)
    try:
        store, injector = location.open()
        model, big = Model(), big_shard_size(location)
        for step in (1, 2):
            save(store, model, Saved(step, _shards(step, big), {}))
            result.first_save_calls = result.first_save_calls or injector.count
        result.calls = injector.count
        result.call_names = [_call_label(call) for call in injector.calls]
    except CkptStoreError as exc:
        return _undecided(result, "two saves without faults", exc)
    finally:
        location.destroy()
    return result


def _transient_case(
    new_location: LocationMaker, index: int, mode: CrashMode, saves: int
) -> CrashPointResult:
    result = CrashPointResult()
    how = "503 before" if mode is CrashMode.BEFORE else "timeout after"
    name = f"{how} call {index}"
    try:
        location = new_location()
    except CkptStoreError as exc:
        return _undecided(result, name, exc)
    try:
        _fail_once(result, location, index, mode, name, saves)
    except CkptStoreError as exc:
        return _undecided(result, name, exc, "I8")
    finally:
        location.destroy()
    return result


def _fail_once(
    result: CrashPointResult,
    location: Location,
    index: int,
    mode: CrashMode,
    name: str,
    saves: int,
) -> None:
    """Run ``saves`` saves with one fault; judge what they reported, and what they left."""
    model, big = Model(), big_shard_size(location)
    store, injector = location.open(FaultPlan(transient={index: mode}))
    reported: dict[int, CkptStoreError | None] = {}
    for step in range(1, saves + 1):
        try:
            save(store, model, Saved(step, _shards(step, big), {}))
            reported[step] = None
        except CheckpointExistsError as exc:  # the only writer: its own publish, mistaken
            _i8(result, f"{name} {_faulted(injector)}", f"own publish taken for another's: {exc}")
            return
        except CkptStoreError as exc:
            if storage_failure(exc) is not None:
                raise  # the storage failed the save, not the injected fault: nothing to judge
            reported[step] = exc
    record = injector.transient_injected[0] if injector.transient_injected else None
    if record is not None:
        name = f"{name}: {record}"
        label = commit_point_label(record)
        if label is not None:
            result.faulted[f"{mode.value} {label}"] += 1
        if record.conditional:
            result.invariants_checked.add("I8")
    clean, _ = location.open()
    visible = set(clean.steps())
    for step, error in reported.items():
        if error is not None and step in visible and _holds_own(clean, model, step):
            message = f"step {step}'s publish took effect but the save reported failure"
            _i8(result, name, f"{message}: {error!r}")
            return
        if error is None and step not in visible:
            message = f"the save of step {step} reported success but nothing was published"
            _i8(result, name, f"{message} (an unknown outcome guessed)")
            return
    _run_case(result, name, lambda: check_invariants(clean, model))


def _i8(result: CrashPointResult, name: str, message: str) -> None:
    result.cases += 1
    result.failures.append(CaseFailure(name, "I8", message))


def _holds_own(store: Store, model: Model, step: int) -> bool:
    """Whether ``step`` is published with what this (the only) writer saved there."""
    try:
        checkpoint = store.get(step)
    except CkptStoreError:
        return False
    saves = [*model.in_doubt.get(step, []), *filter(None, [model.committed.get(step)])]
    return any(saved.matches(checkpoint) for saved in saves)


def _faulted(injector: FaultInjector) -> str:
    return str(injector.transient_injected[0]) if injector.transient_injected else ""


def run_takeover_crash_points(new_location: LocationMaker) -> CrashPointResult:
    """Crash a takeover (the creation of an epoch record) before and after each of its
    storage calls, with the old writer alive; check the store after each (I9, I1, I4, I7).

    Each case saves steps 1 and 2, then a new run takes the store over from step 1 and dies at
    one call. Afterwards the epoch exists whole (parent 1) or not at all, ``latest()`` answers
    from the one history, GC collects what the dead taker staged once older than the grace
    period, the old writer's next save fails with SupersededError if the epoch exists, and a
    run that takes over again (or the first, if it got through) saves step 2 anew: the name
    the old history holds.
    """
    result = CrashPointResult()
    probe = new_location()
    try:
        keeps = probe.base.keeps_lineages
    finally:
        probe.destroy()
    if not keeps:
        result.not_applicable = "the strategy keeps no lineages: take_over is refused"
        return result
    baseline = _retried(functools.partial(_takeover_case, new_location, None, CrashMode.BEFORE))
    result.add(baseline)
    if baseline.storage_errors:
        return result
    result.calls, result.call_names = baseline.calls, baseline.call_names
    result.records = baseline.records
    result.reads = sum(record.reads_only for record in baseline.records)
    for index, mode in crash_cases(baseline.records, overlapped=baseline.overlapped):
        result.add(_retried(functools.partial(_takeover_case, new_location, index, mode)))
    return result


def _takeover_case(
    new_location: LocationMaker, index: int | None, mode: CrashMode
) -> CrashPointResult:
    result = CrashPointResult()
    name = "takeover, no crash" if index is None else f"takeover, crash {mode.value} call {index}"
    try:
        location = new_location()
    except CkptStoreError as exc:
        return _undecided(result, name, exc)
    try:
        model = Model()
        try:
            old, _ = location.open()
            for step in (1, 2):
                save(old, model, Saved(step, {"model.bin": pattern(100, step)}, {"step": step}))
            taker, injector = location.open(FaultPlan(crash_at=index, crash_mode=mode))
            try:
                taker.take_over(1)
            except SimulatedCrash as crash:
                death = f"crash at call {crash.record}" if crash.record is not None else str(crash)
                name = f"{name}: {death}"
            if index is None:
                result.calls = injector.count
                result.call_names = [call.name for call in injector.calls]
                result.records = list(injector.calls)
                result.overlapped = injector.overlapped
        except CkptStoreError as exc:
            return _undecided(result, name, exc)
        _run_case(result, name, lambda: _recover_takeover(location, model, old, crashed=index))
        result.invariants_checked.add("I9")
    finally:
        location.destroy()
    return result


def _recover_takeover(location: Location, model: Model, old: Store, crashed: int | None) -> None:
    """Judge what a takeover that died (``crashed``: at that call; None: it did not) left."""
    store, _ = location.open()
    epochs = store.lineage().epochs  # LineageCorruptError for a half-made record: I9
    if len(epochs) > 1 or (epochs and epochs[0].parent != 1):
        raise InvariantViolation("I9", f"the takeover from step 1 left the epochs {epochs}")
    if not epochs and crashed is None:
        raise InvariantViolation("I9", "a takeover that returned left no epoch")
    if epochs:
        model.epoch_taken(1)
    check_invariants(store, model)
    location.clock.advance(_AGE)
    model.gc_started()
    store.gc(grace=GRACE)
    check_invariants(store, model)
    leftovers = location.leftovers()
    capabilities = location.base.driver.capabilities
    if Capability.VERSIONING in capabilities and Capability.VERSION_DELETE not in capabilities:
        leftovers = set()  # old versions cannot be freed here: the probe reports it
    if leftovers:
        raise InvariantViolation(
            "I7", f"GC left what the dead taker staged, past the grace period: {sorted(leftovers)}"
        )
    zombie = Saved(3, {"zombie.bin": pattern(100, 33)}, {"step": 3, "writer": "zombie"})
    try:
        save(old, model, zombie)
    except SupersededError:
        if not epochs:
            raise
    else:
        if epochs:
            raise InvariantViolation("I9", "the old writer published after the takeover")
    if not epochs:
        store.take_over(1)
        model.epoch_taken(1)
    else:
        store.join_epoch(1)  # the run's epoch, told: a writer that names none is refused
    clash = Saved(2, {"after-takeover": pattern(100, 22)}, {"step": 2}, epoch=1)
    save(store, model, clash)
    check_invariants(store, model)
    latest = store.latest()
    if latest is None or (latest.step, latest.manifest.epoch) != (2, 1):
        raise InvariantViolation("I9", f"after the takeover latest() is {latest}, not step 2 of 1")
