"""The suite tests itself harder: broken variants modelled on real failures of real systems.

Each variant (``broken_variants.py``) runs through the one layer of the suite that must catch
it, in the ``ci`` profile's settings with a small, derandomised budget, and the test asserts
(1) the invariant it breaks, or the capability reported MISSING, and (2) what the report says:
the crash point in words, the power-loss state, the probe's sentence, or the sequence of steps
hypothesis prints for the failing example (the runner shrinks it; these tests do not, to stay
cheap). Variants that only a suite feature still on another branch can catch are
at the end, marked ``xfail(strict=True)`` with the branch that brings the feature.
"""

from __future__ import annotations

import importlib
import itertools
import os
import re
from collections.abc import Callable, Iterator
from typing import Any

import broken_variants as bv
import pytest
from hypothesis import Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from ckptstore import registry
from ckptstore.backends.memory import MemoryDriver, drop_bucket, get_bucket
from ckptstore.backends.posix import PosixDriver
from ckptstore.checkpoint import Checkpoint
from ckptstore.commit.conditional_put import ConditionalPutCommit
from ckptstore.commit.rename import RenameCommit
from ckptstore.commit.version_pin import VersionPinCommit
from ckptstore.conformance import runner
from ckptstore.conformance.faults import CrashMode, FaultInjector, FaultPlan
from ckptstore.conformance.layers.crash_points import INVARIANTS as CRASH_POINT_INVARIANTS
from ckptstore.conformance.layers.crash_points import _crash_case, run_crash_points
from ckptstore.conformance.layers.layer import Findings
from ckptstore.conformance.layers.power_loss import PUSHED_STEP, run_power_loss
from ckptstore.conformance.layers.probes import run_probes
from ckptstore.conformance.layers.property_based import INVARIANTS as MACHINE_INVARIANTS
from ckptstore.conformance.layers.property_based import machine_findings
from ckptstore.conformance.layers.syscall_trace import INVARIANTS as TRACE_INVARIANTS
from ckptstore.conformance.layers.syscall_trace import run_syscall_trace
from ckptstore.conformance.layers.unknown_outcomes import run_indeterminate_outcomes
from ckptstore.conformance.layers.workload import big_shard_size, standard_workload
from ckptstore.conformance.location import LocationFactory
from ckptstore.conformance.machine import PROFILES, make_state_machine
from ckptstore.conformance.machine.state_machine import INTERLEAVED
from ckptstore.conformance.model import InvariantViolation, Model
from ckptstore.conformance.report import BackendReport, render_text
from ckptstore.conformance.reproducible import same_examples
from ckptstore.conformance.tracing.strace import TracerUnavailable
from ckptstore.store import Store

PART = 1024
STAND_IN_CLONE = "cloned by a stand-in FICLONE"
DOCS = os.path.join(os.path.dirname(__file__), "..", "docs", "conformance.md")

# -- running one layer, and reading its report ----------------------------------------------


@pytest.fixture
def scheme() -> Iterator[Callable[[str, Any], str]]:
    """Register a broken backend under a scheme of its own for the duration of a test."""
    added: list[str] = []

    def add(name: str, factory: Any) -> str:
        registry.register(name, factory, replace=True)
        added.append(name)
        return name

    yield add
    for name in added:
        registry.unregister(name)


@pytest.fixture
def bucket() -> Iterator[str]:
    """A memory bucket of this test's own, dropped afterwards."""
    name = f"variant-{os.getpid()}-{next(_buckets)}"
    yield name
    drop_bucket(name)


_buckets = itertools.count()


def posix(strategy: type[RenameCommit], driver: type[PosixDriver] = PosixDriver) -> Any:
    """A scheme factory: ``strategy`` over ``driver`` at the URL's path."""
    return lambda url, options: strategy(driver(url.path))


def memory(
    driver: type[MemoryDriver],
    strategy: type[ConditionalPutCommit] = ConditionalPutCommit,
    **bucket_settings: Any,
) -> Any:
    """A scheme factory: ``strategy`` over ``driver`` on a memory bucket with 1 KiB parts."""

    def open_variant(url: Any, options: Any) -> ConditionalPutCommit:
        bucket = get_bucket(url.netloc, min_part_size=PART, **bucket_settings)
        return strategy(driver(bucket, url.path), part_size=PART)

    return open_variant


