"""Unknown outcomes (object stores): a 503 before, or a timeout after, each commit point.

Two saves, with one storage call failed per case, a 503 before it reached storage or a timeout
after it took effect, at every commit point; the save must retry or fail cleanly, and what it
reports must match what it published (I8).
"""

from __future__ import annotations

import functools
import re

from ckptstore.conformance.faults import CallRecord, CrashMode, FaultInjector, FaultPlan
from ckptstore.conformance.layers import cases, workload
from ckptstore.conformance.layers.layer import Findings, SuiteRun
from ckptstore.conformance.location import Location
from ckptstore.conformance.model import Model, Saved, check_invariants
from ckptstore.conformance.outcomes import storage_failure
from ckptstore.errors import CheckpointExistsError, CkptStoreError
from ckptstore.store import Store

__all__ = [
    "INVARIANTS",
    "NOT_ON_FILE_SYSTEMS",
    "commit_point_label",
    "run_indeterminate_outcomes",
    "run_layer",
]

INVARIANTS = ("I8",)
NOT_ON_FILE_SYSTEMS = "file-system calls have no unknown outcomes"


def run_indeterminate_outcomes(
    new_location: workload.LocationMaker,
    *,
    before_every_call: bool = False,
    workers: int = cases.CASE_WORKERS,
    incremental: bool = False,
) -> cases.CrashPointResult:
    """Fail storage calls of two saves, one per case; then read back (I8) and check.

    The first save creates LATEST, the second moves it by compare-and-swap. Every commit point
    of both (a conditional call, a multipart completion) fails with a 503 before it reached
    storage, and times out after it took effect; every other call of the first save times out
    after it took effect; with ``before_every_call``, every call of both fails both ways. A
    save whose publish took effect must not report failure, nor mistake its own earlier write
    for another writer's (CheckpointExistsError); a save that reports success must have
    published; whatever the saves left must satisfy the invariants. ``workers`` cases run at
    once.

    ``incremental`` (object stores that lease blobs, docs/protocol.md §12.3): both saves are
    incremental and hold a shard of the same bytes, so the first reserves and uploads its
    blob and the second shares it; the lease's compare-and-swaps are commit points too, and
    every checkpoint must read back whole (I10) whatever their outcomes. No case runs
    where the store does not lease blobs.
    """
    result = cases.CrashPointResult()
    baseline = cases.retried(functools.partial(_count_save_calls, new_location, incremental))
    result.add(baseline)
    if baseline.storage_errors:
        return result
    result.calls, result.first_save_calls = baseline.calls, baseline.first_save_calls
    chosen = []
    for index, label in enumerate(baseline.call_names):
        commit_point = commit_point_label(label) is not None
        every = before_every_call or commit_point
        modes = [CrashMode.BEFORE] if every else []
        if every or index < baseline.first_save_calls:
            modes.append(CrashMode.AFTER)
        for mode in modes:
            saves = 1 if index < baseline.first_save_calls else 2
            chosen.append(
                functools.partial(_transient_case, new_location, index, mode, saves, incremental)
            )
    for outcome in cases.run_all(chosen, workers):
        result.add(outcome)
    return result


def commit_point_label(record: CallRecord | str) -> str | None:
    """How the report names a commit point (``If-Match put LATEST``), or None for another
    call. ``record`` may be a label from ``_call_label`` already."""
    label = record if isinstance(record, str) else _call_label(record)
    if label.startswith(("If-None-Match ", "If-Match ")) or workload.MULTIPART_COMPLETION in label:
        return label
    return None


def _call_label(record: CallRecord) -> str:
    """A call's name, condition and key, with step numbers and attempt ids left out."""
    key = _STEP_DIGITS.sub("step-N", record.args[0]) if record.args else ""
    key = _ATTEMPT_TAIL.sub(".<attempt>/", key)
    key = _BLOB.sub(r"\1<blob>", key)
    key = _LIVE.sub(r"\1.<attempt>", key)
    condition = f"{record.condition} " if record.condition else ""
    return f"{condition}{record.name} {key}".rstrip()


_STEP_DIGITS = re.compile(r"step-\d+")
_ATTEMPT_TAIL = re.compile(r"\.[0-9a-z]{6,}/")
_BLOB = re.compile(r"(blobs/[a-z0-9]+/)[0-9a-f]{16,}\S*")
_LIVE = re.compile(r"(blobs/live/step-N)\.[0-9a-z]+")


FROZEN = "frozen/base.bin"
"""The shard both saves of the incremental pass hold, with the same bytes."""


