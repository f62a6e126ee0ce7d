"""Test classes a storage backend subclasses to run the whole conformance suite under pytest.

As with fsspec's abstract test suite, a backend enables everything in a few lines::

    from ckptstore.conformance.mixins import ConformanceTests

    class TestMyStorage(ConformanceTests):
        @pytest.fixture
        def ckpt_url(self, tmp_path):
            return "mystore://test-bucket/ckptstore-conformance"

``ckpt_url`` (required) is a location the suite may write and delete under; it creates its
own sub-locations there. ``ckpt_options`` (backend options) and ``ckpt_profile`` (``ci`` or
``thorough``) may be overridden too. Each layer is also a test of its own, on a class of its
own to pick from: its tests are made from the suite's list of layers
(``layers.registry.LAYERS``, which the command line runs too), one test per layer.

A case the storage fails (a 5xx after the driver's retries) is run again; if the storage keeps
failing it, the test fails with "storage error", never as an invariant violation.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from ckptstore.conformance.layers.layer import Findings, Layer, SuiteRun, TargetKind
from ckptstore.conformance.layers.probes import HELD, NOT_MEASURED
from ckptstore.conformance.layers.registry import LAYERS
from ckptstore.conformance.location import LocationFactory
from ckptstore.conformance.outcomes import REFUSES, STORAGE_ERROR
from ckptstore.driver import DriverFamily, driver_family

__all__ = [
    "CapabilityProbeTests",
    "ConformanceFixtures",
    "ConformanceTests",
    "CrashPointTests",
    "ParallelRaceTests",
    "PowerLossTests",
    "StateMachineTests",
    "TrustTests",
    "UnknownOutcomeTests",
]

MAX_LINES = 10
"""Findings a failing test lists before it says how many more there are."""


class ConformanceFixtures:
    """The fixtures every layer uses; ``ckpt_url`` must be overridden."""

    @pytest.fixture
    def ckpt_url(self) -> str:
        """An empty location (URL) of the storage under test."""
        raise NotImplementedError("override the ckpt_url fixture with your storage's URL")

    @pytest.fixture
    def ckpt_options(self) -> dict[str, Any]:
        """Backend options passed to ckptstore.open."""
        return {}

    @pytest.fixture
    def ckpt_profile(self) -> str:
        """``ci`` (fast) or ``thorough``."""
        return "ci"

    @pytest.fixture
    def ckpt_locations(self, ckpt_url: str, ckpt_options: dict[str, Any]) -> LocationFactory:
        """Makes fresh sub-locations of ``ckpt_url``."""
        return LocationFactory(ckpt_url, ckpt_options)


class CapabilityProbeTests(ConformanceFixtures):
    """Every capability the driver declares is present on the real system."""


class CrashPointTests(ConformanceFixtures):
    """A crash before and after every storage call of the standard workload, and of a
    takeover, is recovered."""


class UnknownOutcomeTests(ConformanceFixtures):
    """A 503 before, or a timeout after, a commit point is retried or read back (I8)."""


class PowerLossTests(ConformanceFixtures):
    """Every state a power loss may leave satisfies the invariants, on the simulated file
    system and in the real driver's traced system calls (file systems)."""


class StateMachineTests(ConformanceFixtures):
    """Property-based crash injection: random saves, crashes, GC, corruption, races, and
    takeovers with the old writer still saving (I9)."""


class ParallelRaceTests(ConformanceFixtures):
    """Writers released together at the publish and at the LATEST update: one winner per step
    with its own data (I5); LATEST names a published step, never going back (I1, I4)."""


class TrustTests(ConformanceFixtures):
    """A reader that trusts a signing key refuses every forgery of a writer without it (I6)."""


class ConformanceTests(
    CapabilityProbeTests,
    CrashPointTests,
    UnknownOutcomeTests,
    TrustTests,
    PowerLossTests,
    ParallelRaceTests,
    StateMachineTests,
):
    """The whole conformance suite."""


def _kind(locations: LocationFactory) -> TargetKind:
    location = locations()
    try:
        family = driver_family(location.base.driver)
    finally:
        location.destroy()
    return TargetKind.FILE_SYSTEM if family is DriverFamily.FILE_SYSTEM else TargetKind.OBJECT_STORE


def _fail_on(lines: list[str]) -> None:
    if lines:
        more = len(lines) - MAX_LINES
        tail = f"\n... and {more} more" if more > 0 else ""
        pytest.fail("\n".join(lines[:MAX_LINES]) + tail, pytrace=False)


def judge(found: Findings) -> None:
    """Fail the running test on what a layer found (skip it where the layer did not run):
    capabilities declared but missing, violations, then what the storage kept failing (said
    to be no violation), then a run that proved nothing."""
    missing = [
        c
        for c in found.capabilities
        if (c.declared or c.required) and c.measured not in (HELD, NOT_MEASURED, STORAGE_ERROR)
    ]
    assert not missing, "declared or needed, but not found: " + "; ".join(
        f"{c.capability}: {c.detail}" for c in missing
    )
    unmeasured = [c for c in found.capabilities if c.measured == STORAGE_ERROR]
    assert not unmeasured, f"{STORAGE_ERROR} (not a missing capability): " + "; ".join(
        f"{c.capability}: {c.detail}" for c in unmeasured
    )
    _fail_on([f"{invariant}: {evidence}" for invariant, evidence in found.violations])
    heading = f"{STORAGE_ERROR} (the storage kept failing; not an invariant violation)"
    _fail_on([f"{heading}: {evidence}" for _, evidence in found.undecided])
    _fail_on([f"suite error: {part} not run: {why}" for part, why in found.not_run.items()])
    # The store refused the storage mid-case: ckptstore would refuse such saves in production.
    _fail_on(sorted({why for why in found.not_applicable.values() if REFUSES in why}))
    if found.skipped:
        pytest.skip(found.skipped)
    assert not found.vacuous, found.vacuous


def _test_of(layer: Layer) -> Callable[..., None]:
    """The pytest test that runs ``layer`` on the storage under test."""

    def test(self: ConformanceFixtures, ckpt_locations: LocationFactory, ckpt_profile: str) -> None:
        run = SuiteRun(ckpt_locations, ckpt_profile, _kind(ckpt_locations))
        judge(layer.findings(run))

    assert layer.pytest is not None
    test.__name__ = test.__qualname__ = layer.pytest.test
    test.__doc__ = layer.doc
    return test


_MIXINS = {mixin.__name__: mixin for mixin in ConformanceTests.__bases__}
for _layer in LAYERS:
    if _layer.pytest is not None:
        setattr(_MIXINS[_layer.pytest.mixin], _layer.pytest.test, _test_of(_layer))
