"""Every storage path a backend declares is driven by the conformance suite: multipart uploads
of small parts, crashes around their completion, GC during a live upload and a live stream, a
transient failure before and after every commit point. Each check catches a broken variant."""

from __future__ import annotations

import os
import re
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
from broken_variants import BlindRetryCommit
from hypothesis import Phase, settings

from ckptstore import registry
from ckptstore.backends.memory import MemoryDriver, drop_bucket, get_bucket, open_memory
from ckptstore.backends.posix import PosixDriver
from ckptstore.commit.conditional_put import ConditionalPutCommit
from ckptstore.commit.rename import DATA_DIR, RenameCommit
from ckptstore.conformance import runner
from ckptstore.conformance.faults import CrashMode
from ckptstore.conformance.layers.crash_points import completions_note, run_crash_points
from ckptstore.conformance.layers.layer import Findings, SuiteRun
from ckptstore.conformance.layers.probes import VIOLATED, run_probes
from ckptstore.conformance.layers.property_based import machine_completions, machine_findings
from ckptstore.conformance.layers.unknown_outcomes import run_indeterminate_outcomes
from ckptstore.conformance.layers.workload import MULTIPART_COMPLETION, pattern
from ckptstore.conformance.location import LocationFactory
from ckptstore.conformance.machine import PROFILES, make_state_machine
from ckptstore.conformance.model import InvariantViolation
from ckptstore.conformance.report import BackendReport, render_text
from ckptstore.driver import PutMode
from ckptstore.errors import PreconditionFailedError, TargetExistsError, TransientStorageError
from ckptstore.manifest import Manifest
from ckptstore.tools.embedded import EmbeddedS3

SMALL_PARTS = "min_part_size=4096&part_size=4096"


@pytest.fixture
def memory_url() -> Iterator[str]:
    bucket = f"coverage-{os.getpid()}"
    yield f"memory://{bucket}/run?{SMALL_PARTS}"
    drop_bucket(bucket)


@pytest.fixture
def scheme() -> Iterator[Any]:
    """Register a broken backend under a scheme of its own for the duration of a test."""
    added: list[str] = []

    def add(name: str, factory: Any) -> str:
        registry.register(name, factory, replace=True)
        added.append(name)
        return name

    yield add
    for name in added:
        registry.unregister(name)


def _memory_with(strategy_class: type[ConditionalPutCommit], driver_class: type = MemoryDriver):
    def factory(url: Any, options: Any) -> ConditionalPutCommit:
        base = open_memory(url, options)
        driver = driver_class(get_bucket(url.netloc), url.path)
        return strategy_class(driver, part_size=base.part_size)

    return factory


# -- small parts are honoured: a 4 KiB store really uploads in parts ----------------------


def test_a_small_part_size_is_honoured_for_a_shard_of_known_size(memory_url: str) -> None:
    location = LocationFactory(memory_url)()
    store, injector = location.open()
    store.save(1, {"big": pattern(2 * 4096 + 5, 1)})
    calls = Counter(call.name for call in injector.calls)
    assert calls["upload_part"] == 3 and calls[MULTIPART_COMPLETION] == 1
    assert store.latest().read("big") == pattern(2 * 4096 + 5, 1)  # type: ignore[union-attr]


# -- the crash-point layer crashes around multipart completions, and counts them honestly --


def test_the_crash_points_crash_around_every_multipart_completion(memory_url: str) -> None:
    report = BackendReport(url=memory_url, strategy="conditional-put")
    runner.run_layer(report, "crash points", SuiteRun(LocationFactory(memory_url)))
    line = report.coverage["crash points"]
    assert "2 multipart completions crashed around (before and after each; 2 in the workload)" in (
        line
    )
    assert report.invariants["I7"].status == "held"


