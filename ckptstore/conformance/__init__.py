"""The conformance suite: proves the protocol's invariants I1 to I9 on a storage system.

Three ways to run it (see README, "Conformance"):

- ``ckptstore conformance [URL ...]``: the command line, with a report for a storage engineer;
- ``pytest --pyargs ckptstore.conformance --ckpt-url URL``: as a pytest plugin;
- ``class TestMine(ckptstore.conformance.mixins.ConformanceTests)``: as test classes a
  backend subclasses, overriding the ``ckpt_url`` fixture.

The layers, one module each under ``layers/``: capability probes (``probes``), exhaustive
crash points of the standard workload (``crash_points``, ``workload``, ``cases``), crash
points of a takeover (``takeover``), unknown outcomes of conditional writes
(``unknown_outcomes``), power loss on a simulated file system (``power_loss``, over
``models.simfs``), the real driver's system calls (``syscall_trace``, over ``tracing``),
writers racing in threads and processes (``races``), property-based crash injection
(``property_based``, over the state machine in ``machine``), and a tiered pair's replication
(``tiers``). ``layers.registry`` lists them once: the command line runs them through
``runner``, pytest through ``mixins``. The model and the invariant checks they share are in
``model``, fault injection in ``faults``, and how a failure of the storage itself is told
apart from a violation (a third outcome, "storage error") in ``outcomes``.
"""

from ckptstore.conformance.faults import CrashMode, FaultInjector, FaultPlan, SimulatedCrash
from ckptstore.conformance.location import Location, LocationFactory
from ckptstore.conformance.model import INVARIANTS, InvariantViolation, Model, check_invariants
from ckptstore.conformance.report import BackendReport

__all__ = [
    "INVARIANTS",
    "BackendReport",
    "CrashMode",
    "FaultInjector",
    "FaultPlan",
    "InvariantViolation",
    "Location",
    "LocationFactory",
    "Model",
    "SimulatedCrash",
    "check_invariants",
]
