"""Run every layer of the suite on a backend and gather one report.

Layers: capability probes; exhaustive crash points; crash points of a takeover (I9); unknown
outcomes of conditional writes
(object stores); power loss (file systems); parallel races; the property-based state machine.
Each layer marks the invariants it checks as held unless it found a violation, or unless the
storage failed one of its cases on every run (a storage error: undecided, see ``outcomes``).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import hypothesis
from hypothesis.reporting import with_reporter

from ckptstore.conformance.layers.cases import CrashPointResult
from ckptstore.conformance.layers.crash_points import run_crash_points
from ckptstore.conformance.layers.power_loss import run_power_loss
from ckptstore.conformance.layers.probes import run_probes
from ckptstore.conformance.layers.races import RACE_PROFILES, run_races
from ckptstore.conformance.layers.syscall_trace import TRACE_INVARIANTS, report_syscall_layers
from ckptstore.conformance.layers.takeover import run_takeover_crash_points
from ckptstore.conformance.layers.unknown_outcomes import run_indeterminate_outcomes
from ckptstore.conformance.layers.workload import big_shard_size
from ckptstore.conformance.location import LocationFactory, open_for_measuring
from ckptstore.conformance.machine import PROFILES, make_state_machine, run_state_machine
from ckptstore.conformance.machine.shrinking import shrinking_stops_at
from ckptstore.conformance.model import InvariantViolation
from ckptstore.conformance.outcomes import STORAGE_ERROR, StorageFailure, storage_failure
from ckptstore.conformance.report import INTERRUPTED, VIOLATED_STATUS, BackendReport
from ckptstore.driver import DriverFamily, driver_family
from ckptstore.errors import InvalidOptionError, RefusedError
from ckptstore.store import Store
from ckptstore.urls import redact

__all__ = ["Target", "run_backend", "run_tiered"]

log = logging.getLogger(__name__)

Progress = Callable[[str], None]


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """The suite provokes every warning ckptstore can log; keep them out of the report."""
    logger = logging.getLogger("ckptstore")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


@dataclass(frozen=True)
class Target:
    """A URL to run the suite on, with the options (credentials) to open it."""

    url: str
    options: dict[str, Any] = field(default_factory=dict)


def run_backend(
    url: str,
    *,
    profile: str = "ci",
    options: dict[str, Any] | None = None,
    allow_nonempty: bool = False,
    progress: Progress | None = None,
    budget_s: float | None = None,
    on_layer: Callable[[BackendReport], None] | None = None,
) -> BackendReport:
    """Run the whole suite on the store at ``url``; refuse a non-empty store unless allowed.

    Every layer runs whatever another one found: an error escaping a layer is recorded in the
    report (a violation, or a storage error) and the next layer runs. ``budget_s`` (default:
    the profile's ``BUDGET_S``) bounds the run, shrinking included. ``on_layer`` is called with
    the report after each layer, so that what is found is written as it is found.
    """
    if profile not in PROFILES:
        raise InvalidOptionError(f"unknown profile {profile!r}; choose from {sorted(PROFILES)}")
    say = progress or (lambda message: None)
    started = time.monotonic()
    budget = BUDGET_S.get(profile) if budget_s is None else budget_s
    deadline = None if budget is None else started + budget
    report = BackendReport(url=redact(url), strategy="?")
    written = on_layer or (lambda report: None)
    layer = functools.partial(_layer, report, started=started, written=written)
    base = _open_base(report, url, options, allow_nonempty)
    if base is None:
        report.duration_s = time.monotonic() - started
        written(report)
        return report
    factory = LocationFactory(url, options)
    file_system = driver_family(base.driver) is DriverFamily.FILE_SYSTEM
    sizes = {"multipart": 0, "per_case": 0.0}
    with _quiet():

        def probes() -> None:
            location = factory()
            try:
                report.capabilities = run_probes(location)
                sizes["multipart"] = big_shard_size(location)
            finally:
                location.destroy()

        say("capability probes")
        layer("capability probes", (), probes)
        say("exhaustive crash points")
        layer(
            "crash points",
            CRASH_POINT_INVARIANTS,
            lambda: sizes.update(per_case=_crash_points(report, factory)),
        )
        say("takeover crash points")
        layer(
            "takeover crash points",
            TAKEOVER_INVARIANTS,
            lambda: _takeover_crash_points(report, factory),
        )
        if file_system:
            report.not_applicable("I8", "file-system calls have no unknown outcomes")
            say("power loss")
            layer("power loss", POWER_LOSS_INVARIANTS, lambda: _power_loss(report, base, profile))
            layer(
                "syscall trace",
                TRACE_INVARIANTS,
                lambda: report_syscall_layers(report, factory, profile, say),
            )
        else:
            say("unknown outcomes of conditional writes")
            layer(
                "unknown outcomes",
                ("I8",),
                lambda: _indeterminate(report, factory, every_call=profile != "ci"),
            )
            report.coverage["power loss"] = "not applicable (object store)"
            report.coverage["syscall trace"] = "not applicable (object store)"
        say("parallel races")
        layer("parallel races", RACE_INVARIANTS, lambda: _races(report, factory, profile))
        layer(
            "property-based",
            MACHINE_INVARIANTS,
            lambda: _state_machine(
                report, factory, profile, int(sizes["multipart"]), sizes["per_case"], say,
                deadline, budget or 0.0,
            ),
        )  # fmt: skip
    return report


def _open_base(
    report: BackendReport, url: str, options: dict[str, Any] | None, allow_nonempty: bool
) -> Any:
    """The strategy at ``url``, checked empty; None (recorded in ``report``) if the storage
    cannot even be opened. A storage error in the emptiness check is recorded, not fatal."""
    try:
        strategy = open_for_measuring(url, dict(options or {}))
    except Exception as exc:
        cause = storage_failure(exc)
        if cause is None:
            raise
        report.storage_error(ALL_INVARIANTS, f"opening the store: {cause!r}")
        report.layer_error("opening the store", STORAGE_ERROR, f"nothing could run: {cause!r}")
        return None
    report.strategy = strategy.name
    try:
        empty = allow_nonempty or Store(strategy).is_empty()
    except Exception as exc:
        cause = storage_failure(exc)
        if cause is None:
            raise
        # The suite writes only under locations of its own: run, and say what was not known.
        report.layer_error(
            "emptiness check", STORAGE_ERROR, f"whether the store is empty is unknown: {cause!r}"
        )
        return strategy
    if not empty:
        raise RefusedError(
            f"{url} is not empty; the conformance suite writes and deletes under it. "
            f"Point it at an empty location, or pass --yes (allow_nonempty=True)"
        )
    return strategy


def _layer(
    report: BackendReport,
    name: str,
    invariants: tuple[str, ...],
    body: Callable[[], object],
    *,
    started: float,
    written: Callable[[BackendReport], None],
) -> None:
    """Run one layer of the suite: whatever escapes it is recorded in ``report``, never raised.

    An ``InvariantViolation`` is a violation of its invariant; the storage's own failure (see
    ``outcomes``) leaves ``invariants`` undecided; anything else ckptstore raised is the
    protocol misbehaving: the layer's first invariant is violated (the report's ``errors``
    name the layer whose invariants it leaves unchecked). Then ``written(report)`` is called,
    also when the run is interrupted (KeyboardInterrupt), so that finished layers stay written.
    """
    try:
        body()
    except StorageFailure as failure:
        report.storage_error(invariants, f"{name}: {failure}")
        report.layer_error(name, STORAGE_ERROR, f"stopped by the storage: {failure.error!r}")
    except InvariantViolation as violation:
        report.violated(violation.invariant, f"{name}: {violation.detail}")
    except Exception as exc:
        cause = storage_failure(exc)
        if cause is not None:
            report.storage_error(invariants, f"{name}: {cause!r}")
            report.layer_error(name, STORAGE_ERROR, f"stopped by the storage: {cause!r}")
        else:
            if invariants:
                report.violated(invariants[0], f"{name}: the layer failed: {exc!r}")
            report.layer_error(name, VIOLATED_STATUS, f"stopped by an unexpected error: {exc!r}")
            log.debug("%s failed", name, exc_info=True)
    except BaseException:
        report.layer_error(
            name, INTERRUPTED, "interrupted: this layer and the later ones did not finish"
        )
        raise
    finally:
        report.duration_s = time.monotonic() - started
        written(report)


CRASH_WORKERS = 4
BUDGET_S: dict[str, float | None] = {"ci": 60.0, "thorough": None}
"""Seconds one backend's run may take per profile (None: no limit). The property-based layer
gets what the layers before it left (at least ``MACHINE_MIN_S``), and stops shrinking at the
budget: a failing backend's run ends well within twice it."""
MACHINE_MAX_S: dict[str, float | None] = {"ci": 25.0, "thorough": None}
"""Seconds the property-based layer takes at most per profile (None: what the budget leaves)."""
MACHINE_MIN_S = 10.0
"""Seconds the property-based layer gets even when the layers before it used the budget (at
most a quarter of the budget)."""
EXAMPLE_COST_IN_CRASH_CASES = 8.0
"""An example of the state machine costs about as much storage traffic as this many crash
cases; used to fit the examples into the budget on slow (networked) storage."""
CRASH_POINT_INVARIANTS = ("I1", "I2", "I3", "I4", "I7")
POWER_LOSS_INVARIANTS = ("I1", "I2", "I3", "I4")
MACHINE_INVARIANTS = ("I1", "I2", "I3", "I4", "I5", "I6", "I7", "I9")
TAKEOVER_INVARIANTS = ("I9", "I1", "I4", "I7")
ALL_INVARIANTS = ("I1", "I2", "I3", "I4", "I5", "I6", "I7", "I8", "I9")


