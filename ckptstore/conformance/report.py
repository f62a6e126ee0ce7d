"""The conformance report: capabilities and invariants per backend, as text, JSON and JUnit.

It is written for a storage engineer: which capabilities the driver declares and what the
probes measured, each invariant I1 to I10 held / violated / not applicable with the failing
cases (for the property-based layer, hypothesis's shrunk sequence of steps), and how much
was covered (crash points, power-loss states, examples).

A case that the storage kept failing (``outcomes``) is a third outcome, ``storage error``:
the invariants it was checking are reported so, with the storage's errors, unless another
case violated them. A storage error is not ``ok`` (nothing was proved), and it is not a
violation: the text says which it is, JSON gives an ``outcome``, JUnit an ``error``.

A layer the suite itself failed in (``outcomes.SuiteError``, or a Python error of its own: a
wait that timed out, a step it could not carry out) is a fourth: ``suite error``, with the
traceback, and that layer's invariants "not checked (the suite failed)" unless another case
violated them. It is never a violation, and never a pass.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any
from xml.etree import ElementTree

from ckptstore.conformance.layers.behaviours import CONSEQUENCES, TOLERATED
from ckptstore.conformance.layers.probes import HELD, MEASURED_ONLY, NOT_MEASURED, ProbeResult
from ckptstore.conformance.model import INVARIANTS
from ckptstore.conformance.outcomes import STORAGE_ERROR, SUITE_ERROR
from ckptstore.urls import redact

__all__ = ["BackendReport", "InvariantResult", "LayerError", "render_text", "to_json", "to_junit"]

HELD_STATUS, VIOLATED_STATUS, NOT_APPLICABLE = "held", "violated", "not applicable"
NOT_CHECKED = "not checked"
INTERRUPTED = "interrupted"
"""The run was stopped (KeyboardInterrupt) before a layer finished: what is there was found."""
STORAGE_ERROR_STATUS = STORAGE_ERROR
"""Undecided: the storage failed the cases that check it, on every run."""
SUITE_ERROR_STATUS = SUITE_ERROR
"""A layer's outcome when the suite itself failed in it (``outcomes.SuiteError``)."""
SUITE_FAILED = "not checked (the suite failed)"
"""An invariant a layer was checking when the suite failed in it: no verdict, either way."""


@dataclass
class InvariantResult:
    """One invariant's verdict on one backend, with the evidence of any violation."""

    invariant: str
    name: str
    status: str = NOT_CHECKED
    evidence: list[str] = field(default_factory=list)


@dataclass
class LayerError:
    """What stopped a layer (or a step around the layers) before it finished: ``violated``
    (ckptstore raised something unexpected), ``storage error`` or ``suite error`` (the
    message ends with the traceback); the rest still ran."""

    layer: str
    outcome: str
    message: str


