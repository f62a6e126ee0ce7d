"""Crash cases: what each found, how they are chosen, and how one runs in a place of its own.

Shared by the layers that crash a fixed workload at its storage calls (``crash_points``,
``takeover``, ``unknown_outcomes``, ``tiers``). A case runs in a fresh location (or tiered
pair) of its own, destroyed afterwards; one that the storage itself fails (see ``outcomes``) is
run again from a fresh location, and if the storage keeps failing it, it is reported as a
storage error, never as a failure.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from ckptstore.conformance.faults import CallRecord, CrashMode, SimulatedCrash
from ckptstore.conformance.layers.workload import AGE_PAST_GRACE, GRACE, MULTIPART_COMPLETION
from ckptstore.conformance.location import Location
from ckptstore.conformance.model import InvariantViolation, Model, check_invariants
from ckptstore.conformance.outcomes import (
    REFUSES,
    STORAGE_ERROR,
    refusal,
    retry_storage_failures,
    storage_failure,
)
from ckptstore.driver import Capability
from ckptstore.errors import CkptStoreError
from ckptstore.store import Store

__all__ = [
    "LONG_AGE",
    "Case",
    "CaseFailure",
    "CrashPointResult",
    "aged_gc",
    "collectable_leftovers",
    "crash_cases",
    "retried",
    "run_case",
    "run_in_fresh",
    "undecided",
]


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
    not_run: int = 0
    """Cases left out because the run's time budget was spent (``run_crash_points``)."""
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
    refused: str = ""
    """The store refused the storage in a case (``outcomes.refusal``): the layer's
    invariants are not applicable there, with this reason."""
    call_s: float = 0.0
    """Seconds one storage call of the workload took, run alone without a crash (0: not
    measured): what the property-based layer fits its examples to."""
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
        self.not_run += other.not_run
        self.slow_cleanups += other.slow_cleanups
        self.completions_before |= other.completions_before
        self.completions_after |= other.completions_after
        self.faulted.update(other.faulted)
        self.refused = self.refused or other.refused

    def crash_states_note(self) -> str:
        """How the crashes were chosen, for the coverage line."""
        if self.overlapped:
            return "made concurrently: a crash before and after each"
        return (
            f"made one at a time: a crash before each and after the last (a call that only "
            f"reads shares its crash with the next: {self.reads} of them)"
        )

    def coverage_line(self, calls: str, chosen: str, checked: str, notes: str = "") -> str:
        """The coverage line of a crash-point run: how many storage calls of what, how the
        crashes were chosen, how many were made and what each checked, then ``notes`` and
        the retries."""
        crashes = max(self.cases - 1, 0)  # the first case is the baseline: no crash
        if self.calls == 0 and self.refused:
            return f"no case ran: {self.refused}"
        if self.calls == 0 and (self.failures or self.storage_errors):
            return (
                "no case ran: the workload failed without any fault injected (see the "
                f"verdicts){self.retries_note()}"
            )
        return (
            f"{self.calls} storage calls{calls}, {chosen}: {crashes} crashes, each {checked}"
            f"{notes}{self.retries_note()}"
        )

    def retries_note(self) -> str:
        """Cases run again after a storage error, and cases left undecided, for the coverage
        line (empty if none)."""
        notes = []
        if self.retried:
            notes.append(f"{self.retried} run(s) of a case repeated after a storage error")
        if self.storage_errors:
            notes.append(f"{len(self.storage_errors)} case(s) undecided (storage error)")
        return "".join(f"; {note}" for note in notes)

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


def retried(run_once: Callable[[], CrashPointResult]) -> CrashPointResult:
    """Run a case again, afresh, while the storage fails it; say so if it always did."""
    outcome, retries = retry_storage_failures(run_once, lambda done: bool(done.storage_errors))
    outcome.retried += retries
    for error in outcome.storage_errors:
        error.message += f" (the storage failed all {retries + 1} runs of this case)"
    return outcome


CASE_WORKERS = 4
"""Cases run at once (each in a location of its own): on networked storage most of a case
is waiting for answers, and the client and the server then both work."""