def _crash_points(report: BackendReport, factory: LocationFactory) -> float:
    """Run the crash-point layer; return the seconds one crash case took on average."""
    started = time.monotonic()
    result = run_crash_points(factory, workers=CRASH_WORKERS)
    # What one case costs when run alone (the state machine runs one thing at a time).
    per_case = (time.monotonic() - started) * CRASH_WORKERS / max(result.cases, 1)
    report.checked(*CRASH_POINT_INVARIANTS)
    for failure in result.failures:
        report.violated(failure.invariant, f"{failure.case}: {failure.message}")
    _undecided(report, CRASH_POINT_INVARIANTS, result)
    report.coverage["crash points"] = (
        f"{result.calls} storage calls, {_crash_states(result)}: "
        f"{max(result.cases - 1, 0)} crashes, each recovered, GC'd and checked"
        + _completions_note(result)
        + _retries(result)
        + _slow_cleanup(result)
    )
    return per_case


def _takeover_crash_points(report: BackendReport, factory: LocationFactory) -> None:
    """Crash a takeover at each of its storage calls, the old writer alive (I9)."""
    result = run_takeover_crash_points(factory)
    if result.not_applicable:
        report.coverage["takeover crash points"] = f"not run: {result.not_applicable}"
        return
    if "I9" in result.invariants_checked:
        report.checked(*TAKEOVER_INVARIANTS)
    for failure in result.failures:
        report.violated(failure.invariant, f"{failure.case}: {failure.message}")
    _undecided(report, TAKEOVER_INVARIANTS, result)
    report.coverage["takeover crash points"] = (
        f"{result.calls} storage calls of a takeover (the old writer alive), "
        f"{_crash_states(result)}: {max(result.cases - 1, 0)} crashes, each checked: the "
        f"epoch whole or absent, the staging GC'd, the old writer refused, the step saved "
        f"anew" + _retries(result)
    )