@dataclass
class BackendReport:
    """Everything the suite found on one backend."""

    url: str
    strategy: str
    capabilities: list[ProbeResult] = field(default_factory=list)
    invariants: dict[str, InvariantResult] = field(
        default_factory=lambda: {
            key: InvariantResult(key, name) for key, name in INVARIANTS.items()
        }
    )
    coverage: dict[str, Any] = field(default_factory=dict)
    duration_s: float = 0.0
    errors: list[LayerError] = field(default_factory=list)
    """Layers that stopped early, and why (their invariants' verdicts say what was decided)."""
    cut_short: dict[str, str] = field(default_factory=dict)
    """Layers (or parts) the run's time budget cut short, with what they left out: what ran
    is in the verdicts; a larger ``--budget`` (or ``--profile thorough``) runs the rest."""

    def layer_error(self, layer: str, outcome: str, message: str) -> None:
        """Record what stopped ``layer``: ``violated``, ``storage error`` or ``suite error``."""
        self.errors.append(LayerError(layer, outcome, message))

    def suite_failed(self, layer: str, invariants: tuple[str, ...], message: str) -> None:
        """Record that the suite itself failed in ``layer`` (``message``: what and the
        traceback): its ``invariants`` are not checked, unless a violation was found."""
        self.layer_error(layer, SUITE_ERROR_STATUS, message)
        for key in invariants:
            result = self.invariants[key]
            if result.status != VIOLATED_STATUS:
                if result.status != SUITE_FAILED:
                    result.evidence = []
                result.status = SUITE_FAILED
                result.evidence.append(f"{layer}: the suite failed (see the layer's error)")

    def checked(self, *invariants: str) -> None:
        """Mark invariants as checked by a layer (held unless a violation says otherwise)."""
        for key in invariants:
            if self.invariants[key].status in (NOT_CHECKED, NOT_APPLICABLE):
                self.invariants[key].status = HELD_STATUS

    def not_applicable(self, key: str, why: str) -> None:
        """Mark an invariant that cannot arise on this backend."""
        if self.invariants[key].status == NOT_CHECKED:
            self.invariants[key].status = NOT_APPLICABLE
            self.invariants[key].evidence.append(why)

    def violated(self, key: str, evidence: str) -> None:
        """Record a violation of an invariant."""
        result = self.invariants[key]
        if result.status != VIOLATED_STATUS:
            result.status = VIOLATED_STATUS
            result.evidence = []
        if len(result.evidence) < 5:
            result.evidence.append(evidence)

    def storage_error(self, keys: tuple[str, ...], evidence: str) -> None:
        """Record a case the storage failed on every run: its invariants are undecided
        (unless a violation was, or is later, found: that stands)."""
        for key in keys:
            result = self.invariants[key]
            if result.status in (VIOLATED_STATUS, SUITE_FAILED):
                continue
            if result.status != STORAGE_ERROR_STATUS:
                result.status = STORAGE_ERROR_STATUS
                result.evidence = []
            if len(result.evidence) < 5:
                result.evidence.append(evidence)

    def storage_blamed(self, invariant: str) -> list[str]:
        """What the probes measured of this storage that can explain a violation of
        ``invariant``: one sentence per capability found missing, naming its probe (said
        before the violation's evidence: the storage is blamed before the protocol)."""
        if self.invariants[invariant].status != VIOLATED_STATUS:
            return []
        blamed = []
        for probe in self.capability_mismatches:
            breaks, what = CONSEQUENCES.get(probe.capability, ((), ""))
            if invariant in breaks:
                blamed.append(f"{what}: see probe '{probe.capability}'")
        return blamed

    @property
    def capability_mismatches(self) -> list[ProbeResult]:
        """Capabilities declared but not found on the real system."""
        return [c for c in self.capabilities if _missing(c)]

    @property
    def storage_errors(self) -> list[str]:
        """What the storage's failures left undecided: invariants and capabilities."""
        return (
            [
                f"{r.invariant} {r.name}"
                for r in self.invariants.values()
                if r.status == STORAGE_ERROR_STATUS
            ]
            + [
                f"capability {c.capability}"
                for c in self.capabilities
                if c.measured == STORAGE_ERROR
            ]
            + [f"{e.layer}: {e.message}" for e in self.errors if e.outcome == STORAGE_ERROR_STATUS]
        )

    @property
    def outcome(self) -> str:
        """``violated`` (an invariant, a declared capability missing, or a layer stopped by
        an unexpected error of ckptstore's), else ``suite error`` (the suite failed in a
        layer), else ``interrupted``, else ``storage error`` (something undecided), else
        ``held``."""
        if (
            self.capability_mismatches
            or any(r.status == VIOLATED_STATUS for r in self.invariants.values())
            or any(e.outcome == VIOLATED_STATUS for e in self.errors)
        ):
            return VIOLATED_STATUS
        if any(e.outcome == SUITE_ERROR_STATUS for e in self.errors):
            return SUITE_ERROR_STATUS
        if any(e.outcome == INTERRUPTED for e in self.errors):
            return INTERRUPTED
        return STORAGE_ERROR_STATUS if self.storage_errors else HELD_STATUS

    @property
    def ok(self) -> bool:
        """Everything checked held: nothing violated, and nothing left undecided by storage
        errors."""
        return self.outcome == HELD_STATUS