def run_all(
    chosen: Sequence[Callable[[], CrashPointResult]], workers: int = CASE_WORKERS
) -> list[CrashPointResult]:
    """Run each independent case (``retried``), ``workers`` at once; the outcomes in
    ``chosen``'s order, so that reports are the same whatever finished first."""
    with ThreadPoolExecutor(max(1, workers), thread_name_prefix="suite-case") as pool:
        return list(pool.map(retried, chosen))


def undecided(
    result: CrashPointResult, name: str, error: CkptStoreError, invariant: str = "I1"
) -> CrashPointResult:
    """Record a case that failed before its check: a storage error if the storage failed it,
    a refusal if the store refused the storage, else a failure of ``invariant`` (ckptstore
    raised, with no crash or fault to excuse it)."""
    result.cases += 1
    refused = refusal(error)
    if refused is not None:
        result.refused = result.refused or f"{REFUSES}: {refused}"
        return result
    failure = storage_failure(error)
    if failure is None:
        result.failures.append(CaseFailure(name, invariant, f"the workload failed: {error!r}"))
    else:
        result.storage_errors.append(CaseFailure(name, STORAGE_ERROR, f"{failure!r}"))
    return result


def run_case(result: CrashPointResult, name: str, body: Callable[[], None]) -> None:
    """Run a case's check: a violation or ckptstore error it raises is the case's failure,
    unless the storage failed the check (then it decided nothing)."""
    result.cases += 1
    try:
        body()
    except (InvariantViolation, CkptStoreError) as exc:
        failure = storage_failure(exc)
        refused = refusal(exc)
        if refused is not None:
            result.refused = result.refused or f"{REFUSES}: {refused}"
        elif failure is not None:
            result.storage_errors.append(CaseFailure(name, STORAGE_ERROR, f"{failure!r}"))
        elif isinstance(exc, InvariantViolation):
            result.failures.append(CaseFailure(name, exc.invariant, exc.detail))
        else:
            result.failures.append(CaseFailure(name, "I1", f"recovery failed: {exc!r}"))


class Destroyable(Protocol):
    """A place a case runs in: a location, a tiered pair."""

    def destroy(self) -> None: ...


P = TypeVar("P", bound=Destroyable)


@dataclass
class Case:
    """One case as it runs: its name as the report gives it (it grows where the process
    died), and what it found."""

    name: str
    result: CrashPointResult = field(default_factory=CrashPointResult)

    def died(self, crash: SimulatedCrash, where: str = "call") -> None:
        """Name the case by where the process died, even if a later call (in an ``except``
        or ``finally``) was the one that noticed it."""
        death = f"crash at {where} {crash.record}" if crash.record is not None else str(crash)
        self.name = f"{self.name}: {death}"


def run_in_fresh(
    new_place: Callable[[], P],
    name: str,
    body: Callable[[P, Case], None],
    *,
    invariant: str = "I1",
) -> CrashPointResult:
    """Run ``body`` in a fresh place (a location, a tiered pair), destroyed afterwards.

    A ckptstore error escaping ``body`` (the workload failed before the case's check) is
    ``undecided``: a storage error, or a failure of ``invariant``; a violation the workload
    saw itself is the case's failure.
    """
    case = Case(name)
    try:
        place = new_place()
    except CkptStoreError as exc:
        return undecided(case.result, case.name, exc)
    try:
        body(place, case)
    except CkptStoreError as exc:
        return undecided(case.result, case.name, exc, invariant)
    except InvariantViolation as violation:  # the workload itself saw a violation
        case.result.cases += 1
        case.result.failures.append(CaseFailure(case.name, violation.invariant, violation.detail))
        return case.result
    finally:
        place.destroy()
    return case.result


def aged_gc(location: Location, store: Store, model: Model, age: float = AGE_PAST_GRACE) -> None:
    """Move the clock by ``age``, collect garbage, and check the invariants afterwards."""
    location.clock.advance(age)
    model.gc_started()
    store.gc(grace=GRACE)
    check_invariants(store, model)


def collectable_leftovers(location: Location) -> set[str]:
    """What GC should have collected and has not: the location's leftovers, unless its
    storage cannot free old versions (the probe reports that)."""
    leftovers = location.leftovers()
    capabilities = location.base.driver.capabilities
    if Capability.VERSIONING in capabilities and Capability.VERSION_DELETE not in capabilities:
        return set()
    return leftovers