def test_the_count_comes_from_the_crashes_the_injector_recorded(
    memory_url: str, tmp_path: Any
) -> None:
    factory = LocationFactory(memory_url)
    early = run_crash_points(factory, limit=5)  # crashes before any upload began
    assert early.completions == 2 and early.completions_crashed_around == 0
    assert "; 0 multipart completions crashed around" in completions_note(early)
    around = run_crash_points(factory, around=MULTIPART_COMPLETION)
    assert around.failures == [] and around.storage_errors == []
    assert around.cases == 1 + 4  # no crash; before each completion and before the next call
    assert around.completions_before == around.completions_after
    completions = [i for i, n in enumerate(around.call_names) if n == MULTIPART_COMPLETION]
    assert sorted(around.completions_before) == completions
    files = run_crash_points(LocationFactory(f"file://{tmp_path}/fs"), limit=3)
    assert files.completions == 0 and completions_note(files) == ""


def test_on_s3_the_crash_points_crash_around_multipart_completions(moto_s3: EmbeddedS3) -> None:
    url = moto_s3.url(f"coverage-{os.getpid()}", part_size=4096, concurrency=1)
    result = run_crash_points(LocationFactory(url, moto_s3.options), around=MULTIPART_COMPLETION)
    assert result.failures == [] and result.storage_errors == []
    assert result.completions == 2 and result.completions_crashed_around == 2


def test_the_state_machine_counts_its_crashes_around_completions(memory_url: str) -> None:
    factory, size = LocationFactory(memory_url), 4096 + 123
    location = factory()
    store, injector = location.open()
    store.save(1, {"rank00/part.bin": pattern(size, 1)})
    k = [call.name for call in injector.calls].index(MULTIPART_COMPLETION)
    location.destroy()
    machine_class = make_state_machine(factory, multipart_size=size)
    machine = machine_class()
    try:
        for crash in ((k, CrashMode.BEFORE), (k + 1, CrashMode.BEFORE), (k, CrashMode.AFTER)):
            machine.save(shard_sizes=[size], crash=crash, skip=0)
            machine.invariants_hold()
        machine.save(shard_sizes=[size], crash=(k - 1, CrashMode.BEFORE), skip=0)  # not around
        machine.save_crashing_at_a_multipart_completion(mode=CrashMode.AFTER)
        machine.invariants_hold()
    finally:
        machine.teardown()
    assert machine_class.completion_crashes == Counter(before=1, after=3)
    assert machine_completions(machine_class, size) == (
        "; crashes around multipart completions: 1 before, 3 after"
    )


class UploadBlindGcCommit(ConditionalPutCommit):
    """Broken: GC lists objects only, never incomplete multipart uploads (a cleanup script's
    way): a dead attempt's parts stay, and take space, for ever."""

    def incomplete_uploads(self, prefix: str, report: Any = None) -> Any:
        return [] if report is not None else super().incomplete_uploads(prefix)


def test_gc_blind_to_multipart_uploads_is_caught_around_completions(scheme: Any) -> None:
    scheme("broken-upload-blind", _memory_with(UploadBlindGcCommit))
    url = f"broken-upload-blind://blind-{os.getpid()}/run?{SMALL_PARTS}"
    result = run_crash_points(LocationFactory(url), around=MULTIPART_COMPLETION)
    assert {failure.invariant for failure in result.failures} == {"I7"}
    assert all("(upload " in failure.message for failure in result.failures)
    assert "GC never collected dead attempts' data" in result.failures[0].message


class LastPartDroppingDriver(MemoryDriver):
    """Broken: a completion of several parts silently leaves out the last one."""

    def complete_multipart(self, key: str, upload_id: str, parts: Any, **kwargs: Any) -> Any:
        return super().complete_multipart(key, upload_id, parts[:-1] or parts, **kwargs)


def test_a_completion_that_drops_the_last_part_is_caught_by_the_probe(scheme: Any) -> None:
    scheme("broken-last-part", _memory_with(ConditionalPutCommit, LastPartDroppingDriver))
    url = f"broken-last-part://last-{os.getpid()}/run?{SMALL_PARTS}"
    location = LocationFactory(url)()
    report = BackendReport(url=url, strategy="conditional-put", capabilities=run_probes(location))
    multipart = {p.capability: p for p in report.capabilities}["multipart"]
    assert multipart.declared and multipart.measured == VIOLATED
    text = render_text([report])
    assert re.search(r"multipart .* MISSING \(declared, not found\)", text)
    assert (
        "the object completed from 13 parts (49161 bytes, uploaded out of order) holds 49152 "
        "bytes" in text
    )