def report_of(url: str, failures: Any, checked: tuple[str, ...]) -> str:
    """The rendered report of one layer's findings, recorded as the runner records them."""
    report = BackendReport(url=url, strategy="broken variant")
    report.checked(*checked)
    for failure in failures:
        report.violated(failure.invariant, f"{failure.case}: {failure.message}")
    return render_text([report])


def verdicts(text: str) -> dict[str, str]:
    """Each invariant's status as the report prints it (from the 39th column)."""
    return {line.split()[0]: line[39:] for line in text.splitlines() if re.match(r"  I\d+ ", line)}


def evidence(text: str, invariant: str) -> str:
    """The evidence lines the report prints under ``invariant``."""
    match = re.search(rf"^  {invariant} .*VIOLATED\n((?:      .*\n)+)", text, re.MULTILINE)
    assert match is not None, f"{invariant} not VIOLATED in:\n{text}"
    return match.group(1)


def first_call(url: str, pattern: str, occurrence: int = 1) -> int:
    """The index of the standard workload's storage call that is the ``occurrence``-th to
    match ``pattern``."""
    location = LocationFactory(url)()
    try:
        store = standard_workload(location, FaultPlan(), Model(), big_shard_size(location))
        injector = store.strategy.driver
        assert isinstance(injector, FaultInjector)  # Location.open puts one under every store
        calls = injector.calls
    finally:
        location.destroy()
    matching = [call.index for call in calls if re.search(pattern, str(call))]
    return matching[occurrence - 1]


def crash_points(
    url: str, *, through: str | None = None, occurrence: int = 1, after: int = 1
) -> tuple[str, str]:
    """The crash-point layer's report, and every case it found violated (one per line; the
    report shows five per invariant). With ``through``, only crashes up to ``after`` calls
    past the call matching it (the part of the workload the variant breaks)."""
    limit = None if through is None else first_call(url, through, occurrence) + after
    result = run_crash_points(LocationFactory(url), limit=limit, workers=2)
    cases = "\n".join(f"{f.invariant} {f.case}: {f.message}" for f in result.failures)
    return report_of(url, result.failures, CRASH_POINT_INVARIANTS), cases


def crash_at(
    url: str, through: str, *, occurrence: int = 1, after: int = 0, mode: str = "before"
) -> tuple[str, str]:
    """One case of the crash-point layer: the process dies ``mode`` the call ``after`` calls
    past the one matching ``through`` (where the variant breaks), then recovery is checked;
    the report, and the case's findings as ``crash_points`` gives them."""
    index = first_call(url, through, occurrence) + after
    result = _crash_case(LocationFactory(url), index, CrashMode(mode))
    cases = "\n".join(f"{f.invariant} {f.case}: {f.message}" for f in result.failures)
    return report_of(url, result.failures, CRASH_POINT_INVARIANTS), cases


def power_loss(strategy: Any) -> str:
    """The power-loss layer's report on ``strategy``'s file-system protocol."""
    result = run_power_loss(strategy)
    return report_of(strategy.url, result.failures, ("I1", "I2", "I3", "I4"))


def machine(
    url: str,
    examples: int,
    *,
    multipart: int = 0,
    leave_out: tuple[str, ...] = (),
    keep: tuple[str, ...] = (),
) -> tuple[str, str]:
    """The property-based layer's violation: (its report, the steps hypothesis printed).

    Derandomised (the same examples every run, no luck involved in CI), in sequences of up to
    10 steps, and not shrunk: on a loaded CI machine shrinking costs more than finding (the
    runner shrinks). Generation stops at the first failure, so ``examples`` is a cap that
    costs nothing while the variant is found early: headroom for rules added later, which
    change the derandomised sequence of examples."""
    test = make_state_machine(LocationFactory(url), multipart_size=multipart)
    # Rules that would find another of the variant's failures first, and the tiered rule: its
    # takeover finds the epoch variants' failures as take_over does, and it has its own variant
    # (HistoryBlindReplicator, test_conformance_tiered); and the incremental rules, tested on
    # their own (test_conformance_incremental), which move the derandomised examples.
    # ``keep``: those of them a variant needs.
    incremental = (
        "save_incrementally",
        "gc_without_grace",
        "share_racing_gc",
        "share_a_truncated_blob",
    )
    left = ("fast_tier_partitioned", *incremental)
    leave_out = (*leave_out, *(name for name in left if name not in keep))
    test = type("CheckpointStoreMachine", (test,), dict.fromkeys(leave_out, _not_a_rule))
    profile = settings(
        PROFILES["ci"],
        max_examples=examples,
        stateful_step_count=10,
        derandomize=True,
        phases=[Phase.explicit, Phase.generate],
    )
    with same_examples(), pytest.raises(InvariantViolation) as caught:
        run_state_machine_as_test(test, settings=profile)
    violation = caught.value
    report = BackendReport(url=url, strategy="broken variant")
    report.checked(*MACHINE_INVARIANTS)
    report.violated(violation.invariant, violation.detail)
    return render_text([report]), "\n".join(getattr(violation, "__notes__", []))


