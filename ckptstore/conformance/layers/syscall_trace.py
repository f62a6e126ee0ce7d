"""The real driver's system calls: the standard workload traced on the real file system.

The power-loss layer runs the strategy on a simulated file system, so it cannot see what the
driver itself asks of the kernel: an ``fsync`` that does nothing, or syncs the wrong
descriptor, or a no-replace rename done with plain ``rename(2)``, all pass it. This layer runs
the standard workload through the backend's own driver, on its real directory, in a child
process under strace (``tracing.strace``, ``tracing.child``), maps each recorded system call back to
the driver call that made it, and judges the trace (``tracing.replay``): every durability call
must reach the kernel on the right file or directory, and every power-loss state of the
*recorded* system calls must satisfy the invariants.

In the ``thorough`` profile the layers that touch the real file system (probes, crash points,
this one) run again on ext4, xfs and btrfs images on loop devices (``tracing.images``), where the
machine allows it.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import tempfile
from dataclasses import dataclass, replace

from ckptstore.conformance.layers.crash_points import run_crash_points
from ckptstore.conformance.layers.layer import Findings, SuiteRun
from ckptstore.conformance.layers.probes import HELD, NOT_MEASURED, STORAGE_ERROR, run_probes
from ckptstore.conformance.location import Location, LocationFactory, original_class
from ckptstore.conformance.tracing.child import TraceOutcome
from ckptstore.conformance.tracing.images import (
    IMAGE_TYPES,
    ImageUnavailable,
    image_url,
    mounted_image,
)
from ckptstore.conformance.tracing.replay import ReplayResult, replay_trace
from ckptstore.conformance.tracing.strace import TracerUnavailable, parse_trace, trace_command

__all__ = ["INVARIANTS", "SyscallTraceResult", "run_layer", "run_syscall_trace"]

TRACE_TIMEOUT_S = 300.0
INVARIANTS = ("I1", "I2", "I3", "I4", "I5")
CRASH_INVARIANTS = ("I1", "I2", "I3", "I4", "I7")


@dataclass
class SyscallTraceResult(ReplayResult):
    """The replay's result, plus the workload's own failure in the traced process, if any."""

    workload_error: str | None = None
    storage_failed: bool = False

    def summary(self) -> str:
        """The coverage line."""
        line = (
            f"{self.syscalls:,} system calls recorded ({self.store_syscalls:,} on the store), "
            f"{self.matched} of {self.durability_calls} durability calls matched, "
            f"{self.states:,} power-loss states from the trace checked at {self.cuts} instants"
        )
        return "; ".join([line, *self.notes])


def run_syscall_trace(location: Location, *, depth: int = 1) -> SyscallTraceResult:
    """Trace the standard workload through ``location``'s real driver and judge the trace.

    Raises TracerUnavailable (with the reason) where it cannot be traced: no strace, no
    ptrace, a driver without a local root directory or that cannot be handed to a child.
    """
    strategy = location.base
    root = getattr(strategy.driver, "root", None)
    if not isinstance(root, str) or not os.path.isdir(root):
        raise TracerUnavailable("the driver has no local root directory to trace")
    try:
        recipe = pickle.dumps(
            (original_class(type(strategy)), strategy.settings(), strategy.driver)
        )
    except (pickle.PicklingError, TypeError, AttributeError) as exc:
        raise TracerUnavailable(f"the driver cannot be handed to a traced process: {exc}") from exc
    with tempfile.TemporaryDirectory(prefix="ckptstore-trace-") as scratch:
        recipe_path = os.path.join(scratch, "recipe.pickle")
        outcome_path = os.path.join(scratch, "outcome.pickle")
        trace_path = os.path.join(scratch, "trace")
        with open(recipe_path, "wb") as stream:
            stream.write(recipe)
        env = dict(os.environ)  # the child finds what this process imported, test modules too
        env["PYTHONPATH"] = os.pathsep.join(os.path.abspath(p) for p in sys.path if p)
        argv = [sys.executable, "-m", "ckptstore.conformance.tracing.child", recipe_path]
        try:
            completed = trace_command(
                [*argv, outcome_path], trace_path, cwd=scratch, env=env, timeout_s=TRACE_TIMEOUT_S
            )
        except subprocess.TimeoutExpired as exc:
            raise TracerUnavailable(f"the traced workload took over {exc.timeout:.0f}s") from exc
        if not os.path.exists(outcome_path):
            tail = (completed.stderr.strip().splitlines() or ["no output"])[-1]
            raise TracerUnavailable(f"the traced workload did not finish: {tail}")
        with open(outcome_path, "rb") as stream:
            outcome: TraceOutcome = pickle.load(stream)  # written by our own child
        with open(trace_path, encoding="latin-1") as stream:
            syscalls = parse_trace(stream.read())
    replayed = replay_trace(syscalls, outcome, strategy, root=root, cwd=scratch, depth=depth)
    result = SyscallTraceResult(**vars(replayed))
    result.workload_error = outcome.error
    result.storage_failed = outcome.storage_failed
    if result.store_syscalls == 0:
        raise TracerUnavailable("the driver made no system call under its root directory")
    return result


def run_layer(run: SuiteRun, found: Findings) -> None:
    """The layer on ``run``'s target; in ``thorough``, the file-system layers on images too."""
    run.say("system calls of the real driver (strace)")
    depth = 1 if run.profile == "ci" else 2
    found.coverage["syscall trace"] = _trace_into(found, run.locations, depth, "")
    if run.profile != "thorough":
        return
    for fs_type in IMAGE_TYPES:
        run.say(f"file-system layers on {fs_type} (an image on a loop device)")
        try:
            with mounted_image(fs_type) as mount_point:
                factory = run.locations
                images = LocationFactory(image_url(factory.base_url, mount_point), factory.options)
                line = _image_layers(found, images, depth, fs_type)
        except ImageUnavailable as exc:
            line = f"skipped: {exc}"
        found.coverage[f"{fs_type} image"] = line


