"""Exhaustive crash points: the standard workload, crashed at every storage call, both ways.

The standard workload (``workload``) is run once to count its storage calls; then, for every
call k, it is run again with the process dying before call k, and again with it dying after
call k took effect (``cases.crash_cases`` keeps the crashes that leave distinct states). After
each crash a fresh store (a restarted trainer) is checked against the model, cleaned by GC,
checked again, audited for leftovers, and used for one more save.
"""

from __future__ import annotations

import functools
import time
from concurrent.futures import ThreadPoolExecutor

from ckptstore.conformance.faults import CrashMode, FaultInjector, FaultPlan, SimulatedCrash
from ckptstore.conformance.layers import cases, workload
from ckptstore.conformance.layers.layer import Findings, SuiteRun
from ckptstore.conformance.location import Location
from ckptstore.conformance.model import InvariantViolation, Model, Saved, check_invariants

__all__ = [
    "CRASH_WORKERS",
    "INVARIANTS",
    "completions_note",
    "recover_and_check",
    "run_crash_points",
    "run_layer",
]

INVARIANTS = ("I1", "I2", "I3", "I4", "I7")
CRASH_WORKERS = 4
BUDGETS = 4.0
"""The crash points start no case once this many times the run's budget have passed since
the run began (240 s in ``ci``): exhaustive on the embedded emulators, bounded on a server
that takes seconds per request (the cases beyond are left out, and the report says so)."""


def recover_and_check(location: Location, model: Model) -> bool:
    """A restarted trainer: check, GC the dead process's leftovers, check, audit, save again.

    Returns whether GC kept dead attempts past the grace period and collected them only when
    they were much older (a slower cleanup, allowed: e.g. the storage's clock is ahead).
    """
    store, _ = location.open()
    check_invariants(store, model)
    cases.aged_gc(location, store, model)
    slower = bool(location.leftovers())
    if slower:  # kept longer than the grace: allowed, if they go when much older
        cases.aged_gc(location, store, model, cases.LONG_AGE)
        leftovers = cases.collectable_leftovers(location)
        if leftovers:
            raise InvariantViolation(
                "I7",
                f"GC never collected dead attempts' data, even {cases.LONG_AGE / 86400:.0f} days "
                f"past the grace period: {sorted(leftovers)[:5]}",
            )
    steps = store.steps()
    following = (steps[-1] if steps else 0) + 10
    workload.save(
        store, model, Saved(following, {"after-recovery": workload.pattern(100, following)}, {})
    )
    latest = store.latest()
    if latest is None or latest.step != following:
        raise InvariantViolation("I4", f"a save after recovery is not the latest: {latest}")
    return slower


def run_crash_points(
    new_location: workload.LocationMaker,
    *,
    limit: int | None = None,
    workers: int = 4,
    around: str | None = None,
    deadline: float | None = None,
) -> cases.CrashPointResult:
    """Crash the standard workload at every storage call, before and after it took effect.

    Cases are independent (each has a location of its own), so ``workers`` run at once: on
    networked storage most of a case is waiting for answers. ``limit``: only the first calls;
    ``around``: only just before and just after the calls of that name (a cheap test).
    ``deadline`` (``time.monotonic()``): no case starts after it; ``result.not_run`` counts
    the cases left out.
    """
    result = cases.CrashPointResult()
    baseline = cases.retried(functools.partial(_baseline, new_location))
    result.add(baseline)
    if baseline.storage_errors:  # the workload never ran through: no call to crash at
        return result
    result.calls = baseline.calls
    result.call_s = baseline.call_s
    result.call_names = baseline.call_names
    result.overlapped = baseline.overlapped
    result.records = baseline.records
    result.reads = sum(record.reads_only for record in baseline.records)
    result.completions = baseline.completions
    reached = baseline.calls if limit is None else min(baseline.calls, limit)
    names = baseline.call_names
    chosen = [
        (index, mode)
        for index, mode in cases.crash_cases(
            baseline.records[:reached], overlapped=baseline.overlapped
        )
        if around is None or around in names[max(0, index - 1) : index + 1]
    ]

    def one(case: tuple[int, CrashMode]) -> cases.CrashPointResult | None:
        if deadline is not None and time.monotonic() >= deadline:
            return None  # the budget is spent: left out, and counted
        return cases.retried(functools.partial(_crash_case, new_location, *case))

    with ThreadPoolExecutor(max(1, workers), thread_name_prefix="crash-case") as pool:
        for outcome in pool.map(one, chosen):  # in case order: reports are deterministic
            if outcome is None:
                result.not_run += 1
            else:
                result.add(outcome)
    return result


