"""Run every layer of the suite on a backend and gather one report.

The layers, and the order they run in, are ``layers.registry.LAYERS`` (the pytest mix-ins read
the same list). Each layer marks the invariants it checks as held unless it found a
violation, or unless the storage failed one of its cases on every run (a storage error:
undecided, see ``outcomes``); a layer that does not apply to the backend says so in the
report. ``run_tiered`` runs the layers of a tiered pair.
"""

from __future__ import annotations

import logging
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ckptstore.conformance.layers.layer import Findings, Layer, SuiteRun, TargetKind
from ckptstore.conformance.layers.probes import ACCEPTED, VIOLATED, ProbeResult
from ckptstore.conformance.layers.property_based import check_reproduction
from ckptstore.conformance.layers.registry import layer_named, layers_for
from ckptstore.conformance.library_log import captured
from ckptstore.conformance.location import LocationFactory, open_for_measuring
from ckptstore.conformance.machine import PROFILES
from ckptstore.conformance.model import INVARIANTS, InvariantViolation
from ckptstore.conformance.outcomes import (
    REFUSES,
    STORAGE_ERROR,
    SUITE_ERROR,
    StorageFailure,
    StorageRefused,
    SuiteError,
    refusal,
    storage_failure,
    suite_failed,
)
from ckptstore.conformance.report import (
    INTERRUPTED,
    NOT_APPLICABLE,
    VIOLATED_STATUS,
    BackendReport,
)
from ckptstore.driver import DriverFamily, driver_family
from ckptstore.errors import InvalidOptionError, RefusedError
from ckptstore.store import Store
from ckptstore.urls import redact

__all__ = ["BUDGET_S", "Target", "record", "run_backend", "run_layer", "run_tiered"]

log = logging.getLogger(__name__)

Progress = Callable[[str], None]

BUDGET_S: dict[str, float | None] = {"ci": 60.0, "thorough": None}
"""Seconds one backend's run may take per profile (None: no limit). A layer with a budget of
its own (the property-based layer: ``layers.property_based.BUDGET``) gets what the layers
before it left, and stops shrinking at its end: a failing backend's run ends well within twice
the budget."""
ALL_INVARIANTS = tuple(INVARIANTS)
REPLAYED = "property-based"
"""The layer ``--reproduce`` runs alone."""
CLEANUP = "cleanup"
"""The coverage line that says what the suite could not remove of what it wrote."""
LIBRARY_LOG = "library log"
"""The coverage line that counts what ckptstore logged during the run (``library_log``)."""


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
    reproduce: str = "",
) -> BackendReport:
    """Run the whole suite on the store at ``url``; refuse a non-empty store unless allowed.

    Every layer runs whatever another one found: an error escaping a layer is recorded in the
    report (a violation, or a storage error) and the next layer runs. ``budget_s`` (default:
    the profile's ``BUDGET_S``) bounds the run, shrinking included. ``on_layer`` is called with
    the report after each layer, so that what is found is written as it is found.
    ``reproduce`` (``VERSION:BLOB[:STEPS]`` from a report): replay that one failing example of the
    property-based layer, and run nothing else.
    """
    if profile not in PROFILES:
        raise InvalidOptionError(f"unknown profile {profile!r}; choose from {sorted(PROFILES)}")
    if reproduce:
        check_reproduction(reproduce)
    started = time.monotonic()
    budget = BUDGET_S.get(profile) if budget_s is None else budget_s
    report = BackendReport(url=redact(url), strategy="?")
    written = on_layer or (lambda report: None)
    base = _open_base(report, url, options, allow_nonempty)
    if base is None:
        report.duration_s = time.monotonic() - started
        written(report)
        return report
    family = driver_family(base.driver)
    run = SuiteRun(
        LocationFactory(url, options),
        profile,
        TargetKind.FILE_SYSTEM if family is DriverFamily.FILE_SYSTEM else TargetKind.OBJECT_STORE,
        say=progress or (lambda message: None),
        deadline=None if budget is None else started + budget,
        budget_s=budget or 0.0,
        multipart_size=None if reproduce else 0,  # until the probes measure it
        reproduce=reproduce,
    )
    _run_layers(report, run, started=started, written=written)
    return report


def run_layer(report: BackendReport, name: str, run: SuiteRun) -> None:
    """Run the one layer called ``name`` on ``run``'s target into ``report`` (raising what it
    raises: a layer alone, for tests and tools)."""
    record(report, layer_named(name).findings(run))


def record(report: BackendReport, found: Findings) -> None:
    """Put what a layer found in the report."""
    report.checked(*found.checked)
    for key, why in found.not_applicable.items():
        report.not_applicable(key, why)
    for invariant, evidence in found.violations:
        report.violated(invariant, evidence)
    for invariants, evidence in found.undecided:
        report.storage_error(invariants, evidence)
    report.capabilities.extend(found.capabilities)
    report.coverage.update(found.coverage)
    report.cut_short.update(found.cut_short)
    for part, why in found.not_run.items():
        report.layer_error(part, SUITE_ERROR, f"not run: {why}")