def _trace_into(found: Findings, factory: LocationFactory, depth: int, where: str) -> str:
    """Trace a fresh location into ``found``; the coverage line (or why it was skipped)."""
    location = factory()
    try:
        result = run_syscall_trace(location, depth=depth)
    except TracerUnavailable as exc:
        found.skipped = found.skipped or f"syscall trace: {exc}"
        return f"skipped: {exc}"
    except Exception as exc:  # the suite's own failure must not end the other layers' report
        found.vacuous = f"the trace could not be judged (a bug in the suite): {exc!r}"
        return f"skipped: {found.vacuous}"
    finally:
        location.destroy()
    found.check(*INVARIANTS)
    for failure in result.failures:
        found.violated(failure.invariant, f"{where}{failure.case}: {failure.message}")
    if result.workload_error is not None:
        message = f"{where}syscall trace: the traced workload failed: {result.workload_error}"
        if result.storage_failed:
            found.storage_error(INVARIANTS, message)
        else:
            found.violated("I1", message)
    if result.durability_calls == 0:
        found.vacuous = f"{where}no durability call of the driver was judged"
    return result.summary()


def _image_layers(found: Findings, factory: LocationFactory, depth: int, fs_type: str) -> str:
    """Probes, crash points and the syscall trace on a mounted image; its coverage line."""
    where = f"on {fs_type}: "
    location = factory()
    try:
        probes = run_probes(location)
    finally:
        location.destroy()
    missing = [
        p for p in probes if p.declared and p.measured not in (HELD, NOT_MEASURED, STORAGE_ERROR)
    ]
    for probe in missing:  # shown in the capability table, and counted as a mismatch
        found.capabilities.append(replace(probe, capability=f"{probe.capability} ({fs_type})"))
    crashes = run_crash_points(factory)
    found.check(*CRASH_INVARIANTS)
    found.cases(CRASH_INVARIANTS, crashes, where)
    traced = _trace_into(found, factory, depth, where)
    held = "declared capabilities held" if not missing else f"{len(missing)} capabilities MISSING"
    return f"probes: {held}; crash points: {crashes.cases - 1} crashes; syscall trace: {traced}"