# -- GC during a live multipart upload and a live streamed shard -------------------------


def _machine_report(url: str, multipart_size: int, examples: int = 150) -> BackendReport:
    """What the state machine reports: the same examples every run, no shrinking."""
    machine = make_state_machine(LocationFactory(url), multipart_size=multipart_size)
    found = settings(
        PROFILES["ci"],
        max_examples=examples,
        derandomize=True,
        phases=[Phase.explicit, Phase.generate],
    )
    report = BackendReport(url=url, strategy="broken")
    findings = Findings()
    machine_findings(findings, machine, found, None)
    runner.record(report, findings)
    return report


class UploadReapingGcCommit(ConditionalPutCommit):
    """Broken: GC aborts every incomplete multipart upload, however young (a lifecycle rule
    "abort incomplete uploads after 0 days", or a cleanup that takes any upload for dead)."""

    def collect_garbage(self, *, grace_s: float, now: float, dry_run: bool) -> Any:
        if not dry_run:
            for upload in list(self.driver.list_multipart_uploads("")):
                self.driver.abort_multipart(upload.key, upload.upload_id)
        return super().collect_garbage(grace_s=grace_s, now=now, dry_run=dry_run)


def test_gc_aborting_live_uploads_is_caught_as_i7(scheme: Any) -> None:
    scheme("broken-reaper", _memory_with(UploadReapingGcCommit))
    report = _machine_report(f"broken-reaper://reaper-{os.getpid()}/run?{SMALL_PARTS}", 4096 + 123)
    assert report.invariants["I7"].status == "violated"
    evidence = "\n".join(report.invariants["I7"].evidence)
    assert re.search(
        r"GC broke a save with a live (multipart upload|streamed shard) younger"
        r"|GC removed a multipart upload whose parts were still arriving",
        evidence,
    )
    assert "I7 safe cleanup" in render_text([report])


class StagingRecreatingCommit(RenameCommit):
    """Broken: publish re-creates the attempt's directories before writing the manifest (as
    torch DCP's FileSystemWriter does, ``makedirs(exist_ok=True)``): after GC removed an
    attempt, it publishes a checkpoint whose shards are gone."""

    def publish(self, manifest: Manifest) -> None:
        staging = self.staging_dir(manifest.step, manifest.attempt)
        directories = {f"{DATA_DIR}/{'/'.join(r.name.split('/')[:-1])}" for r in manifest.shards}
        for path in ["", DATA_DIR, *sorted(directories)]:
            try:
                self.driver.mkdir(f"{staging}/{path}".rstrip("/"))
            except TargetExistsError:
                pass
        super().publish(manifest)


def _rules(
    url: str, multipart_size: int, steps: list[tuple[str, bool]], options: Any = None
) -> None:
    """Run rules of the state machine in a fixed order, checking the invariants after each."""
    factory = LocationFactory(url, options)
    machine = make_state_machine(factory, multipart_size=multipart_size)()
    try:
        machine.save(shard_sizes=[100], crash=None, skip=0)  # a published checkpoint to keep
        for rule, age in steps:
            getattr(machine, rule)(age=age)
            machine.invariants_hold()
        if multipart_size:
            for mode in CrashMode:
                machine.save_crashing_at_a_multipart_completion(mode=mode)
                machine.invariants_hold()
            assert sum(type(machine).completion_crashes.values()) == 2
    finally:
        machine.teardown()


def test_a_publish_after_gc_took_the_stream_is_caught_as_i1(scheme: Any, tmp_path: Any) -> None:
    scheme("broken-recreate", lambda url, options: StagingRecreatingCommit(PosixDriver(url.path)))
    url = f"broken-recreate://{tmp_path}"
    _rules(url, 0, [("gc_during_a_live_streamed_shard", False)])  # young: GC leaves it alone
    with pytest.raises(InvariantViolation) as caught:
        _rules(url, 0, [("gc_during_a_live_streamed_shard", True)])
    assert caught.value.invariant == "I1"
    assert re.search(
        r"I1 \(atomic visibility\) violated: published step 2 is incomplete", str(caught.value)
    )


