"""Fault injection: crashes and transient faults at a storage call (``injector``), entries
the protocol did not make (``strays``), an operator's action before a call (``operators``).

``ckptstore.conformance.faults`` names the injector's public names, as before it was a folder.
"""

from ckptstore.conformance.faults.injector import (
    READ_CALLS,
    READ_ONLY_CALLS,
    CallRecord,
    CrashMode,
    FaultInjector,
    FaultPlan,
    InjectedFault,
    InjectedTimeoutError,
    InjectedTransientError,
    SimulatedCrash,
)

__all__ = [
    "READ_CALLS",
    "READ_ONLY_CALLS",
    "CallRecord",
    "CrashMode",
    "FaultInjector",
    "FaultPlan",
    "InjectedFault",
    "InjectedTimeoutError",
    "InjectedTransientError",
    "SimulatedCrash",
]