def _completions_note(result: CrashPointResult) -> str:
    """How many multipart completions the crashes surrounded, as the injector recorded them."""
    if not result.completions:
        return ""
    return (
        f"; {result.completions_crashed_around} multipart completions crashed around (before "
        f"and after each; {result.completions} in the workload)"
    )


def _crash_states(result: CrashPointResult) -> str:
    if result.overlapped:
        return "made concurrently: a crash before and after each"
    return (
        f"made one at a time: a crash before each and after the last (a call that only reads "
        f"shares its crash with the next: {result.reads} of them)"
    )


def _slow_cleanup(result: CrashPointResult) -> str:
    if not result.slow_cleanups:
        return ""
    return (
        f"; in {result.slow_cleanups} case(s) GC kept dead attempts longer than the grace "
        f"period, and collected them later (allowed: the storage's clock may be ahead)"
    )


def _undecided(report: BackendReport, keys: tuple[str, ...], result: CrashPointResult) -> None:
    for error in result.storage_errors:
        report.storage_error(keys, f"{error.case}: {error.message}")


def _retries(result: CrashPointResult) -> str:
    notes = []
    if result.retried:
        notes.append(f"{result.retried} run(s) of a case repeated after a storage error")
    if result.storage_errors:
        notes.append(f"{len(result.storage_errors)} case(s) undecided (storage error)")
    return "".join(f"; {note}" for note in notes)


def _indeterminate(
    report: BackendReport, factory: LocationFactory, *, every_call: bool = False
) -> None:
    result = run_indeterminate_outcomes(factory, before_every_call=every_call)
    if "I8" in result.invariants_checked:
        report.checked("I8")
    for failure in result.failures:
        report.violated(failure.invariant, f"{failure.case}: {failure.message}")
    _undecided(report, ("I8",), result)
    each = (
        f"each of the {result.calls} storage calls of two saves, a 503 before and a timeout after"
        if every_call
        else f"a 503 before and a timeout after each commit point of two saves, a timeout after "
        f"each of the first save's {result.first_save_calls} calls"
    )
    report.coverage["unknown outcomes"] = (
        f"{result.cases} cases ({each}); commit points failed: {_faulted_note(result)}"
        + _retries(result)
    )