def _run_layers(
    report: BackendReport,
    run: SuiteRun,
    *,
    started: float,
    written: Callable[[BackendReport], None],
) -> None:
    """Every layer of ``run``'s kind of target, in order, into ``report``."""
    layers = [layer_named(REPLAYED)] if run.reproduce else layers_for(run.kind)
    with captured(report.url) as logged:  # the library's warnings: counted, not printed
        for layer in layers:
            if run.kind in layer.applies_to:
                _layer(report, layer, run, started=started, written=written)
            else:
                record(report, layer.elsewhere)
            if logged.count:
                report.coverage[LIBRARY_LOG] = logged.line()
            _refusal_missing(report)
            left = _cleanup_problems(run)
            if left:
                report.coverage[CLEANUP] = (
                    f"the suite could not remove everything it wrote ({len(left)} kind(s); "
                    f"remove it by hand): {'; '.join(left)}"
                )


def _cleanup_problems(run: SuiteRun) -> list[str]:
    """What the run's locations could not remove: its store's, and each tier's of a pair."""
    factories = [run.locations]
    if run.pairs is not None:
        factories += [run.pairs.fast, run.pairs.durable]
    left: dict[str, None] = {}
    for factory in factories:
        left.update(dict.fromkeys(factory.cleanup_problems))
    return list(left)


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
    layer: Layer,
    run: SuiteRun,
    *,
    started: float,
    written: Callable[[BackendReport], None],
) -> None:
    """Run one layer of the suite: whatever escapes it is recorded in ``report``, never raised.

    What the layer found until then is recorded. An ``InvariantViolation`` is a violation of
    its invariant; the storage's own failure (see ``outcomes``) leaves the layer's invariants
    undecided; a ``CapabilityError`` (the store refused the storage) makes them not
    applicable, with the refusal; any other error ckptstore raised is the protocol
    misbehaving: the layer's first invariant is violated (the report's ``errors`` name the
    layer whose invariants it leaves unchecked). The suite's own failure (``SuiteError``, or
    any error that is not ckptstore's: a Python error in the suite, a barrier broken by a
    timeout) is a ``suite error`` with its traceback, and the layer's invariants are "not
    checked": never a violation. Then ``written(report)`` is called, also when the run is
    interrupted (KeyboardInterrupt), so that finished layers stay written.
    """
    name, invariants, found = layer.name, layer.invariants, Findings()
    try:
        layer.findings(run, found)
    except StorageFailure as failure:
        report.storage_error(invariants, f"{name}: {failure}")
        report.layer_error(name, STORAGE_ERROR, f"stopped by the storage: {failure.error!r}")
    except SuiteError as failure:
        report.suite_failed(name, invariants, _told(failure.message, failure))
    except StorageRefused as stopped:
        _refused(report, name, invariants, str(stopped))
    except InvariantViolation as violation:
        report.violated(violation.invariant, f"{name}: {violation.detail}")
    except Exception as exc:
        cause = storage_failure(exc)
        if cause is not None:
            report.storage_error(invariants, f"{name}: {cause!r}")
            report.layer_error(name, STORAGE_ERROR, f"stopped by the storage: {cause!r}")
        elif refusal(exc) is not None:
            _refused(report, name, invariants, f"{REFUSES}: {refusal(exc)}")
        elif suite_failed(exc):
            report.suite_failed(name, invariants, _told(f"the suite failed: {exc!r}", exc))
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
        record(report, found)
        report.duration_s = time.monotonic() - started
        written(report)


def _refusal_missing(report: BackendReport) -> None:
    """A refusal of the storage (an invariant not applicable because the store refused it)
    that no missing capability explains is a capability row of its own, missing: ckptstore
    would refuse such saves in production, and the run must not pass."""
    if report.capability_mismatches or any(p.capability == ACCEPTED for p in report.capabilities):
        return
    for result in report.invariants.values():
        refused = next((e for e in result.evidence if REFUSES in e), None)
        if result.status == NOT_APPLICABLE and refused is not None:
            report.capabilities.append(ProbeResult(ACCEPTED, False, VIOLATED, refused, True))
            return


def _refused(report: BackendReport, name: str, invariants: tuple[str, ...], why: str) -> None:
    """The store refused the storage in layer ``name``: its invariants are not applicable."""
    for key in invariants:
        report.not_applicable(key, f"{name}: {why}")
    report.coverage.setdefault(name, f"not run: {why}")


def _told(message: str, error: BaseException) -> str:
    """``message``, then the traceback of ``error``: what a suite error is reported with."""
    trace = "".join(traceback.format_exception(error)).rstrip()
    return f"{message}\n{trace}"


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
    its replication (``layers.tiers``); each store alone is proved by ``run_backend`` on its
    URL.

    The report is the pair's: I1 to I4 and I7 of each tier, across tiers, and after a
    restarted replicator; I9 across the pair with a partitioned node; the invariants no pair
    layer checks (I5, I6 and I8) are not applicable here (each store's own run checks them; a
    copy is an ordinary save of the durable store's protocol).
    """
    from ckptstore.conformance.layers.tiers import TieredPairFactory

    started = time.monotonic()
    report = BackendReport(url=redact(f"{url} -> {durable_url}"), strategy="tiered")
    written = on_layer or (lambda report: None)
    layers = layers_for(TargetKind.TIERED_PAIR)
    checked = {key for layer in layers for key in layer.invariants}
    for key in ALL_INVARIANTS:
        if key not in checked:
            report.not_applicable(key, "checked by the suite on each store's own URL")
    fast = LocationFactory(url, options)
    run = SuiteRun(
        fast,
        kind=TargetKind.TIERED_PAIR,
        say=progress or (lambda message: None),
        pairs=TieredPairFactory(fast, LocationFactory(durable_url, durable_options)),
    )
    _run_layers(report, run, started=started, written=written)
    return report