def _not_a_rule(self: Any, **kwargs: Any) -> None:
    """Overrides a rule with a plain method: hypothesis no longer runs it."""


def probes(url: str) -> str:
    """The capability probes' report."""
    location = LocationFactory(url)()
    try:
        report = BackendReport(url=url, strategy="broken variant")
        report.capabilities = run_probes(location)
    finally:
        location.destroy()
    return render_text([report])


def syscall_trace(url: str) -> str:
    """The report of the syscall-trace layer (the real driver under strace) on ``url``."""
    location = LocationFactory(url)()
    try:
        result = run_syscall_trace(location)
    except TracerUnavailable as exc:
        pytest.skip(f"the real driver cannot be traced here: {exc}")
    finally:
        location.destroy()
    return report_of(url, result.failures, TRACE_INVARIANTS)


def missing(text: str, capability: str) -> str:
    """The detail the report gives for a declared capability the probe did not find."""
    match = re.search(
        rf"^  {capability} +yes +no +MISSING \(declared, not found\) / (.*)$", text, re.MULTILINE
    )
    assert match is not None, f"{capability} not MISSING in:\n{text}"
    return match.group(1)


def test_the_same_layers_find_nothing_on_the_real_backends(tmp_path: Any, bucket: str) -> None:
    """No false positives: the harness above, at the variants' own crash points and with the
    variants' budgets, on the real strategies and drivers."""
    url = f"file://{tmp_path}"
    points = ((r"rename_replace\(.LATEST", 1, 0), (r"create\(\.LATEST\.tmp", 2, 1))
    for through, occurrence, after in points:
        text, cases = crash_at(url, through, occurrence=occurrence, after=after)
        assert "VIOLATED" not in text and not cases
    assert "VIOLATED" not in crash_points(url, through=r"^#0 ", after=0)[0]
    assert "VIOLATED" not in power_loss(RenameCommit(PosixDriver(str(tmp_path / "power"))))
    assert "MISSING" not in probes(f"memory://{bucket}/run?min_part_size={PART}")


# -- file systems ---------------------------------------------------------------------------


def test_dcp_writing_in_place_is_caught_as_i5(tmp_path: Any, scheme: Any) -> None:
    scheme("dcp-in-place", posix(bv.DcpInPlaceCommit))
    text, steps = machine(f"dcp-in-place://{tmp_path}", 100)
    assert verdicts(text)["I5"] == "VIOLATED"
    assert "two attempts both published step" in evidence(text, "I5")
    assert "state.concurrent_writers(" in steps


def test_a_clone_committed_without_its_fsync_is_caught_by_power_loss_as_i1(
    tmp_path: Any, scheme: Any
) -> None:
    text = power_loss(bv.UnsyncedCloneCommit(PosixDriver(str(tmp_path / "power"))))
    assert verdicts(text)["I1"] == "VIOLATED"
    assert re.search(
        rf"power loss at change \d+: .*inode \d+ (lost|torn|zeroed): .*step {PUSHED_STEP}\b",
        evidence(text, "I1"),
    )
    # ... and only there: a process that dies leaves the page cache, which holds the clone
    scheme("unsynced-clone", posix(bv.UnsyncedCloneCommit))
    state = make_state_machine(LocationFactory(f"unsynced-clone://{tmp_path}/machine"))()
    try:
        state.take_over(data=None, fresh=True, zombie="idle")
        for crash in (None, ("rename_noreplace", CrashMode.AFTER)):
            state.push_a_directory(how="its epoch", cloning=STAND_IN_CLONE, crash=crash)
            state.invariants_hold()
    finally:
        state.teardown()