def _faulted_note(result: CrashPointResult) -> str:
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


def _power_loss(report: BackendReport, strategy: Any, profile: str) -> None:
    result = run_power_loss(strategy, depth=1 if profile == "ci" else 2)
    report.checked(*POWER_LOSS_INVARIANTS)
    for failure in result.failures:
        report.violated(failure.invariant, f"{failure.case}: {failure.message}")
    report.coverage["power loss"] = (
        f"{result.states} file-system states checked at {result.points} instants"
    )


RACE_INVARIANTS = ("I5", "I1", "I4")


def _races(report: BackendReport, factory: LocationFactory, profile: str) -> None:
    """Writers racing in threads and processes, released together (``races``)."""
    result = run_races(factory, RACE_PROFILES[profile])
    report.checked("I1", "I4", "I5")
    for failure in result.failures:
        report.violated(failure.invariant, f"{failure.case}: {failure.message}")
    for error in result.storage_errors:
        report.storage_error((error.invariant,), f"{error.case}: {error.message}")
    report.coverage["parallel races"] = result.coverage()


def _state_machine(
    report: BackendReport,
    factory: LocationFactory,
    profile: str,
    multipart: int,
    per_case_s: float,
    say: Progress,
    deadline: float | None,
    total_s: float = MACHINE_MIN_S * 4,
) -> None:
    machine = make_state_machine(factory, multipart_size=multipart)
    settings = PROFILES[profile]
    if deadline is not None:
        budget = max(deadline - time.monotonic(), min(MACHINE_MIN_S, total_s / 4))
        budget = min(budget, MACHINE_MAX_S.get(profile) or budget)
        deadline = time.monotonic() + budget
        affordable = int(budget / max(per_case_s * EXAMPLE_COST_IN_CRASH_CASES, 1e-6))
        examples = max(5, min(settings.max_examples, affordable))
        settings = hypothesis.settings(settings, max_examples=examples)
    say(f"property-based crash injection (profile {profile}, {settings.max_examples} examples)")
    note = _run_machine(report, machine, settings, deadline)
    report.checked(*MACHINE_INVARIANTS)
    report.coverage["property-based"] = (
        f"{settings.max_examples} examples of up to {settings.stateful_step_count} steps"
        f"{_machine_completions(machine, multipart)}{note}"
    )


def _machine_completions(machine: Any, multipart: int) -> str:
    """How many of the state machine's crashes fell just before or after a multipart
    completion (stores with multipart only)."""
    crashes = getattr(machine, "completion_crashes", None)
    if not multipart or crashes is None:
        return ""
    return (
        f"; crashes around multipart completions: {crashes['before']} before, "
        f"{crashes['after']} after"
    )


def _run_machine(
    report: BackendReport, machine: Any, settings: hypothesis.settings, deadline: float | None
) -> str:
    """Run the state machine, recording what it found; a note for the coverage line.
    Shrinking stops at ``deadline`` (``time.monotonic()``; None: at hypothesis's own limit)."""
    undecided = "; stopped by the storage's failure on every run (undecided)"
    printed: list[str] = []
    try:
        with shrinking_stops_at(deadline), with_reporter(lambda value: printed.append(str(value))):
            run_state_machine(machine, settings)
    except StorageFailure as failure:  # on every run: undecided, neither held nor violated
        report.storage_error(MACHINE_INVARIANTS, f"property-based: {failure}")
        return undecided
    except Exception as exc:
        # Hypothesis raises several distinct failures as one group, each shrunk on its own.
        found = list(getattr(exc, "exceptions", None) or [exc])  # an ExceptionGroup's, or it
        notes = [_machine_finding(report, error, printed) for error in found]
        if any(note is None for note in notes):
            return undecided
        return next((note for note in notes if note), "")
    return ""


def _machine_finding(report: BackendReport, error: BaseException, printed: list[str]) -> str | None:
    """Record one failure the state machine found; its coverage note (None: undecided)."""
    if isinstance(error, InvariantViolation):
        report.violated(error.invariant, _shrunk(error.detail, error, printed))
        return _budget_note(error, printed)
    cause = storage_failure(error)  # one that hypothesis shrank: the storage failed
    if cause is None:  # anything else the store raised is reported, not hidden
        report.violated("I1", _shrunk(f"unexpected error: {error!r}", error, printed))
        return _budget_note(error, printed)
    report.storage_error(MACHINE_INVARIANTS, f"property-based: {cause!r}")
    return None


