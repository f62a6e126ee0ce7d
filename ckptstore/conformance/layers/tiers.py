"""Crash points inside replication: a tiered pair, crashed at every storage call of both tiers.

The tiered workload runs on a fresh location of each store (the fast one and the durable
one), each driver wrapped in a fault injector, with the replicator run in the workload's
thread (no background thread: its calls are numbered like the trainer's). It saves two
checkpoints, replicates them, saves a third (the fast tier's retention then removes what is
durable and keeps what is owed), replicates it (the durable tier's retention removes the
oldest copy), reads the newest across tiers and collects garbage in both. It is run once to
count the calls of each driver; then, for every call of either, again with the process dying
before it, and after it took effect (as ``cases.crash_cases`` chooses them). The process
dies for both stores at once: a death at a durable call stops the fast driver too.

After each crash a restarted trainer (a new TieredStore, so a new replicator) is checked:
each tier against a model of its own (I1 to I4: the durable tier's model learns of a copy
when the replicator begins it, and holds it committed once the durable publish returned, with
exactly the shards and metadata the trainer saved); the newest checkpoint across tiers is what
``latest()`` answers (I4); the new replicator copies what was published in the fast tier and
not yet in the durable one (else I2: it would never be durable); every durable copy names its
source step; GC in both tiers leaves nothing a crash left (I7); and a save after recovery
reaches both tiers.

The partitioned case (``run_partitioned``) checks I9 across the pair: a node cut off from
the durable tier keeps saving to its fast tier while another node resumes from the durable
tier, takes the pair over and saves the same steps; when the job restarts on the first node,
neither its readers nor its replicator may take the branch the durable lineage does not hold.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

from ckptstore.conformance.faults import (
    CallRecord,
    CrashMode,
    FaultInjector,
    FaultPlan,
    SimulatedCrash,
)
from ckptstore.conformance.layers.cases import (
    LONG_AGE,
    Case,
    CrashPointResult,
    collectable_leftovers,
    crash_cases,
    retried,
    run_case,
    run_in_fresh,
    undecided,
)
from ckptstore.conformance.layers.crash_points import CRASH_WORKERS
from ckptstore.conformance.layers.layer import Findings, SuiteRun
from ckptstore.conformance.layers.workload import (
    AGE_PAST_GRACE,
    GRACE,
    big_shard_size,
    pattern,
    save,
)
from ckptstore.conformance.location import Location, LocationFactory
from ckptstore.conformance.model import InvariantViolation, Model, Saved, check_invariants
from ckptstore.conformance.tiered_model import tell_model
from ckptstore.errors import CkptStoreError
from ckptstore.retention import KeepLast
from ckptstore.tiers.replication import ReplicateAll, ReplicationPolicy, Replicator
from ckptstore.tiers.tiered import TieredStore

__all__ = [
    "PARTITION_INVARIANTS",
    "TIERED_INVARIANTS",
    "TieredPair",
    "TieredPairFactory",
    "run_crash_points_layer",
    "run_partitioned",
    "run_partitioned_layer",
    "run_tiered_crash_points",
]

TIERED_INVARIANTS = ("I1", "I2", "I3", "I4", "I7")
PARTITION_INVARIANTS = ("I9",)
TIERS = ("fast", "durable")


class TieredPair:
    """A fresh location in each of two stores, and a model of each."""

    def __init__(
        self,
        fast: Location,
        durable: Location,
        policy: Callable[[], ReplicationPolicy] = ReplicateAll,
        replicator: type[Replicator] = Replicator,
    ) -> None:
        self.fast = fast
        self.durable = durable
        self.policy = policy
        self.replicator = replicator
        self.models = {"fast": Model(), "durable": Model()}

    def observe(self) -> object:
        """What a crash before the next call would leave besides storage (see ``FaultPlan``)."""
        return (
            self.models["fast"].events,
            self.models["durable"].events,
            self.fast.clock.offset,
            self.durable.clock.offset,
        )

    def open(self, plans: dict[str, FaultPlan] | None = None) -> TieredStore:
        """A TieredStore over the pair (the trainer's and the replicator's Stores are the same,
        one thread), each driver in a fault injector; a death at either is a death for both.
        The durable tier's model is told of each copy the replicator makes."""
        plans = plans or {}
        fast, fast_faults = self.fast.open(plans.get("fast"), retention=KeepLast(1))
        # A durable store that shares under leases saves incrementally: the replicator shares
        # there what it holds already (docs/protocol.md §12.4), crashed at every call too.
        sharing = self.durable.base.sharing_digest is not None
        durable, durable_faults = self.durable.open(
            plans.get("durable"), retention=KeepLast(2), incremental=sharing
        )
        fast_faults.on_death = durable_faults.kill
        durable_faults.on_death = fast_faults.kill
        replicator = self.replicator(fast, durable, self.policy())
        tell_model(replicator, self.models["durable"])
        return TieredStore(fast, durable, replicator, background=False)

    def injectors(self, store: TieredStore) -> dict[str, FaultInjector]:
        """The fault injectors under ``store``'s two tiers."""
        found = {}
        for tier, tier_store in (("fast", store.fast), ("durable", store.durable)):
            injector = tier_store.strategy.driver
            assert isinstance(injector, FaultInjector)  # Location.open puts one under each
            found[tier] = injector
        return found

    def destroy(self) -> None:
        """Remove both locations (best effort)."""
        self.fast.destroy()
        self.durable.destroy()