def test_dcp_unsynced_metadata_is_caught_by_power_loss_as_i2(tmp_path: Any) -> None:
    text = power_loss(bv.UnsyncedManifestCommit(PosixDriver(str(tmp_path))))
    assert verdicts(text)["I2"] == "VIOLATED"
    assert re.search(
        r"power loss at change \d+: .*inode \d+ (lost|torn|zeroed)", evidence(text, "I2")
    )


def test_copying_directory_rename_is_caught_as_i1(tmp_path: Any, scheme: Any) -> None:
    scheme("copy-rename", posix(bv.CopyingRenameCommit))
    url, manifest_copy = f"copy-rename://{tmp_path}", r"create\(step-0+1/manifest"
    # the manifest copied, the first shard not yet: a checkpoint visible, and incomplete
    text, _ = crash_at(url, manifest_copy, after=4)
    assert verdicts(text)["I1"] == "VIOLATED"
    assert re.search(
        r"crash before call \d+: crash at call #\d+ create\(step-0+1/data/[^)]+\)"
        r": published step 1 is incomplete: .* shard '[^']+' is missing",
        evidence(text, "I1"),
    ), text
    # the manifest half copied: a checkpoint that cannot be read
    text, _ = crash_at(url, manifest_copy, after=1)
    assert re.search(
        r"crash before call \d+: crash at call #\d+ write\(\d+, <\d+ bytes>\): "
        r"latest\(\) failed on an intact store: .*manifest is not valid JSON",
        evidence(text, "I1"),
    ), text


def test_orbax_shared_tmp_dir_is_caught_as_i7(tmp_path: Any, scheme: Any) -> None:
    scheme("orbax-tmp", posix(bv.OrbaxTmpDirCommit))
    staged = r"create\(step-0+1\.orbax-checkpoint-tmp/data/model/rank00000"
    text, _ = crash_at(f"orbax-tmp://{tmp_path}", staged)
    assert re.search(
        r"crash before call \d+: .*GC never collected dead attempts' data.*: "
        r"\['step-0+1\.orbax-checkpoint-tmp'",
        evidence(text, "I7"),
    ), text


