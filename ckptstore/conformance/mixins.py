"""Test classes a storage backend subclasses to run the whole conformance suite under pytest.

As with fsspec's abstract test suite, a backend enables everything in a few lines::

    from ckptstore.conformance.mixins import ConformanceTests

    class TestMyStorage(ConformanceTests):
        @pytest.fixture
        def ckpt_url(self, tmp_path):
            return "mystore://test-bucket/ckptstore-conformance"

``ckpt_url`` (required) is a location the suite may write and delete under; it creates its
own sub-locations there. ``ckpt_options`` (backend options) and ``ckpt_profile`` (``ci`` or
``thorough``) may be overridden too. Each layer is also a class of its own, to pick from.

A case the storage fails (a 5xx after the driver's retries) is run again; if the storage keeps
failing it, the test fails with "storage error", never as an invariant violation.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from ckptstore.conformance.layers.cases import CaseFailure, CrashPointResult
from ckptstore.conformance.layers.crash_points import run_crash_points
from ckptstore.conformance.layers.power_loss import run_power_loss
from ckptstore.conformance.layers.probes import HELD, NOT_MEASURED, run_probes
from ckptstore.conformance.layers.races import RACE_PROFILES, run_races
from ckptstore.conformance.layers.syscall_trace import run_syscall_trace
from ckptstore.conformance.layers.takeover import run_takeover_crash_points
from ckptstore.conformance.layers.unknown_outcomes import run_indeterminate_outcomes
from ckptstore.conformance.layers.workload import big_shard_size
from ckptstore.conformance.location import LocationFactory
from ckptstore.conformance.machine import PROFILES, make_state_machine, run_state_machine
from ckptstore.conformance.outcomes import STORAGE_ERROR, StorageFailure
from ckptstore.conformance.tracing.strace import TracerUnavailable
from ckptstore.driver import DriverFamily, driver_family

__all__ = [
    "CapabilityProbeTests",
    "ConformanceFixtures",
    "ConformanceTests",
    "CrashPointTests",
    "ParallelRaceTests",
    "PowerLossTests",
    "StateMachineTests",
    "UnknownOutcomeTests",
]


def _fail_on(failures: Sequence[CaseFailure]) -> None:
    if failures:
        lines = [f"{f.invariant}: {f.case}: {f.message}" for f in failures[:10]]
        more = f"\n... and {len(failures) - 10} more" if len(failures) > 10 else ""
        pytest.fail("\n".join(lines) + more, pytrace=False)


def _fail_on_result(result: CrashPointResult) -> None:
    """Violations first; then cases the storage kept failing, said to be no violation."""
    _fail_on(result.failures)
    if result.storage_errors:
        heading = f"{STORAGE_ERROR} (the storage kept failing; not an invariant violation)"
        _fail_on([CaseFailure(f.case, heading, f.message) for f in result.storage_errors])


def _is_file_system(locations: LocationFactory) -> bool:
    location = locations()
    try:
        return driver_family(location.base.driver) is DriverFamily.FILE_SYSTEM
    finally:
        location.destroy()


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

    def test_declared_capabilities_are_present(self, ckpt_locations: LocationFactory) -> None:
        location = ckpt_locations()
        try:
            results = run_probes(location)
        finally:
            location.destroy()
        undecided = [r for r in results if r.measured == STORAGE_ERROR]
        missing = [
            r
            for r in results
            if r.declared and r.measured not in (HELD, NOT_MEASURED, STORAGE_ERROR)
        ]
        assert not missing, "declared but not found: " + "; ".join(
            f"{r.capability}: {r.detail}" for r in missing
        )
        assert not undecided, f"{STORAGE_ERROR} (not a missing capability): " + "; ".join(
            f"{r.capability}: {r.detail}" for r in undecided
        )


class CrashPointTests(ConformanceFixtures):
    """A crash before and after every storage call of the standard workload is recovered."""

    def test_every_crash_point_recovers(self, ckpt_locations: LocationFactory) -> None:
        result = run_crash_points(ckpt_locations)
        _fail_on_result(result)
        assert result.calls > 0

    def test_every_takeover_crash_point_recovers(self, ckpt_locations: LocationFactory) -> None:
        """A takeover crashed at each of its storage calls, the old writer alive: the epoch
        exists whole or not at all, GC takes the staging, one history (I9)."""
        result = run_takeover_crash_points(ckpt_locations)
        if result.not_applicable:
            pytest.skip(result.not_applicable)
        _fail_on_result(result)
        assert result.calls > 0
        assert "I9" in result.invariants_checked


class UnknownOutcomeTests(ConformanceFixtures):
    """A 503 before, or a timeout after, a commit point is retried or read back (I8)."""

    def test_unknown_outcomes_are_read_back(
        self, ckpt_locations: LocationFactory, ckpt_profile: str
    ) -> None:
        if _is_file_system(ckpt_locations):
            pytest.skip("file-system calls have no unknown outcomes")
        result = run_indeterminate_outcomes(ckpt_locations, before_every_call=ckpt_profile != "ci")
        _fail_on_result(result)
        assert "I8" in result.invariants_checked, "no conditional write was exercised"


class PowerLossTests(ConformanceFixtures):
    """Every state a power loss may leave satisfies the invariants (file systems)."""

    def test_every_power_loss_state(
        self, ckpt_locations: LocationFactory, ckpt_profile: str
    ) -> None:
        location = ckpt_locations()
        try:
            if driver_family(location.base.driver) is not DriverFamily.FILE_SYSTEM:
                pytest.skip("power loss is simulated for file systems only")
            result = run_power_loss(location.base, depth=1 if ckpt_profile == "ci" else 2)
        finally:
            location.destroy()
        assert result.states > 0
        _fail_on(result.failures)

    def test_real_driver_system_calls(
        self, ckpt_locations: LocationFactory, ckpt_profile: str
    ) -> None:
        """The driver's own system calls, traced: durability calls on the right objects, and
        every power-loss state of the recorded trace (``layers.syscall_trace``)."""
        location = ckpt_locations()
        try:
            if driver_family(location.base.driver) is not DriverFamily.FILE_SYSTEM:
                pytest.skip("system calls are traced for file systems only")
            try:
                result = run_syscall_trace(location, depth=1 if ckpt_profile == "ci" else 2)
            except TracerUnavailable as exc:
                pytest.skip(f"syscall trace: {exc}")
        finally:
            location.destroy()
        _fail_on(result.failures)
        assert result.workload_error is None, result.workload_error
        assert result.durability_calls > 0


class StateMachineTests(ConformanceFixtures):
    """Property-based crash injection: random saves, crashes, GC, corruption, races, and
    takeovers with the old writer still saving (I9)."""

    def test_state_machine(self, ckpt_locations: LocationFactory, ckpt_profile: str) -> None:
        location = ckpt_locations()
        try:
            multipart = big_shard_size(location)
        finally:
            location.destroy()
        machine = make_state_machine(ckpt_locations, multipart_size=multipart)
        try:
            run_state_machine(machine, PROFILES[ckpt_profile])
        except StorageFailure as failure:
            pytest.fail(str(failure), pytrace=False)


class ParallelRaceTests(ConformanceFixtures):
    """Writers released together at the publish and at the LATEST update: one winner per step
    with its own data (I5); LATEST names a published step, never going back (I1, I4)."""

    def test_parallel_races(self, ckpt_locations: LocationFactory, ckpt_profile: str) -> None:
        result = run_races(ckpt_locations, RACE_PROFILES[ckpt_profile])
        _fail_on([CaseFailure(f.case, f.invariant, f.message) for f in result.failures])
        if result.storage_errors:
            heading = f"{STORAGE_ERROR} (the storage kept failing; not an invariant violation)"
            _fail_on([CaseFailure(f.case, heading, f.message) for f in result.storage_errors])


class ConformanceTests(
    CapabilityProbeTests,
    CrashPointTests,
    UnknownOutcomeTests,
    PowerLossTests,
    ParallelRaceTests,
    StateMachineTests,
):
    """The whole conformance suite."""