@dataclass
class TieredPairFactory:
    """Fresh pairs: a location under each of two URLs."""

    fast: LocationFactory
    durable: LocationFactory
    policy: Callable[[], ReplicationPolicy] = ReplicateAll
    """Makes each replicator's policy (the suite's own tests put a broken one here)."""
    replicator: type[Replicator] = Replicator
    """The replicator (the suite's own tests put a broken one here)."""

    def __call__(self) -> TieredPair:
        return TieredPair(self.fast(), self.durable(), self.policy, self.replicator)


def _shards(step: int, big: int) -> dict[str, bytes]:
    shards = {
        "model/frozen.bin": pattern(3000, 0),  # the same at every step: shared where it can be
        "model/rank00000.bin": pattern(3000, step),
        "trainer.json": b'{"step": %d}' % step,
    }
    if big:
        shards["optimizer/big.bin"] = pattern(big, step + 2)
    return shards


def tiered_workload(
    pair: TieredPair,
    plans: dict[str, FaultPlan],
    *,
    on_first_pass: Callable[[], object] = lambda: None,
) -> TieredStore:
    """Two saves, replicated; a third (fast retention), replicated (durable retention); the
    newest read across tiers; GC of both tiers, past the grace period."""
    store = pair.open(plans)
    fast_model, durable_model = pair.models["fast"], pair.models["durable"]
    big = big_shard_size(pair.durable)
    for step in (1, 2):
        save(store.fast, fast_model, Saved(step, _shards(step, big), {"step": step}))
    on_first_pass()
    store.replicator.run_pass()
    fast_model.removal_started({1, 2}, explicit=False)  # replicated: no longer owed
    save(store.fast, fast_model, Saved(3, _shards(3, big), {"step": 3}))
    durable_model.removal_started({1}, explicit=False)  # KeepLast(2) after step 3's copy
    store.replicator.run_pass()
    latest = store.latest()
    if latest is not None:
        for name in latest.names:
            latest.read(name)
    for location, model in ((pair.fast, fast_model), (pair.durable, durable_model)):
        location.clock.advance(AGE_PAST_GRACE)
        model.gc_started()
    store.gc(grace=GRACE)
    return store


