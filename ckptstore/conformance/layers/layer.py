"""What a layer of the suite is: an entry of the registry (``registry``) that both forms of
the suite read, the command line (``runner``) and the pytest mix-ins (``mixins``).

A layer runs on one target (a store of a family, or a tiered pair) and fills ``Findings``:
the invariants it checked, their violations, what the storage's failures left undecided, its
coverage lines. The runner records findings in the report; the mix-ins fail a test on them.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ckptstore.conformance.layers.probes import ProbeResult
    from ckptstore.conformance.layers.tiers import TieredPairFactory
    from ckptstore.conformance.location import LocationFactory

__all__ = ["Budget", "Findings", "Layer", "PytestForm", "SuiteRun", "TargetKind"]

Progress = Callable[[str], None]


class TargetKind(enum.Flag):
    """What a layer runs on."""

    FILE_SYSTEM = enum.auto()
    OBJECT_STORE = enum.auto()
    TIERED_PAIR = enum.auto()
    """A fast store replicating to a durable one (``tiers``)."""
    STORE = FILE_SYSTEM | OBJECT_STORE


@dataclass
class Findings:
    """What one layer found on one target, in the report's terms.

    ``skipped`` and ``vacuous`` speak to the pytest form only (the report says them in the
    coverage lines): why the layer did not run there (the test is skipped), and why its run
    proved nothing (the test fails).
    """

    checked: tuple[str, ...] = ()
    """Invariants the layer checked: held, unless a violation or a storage error says not."""
    violations: list[tuple[str, str]] = field(default_factory=list)
    """(invariant, evidence) of each violation found, in the order found."""
    undecided: list[tuple[tuple[str, ...], str]] = field(default_factory=list)
    """(invariants, evidence) of each case the storage failed on every run."""
    not_applicable: dict[str, str] = field(default_factory=dict)
    """Invariants that cannot arise on the target, with why."""
    capabilities: list[ProbeResult] = field(default_factory=list)
    coverage: dict[str, str] = field(default_factory=dict)
    """Coverage lines by name (the layer's name, or a part of it: ``ext4 image``)."""
    cut_short: dict[str, str] = field(default_factory=dict)
    """Parts of the layer the run's time budget cut short, with what was left out (the
    report's "cut short by the budget" line): what ran is reported, nothing was skipped
    silently."""
    not_run: dict[str, str] = field(default_factory=dict)
    """Parts of the layer the suite could not run where they apply, with why (a racer
    process that could not open the store): a suite error, the run does not pass."""
    skipped: str = ""
    vacuous: str = ""

    def check(self, *invariants: str) -> None:
        """Add ``invariants`` to those checked."""
        self.checked = tuple(dict.fromkeys((*self.checked, *invariants)))

    def violated(self, invariant: str, evidence: str) -> None:
        self.violations.append((invariant, evidence))

    def storage_error(self, invariants: tuple[str, ...], evidence: str) -> None:
        self.undecided.append((invariants, evidence))

    def cases(self, invariants: tuple[str, ...], result: Any, where: str = "") -> None:
        """The failures and storage errors of a crash-point style ``result`` (each with its
        ``case`` and ``message``): violations of their invariants, undecided ``invariants``."""
        if result.refused:
            for invariant in invariants:
                self.not_applicable.setdefault(invariant, f"{where}{result.refused}")
        for failure in result.failures:
            self.violated(failure.invariant, f"{where}{failure.case}: {failure.message}")
        for error in result.storage_errors:
            self.storage_error(invariants, f"{where}{error.case}: {error.message}")


@dataclass
class SuiteRun:
    """One run of the suite on one target: where, how hard, the time it has, and what the
    earlier layers measured for the later ones."""

    locations: LocationFactory
    profile: str = "ci"
    kind: TargetKind = TargetKind.OBJECT_STORE
    say: Progress = field(default=lambda message: None)
    deadline: float | None = None
    """When the whole run should end (``time.monotonic()``); None: no budget (pytest)."""
    budget_s: float = 0.0
    """The whole run's budget in seconds (0: none)."""
    layer_deadline: float | None = None
    """When the running layer should end, from its ``Budget`` (None: not cut)."""
    multipart_size: int | None = None
    """A shard size that takes a multipart upload (0: none), once measured."""
    call_s: float = 0.0
    """Seconds one storage call took in the crash points' workload, run alone (0: not
    measured)."""
    reproduce: str = ""
    """A failing example of the property-based layer to replay alone
    (``VERSION:BLOB[:STEPS]``, as its report prints it); empty: explore."""
    pairs: TieredPairFactory | None = None
    """Fresh tiered pairs, for the layers that run on one."""

    def budgets_from_start(self, budgets: float) -> float | None:
        """When ``budgets`` times the run's budget have passed since the run began: when a
        layer allowed that long stops starting new cases (None: the run has no budget)."""
        if self.deadline is None:
            return None
        return self.deadline + (budgets - 1) * self.budget_s

    def big_shard_size(self) -> int:
        """``multipart_size``, measured on a fresh location if no earlier layer did."""
        if self.multipart_size is None:
            from ckptstore.conformance.layers.workload import big_shard_size

            location = self.locations()
            try:
                self.multipart_size = big_shard_size(location)
            finally:
                location.destroy()
        return self.multipart_size


@dataclass(frozen=True)
class Budget:
    """The seconds a layer may take: what the run's budget leaves, at most ``most_s`` (by
    profile; None: no cap of its own), and at least ``least_s`` even when the layers before it
    used the budget (at most a quarter of the budget)."""

    most_s: Mapping[str, float | None]
    least_s: float

    def deadline(self, run: SuiteRun) -> float | None:
        """When the layer should end on ``run`` (None: the run has no budget)."""
        if run.deadline is None:
            return None
        now = time.monotonic()
        seconds = max(run.deadline - now, min(self.least_s, run.budget_s / 4))
        seconds = min(seconds, self.most_s.get(run.profile) or seconds)
        return now + seconds


@dataclass(frozen=True)
class PytestForm:
    """Where the pytest mix-ins run a layer: the test method and the mix-in class it is on."""

    mixin: str
    test: str


@dataclass(frozen=True)
class Layer:
    """One layer of the suite: adding a layer is adding one of these to ``registry.LAYERS``."""

    name: str
    """As the report names it: its coverage line, and its row when it stops early."""
    invariants: tuple[str, ...]
    """What it checks; the first is the one violated when the layer itself fails."""
    run: Callable[[SuiteRun, Findings], None]
    """Runs it on a target, filling the findings as it goes."""
    doc: str
    """What it proves, in a sentence (the pytest test's docstring)."""
    applies_to: TargetKind = TargetKind.STORE
    elsewhere: Findings = field(default_factory=Findings)
    """What it reports on a target it does not apply to."""
    budget: Budget | None = None
    """None: the layer is not cut; it runs to its end."""
    announce: str = ""
    """The progress line said before it runs (empty: it says its own)."""
    pytest: PytestForm | None = None
    """None: not in the pytest mix-ins (the command line runs it)."""

    def findings(self, run: SuiteRun, found: Findings | None = None) -> Findings:
        """Run the layer on ``run``'s target into ``found`` (or new findings), or give what it
        reports where it does not apply."""
        if run.kind not in self.applies_to:
            return self.elsewhere
        found = Findings() if found is None else found
        if self.announce:
            run.say(self.announce)
        run.layer_deadline = None if self.budget is None else self.budget.deadline(run)
        self.run(run, found)
        return found