def _budget_note(error: BaseException, printed: list[str]) -> str:
    said = [str(note) for note in getattr(error, "__notes__", [])] + printed
    if not any("stopped because it is making very slow" in line for line in said):
        return ""
    return "; shrinking stopped at the time budget (the sequence shown may not be the shortest)"


_NOT_STEPS = (
    "Falsifying example",
    "Failing test case",
    "You can reproduce",
    "@reproduce_failure",
    "WARNING",
    "PLEASE",
    "stopped because",
    "progress.",
    "take this long",
    "provide a reproducing",
    "performance for",
)


def _steps(error: BaseException, printed: list[str]) -> list[str]:
    """Hypothesis's shrunk sequence of steps: from the exception's notes (where hypothesis
    6.x puts them), else from what it printed through its reporter; without its explanation."""
    notes = [str(note) for note in getattr(error, "__notes__", [])]
    steps = []
    for line in "\n".join(notes or printed).splitlines():
        if line.lstrip().startswith("Explanation:"):
            break
        if line.strip() and not line.lstrip().startswith(_NOT_STEPS):
            steps.append(line.rstrip())
    return steps


def _shrunk(message: str, error: BaseException, printed: list[str]) -> str:
    steps = _steps(error, printed)
    if not steps:
        return message
    return message + "\n  shrunk failing sequence:\n" + "\n".join("    " + s for s in steps)


TIERED_NOT_COVERED = ("I5", "I6", "I8")


def run_tiered(
    url: str,
    durable_url: str,
    *,
    options: dict[str, Any] | None = None,
    durable_options: dict[str, Any] | None = None,
    progress: Progress | None = None,
    on_layer: Callable[[BackendReport], None] | None = None,
) -> BackendReport:
    """Crash a tiered pair (``url`` fast, ``durable_url`` durable) at every storage call of
    its replication (``tiers``); each store alone is proved by ``run_backend`` on its URL.

    The report is the pair's: I1 to I4 and I7 of each tier, across tiers, and after a
    restarted replicator; I9 across the pair with a partitioned node; I5, I6 and I8 are not
    applicable here (each store's own run checks
    them; a copy is an ordinary save of the durable store's protocol).
    """
    from ckptstore.conformance.layers.tiers import (
        PARTITION_INVARIANTS,
        TIERED_INVARIANTS,
        TieredPairFactory,
        run_partitioned,
        run_tiered_crash_points,
    )

    say = progress or (lambda message: None)
    started = time.monotonic()
    report = BackendReport(url=redact(f"{url} -> {durable_url}"), strategy="tiered")
    written = on_layer or (lambda report: None)
    for key in TIERED_NOT_COVERED:
        report.not_applicable(key, "checked by the suite on each store's own URL")
    factory = TieredPairFactory(
        LocationFactory(url, options), LocationFactory(durable_url, durable_options)
    )

    def crash_points() -> None:
        result = run_tiered_crash_points(factory, workers=CRASH_WORKERS)
        report.checked(*TIERED_INVARIANTS)
        for failure in result.failures:
            report.violated(failure.invariant, f"{failure.case}: {failure.message}")
        _undecided(report, TIERED_INVARIANTS, result)
        report.coverage["replication crash points"] = (
            f"{result.calls} storage calls of both tiers: {max(result.cases - 1, 0)} crashes "
            f"(before each call of either driver that leaves a distinct state, and after the "
            f"last; the fast tier's calls from the first replication pass on), each recovered "
            f"by a new replicator, GC'd and checked" + _retries(result)
        )

    def partitioned() -> None:
        result = run_partitioned(factory)
        report.checked(*PARTITION_INVARIANTS)
        for failure in result.failures:
            report.violated(failure.invariant, f"{failure.case}: {failure.message}")
        _undecided(report, PARTITION_INVARIANTS, result)
        report.coverage["partitioned fast tier"] = (
            "a node cut off from the durable tier saves on in its fast tier while another "
            "takes the pair over; the first node's restarted readers and replicator keep to "
            "the durable history"
        )

    with _quiet():
        say("replication crash points")
        _layer(
            report,
            "replication crash points",
            TIERED_INVARIANTS,
            crash_points,
            started=started,
            written=written,
        )
        say("partitioned fast tier")
        _layer(
            report,
            "partitioned fast tier",
            PARTITION_INVARIANTS,
            partitioned,
            started=started,
            written=written,
        )
    return report