def _measured(probe: ProbeResult) -> str:
    if probe.measured == NOT_MEASURED:
        return "-"
    if probe.measured == STORAGE_ERROR:
        return "?"
    return "yes" if probe.measured == HELD else "no"


def _missing(probe: ProbeResult) -> bool:
    """Declared or required, and not found; or required and not declared (ckptstore would
    refuse the storage at open)."""
    if probe.measured == STORAGE_ERROR or probe.capability in TOLERATED:
        return False
    if probe.capability in MEASURED_ONLY:  # no driver declares it: only the measure counts
        return probe.measured not in (HELD, NOT_MEASURED)
    if probe.required and not probe.declared:
        return True
    return (probe.declared or probe.required) and probe.measured not in (HELD, NOT_MEASURED)


def _verdict(probe: ProbeResult) -> str:
    if probe.measured == STORAGE_ERROR:
        return "STORAGE ERROR (undecided)"
    if probe.capability in TOLERATED:  # measured, and the protocol does without it
        return "ok" if probe.measured in (HELD, NOT_MEASURED) else "measured (tolerated)"
    if probe.capability in MEASURED_ONLY:  # declared by no driver: needed by every store
        return "ok" if probe.measured in (HELD, NOT_MEASURED) else "MISSING (needed, not found)"
    if probe.required and not probe.declared:
        if probe.measured == HELD:
            return "MISSING from the driver's declaration (required; found: declare it)"
        if probe.measured == NOT_MEASURED:
            return "MISSING (required by the commit protocol, not declared)"
        return "MISSING (required by the commit protocol, not declared, not found)"
    if probe.measured == NOT_MEASURED:
        return ""
    if probe.declared and probe.measured != HELD:
        return "MISSING (declared, not found)"
    if not probe.declared and probe.measured == HELD:
        return "available, not declared"
    return "ok"


def render_text(reports: list[BackendReport]) -> str:
    """The human report: one block of tables per backend, then a summary line."""
    lines: list[str] = []
    for report in reports:
        lines.append(f"== {report.url}  ({report.strategy}, {report.duration_s:.1f}s)")
        lines.append(f"  {'capability':<32} {'declared':<9} {'measured':<9} verdict / detail")
        for probe in report.capabilities:
            declared = (
                "-" if probe.capability in MEASURED_ONLY else "yes" if probe.declared else "no"
            )
            detail = " / ".join(x for x in (_verdict(probe), probe.detail) if x)
            lines.append(f"  {probe.capability:<32} {declared:<9} {_measured(probe):<9} {detail}")
        lines.append("")
        lines.append(f"  {'invariant':<36} status")
        for result in report.invariants.values():
            loud = result.status in (VIOLATED_STATUS, STORAGE_ERROR_STATUS, SUITE_FAILED)
            status = result.status.upper() if loud else result.status
            lines.append(f"  {result.invariant + ' ' + result.name:<36} {status}")
            for blamed in report.storage_blamed(result.invariant):
                lines.append(f"      the storage first: {blamed}")
            if loud:
                for evidence in result.evidence:
                    lines.extend("      " + part for part in evidence.splitlines())
        lines.append("")
        for key, value in report.coverage.items():
            lines.append(f"  {key}: {value}")
        for part, what in report.cut_short.items():
            lines.append(f"  cut short by the budget: {part}: {what} (a larger --budget runs it)")
        for error in report.errors:
            first, *rest = error.message.splitlines() or [""]
            lines.append(f"  {error.layer}: {error.outcome.upper()}: {first}")
            lines.extend("      " + part for part in rest)
        lines.append("")
    lines.append(f"conformance: {len(reports)} backend(s); {_summary(reports)}")
    return redact("\n".join(lines) + "\n")  # evidence quotes URLs and foreign errors


def _summary(reports: list[BackendReport]) -> str:
    violating = [r.url for r in reports if r.outcome == VIOLATED_STATUS]
    failed = [r.url for r in reports if r.outcome == SUITE_ERROR_STATUS]
    undecided = [r.url for r in reports if r.outcome == STORAGE_ERROR_STATUS]
    parts = [f"VIOLATIONS on {', '.join(violating)}"] if violating else []
    if failed:
        parts.append(
            f"SUITE ERRORS on {', '.join(failed)} (the suite itself failed: no verdict on "
            f"the layers named; please report it with the traceback)"
        )
    if undecided:
        parts.append(
            f"STORAGE ERRORS on {', '.join(undecided)} (the storage kept failing after "
            f"retries: undecided, not violations; run again)"
        )
    return "; ".join(parts) or "all invariants held"