def recover_and_check(pair: TieredPair) -> None:
    """A restarted trainer and replicator: check both tiers, replicate what is owed, check
    across tiers, GC, audit, save once more."""
    store = pair.open()
    fast_model, durable_model = pair.models["fast"], pair.models["durable"]
    check_invariants(store.fast, fast_model)
    check_invariants(store.durable, durable_model)
    _check_across(store)
    durable_model.removal_started(set(store.durable.steps()), explicit=False)  # KeepLast(2)
    store.replicator.run_pass()  # the new replicator: what the dead one left owed
    check_invariants(store.durable, durable_model)
    fast_steps, durable_steps = store.fast.steps(), store.durable.steps()
    if fast_steps and (not durable_steps or durable_steps[-1] < fast_steps[-1]):
        raise InvariantViolation(
            "I2",
            f"a restarted replicator left step {fast_steps[-1]} in the fast tier only (the "
            f"durable tier's newest is {durable_steps[-1] if durable_steps else None}): what "
            f"was published in the fast tier must become durable",
        )
    _check_sources(store)
    fast_model.removal_started(set(store.fast.steps()), explicit=False)  # KeepLast(1) below
    durable_model.removal_started(set(store.durable.steps()), explicit=False)  # KeepLast(2)
    for location, model in ((pair.fast, fast_model), (pair.durable, durable_model)):
        location.clock.advance(AGE_PAST_GRACE)
        model.gc_started()
    store.gc(grace=GRACE)
    check_invariants(store.fast, fast_model)
    check_invariants(store.durable, durable_model)
    _audit(pair, store)
    following = (max(store.steps(), default=0)) + 10
    save(store.fast, fast_model, Saved(following, {"after": pattern(100, following)}, {}))
    store.replicator.run_pass()
    latest = store.latest()
    if latest is None or latest.step != following or following not in store.durable.steps():
        raise InvariantViolation("I4", f"a save after recovery is not the latest: {latest}")


def _check_across(store: TieredStore) -> None:
    """``latest()`` is the newest of what either tier publishes, the fast copy where both do."""
    fast, durable = store.fast.steps(), store.durable.steps()
    newest = max([*fast, *durable], default=None)
    latest = store.latest()
    got = None if latest is None else latest.step
    if got != newest:
        raise InvariantViolation(
            "I4", f"latest() across tiers is {got}; the tiers publish {fast} and {durable}"
        )
    if latest is not None and newest in fast and latest.url != store.url:
        raise InvariantViolation("I4", f"step {newest} read from the durable tier, not the fast")


def _check_sources(store: TieredStore) -> None:
    """Every durable checkpoint is a copy that names the step it was published at first."""
    for checkpoint in store.durable.checkpoints():
        source = checkpoint.manifest.source
        if source is None or source.step != checkpoint.step:
            raise InvariantViolation(
                "I1", f"durable step {checkpoint.step} does not record its source: {source}"
            )


def _audit(pair: TieredPair, store: TieredStore) -> None:
    """After GC past the grace period, neither tier holds what a crash left (I7); a storage
    whose clock is ahead may need longer (``cases.LONG_AGE``)."""
    for tier, location, model in (
        ("fast", pair.fast, pair.models["fast"]),
        ("durable", pair.durable, pair.models["durable"]),
    ):
        if not location.leftovers():
            continue
        location.clock.advance(LONG_AGE)
        model.gc_started()
        (store.fast if tier == "fast" else store.durable).gc(grace=GRACE)
        leftovers = collectable_leftovers(location)
        if leftovers:
            raise InvariantViolation(
                "I7", f"GC of the {tier} tier never collected: {sorted(leftovers)[:5]}"
            )


PairMaker = Callable[[], TieredPair]


def run_partitioned(factory: TieredPairFactory) -> CrashPointResult:
    """I9 across the pair, with a partitioned node (``_partitioned``): one case, no crash."""
    result = CrashPointResult()
    name = "partitioned fast tier"
    try:
        pair = factory()
    except CkptStoreError as exc:
        return undecided(result, name, exc)
    try:
        other = factory.fast()
    except CkptStoreError as exc:
        pair.destroy()
        return undecided(result, name, exc)
    try:
        run_case(result, name, lambda: _partitioned(pair, other))
        result.invariants_checked.update(PARTITION_INVARIANTS)
    finally:
        pair.destroy()
        other.destroy()
    return result


def _open_node(pair: TieredPair, fast: Location) -> TieredStore:
    """A trainer's pair on a node whose fast tier is ``fast`` (no retention, no thread)."""
    fast_store, _ = fast.open()
    durable_store, _ = pair.durable.open()
    durable_store.join_epoch(durable_store.lineage().newest)  # as open_tiered: the epoch of now
    replicator = pair.replicator(fast_store, durable_store, pair.policy())
    return TieredStore(fast_store, durable_store, replicator, background=False)