def test_megatron_reader_trusting_its_tracker_is_caught_as_i4(
    tmp_path: Any, scheme: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(Store, "latest", bv.latest_from_tracker)
    scheme("trusts-tracker", posix(RenameCommit))
    text, _ = crash_at(f"trusts-tracker://{tmp_path}", r"rename_replace\(.LATEST")
    assert verdicts(text)["I4"] == "VIOLATED"
    # the crash between the publishing rename and the tracker's update
    assert re.search(
        r"crash before call \d+: .*latest\(\) returned None, newest published is 1",
        evidence(text, "I4"),
    )


def test_megatron_tracker_written_in_place_is_caught_as_i4(
    tmp_path: Any, scheme: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    scheme("tracker-in-place", posix(bv.InPlaceTrackerCommit))
    url, tracker = f"tracker-in-place://{tmp_path}", r"create\(LATEST"
    # the crash between truncating the tracker and writing it, at the second save:
    # ckptstore's own reader takes the tracker for a hint, and an empty one breaks nothing ...
    assert "VIOLATED" not in crash_at(url, tracker, occurrence=2, after=1)[0]
    # ... Megatron's loads what it names, and starts from scratch without one
    monkeypatch.setattr(Store, "latest", bv.latest_from_tracker)
    text, _ = crash_at(url, tracker, occurrence=2, after=1)
    assert re.search(
        r"crash before call \d+: crash at call #\d+ write\(\d+, <2 bytes>\): "
        r"latest\(\) returned None, newest published is 2",
        evidence(text, "I4"),
    ), text


def test_rmtree_retention_is_caught_as_i1(tmp_path: Any, scheme: Any) -> None:
    scheme("rmtree", posix(bv.RmtreeUnpublishCommit))
    text, _ = crash_at(f"rmtree://{tmp_path}", r"unlink\(step-0+1/data", after=1)
    assert verdicts(text)["I1"] == "VIOLATED"
    assert re.search(
        r"crash before call \d+: crash at call #\d+ \w+\(step-0+1/.*\): "
        r"published step 1 is incomplete: .* shard '.*' is missing",
        evidence(text, "I1"),
    ), text


def test_short_writes_are_caught_as_i1(tmp_path: Any, scheme: Any) -> None:
    scheme("short-write", posix(RenameCommit, bv.ShortWritePosixDriver))
    text, steps = machine(f"short-write://{tmp_path}", 100)
    assert verdicts(text)["I1"] == "VIOLATED"
    # A short write drops what one write(2) call did not take: the shard is short by it.
    assert re.search(r"has 40\d\d bytes, manifest says 4096", evidence(text, "I1"))
    writes = r"state\.(save|save_with_transient_fault|gc_during_a_live_streamed_shard)\("
    assert re.search(writes, steps), steps


def test_lying_fsync_is_caught_by_the_syscall_trace_as_i2(tmp_path: Any, scheme: Any) -> None:
    scheme("lying-fsync", posix(RenameCommit, bv.NoopFsyncPosixDriver))
    url = f"lying-fsync://{tmp_path}"
    # the other layers cannot see it: a crash keeps the page cache, power loss is simulated
    assert run_crash_points(LocationFactory(url), limit=0).failures == []
    assert run_power_loss(RenameCommit(bv.NoopFsyncPosixDriver(str(tmp_path)))).failures == []
    text = syscall_trace(url)
    assert re.search(
        r"syscall trace: driver call #\d+ fsync\(\d+\): fsync of step-0+1\.pending-\w+/\S+: "
        r"no fsync or fdatasync system call reached the kernel",
        evidence(text, "I2"),
    ), text


def test_fsync_of_the_wrong_descriptor_is_caught_by_the_syscall_trace_as_i2_and_i1(
    tmp_path: Any, scheme: Any
) -> None:
    scheme("wrong-fd", posix(RenameCommit, bv.WrongDescriptorFsyncPosixDriver))
    text = syscall_trace(f"wrong-fd://{tmp_path}")
    assert re.search(
        r"driver call #\d+ fsync\(\d+\): fsync of step-0+1\.pending-\w+/\S+: the kernel was "
        r"asked to sync fsync\(\(the store's root\) \(a directory\)\) instead",
        evidence(text, "I2"),
    ), text
    assert re.search(
        r"syscall trace: power loss before system call #\d+ .*: published step 1 is incomplete",
        evidence(text, "I1"),
    ), text


def test_retention_counting_unfinished_attempts_is_caught_as_i3(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(Store, "apply_retention", bv.retention_counting_unfinished)
    text, _ = crash_points(
        f"file://{tmp_path}", through=r"^#0 ", after=0
    )  # the run without a crash
    assert verdicts(text)["I3"] == "VIOLATED"
    assert "no crash: the newest committed step 2 disappeared" in evidence(text, "I3")


def test_resuming_by_name_order_is_caught_as_i4(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(Store, "latest", bv.latest_by_name)
    text, _ = crash_points(f"file://{tmp_path}", through=r"^#0 ", after=0)
    assert verdicts(text)["I4"] == "VIOLATED"
    assert "no crash: a save after recovery is not the latest" in evidence(text, "I4")


def test_a_push_joining_the_newest_epoch_by_itself_is_caught_as_i9(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 26 item 9 (push x takeovers): a push that names no epoch after a takeover must
    be refused; one that joins the newest epoch by itself publishes a zombie's directory."""
    monkeypatch.setattr(Store, "begin", bv.begin_in_the_newest_epoch)
    text, steps = machine(f"file://{tmp_path}", 300)
    assert "a push naming no epoch (epoch None) published step" in evidence(text, "I9")
    assert "state.take_over(" in steps
    assert re.search(r"^state\.push_a_directory\(.*how='no epoch'\)$", steps, re.MULTILINE)


def test_verify_by_size_is_caught_as_i6(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Checkpoint, "verify", bv.verify_sizes_only)
    text, steps = machine(f"file://{tmp_path}", 100)
    assert verdicts(text)["I6"] == "VIOLATED"
    assert re.search(r"verify passed step \d+ with a corrupted shard", evidence(text, "I6"))
    assert "state.corrupt_a_shard(" in steps and "how='bitflip'" in steps


# -- object stores --------------------------------------------------------------------------


def test_a_clone_ignoring_if_none_match_on_complete_is_reported_missing(
    bucket: str, scheme: Any
) -> None:
    scheme("no-complete-inm", memory(bv.IgnoresIfNoneMatchOnCompleteDriver))
    text = probes(f"no-complete-inm://{bucket}/run")
    assert "answered 200 to CompleteMultipartUpload If-None-Match: *" in missing(
        text, "conditional-multipart-complete"
    )
    assert re.search(r"conditional-create +yes +yes +ok", text)  # PutObject honours it


def test_a_clone_ignoring_if_match_is_reported_missing(bucket: str, scheme: Any) -> None:
    scheme("no-if-match", memory(bv.IgnoresIfMatchDriver))
    text = probes(f"no-if-match://{bucket}/run")
    assert "answered 200 to PutObject If-Match with a stale ETag and replaced" in missing(
        text, "compare-and-swap"
    )


def test_a_listing_lagging_writes_is_reported_missing(bucket: str, scheme: Any) -> None:
    scheme("lagging-list", memory(bv.LaggingListDriver))
    text = probes(f"lagging-list://{bucket}/run")
    assert "listed after put: False" in missing(text, "strong-list-after-write")


def test_a_listing_lagging_deletes_is_reported_missing(bucket: str, scheme: Any) -> None:
    scheme("stale-list", memory(bv.StaleDeleteListDriver))
    text = probes(f"stale-list://{bucket}/run")
    assert "gone after delete: False" in missing(text, "strong-list-after-write")


def test_a_listing_ending_early_no_longer_hides_the_newest_checkpoint(
    bucket: str, scheme: Any
) -> None:
    """Issue 24 ("a listing cut short"): readers cross-check a listing with the LATEST hint
    and list again past where it ended, so the newest committed step no longer disappears
    (this was caught as I3 while readers trusted the listing)."""
    scheme("first-page", memory(bv.FirstPageListDriver))
    text, _ = crash_points(f"first-page://{bucket}/run", through=r"^#0 ", after=0)
    assert verdicts(text)["I3"] == "held"


def test_a_blindly_written_commit_marker_is_caught_as_i5(bucket: str, scheme: Any) -> None:
    scheme("blind-marker", memory(MemoryDriver, bv.BlindMarkerCommit))
    # A takeover racing a zombie's publish overwrites its marker too (caught as I3): left out,
    # so that the search finds the two writers of one step it is named for.
    text, steps = machine(f"blind-marker://{bucket}/run", 100, leave_out=("take_over",))
    assert "two attempts both published step" in evidence(text, "I5")
    assert "state.concurrent_writers(" in steps


def test_a_stale_read_cache_is_caught_as_i6(bucket: str, scheme: Any) -> None:
    scheme("stale-cache", memory(bv.StaleReadCacheDriver))
    text, steps = machine(f"stale-cache://{bucket}/run", 100)
    assert re.search(r"was corrupted \((bitflip|truncate)\) but read fine", evidence(text, "I6"))
    assert "state.corrupt_a_shard(" in steps


def test_a_versioned_clone_ignoring_version_ids_is_reported_missing(
    bucket: str, scheme: Any
) -> None:
    scheme("no-version-id", memory(bv.IgnoresVersionIdDriver, VersionPinCommit, versioned=True))
    text = probes(f"no-version-id://{bucket}/run")
    assert "reading an old version by id returned other bytes" in missing(text, "versioning")


def test_visible_multipart_parts_are_reported_missing(bucket: str, scheme: Any) -> None:
    scheme("visible-parts", memory(bv.VisiblePartsDriver))
    text = probes(f"visible-parts://{bucket}/run")
    assert "an incomplete multipart upload was visible" in missing(text, "multipart")


def test_a_clone_answering_200_to_a_refused_create_is_reported_and_survived(
    bucket: str, scheme: Any
) -> None:
    """The probe reports the storage; a writer reads back what its create made (issue 24,
    "non-atomic If-None-Match"), so the loser is no longer told it won (this was caught as
    I5 while writers trusted the 200)."""
    scheme("silent-refusal", memory(bv.SilentRefusalDriver))
    url = f"silent-refusal://{bucket}/run"
    assert missing(probes(url), "conditional-create")
    test = make_state_machine(LocationFactory(url), multipart_size=0)
    profile = settings(
        PROFILES["ci"],
        max_examples=100,
        stateful_step_count=10,
        derandomize=True,
        phases=[Phase.explicit, Phase.generate],
    )
    run_state_machine_as_test(test, settings=profile)  # raises InvariantViolation if not


def test_a_retry_taking_its_own_publish_for_another_is_caught_as_i8(
    bucket: str, scheme: Any
) -> None:
    scheme("blind-retry", memory(MemoryDriver, bv.BlindRetryCommit))
    url = f"blind-retry://{bucket}/run"
    result = run_indeterminate_outcomes(LocationFactory(url))
    text = report_of(url, result.failures, ("I8",))
    assert re.search(
        r"timeout after call \d+ #\d+ put\(manifests/step-0+1\.json, .*\): "
        r"own publish taken for another's",
        evidence(text, "I8"),
    ), text


# -- incremental saves on object stores (docs/protocol.md §12.3) -----------------------------


def test_gc_deleting_a_blob_without_its_doom_cas_is_caught_as_i10(bucket: str, scheme: Any) -> None:
    scheme("no-doom", memory(MemoryDriver, bv.GcWithoutDoomCommit))
    text, steps = machine(f"no-doom://{bucket}/run", 100, keep=("share_racing_gc",))
    assert re.search(
        r"step \d+ is damaged: shard 'rank00/frozen.bin' is missing", evidence(text, "I10")
    ), text
    assert 'state.share_racing_gc(at="gc\'s first change")' in steps, steps


def test_a_writer_that_checks_a_blob_before_it_appends_itself_is_caught_as_i10(
    bucket: str, scheme: Any
) -> None:
    scheme("check-then-append", memory(MemoryDriver, bv.CheckThenAppendCommit))
    text, steps = machine(f"check-then-append://{bucket}/run", 100, keep=("share_racing_gc",))
    assert re.search(
        r"step \d+ is damaged: shard 'rank00/frozen.bin' is missing", evidence(text, "I10")
    ), text
    assert f'state.share_racing_gc(at="{INTERLEAVED}")' in steps, steps


def test_a_writer_that_trusts_a_digest_without_the_blob_size_is_caught_as_i10(
    bucket: str, scheme: Any
) -> None:
    scheme("size-blind", memory(MemoryDriver, bv.SizeBlindCommit))
    # Two writers racing for a step would have the damage blamed on their race (I5).
    text, steps = machine(
        f"size-blind://{bucket}/run", 100, keep=("share_a_truncated_blob",),
        leave_out=("concurrent_writers",),
    )  # fmt: skip
    assert re.search(r"step \d+ shard 'rank00/frozen.bin' unreadable", evidence(text, "I10"))
    assert "state.share_a_truncated_blob()" in steps, steps


def test_gc_judging_blob_users_by_a_listing_is_caught_as_i10(bucket: str, scheme: Any) -> None:
    scheme("listed-users", memory(bv.ShortPagesDriver, bv.ListedUsersGcCommit))
    text, steps = machine(f"listed-users://{bucket}/run", 100, keep=("share_racing_gc",))
    assert re.search(r"step \d+ .*'rank00/frozen.bin'.* missing", evidence(text, "I10")), text
    assert "state.share_racing_gc(" in steps, steps


# -- variants that need a suite feature from another branch ---------------------------------
# Each runs the layer that branch adds (its name as the branch has it now); the lead removes
# the mark once the branch is merged. Strict: a variant caught early fails the mark.


def needs(branch: str, feature: str) -> pytest.MarkDecorator:
    return pytest.mark.xfail(reason=f"needs {feature} from branch {branch}", strict=True)


def race_findings(url: str) -> set[str]:
    """The invariants the race layer finds broken on ``url``, threads only."""
    races = importlib.import_module("ckptstore.conformance.layers.races")
    result = races.run_races(LocationFactory(url), races.RACE_PROFILES["ci"], processes=False)
    return {failure.invariant for failure in result.failures}


def test_a_conditional_create_checked_apart_from_the_write_is_caught_as_i5(
    bucket: str, scheme: Any
) -> None:
    scheme("check-then-put", memory(bv.CheckThenPutDriver))
    url = f"check-then-put://{bucket}/run"
    # one writer at a time it holds; racing, two creates of one key succeed
    assert "racing conditional creates succeeded" in missing(probes(url), "conditional-create")
    assert "I5" in race_findings(url)


def test_orbax_shared_tmp_dir_wiped_by_a_second_writer_is_caught(
    tmp_path: Any, scheme: Any
) -> None:
    scheme("orbax-tmp", posix(bv.OrbaxTmpDirCommit))
    assert {"I5", "I7"} & race_findings(f"orbax-tmp://{tmp_path}")


def test_gc_removing_unfinished_looking_checkpoints_is_caught_as_i7(
    tmp_path: Any, scheme: Any
) -> None:
    scheme("unfinished-gc", posix(bv.UnfinishedRemovingGcCommit))
    text, steps = machine(f"unfinished-gc://{tmp_path}", 60)
    assert verdicts(text)["I7"] == "VIOLATED"
    assert "state.gc" in steps


def test_gc_aging_uploads_by_initiation_is_caught_as_i7(bucket: str, scheme: Any) -> None:
    scheme("initiation-gc", memory(MemoryDriver, bv.InitiationAgedGcCommit))
    text, steps = machine(f"initiation-gc://{bucket}/run", 20, multipart=2 * PART + 1)
    assert verdicts(text)["I7"] == "VIOLATED"
    assert "state.gc_during_a_long_multipart_upload()" in steps


def test_a_loser_cleaning_up_by_step_prefix_is_caught_as_i5(bucket: str, scheme: Any) -> None:
    scheme("prefix-abort", memory(MemoryDriver, bv.StepPrefixAbortCommit))
    text, steps = machine(f"prefix-abort://{bucket}/run", 150)
    assert verdicts(text)["I5"] == "VIOLATED"  # today: I1, a published step incomplete
    assert "state.concurrent_writers(" in steps


def test_the_probe_says_the_server_answered_200_and_kept_the_old_object(
    bucket: str, scheme: Any
) -> None:
    scheme("silent-refusal", memory(bv.SilentRefusalDriver))
    detail = missing(probes(f"silent-refusal://{bucket}/run"), "conditional-create")
    assert "overwrote" not in detail  # today's sentence: it did not overwrite
    assert "200" in detail and "kept" in detail


def test_the_runner_report_prints_the_shrunk_steps(tmp_path: Any, scheme: Any) -> None:
    scheme("dcp-in-place", posix(bv.DcpInPlaceCommit))
    report = BackendReport(url="dcp-in-place://", strategy="broken variant")
    test = make_state_machine(LocationFactory(f"dcp-in-place://{tmp_path}"), multipart_size=0)
    profile = settings(
        PROFILES["ci"],
        max_examples=150,
        stateful_step_count=10,
        derandomize=True,
        phases=[Phase.explicit, Phase.generate],
    )
    found = Findings()
    machine_findings(found, test, profile, None)
    runner.record(report, found)
    assert "state.concurrent_writers(" in "\n".join(report.invariants["I5"].evidence)


def test_every_variant_is_in_the_docs_table() -> None:
    with open(DOCS, encoding="utf-8") as docs:
        table = [line for line in docs if line.startswith("| `")]
    listed = {line.split("`")[1] for line in table}
    variants = {
        name
        for name, value in vars(bv).items()
        if getattr(value, "__module__", "") == bv.__name__ and not name.startswith("_")
    }
    assert variants <= listed, sorted(variants - listed)


def test_readers_that_ignore_epochs_are_caught_as_i9(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store that keeps epochs but whose readers and writers never read them back (the
    lineage a store had before any takeover, always): the zombie is never refused, and what
    it saves after the takeover is returned (docs/protocol.md §8)."""
    from ckptstore.history import History
    from ckptstore.lineage import Lineage

    monkeypatch.setattr(History, "lineage", lambda self: Lineage())
    # An operator's rollback is a takeover too, and finds the same failure; left out, the
    # shrunk steps name the rule this variant is about.
    text, steps = machine(
        f"file://{tmp_path}", 100, leave_out=("operator_rolls_back_under_a_reader",)
    )
    assert verdicts(text)["I9"] == "VIOLATED", text
    assert "state.take_over(" in steps, steps