def _shards(step: int, big: int, incremental: bool) -> dict[str, bytes]:
    shards = workload.standard_shards(step, big)
    if incremental:
        shards[FROZEN] = workload.pattern(4000, 9901)
    return shards


def _count_save_calls(
    new_location: workload.LocationMaker, incremental: bool = False
) -> cases.CrashPointResult:
    """The two saves without faults, to list their storage calls (not itself a case)."""

    def run(location: Location, case: cases.Case) -> None:
        result = case.result
        if incremental and location.base.sharing_digest is None:
            return  # no blob leases here: no case
        store, injector = location.open(incremental=incremental)
        model, big = Model(), workload.big_shard_size(location)
        for step in (1, 2):
            workload.save(store, model, Saved(step, _shards(step, big, incremental), {}))
            result.first_save_calls = result.first_save_calls or injector.count
        result.calls = injector.count
        result.call_names = [_call_label(call) for call in injector.calls]

    return cases.run_in_fresh(new_location, "two saves without faults", run)


def _transient_case(
    new_location: workload.LocationMaker,
    index: int,
    mode: CrashMode,
    saves: int,
    incremental: bool = False,
) -> cases.CrashPointResult:
    how = "503 before" if mode is CrashMode.BEFORE else "timeout after"
    kind = "incremental save's " if incremental else ""

    def run(location: Location, case: cases.Case) -> None:
        _fail_once(case.result, location, index, mode, case.name, saves, incremental)

    return cases.run_in_fresh(new_location, f"{how} {kind}call {index}", run, invariant="I8")


def _fail_once(
    result: cases.CrashPointResult,
    location: Location,
    index: int,
    mode: CrashMode,
    name: str,
    saves: int,
    incremental: bool = False,
) -> None:
    """Run ``saves`` saves with one fault; judge what they reported, and what they left."""
    model, big = Model(), workload.big_shard_size(location)
    store, injector = location.open(FaultPlan(transient={index: mode}), incremental=incremental)
    reported: dict[int, CkptStoreError | None] = {}
    for step in range(1, saves + 1):
        try:
            workload.save(store, model, Saved(step, _shards(step, big, incremental), {}))
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
    cases.run_case(result, name, lambda: check_invariants(clean, model))


def _i8(result: cases.CrashPointResult, name: str, message: str) -> None:
    result.cases += 1
    result.failures.append(cases.CaseFailure(name, "I8", message))


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


def run_layer(run: SuiteRun, found: Findings) -> None:
    """The layer on ``run``'s target: at every call of both saves outside ``ci``."""
    every_call = run.profile != "ci"
    result = run_indeterminate_outcomes(run.locations, before_every_call=every_call)
    if "I8" in result.invariants_checked:
        found.check(*INVARIANTS)
    else:
        found.vacuous = "no conditional write was exercised"
    found.cases(INVARIANTS, result)
    each = (
        f"each of the {result.calls} storage calls of two saves, a 503 before and a timeout after"
        if every_call
        else f"a 503 before and a timeout after each commit point of two saves, a timeout after "
        f"each of the first save's {result.first_save_calls} calls"
    )
    if result.calls == 0 and result.refused:
        found.coverage["unknown outcomes"] = f"no case ran: {result.refused}"
        return
    if result.calls == 0 and (result.failures or result.storage_errors):
        found.coverage["unknown outcomes"] = (
            "no case ran: the two saves failed without any fault injected (see the verdicts)"
            + result.retries_note()
        )
        return
    found.coverage["unknown outcomes"] = (
        f"{result.cases} cases ({each}); commit points failed: {_faulted_note(result)}"
        + result.retries_note()
    )
    shared = run_indeterminate_outcomes(run.locations, incremental=True)
    if not shared.calls:
        return  # no blob leases on this storage (or the saves failed: said above)
    found.check("I10")
    found.cases((*INVARIANTS, "I10"), shared, "incremental: ")
    found.coverage["unknown outcomes of blob leases"] = (
        f"{shared.cases} cases (two incremental saves sharing a blob: a 503 before and a "
        f"timeout after each commit point, the leases' compare-and-swaps among them, a timeout "
        f"after each of the first save's {shared.first_save_calls} calls); commit points "
        f"failed: {_faulted_note(shared)}" + shared.retries_note()
    )


def _faulted_note(result: cases.CrashPointResult) -> str:
    """Each commit point the layer failed, with how often before and after (from the
    injector's records of the faults it injected)."""
    labels = sorted({key.split(" ", 1)[1] for key in result.faulted})
    if not labels:
        return "none"
    return ", ".join(
        f"{label} ({result.faulted['before ' + label]} before, "
        f"{result.faulted['after ' + label]} after)"
        for label in labels
    )