def _partitioned(pair: TieredPair, other: Location) -> None:
    """Node A saves 1-3 (replicated), then, cut off from the durable tier, 4 and 5 to its
    fast tier; node B (fast tier ``other``) resumes from the durable 3, takes the pair over
    and saves its own 4, replicated. The job restarts on A: ``latest()``, ``steps()`` and
    ``get`` answer from the durable history (B's 4), and A's replicator copies nothing of its
    branch; after A takes the pair over from B's 4, its next save is the history's."""
    a = _open_node(pair, pair.fast)
    for step in (1, 2, 3):
        a.save(step, {"w": pattern(200, step)}, {"node": "A"})
    a.replicator.run_pass()
    for step in (4, 5):  # the durable tier is out of reach from node A
        a.save(step, {"w": pattern(200, step + 100)}, {"node": "A"})
    b = _open_node(pair, other)
    resumed = b.latest()
    if resumed is None or resumed.step != 3:
        raise InvariantViolation("I4", f"node B resumed from {resumed}, not the durable step 3")
    b.take_over(resumed_from=3, note="node B")
    b.save(4, {"w": pattern(200, 4 + 200)}, {"node": "B"})
    b.replicator.run_pass()
    b_attempt = b.fast.get(4).manifest.attempt
    restarted = _open_node(pair, pair.fast)  # the job restarts on node A
    _check_pair_history(restarted, {4: b_attempt}, "before its replicator ran")
    restarted.replicator.run_pass()
    _check_pair_history(restarted, {4: b_attempt}, "after its replicator ran")
    restarted.take_over(resumed_from=4, note="node A again")
    restarted.save(5, {"w": pattern(200, 5 + 300)}, {"node": "A"})
    restarted.replicator.run_pass()
    latest = restarted.latest()
    if latest is None or latest.step != 5 or latest.read("w") != pattern(200, 5 + 300):
        raise InvariantViolation("I4", f"a save after the takeover is not the latest: {latest}")


def _check_pair_history(store: TieredStore, branch: dict[int, str], when: str) -> None:
    """The restarted node's pair returns only the durable history: above step 3, exactly the
    steps of ``branch`` (B's: step -> its fast attempt), and the durable tier holds exactly
    those, as copies of B's attempts."""
    newest = max(branch)
    latest = store.latest()
    got = None if latest is None else (latest.step, latest.read("w"))
    durable_copies = {c.step: c.manifest.source for c in store.durable.checkpoints()}
    foreign = {
        step: source.attempt if source is not None else None
        for step, source in durable_copies.items()
        if step > 3 and (source is None or branch.get(step) != source.attempt)
    }
    if foreign:
        raise InvariantViolation(
            "I9",
            f"{when}: the durable history holds step(s) {sorted(foreign)} copied from the "
            f"partitioned node's fast tier, a branch the durable lineage does not hold "
            f"(another node took the pair over from step 3)",
        )
    if got is None or got[0] != newest or got[1] != pattern(200, newest + 200):
        raise InvariantViolation(
            "I9",
            f"{when}: latest() across the pair is step {None if got is None else got[0]} "
            f"of another branch; the durable history's newest is node B's step {newest}",
        )
    steps = [step for step in store.steps() if step > 3]
    if steps != sorted(branch):
        raise InvariantViolation(
            "I9",
            f"{when}: steps() across the pair lists {steps} above step 3; the durable history "
            f"holds {sorted(branch)}",
        )


def run_tiered_crash_points(
    new_pair: PairMaker, *, workers: int = 4, limit: int | None = None
) -> CrashPointResult:
    """Crash the tiered workload at every storage call of either tier, before and after it
    (``limit``: only the first cases, for a cheap test)."""
    result = CrashPointResult()
    baseline, found = _baseline(new_pair)
    result.add(baseline)
    if baseline.storage_errors or found is None:
        return result
    records, order, first_pass = found
    result.calls = sum(len(calls) for calls in records.values())
    result.call_names = [f"{tier} {r.name}" for tier in TIERS for r in records[tier]]
    result.records = [r for tier in TIERS for r in records[tier]]
    cases = _cases(records, order, first_pass)[:limit]
    with ThreadPoolExecutor(max(1, workers), thread_name_prefix="tiered-case") as pool:
        for outcome in pool.map(
            lambda case: retried(functools.partial(_crash_case, new_pair, *case)), cases
        ):
            result.add(outcome)
    return result