def to_json(reports: list[BackendReport]) -> str:
    """The report as JSON."""
    outcomes = [r.outcome for r in reports]
    order = (VIOLATED_STATUS, SUITE_ERROR_STATUS, INTERRUPTED, STORAGE_ERROR_STATUS)
    worst = next((o for o in order if o in outcomes), HELD_STATUS)
    return redact(
        json.dumps(
            {
                "ok": all(r.ok for r in reports),
                "outcome": worst,
                "backends": [_backend_json(r) for r in reports],
            },
            indent=2,
        )
    )


def _backend_json(report: BackendReport) -> dict[str, Any]:
    """One backend's report as JSON: its fields, its outcome, and under each violated
    invariant what the storage is blamed for first (``storage_blamed``)."""
    found = {**asdict(report), "outcome": report.outcome}
    for key, result in found["invariants"].items():
        result["storage_blamed"] = report.storage_blamed(key)
    return found


def to_junit(reports: list[BackendReport]) -> str:
    """The report as JUnit XML: one suite per backend, a case per invariant and capability; a
    violation is a ``failure``, a storage error an ``error`` (the case could not run)."""
    root = ElementTree.Element("testsuites", name="ckptstore conformance")
    for report in reports:
        suite = ElementTree.SubElement(root, "testsuite", name=report.url)
        failures = errors = 0
        for result in report.invariants.values():
            case = ElementTree.SubElement(
                suite, "testcase", classname=report.url, name=f"{result.invariant} {result.name}"
            )
            if result.status == VIOLATED_STATUS:
                failures += 1
                failure = ElementTree.SubElement(case, "failure", message="violated")
                blamed = [
                    f"the storage first: {b}" for b in report.storage_blamed(result.invariant)
                ]
                failure.text = "\n\n".join([*blamed, *result.evidence])
            elif result.status in (STORAGE_ERROR_STATUS, SUITE_FAILED):
                errors += 1
                what = STORAGE_ERROR if result.status == STORAGE_ERROR_STATUS else SUITE_ERROR
                error = ElementTree.SubElement(case, "error", message=what)
                error.text = "\n\n".join(result.evidence)
            elif result.status in (NOT_APPLICABLE, NOT_CHECKED):
                ElementTree.SubElement(case, "skipped", message=result.status)
        for probe in report.capabilities:
            case = ElementTree.SubElement(
                suite, "testcase", classname=report.url, name=f"capability {probe.capability}"
            )
            if probe in report.capability_mismatches:
                failures += 1
                failure = ElementTree.SubElement(case, "failure", message="declared, not found")
                failure.text = probe.detail
            elif probe.measured == STORAGE_ERROR:
                errors += 1
                error = ElementTree.SubElement(case, "error", message=STORAGE_ERROR)
                error.text = probe.detail
            elif probe.measured == NOT_MEASURED:
                ElementTree.SubElement(case, "skipped", message=probe.detail)
        for layer_error in report.errors:
            case = ElementTree.SubElement(
                suite, "testcase", classname=report.url, name=f"layer {layer_error.layer}"
            )
            if layer_error.outcome == VIOLATED_STATUS:
                failures += 1
                failure = ElementTree.SubElement(case, "failure", message="stopped early")
                failure.text = layer_error.message
            else:
                errors += 1
                error = ElementTree.SubElement(case, "error", message=layer_error.outcome)
                error.text = layer_error.message
        tests = len(report.invariants) + len(report.capabilities) + len(report.errors)
        suite.set("tests", str(tests))
        suite.set("failures", str(failures))
        suite.set("errors", str(errors))
        suite.set("time", f"{report.duration_s:.3f}")
    return redact(ElementTree.tostring(root, encoding="unicode"))
