"""Run every layer of the suite on a backend and gather one report.

Layers: capability probes; exhaustive crash points; unknown outcomes of conditional writes
(object stores); power loss (file systems); the property-based state machine. Each layer
marks the invariants it checks as held unless it found a violation, or unless the storage
failed one of its cases on every run (a storage error: undecided, see ``outcomes``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import hypothesis
from hypothesis.reporting import with_reporter

from ckptstore.conformance.location import LocationFactory, open_for_measuring
from ckptstore.conformance.machine import PROFILES, make_state_machine, run_state_machine
from ckptstore.conformance.model import InvariantViolation
from ckptstore.conformance.outcomes import StorageFailure, storage_failure
from ckptstore.conformance.powerloss import run_power_loss
from ckptstore.conformance.probes import run_probes
from ckptstore.conformance.report import BackendReport
from ckptstore.conformance.workload import (
    CrashPointResult,
    big_shard_size,
    run_crash_points,
    run_indeterminate_outcomes,
)
from ckptstore.driver import DriverFamily, driver_family
from ckptstore.errors import InvalidOptionError, RefusedError
from ckptstore.store import Store

__all__ = ["Target", "embedded_targets", "run_backend"]

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


@contextlib.contextmanager
def embedded_targets() -> Iterator[list[Target]]:
    """Every built-in backend on embedded defaults (a temporary directory, memory, and
    s3:// and s3+versioned:// on a moto server on 127.0.0.1 where moto is installed),
    removed afterwards."""
    with contextlib.ExitStack() as stack:
        scratch = stack.enter_context(tempfile.TemporaryDirectory(prefix="ckptstore-conf-"))
        bucket = f"conformance-{os.getpid()}-{secrets.token_hex(4)}"
        targets = [
            Target(f"file://{scratch}/store"),
            Target(f"memory://{bucket}/store?min_part_size=4096&part_size=4096"),
        ]
        try:
            from ckptstore.tools.embedded import embedded_moto

            s3 = stack.enter_context(embedded_moto())
        except ImportError:
            log.warning("moto is not installed: skipping s3:// (pip install 'ckptstore[embedded]')")
        else:
            part = max(s3.min_part_size, 4096)
            run = f"conformance-{secrets.token_hex(4)}"
            targets.append(Target(s3.url(run, part_size=part, concurrency=1), s3.options))
            versioned = s3.versioned_bucket(f"{s3.bucket}-versioned")
            url = versioned.url(run, scheme="s3+versioned", part_size=part, concurrency=1)
            targets.append(Target(url, versioned.options))
        yield targets


def run_backend(
    url: str,
    *,
    profile: str = "ci",
    options: dict[str, Any] | None = None,
    allow_nonempty: bool = False,
    progress: Progress | None = None,
) -> BackendReport:
    """Run the whole suite on the store at ``url``; refuse a non-empty store unless allowed."""
    if profile not in PROFILES:
        raise InvalidOptionError(f"unknown profile {profile!r}; choose from {sorted(PROFILES)}")
    say = progress or (lambda message: None)
    started = time.monotonic()
    base = Store(open_for_measuring(url, dict(options or {})))
    if not allow_nonempty and not base.is_empty():
        raise RefusedError(
            f"{url} is not empty; the conformance suite writes and deletes under it. "
            f"Point it at an empty location, or pass --yes (allow_nonempty=True)"
        )
    report = BackendReport(url=url, strategy=base.strategy.name)
    factory = LocationFactory(url, options)
    file_system = driver_family(base.strategy.driver) is DriverFamily.FILE_SYSTEM
    with _quiet():
        say("capability probes")
        location = factory()
        try:
            report.capabilities = run_probes(location)
            multipart = big_shard_size(location)
        finally:
            location.destroy()
        per_case = _crash_points(report, factory, say)
        if file_system:
            report.not_applicable("I8", "file-system calls have no unknown outcomes")
            _power_loss(report, base.strategy, profile, say)
        else:
            _indeterminate(report, factory, say, every_call=profile != "ci")
            report.coverage["power loss"] = "not applicable (object store)"
        _state_machine(report, factory, profile, multipart, per_case, say)
    report.duration_s = time.monotonic() - started
    return report


CRASH_WORKERS = 4
MACHINE_BUDGET_S = {"ci": 25.0}
"""Seconds the property-based layer may take per profile (None: the profile's examples)."""
EXAMPLE_COST_IN_CRASH_CASES = 8.0
"""An example of the state machine costs about as much storage traffic as this many crash
cases; used to fit the examples into the budget on slow (networked) storage."""


def _crash_points(report: BackendReport, factory: LocationFactory, say: Progress) -> float:
    """Run the crash-point layer; return the seconds one crash case took on average."""
    say("exhaustive crash points")
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
        f"{result.cases - 1} crashes, each recovered, GC'd and checked"
        + _completions_note(result)
        + _retries(result)
    )
    return per_case


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
    return "made one at a time: a crash before each and after the last"


CRASH_POINT_INVARIANTS = ("I1", "I2", "I3", "I4", "I7")
MACHINE_INVARIANTS = ("I1", "I2", "I3", "I4", "I5", "I6", "I7")


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
    report: BackendReport, factory: LocationFactory, say: Progress, *, every_call: bool = False
) -> None:
    say("unknown outcomes of conditional writes")
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


