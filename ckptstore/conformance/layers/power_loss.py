"""Power loss: the standard workload on a simulated file system, cut at every change.

After every storage call that changes the simulated file system, every state a power loss
could leave (see ``models.simfs``) is materialised, opened by a fresh store, and checked against the
model as it stood at that instant: committed checkpoints must have survived (I2), anything
visible must be complete and exactly as saved (I1), and so on.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from ckptstore.commit.base import CommitStrategy
from ckptstore.conformance.faults import FaultPlan
from ckptstore.conformance.layers.cases import CaseFailure
from ckptstore.conformance.layers.layer import Findings, SuiteRun
from ckptstore.conformance.layers.workload import standard_workload
from ckptstore.conformance.location import Clock, StrategyLocation
from ckptstore.conformance.model import InvariantViolation, Model, check_invariants
from ckptstore.conformance.models.simfs import SimulatedFileSystem
from ckptstore.errors import CkptStoreError
from ckptstore.store import Store

__all__ = ["INVARIANTS", "PowerLossResult", "run_layer", "run_power_loss"]

INVARIANTS = ("I1", "I2", "I3", "I4")

MAX_FAILURES = 20


@dataclass
class PowerLossResult:
    """How many instants were cut, how many file-system states were checked, what broke."""

    points: int = 0
    states: int = 0
    failures: list[CaseFailure] = field(default_factory=list)


def run_power_loss(template: CommitStrategy[Any], *, depth: int = 1) -> PowerLossResult:
    """Cut power at every change of the standard workload on a simulated file system.

    ``template`` is the file-system strategy under test (its settings are kept, its driver is
    replaced). ``depth``: how many choices may differ from the extreme states (1 or 2).
    """
    clock = Clock()
    simulated = SimulatedFileSystem(clock)
    strategy = template.with_driver(simulated)
    model = Model()
    result = PowerLossResult()

    def cut() -> None:
        result.points += 1
        for state in simulated.crash_states(depth=depth):
            result.states += 1
            if len(result.failures) >= MAX_FAILURES:
                continue
            survivor = Store(strategy.with_driver(simulated.materialise(state)), clock=clock)
            try:
                check_invariants(survivor, copy.deepcopy(model), lost_blame="I2")
            except InvariantViolation as violation:
                case = f"power loss at change {result.points}: {state.describe()}"
                result.failures.append(CaseFailure(case, violation.invariant, violation.detail))
            except CkptStoreError as exc:
                case = f"power loss at change {result.points}: {state.describe()}"
                result.failures.append(CaseFailure(case, "I1", f"store unreadable: {exc!r}"))

    simulated.on_change = cut
    standard_workload(StrategyLocation(strategy, clock), FaultPlan(), model, 0)  # type: ignore[arg-type]
    simulated.on_change = None
    return result


def run_layer(run: SuiteRun, found: Findings) -> None:
    """The layer on ``run``'s target: the strategy of a fresh location, on a simulated file
    system (one choice from the extreme states in ``ci``, two otherwise)."""
    location = run.locations()
    try:
        result = run_power_loss(location.base, depth=1 if run.profile == "ci" else 2)
    finally:
        location.destroy()
    found.check(*INVARIANTS)
    for failure in result.failures:
        found.violated(failure.invariant, f"{failure.case}: {failure.message}")
    found.coverage["power loss"] = (
        f"{result.states} file-system states checked at {result.points} instants"
    )
    if result.states == 0:
        found.vacuous = "no file-system state was checked"