LIVE_RULES = [
    (f"gc_during_a_live_{what}", age)
    for age in (False, True)
    for what in ("multipart_upload", "streamed_shard")
]


@pytest.mark.parametrize("kind", ["file", "memory", "memory+versioned", "s3", "s3+versioned"])
def test_the_real_backends_pass_the_new_rules(kind: str, tmp_path: Any, request: Any) -> None:
    if kind == "file":
        _rules(f"file://{tmp_path}/rules", 0, [r for r in LIVE_RULES if "streamed" in r[0]])
        return
    if kind.startswith("memory"):
        url, options = f"{kind}://rules-{os.getpid()}-{kind[-3:]}/run?{SMALL_PARTS}", None
    else:
        server: EmbeddedS3 = request.getfixturevalue("moto_s3")
        if kind == "s3+versioned":
            server = server.versioned_bucket(f"{server.bucket}-versioned")
        url = server.url(f"rules-{os.getpid()}", scheme=kind, part_size=4096, concurrency=1)
        options = server.options
    _rules(url, 4096 + 123, LIVE_RULES, options)


# -- a transient failure before and after every commit point ------------------------------


def test_every_commit_point_is_failed_before_and_after(memory_url: str) -> None:
    report = BackendReport(url=memory_url, strategy="conditional-put")
    runner.run_layer(report, "unknown outcomes", SuiteRun(LocationFactory(memory_url)))
    line = report.coverage["unknown outcomes"]
    for point in (
        "If-None-Match put manifests/step-N.json (2 before, 2 after)",
        "If-None-Match put LATEST (1 before, 1 after)",
        "If-Match put LATEST (1 before, 1 after)",
        "complete_multipart step-N.<attempt>/optimizer/big.bin (2 before, 2 after)",
    ):
        assert point in line
    assert report.invariants["I8"].status == "held"


class GuessingPublishCommit(ConditionalPutCommit):
    """Broken: a manifest put that got no answer is taken as done, never read back."""

    def publish(self, manifest: Manifest) -> None:
        self._check_sealed(manifest)
        try:
            self.driver.put(
                self.manifest_key(manifest.step), manifest.encode(), mode=PutMode.CREATE
            )
        except PreconditionFailedError:
            raise self._exists(manifest.step) from None
        except TransientStorageError:
            return  # a guess: right after a timeout, wrong after a 503


def test_a_publish_guessed_done_is_caught_as_i8_by_the_failure_before(scheme: Any) -> None:
    scheme("broken-guess", _memory_with(GuessingPublishCommit))
    url = f"broken-guess://guess-{os.getpid()}/run?{SMALL_PARTS}"
    failures = run_indeterminate_outcomes(LocationFactory(url)).failures
    assert {failure.invariant for failure in failures} == {"I8"}
    assert all(failure.case.startswith("503 before") for failure in failures)
    assert "reported success but nothing was published" in failures[0].message
    assert "put(manifests/step-" in failures[0].case


NoReadBackCommit = BlindRetryCommit
"""Broken: a retried manifest create refused with 412 is taken for another writer's publish,
without reading back whose it is (the variant of ``broken_variants``)."""


def test_a_retried_create_taken_for_another_writer_is_caught_as_i8(scheme: Any) -> None:
    scheme("broken-no-read-back", _memory_with(NoReadBackCommit))
    url = f"broken-no-read-back://noread-{os.getpid()}/run?{SMALL_PARTS}"
    failures = run_indeterminate_outcomes(LocationFactory(url)).failures
    assert {failure.invariant for failure in failures} == {"I8"}
    assert {failure.case.split(" call")[0] for failure in failures} == {"timeout after"}
    assert "own publish taken for another's" in failures[0].message