def _baseline(new_location: workload.LocationMaker) -> cases.CrashPointResult:
    """The workload without a crash, then checked: counts the storage calls to crash at."""

    def run(location: Location, case: cases.Case) -> None:
        result, model = case.result, Model()
        clock = location.clock
        plan = FaultPlan(observe=lambda: (model.events, clock.offset))
        big = workload.big_shard_size(location)
        started = time.monotonic()
        store = workload.standard_workload(location, plan, model, big)
        injector = store.strategy.driver
        assert isinstance(injector, FaultInjector)  # Location.open puts one under every store
        result.call_s = (time.monotonic() - started) / max(len(injector.calls), 1)
        result.calls = len(injector.calls)
        result.records = list(injector.calls)
        result.call_names = [call.name for call in injector.calls]
        result.overlapped = injector.overlapped
        result.completions = result.call_names.count(workload.MULTIPART_COMPLETION)
        cases.run_case(result, case.name, lambda: _recover(result, location, model))

    return cases.run_in_fresh(new_location, "no crash", run)


def _crash_case(
    new_location: workload.LocationMaker, index: int, mode: CrashMode
) -> cases.CrashPointResult:
    def run(location: Location, case: cases.Case) -> None:
        model = Model()
        plan = FaultPlan(crash_at=index, crash_mode=mode)
        try:
            workload.standard_workload(location, plan, model, workload.big_shard_size(location))
            case.name += " (not reached)"
        except SimulatedCrash as crash:
            case.died(crash)
            case.result.crashed_at(crash)
        cases.run_case(case.result, case.name, lambda: _recover(case.result, location, model))

    return cases.run_in_fresh(new_location, f"crash {mode.value} call {index}", run)


def _recover(result: cases.CrashPointResult, location: Location, model: Model) -> None:
    if recover_and_check(location, model):
        result.slow_cleanups += 1


def run_layer(run: SuiteRun, found: Findings) -> None:
    """The layer on ``run``'s target; it measures what one crash case costs, run alone (the
    property-based layer fits its examples to that)."""
    result = run_crash_points(
        run.locations, workers=CRASH_WORKERS, deadline=run.budgets_from_start(BUDGETS)
    )
    run.call_s = result.call_s  # measured alone: the state machine makes one call at a time
    if result.calls:  # else the workload failed without a crash: nothing was proved held
        found.check(*INVARIANTS)
    found.cases(INVARIANTS, result)
    found.coverage["crash points"] = result.coverage_line(
        "",
        result.crash_states_note(),
        "recovered, GC'd and checked",
        completions_note(result) + _slow_cleanup_note(result),
    )
    if result.calls == 0:
        found.vacuous = "the workload made no storage call"
    if result.not_run:
        found.cut_short["crash points"] = (
            f"{result.not_run} of {result.cases + result.not_run} crash cases not run"
        )


def _note(count: int, text: str) -> str:
    """``text`` as a clause of the coverage line where ``count`` is not 0, else nothing."""
    return f"; {text}" if count else ""


def completions_note(result: cases.CrashPointResult) -> str:
    """How many multipart completions the crashes surrounded, as the injector recorded them."""
    return _note(
        result.completions,
        f"{result.completions_crashed_around} multipart completions crashed around (before "
        f"and after each; {result.completions} in the workload)",
    )


def _slow_cleanup_note(result: cases.CrashPointResult) -> str:
    return _note(
        result.slow_cleanups,
        f"in {result.slow_cleanups} case(s) GC kept dead attempts longer than the grace "
        f"period, and collected them later (allowed: the storage's clock may be ahead)",
    )