def _cases(
    records: dict[str, list[CallRecord]], order: list[tuple[str, int]], first_pass: int
) -> list[tuple[str, int, CrashMode]]:
    """The crashes that leave distinct states, as ``cases.crash_cases`` chooses them over
    both drivers' calls in the order they were made (one at a time: dying after a call leaves
    what dying before the next one, of either driver, does). The fast tier's calls before the
    first replication pass are the trainer's own saves, which the suite's run on the fast
    store alone crashes at; they are left out (``first_pass``: the fast call it began at)."""
    merged = [
        replace(records[tier][index], index=position)
        for position, (tier, index) in enumerate(order)
    ]
    return [
        (*order[position], mode)
        for position, mode in crash_cases(merged, overlapped=False)
        if order[position][0] == "durable" or order[position][1] >= first_pass
    ]


Baseline = tuple[dict[str, list[CallRecord]], list[tuple[str, int]], int]


def _baseline(new_pair: PairMaker) -> tuple[CrashPointResult, Baseline | None]:
    found: list[Baseline] = []

    def run(pair: TieredPair, case: Case) -> None:
        order: list[tuple[str, int]] = []
        counts = dict.fromkeys(TIERS, 0)
        first_pass: list[int] = []

        def observer(tier: str) -> Callable[[], object]:
            def observe() -> object:
                order.append((tier, counts[tier]))
                counts[tier] += 1
                return pair.observe()

            return observe

        plans = {tier: FaultPlan(observe=observer(tier)) for tier in TIERS}
        store = tiered_workload(
            pair, plans, on_first_pass=lambda: first_pass.append(counts["fast"])
        )
        records = {tier: list(i.calls) for tier, i in pair.injectors(store).items()}
        run_case(case.result, case.name, lambda: recover_and_check(pair))
        found.append((records, order, first_pass[0]))

    result = run_in_fresh(new_pair, "no crash", run)
    return result, (found[0] if found else None)


def _crash_case(new_pair: PairMaker, tier: str, index: int, mode: CrashMode) -> CrashPointResult:
    def run(pair: TieredPair, case: Case) -> None:
        plan = FaultPlan(crash_at=index, crash_mode=mode, observe=pair.observe)
        try:
            tiered_workload(pair, {tier: plan})
            case.name += " (not reached)"
        except SimulatedCrash as crash:
            case.died(crash, where=f"{tier} call")
        run_case(case.result, case.name, lambda: recover_and_check(pair))

    return run_in_fresh(new_pair, f"crash {mode.value} {tier} call {index}", run)


def run_crash_points_layer(run: SuiteRun, found: Findings) -> None:
    """The replication crash points on ``run``'s tiered pairs."""
    assert run.pairs is not None, "a tiered layer runs on a tiered pair"
    result = run_tiered_crash_points(run.pairs, workers=CRASH_WORKERS)
    found.check(*TIERED_INVARIANTS)
    found.cases(TIERED_INVARIANTS, result)
    found.coverage["replication crash points"] = result.coverage_line(
        " of both tiers",
        "a crash before each call of either driver that leaves a distinct state, and after "
        "the last (the fast tier's calls from the first replication pass on)",
        "recovered by a new replicator, GC'd and checked",
    )


def run_partitioned_layer(run: SuiteRun, found: Findings) -> None:
    """The partitioned fast tier on ``run``'s tiered pairs."""
    assert run.pairs is not None, "a tiered layer runs on a tiered pair"
    result = run_partitioned(run.pairs)
    found.check(*PARTITION_INVARIANTS)
    found.cases(PARTITION_INVARIANTS, result)
    found.coverage["partitioned fast tier"] = (
        "a node cut off from the durable tier saves on in its fast tier while another "
        "takes the pair over; the first node's restarted readers and replicator keep to "
        "the durable history"
    )
