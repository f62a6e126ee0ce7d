"""The suite's one list of layers, in the order they run: the command line (``runner``) and
the pytest mix-ins (``mixins``) both read it. Adding a layer is adding one entry here (and its
module under ``layers/``); the pytest form gets a test for it where it names one.
"""

from __future__ import annotations

from ckptstore.conformance.layers import (
    crash_points,
    power_loss,
    probes,
    property_based,
    races,
    syscall_trace,
    takeover,
    tiers,
    trust,
    unknown_outcomes,
)
from ckptstore.conformance.layers.layer import Findings, Layer, PytestForm, TargetKind

__all__ = ["LAYERS", "layer_named", "layers_for"]

LAYERS: tuple[Layer, ...] = (
    Layer(
        "capability probes",
        (),
        probes.run_layer,
        "Every capability the driver declares is present on the real system.",
        announce="capability probes",
        pytest=PytestForm("CapabilityProbeTests", "test_declared_capabilities_are_present"),
    ),
    Layer(
        "crash points",
        crash_points.INVARIANTS,
        crash_points.run_layer,
        "A crash before and after every storage call of the standard workload is recovered.",
        announce="exhaustive crash points",
        pytest=PytestForm("CrashPointTests", "test_every_crash_point_recovers"),
    ),
    Layer(
        "takeover crash points",
        takeover.INVARIANTS,
        takeover.run_layer,
        "A takeover crashed at each of its storage calls, the old writer alive: the epoch "
        "exists whole or not at all, GC takes the staging, one history (I9).",
        announce="takeover crash points",
        pytest=PytestForm("CrashPointTests", "test_every_takeover_crash_point_recovers"),
    ),
    Layer(
        "unknown outcomes",
        unknown_outcomes.INVARIANTS,
        unknown_outcomes.run_layer,
        "A 503 before, or a timeout after, a commit point is retried or read back (I8).",
        applies_to=TargetKind.OBJECT_STORE,
        elsewhere=Findings(
            not_applicable={"I8": unknown_outcomes.NOT_ON_FILE_SYSTEMS},
            skipped=unknown_outcomes.NOT_ON_FILE_SYSTEMS,
        ),
        announce="unknown outcomes of conditional writes",
        pytest=PytestForm("UnknownOutcomeTests", "test_unknown_outcomes_are_read_back"),
    ),
    Layer(
        "trust",
        trust.INVARIANTS,
        trust.run_layer,
        "A reader that trusts a signing key refuses every forgery of a writer without it: "
        "shards replaced (CRC32Cs recomputed or not), manifests edited, stripped or replayed, "
        "takeovers unsigned or signed by another key (I6).",
        announce="signed checkpoints",
        pytest=PytestForm("TrustTests", "test_forgeries_are_refused"),
    ),
    Layer(
        "power loss",
        power_loss.INVARIANTS,
        power_loss.run_layer,
        "Every state a power loss may leave satisfies the invariants (file systems).",
        applies_to=TargetKind.FILE_SYSTEM,
        elsewhere=Findings(
            coverage={"power loss": "not applicable (object store)"},
            skipped="power loss is simulated for file systems only",
        ),
        announce="power loss",
        pytest=PytestForm("PowerLossTests", "test_every_power_loss_state"),
    ),
    Layer(
        "syscall trace",
        syscall_trace.INVARIANTS,
        syscall_trace.run_layer,
        "The driver's own system calls, traced: durability calls on the right objects, and "
        "every power-loss state of the recorded trace.",
        applies_to=TargetKind.FILE_SYSTEM,
        elsewhere=Findings(
            coverage={"syscall trace": "not applicable (object store)"},
            skipped="system calls are traced for file systems only",
        ),
        pytest=PytestForm("PowerLossTests", "test_real_driver_system_calls"),
    ),
    Layer(
        "parallel races",
        races.INVARIANTS,
        races.run_layer,
        "Writers released together at the publish and at the LATEST update: one winner per "
        "step with its own data (I5); LATEST names a published step, never going back (I1, "
        "I4); takers released together at the epoch record: one per epoch, one history (I9).",
        announce="parallel races",
        pytest=PytestForm("ParallelRaceTests", "test_parallel_races"),
    ),
    Layer(
        "property-based",
        property_based.INVARIANTS,
        property_based.run_layer,
        "Property-based crash injection: random saves, crashes, GC, corruption, races, and "
        "takeovers with the old writer still saving (I9).",
        budget=property_based.BUDGET,
        pytest=PytestForm("StateMachineTests", "test_state_machine"),
    ),
    Layer(
        "replication crash points",
        tiers.TIERED_INVARIANTS,
        tiers.run_crash_points_layer,
        "A tiered pair crashed at every storage call of its replication is recovered by a new "
        "replicator.",
        applies_to=TargetKind.TIERED_PAIR,
        announce="replication crash points",
    ),
    Layer(
        "partitioned fast tier",
        tiers.PARTITION_INVARIANTS,
        tiers.run_partitioned_layer,
        "A node cut off from the durable tier never makes its branch the pair's history (I9).",
        applies_to=TargetKind.TIERED_PAIR,
        announce="partitioned fast tier",
    ),
)


def layers_for(kind: TargetKind) -> tuple[Layer, ...]:
    """The layers that run on, or report about, a target of ``kind`` (in order): every store
    layer for a store of either family, the pair layers for a tiered pair."""
    family = TargetKind.STORE if kind & TargetKind.STORE else kind
    return tuple(layer for layer in LAYERS if layer.applies_to & family)


def layer_named(name: str) -> Layer:
    """The layer the report calls ``name``."""
    for layer in LAYERS:
        if layer.name == name:
            return layer
    raise KeyError(f"no layer is called {name!r}: {[layer.name for layer in LAYERS]}")