def _power_loss(report: BackendReport, strategy: Any, profile: str, say: Progress) -> None:
    say("power loss")
    result = run_power_loss(strategy, depth=1 if profile == "ci" else 2)
    report.checked("I1", "I2", "I3", "I4")
    for failure in result.failures:
        report.violated(failure.invariant, f"{failure.case}: {failure.message}")
    report.coverage["power loss"] = (
        f"{result.states} file-system states checked at {result.points} instants"
    )


def _state_machine(
    report: BackendReport,
    factory: LocationFactory,
    profile: str,
    multipart: int,
    per_case_s: float,
    say: Progress,
) -> None:
    machine = make_state_machine(factory, multipart_size=multipart)
    settings = PROFILES[profile]
    budget = MACHINE_BUDGET_S.get(profile)
    if budget is not None:
        affordable = int(budget / max(per_case_s * EXAMPLE_COST_IN_CRASH_CASES, 1e-6))
        examples = max(5, min(settings.max_examples, affordable))
        settings = hypothesis.settings(settings, max_examples=examples)
    say(f"property-based crash injection (profile {profile}, {settings.max_examples} examples)")
    note = _run_machine(report, machine, settings)
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


def _run_machine(report: BackendReport, machine: Any, settings: hypothesis.settings) -> str:
    """Run the state machine, recording what it found; a note for the coverage line."""
    undecided = "; stopped by the storage's failure on every run (undecided)"
    printed: list[str] = []
    try:
        with with_reporter(lambda value: printed.append(str(value))):
            run_state_machine(machine, settings)
    except StorageFailure as failure:  # on every run: undecided, neither held nor violated
        report.storage_error(MACHINE_INVARIANTS, f"property-based: {failure}")
        return undecided
    except InvariantViolation as violation:
        report.violated(violation.invariant, _shrunk(violation.detail, printed))
    except Exception as exc:  # anything else the store raised is reported, not hidden
        cause = storage_failure(exc)  # one that hypothesis shrank: the storage failed
        if cause is None:
            report.violated("I1", _shrunk(f"unexpected error: {exc!r}", printed))
            return ""
        report.storage_error(MACHINE_INVARIANTS, f"property-based: {cause!r}")
        return undecided
    return ""


def _shrunk(message: str, printed: list[str]) -> str:
    steps = [line for line in "\n".join(printed).splitlines() if line.strip()]
    if not steps:
        return message
    return message + "\n  shrunk failing sequence:\n" + "\n".join("    " + s for s in steps)
