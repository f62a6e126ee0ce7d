"""Power loss: the standard workload on a simulated file system, cut at every change.

The standard workload runs, then a directory is pushed with ``clone=True`` (``ckptstore push``,
the Hugging Face callback, the background publisher): the simulated file system makes clones,
so each non-empty file becomes its shard by ``clone``, its bytes durable only once the shard is
fsynced. After every storage call that changes the simulated file system, every state a power
loss could leave (see ``models.simfs``) is materialised, opened by a fresh store, and checked
against the model as it stood at that instant: committed checkpoints must have survived (I2),
anything visible must be complete and exactly as saved (I1), and so on.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from ckptstore import names
from ckptstore.commit.base import CommitStrategy
from ckptstore.commit.rename import DATA_DIR
from ckptstore.conformance.faults import FaultInjector, FaultPlan
from ckptstore.conformance.layers.cases import CaseFailure
from ckptstore.conformance.layers.layer import Findings, SuiteRun
from ckptstore.conformance.layers.workload import pattern, push, save, standard_workload
from ckptstore.conformance.location import Clock, StrategyLocation
from ckptstore.conformance.model import InvariantViolation, Model, Saved, check_invariants
from ckptstore.conformance.models.simfs import SimulatedFileSystem
from ckptstore.errors import CkptStoreError
from ckptstore.store import Store

__all__ = ["INVARIANTS", "PUSHED_STEP", "PowerLossResult", "pushed", "run_layer", "run_power_loss"]

INVARIANTS = ("I1", "I2", "I3", "I4")

MAX_FAILURES = 20

PUSHED_STEP = 4
"""The step of the push after the standard workload (which saves 1 and 2 and leaves 3 dead)."""


def pushed(step: int) -> Saved:
    """What the push of ``step`` publishes: two files cloned (one a directory down) and an
    empty one, which is copied (a clone of nothing is no clone)."""
    shards = {
        "model/rank00000.bin": pattern(3000, step),
        "optimizer.pt": pattern(700, step + 1),
        "__0_0.distcp": b"",
    }
    return Saved(step, shards, {"step": step, "pushed": "cloned"})


@dataclass
class PowerLossResult:
    """How many instants were cut, how many file-system states were checked, what broke."""

    points: int = 0
    states: int = 0
    failures: list[CaseFailure] = field(default_factory=list)
    clones: int = 0
    """Shards the push made by ``clone`` (0 where the strategy copies instead)."""
    shared: int = 0
    """Shards the incremental saves shared by a hard link (0 where the strategy cannot)."""


def run_power_loss(template: CommitStrategy[Any], *, depth: int = 1) -> PowerLossResult:
    """Cut power at every change of the standard workload, then of a push with ``clone=True``
    (``pushed``), on a simulated file system.

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
    store = standard_workload(StrategyLocation(strategy, clock), FaultPlan(), model, 0)  # type: ignore[arg-type]
    injector = store.strategy.driver
    assert isinstance(injector, FaultInjector)  # StrategyLocation.open puts one under the store
    push(store, model, pushed(PUSHED_STEP), clone=True, parallel=1)  # one change at a time
    result.shared = incremental_saves(
        Store(store.strategy, clock=clock, incremental=True), model, simulated
    )
    simulated.on_change = None
    result.clones = sum(call.name == "clone" for call in injector.calls)
    return result


def shared_shards(simulated: SimulatedFileSystem, step: int) -> int:
    """How many of ``step``'s shard files have names beyond its own and the blob area's
    index entry: bytes it shares with another checkpoint."""
    data = f"{names.checkpoint_token(step)}/{DATA_DIR}"
    found = 0
    for folder in ("base", "lora"):
        for name in simulated.listdir(f"{data}/{folder}"):
            found += simulated.links(f"{data}/{folder}/{name}").count > 2
    return found


SHARED_STEPS = (PUSHED_STEP + 1, PUSHED_STEP + 2)
"""The steps of the incremental saves after the push (``incremental_saves``)."""


def incremental_saves(store: Store, model: Model, simulated: SimulatedFileSystem) -> int:
    """Two incremental saves whose frozen shard the second shares with the first (a hard
    link into its staging directory, durable with the directory's fsync, docs/protocol.md
    §12.2); then the first is deleted and a GC without grace sweeps the blob area: the second
    must keep its shared shard through every power loss (I10, checked as I1 and I2).
    Returns how many shards the second save shared."""
    frozen = pattern(2500, 4242)
    first, second = SHARED_STEPS
    for step in SHARED_STEPS:
        shards = {"base/frozen.bin": frozen, "lora/adapter.bin": pattern(300, step)}
        save(store, model, Saved(step, shards, {"step": step, "incremental": True}))
    shared = shared_shards(simulated, second)
    model.removal_started({first}, explicit=True)
    store.delete(first)
    model.gc_started()
    store.gc(grace=0)
    return shared


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
        f"{result.states} file-system states checked at {result.points} instants "
        f"({result.clones} shards cloned by a push, {result.shared} shared by an incremental "
        f"save)"
    )
    if result.states == 0:
        found.vacuous = "no file-system state was checked"
