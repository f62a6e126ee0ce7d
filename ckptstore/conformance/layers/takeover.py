"""Takeover crash points (I9): a takeover crashed at each of its storage calls, the old writer
alive.

A run taking the store over from an older step (the creation of an epoch record) dies before
and after each storage call of it, with the old writer's store still open; afterwards the
epoch exists whole or not at all, GC collects what the dead taker staged, the old writer is
refused if the epoch exists, and the step the old history holds is saved anew.
"""

from __future__ import annotations

import functools

from ckptstore.conformance.faults import CrashMode, FaultPlan, SimulatedCrash
from ckptstore.conformance.layers import cases
from ckptstore.conformance.layers.layer import Findings, SuiteRun
from ckptstore.conformance.layers.workload import LocationMaker, pattern, save
from ckptstore.conformance.location import Location
from ckptstore.conformance.model import InvariantViolation, Model, Saved, check_invariants
from ckptstore.errors import SupersededError
from ckptstore.store import Store

__all__ = ["INVARIANTS", "run_layer", "run_takeover_crash_points"]

INVARIANTS = ("I9", "I1", "I4", "I7")


def run_takeover_crash_points(new_location: LocationMaker) -> cases.CrashPointResult:
    """Crash a takeover (the creation of an epoch record) before and after each of its
    storage calls, with the old writer alive; check the store after each (I9, I1, I4, I7).

    Each case saves steps 1 and 2, then a new run takes the store over from step 1 and dies at
    one call. Afterwards the epoch exists whole (parent 1) or not at all, ``latest()`` answers
    from the one history, GC collects what the dead taker staged once older than the grace
    period, the old writer's next save fails with SupersededError if the epoch exists, and a
    run that takes over again (or the first, if it got through) saves step 2 anew: the name
    the old history holds.
    """
    result = cases.CrashPointResult()
    probe = new_location()
    try:
        keeps = probe.base.keeps_lineages
    finally:
        probe.destroy()
    if not keeps:
        result.not_applicable = "the strategy keeps no lineages: take_over is refused"
        return result
    baseline = cases.retried(
        functools.partial(_takeover_case, new_location, None, CrashMode.BEFORE)
    )
    result.add(baseline)
    if baseline.storage_errors:
        return result
    result.calls, result.call_names = baseline.calls, baseline.call_names
    result.records = baseline.records
    result.reads = sum(record.reads_only for record in baseline.records)
    chosen = [
        functools.partial(_takeover_case, new_location, index, mode)
        for index, mode in cases.crash_cases(baseline.records, overlapped=baseline.overlapped)
    ]
    for outcome in cases.run_all(chosen):
        result.add(outcome)
    return result


def _takeover_case(
    new_location: LocationMaker, index: int | None, mode: CrashMode
) -> cases.CrashPointResult:
    def run(location: Location, case: cases.Case) -> None:
        result, model = case.result, Model()
        old, _ = location.open()
        for step in (1, 2):
            save(old, model, Saved(step, {"model.bin": pattern(100, step)}, {"step": step}))
        taker, injector = location.open(FaultPlan(crash_at=index, crash_mode=mode))
        try:
            taker.take_over(1)
        except SimulatedCrash as crash:
            case.died(crash)
        if index is None:
            result.calls = injector.count
            result.call_names = [call.name for call in injector.calls]
            result.records = list(injector.calls)
            result.overlapped = injector.overlapped
        cases.run_case(result, case.name, lambda: _recover_takeover(location, model, old, index))
        result.invariants_checked.add("I9")

    name = "takeover, no crash" if index is None else f"takeover, crash {mode.value} call {index}"
    return cases.run_in_fresh(new_location, name, run)


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
    cases.aged_gc(location, store, model)
    leftovers = cases.collectable_leftovers(location)
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


def run_layer(run: SuiteRun, found: Findings) -> None:
    """The layer on ``run``'s target (not run where the strategy keeps no lineages)."""
    result = run_takeover_crash_points(run.locations)
    if result.not_applicable:
        found.coverage["takeover crash points"] = f"not run: {result.not_applicable}"
        found.skipped = result.not_applicable
        return
    if "I9" in result.invariants_checked:
        found.check(*INVARIANTS)
    found.cases(INVARIANTS, result)
    found.coverage["takeover crash points"] = result.coverage_line(
        " of a takeover (the old writer alive)",
        result.crash_states_note(),
        "checked: the epoch whole or absent, the staging GC'd, the old writer refused, the "
        "step saved anew",
    )
    if result.calls == 0 or "I9" not in result.invariants_checked:
        found.vacuous = "no takeover was crashed and checked (I9 unchecked)"
