"""A correct system is never reported broken, and a broken one is blamed rightly (issue 26).

The suite's own failure (a wait that timed out, a Python error in its code) is a ``suite
error`` with its traceback, never a violation; a store's refusal of the storage is "not
applicable"; a storage that hides what was just written is a durability violation blamed on
the storage's listing, never a crash of the suite nor a violation of another invariant; and
every built-in backend passes the ``ci`` profile with two CPU-bound processes beside it.
"""

from __future__ import annotations

import itertools
import json
import multiprocessing
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import broken_variants as bv
import pytest
from conftest import extended_conformance

from ckptstore import registry
from ckptstore.backends.memory import MemoryDriver, drop_bucket, get_bucket
from ckptstore.backends.posix import PosixDriver
from ckptstore.cli import main
from ckptstore.commit.conditional_put import ConditionalPutCommit
from ckptstore.commit.rename import RenameCommit
from ckptstore.commit.version_pin import VersionPinCommit
from ckptstore.conformance import runner
from ckptstore.conformance.layers import races
from ckptstore.conformance.layers.crash_points import run_crash_points
from ckptstore.conformance.layers.layer import Findings, Layer, SuiteRun
from ckptstore.conformance.layers.probes import HIDDEN_NAMES, run_probes
from ckptstore.conformance.layers.races import RACE_PROFILES, Crew, RaceProfile, run_races
from ckptstore.conformance.layers.registry import layer_named
from ckptstore.conformance.layers.workload import MANY_PARTS, big_shard_size, standard_shards
from ckptstore.conformance.location import LocationFactory
from ckptstore.conformance.machine import make_state_machine
from ckptstore.conformance.machine import state_machine as machine_module
from ckptstore.conformance.outcomes import SuiteError
from ckptstore.conformance.report import SUITE_FAILED, BackendReport, render_text, to_junit
from ckptstore.driver import UploadInfo
from ckptstore.errors import (
    CapabilityError,
    ObjectNotFoundError,
    PreconditionFailedError,
    StorageError,
    TransientStorageError,
)
from ckptstore.store import Store

PART = 1024
MEMORY_OPTIONS = f"min_part_size={PART}&part_size={PART}"
_buckets = itertools.count()


@pytest.fixture
def bucket() -> Iterator[str]:
    name = f"verdicts-{os.getpid()}-{next(_buckets)}"
    yield name
    drop_bucket(name)


@pytest.fixture
def scheme() -> Iterator[Callable[[str, type[MemoryDriver]], str]]:
    """Register a memory driver variant under a scheme of its own for one test."""
    added: list[str] = []

    def add(name: str, driver: type[MemoryDriver]) -> str:
        def open_variant(url: Any, options: Any) -> ConditionalPutCommit:
            bucket = get_bucket(url.netloc, min_part_size=PART)
            return ConditionalPutCommit(driver(bucket, url.path), part_size=PART)

        registry.register(name, open_variant, replace=True)
        added.append(name)
        return name

    yield add
    for name in added:
        registry.unregister(name)


class UnlistedUploadsDriver(MemoryDriver):
    """A storage that accepts multipart uploads and lists none of them (an empty 200)."""

    def list_multipart_uploads(self, prefix: str) -> Iterator[UploadInfo]:
        return iter([])


class EmptyListingDriver(MemoryDriver):
    """A bucket index that never shows a key: every listing is empty, reads find objects."""

    def list(self, prefix: str, *, start_after: str | None = None) -> Iterator[Any]:
        return iter([])


class HidingDriver(EmptyListingDriver):
    """Listings are empty and the LATEST hint cannot be read: a fresh save is not found."""

    def get(self, key: str, *args: Any, **kwargs: Any) -> Any:
        if key.endswith("LATEST"):
            raise ObjectNotFoundError(key)
        return super().get(key, *args, **kwargs)


def layer_report(layer: Layer, url: str) -> BackendReport:
    """The report of ``layer`` alone on ``url``, recorded as the runner records a layer."""
    report = BackendReport(url=url, strategy="test")
    runner._layer(  # the runner's one-layer step, as run_backend takes it
        report, layer, SuiteRun(LocationFactory(url)), started=0.0, written=lambda r: None
    )
    return report


def status(report: BackendReport, key: str) -> str:
    return report.invariants[key].status


# -- a wait that times out ------------------------------------------------------------------


@pytest.mark.parametrize("scheme_name", ["memory", "memory+versioned"])
def test_gc_during_a_long_upload_finds_the_upload_on_every_layout(
    bucket: str, scheme_name: str
) -> None:
    """The rule waited for an upload keyed by its step, and a version-pinning layout keys
    uploads by shard: on ``memory+versioned://`` it timed out and reported I1 violated."""
    url = f"{scheme_name}://{bucket}/run?{MEMORY_OPTIONS}"
    machine = make_state_machine(LocationFactory(url), multipart_size=PART + 123)()
    try:
        machine.gc_during_a_long_multipart_upload()
    finally:
        machine.teardown()


class PartsNeverCountedDriver(MemoryDriver):
    """A storage that lists an incomplete upload but never counts its parts."""

    def upload_progress(self, upload: UploadInfo) -> Any:
        progress = super().upload_progress(upload)
        return type(progress)(progress.last_activity, progress.size, 0)


def test_a_wait_that_times_out_is_the_suites_failure(
    bucket: str, scheme: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(machine_module, "PART_WAIT_S", 0.3)
    name = scheme("parts-never-counted", PartsNeverCountedDriver)
    machine = make_state_machine(LocationFactory(f"{name}://{bucket}/run"), multipart_size=PART)()
    try:
        with pytest.raises(SuiteError, match=r"waited 0\.3 s for a new multipart upload") as caught:
            machine.gc_during_a_long_multipart_upload()
    finally:
        machine.teardown()
    assert not isinstance(caught.value, Exception)  # no rule's ``except Exception`` takes it
    assert "(0 parts)" in str(caught.value)


def test_a_storage_that_lists_no_upload_skips_the_rule_instead(
    bucket: str, scheme: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its probe (incomplete uploads listed) reports it; the rule cannot run there."""
    monkeypatch.setattr(machine_module, "PART_WAIT_S", 0.3)
    name = scheme("unlisted-uploads", UnlistedUploadsDriver)
    machine = make_state_machine(LocationFactory(f"{name}://{bucket}/run"), multipart_size=PART)()
    try:
        machine.gc_during_a_long_multipart_upload()
        machine.invariants_hold()
    finally:
        machine.teardown()


def _failing_layer(error: BaseException, invariants: tuple[str, ...] = ("I1", "I5")) -> Layer:
    def run(run: SuiteRun, found: Any) -> None:
        found.check("I2")  # what it checked before it failed stands
        if isinstance(error, ValueError):
            _raise_as_the_suite(error)
        raise error

    return Layer("failing layer", invariants, run, doc="fails")


def _raise_as_the_suite(error: BaseException) -> None:
    """Raise ``error`` from a frame whose file is in the suite's package, as a Python error
    in a layer's own code is (the origin decides whose failure it is)."""
    suite = os.path.dirname(runner.__file__)
    code = compile("def fail(error):\n    raise error\n", f"{suite}/layers/any.py", "exec")
    namespace: dict[str, Any] = {}
    exec(code, namespace)
    namespace["fail"](error)


@pytest.mark.parametrize(
    "error",
    [SuiteError("waited 30 s for the racers"), ValueError("max() arg is an empty sequence")],
    ids=["suite-error", "python-error-in-the-suite"],
)
def test_a_suite_error_is_reported_with_its_traceback_never_as_a_violation(
    bucket: str, error: BaseException
) -> None:
    report = layer_report(_failing_layer(error), f"memory://{bucket}/run")
    assert report.outcome == "suite error" and not report.ok
    assert status(report, "I1") == status(report, "I5") == SUITE_FAILED
    assert status(report, "I2") == "held"
    assert not any(r.status == "violated" for r in report.invariants.values())
    text = render_text([report])
    assert re.search(r"I1 atomic visibility +NOT CHECKED \(THE SUITE FAILED\)", text)
    assert "failing layer: SUITE ERROR:" in text
    assert "Traceback (most recent call last)" in text and type(error).__name__ in text
    assert "SUITE ERRORS on" in text and "VIOLATIONS" not in text
    assert '<error message="suite error">' in to_junit([report])
    # A later layer that checks an invariant the suite failed on does not make it "held".
    report.checked("I1")
    assert status(report, "I1") == SUITE_FAILED


def test_a_python_error_raised_in_a_driver_is_the_systems_not_the_suites(bucket: str) -> None:
    """A third party's driver that raises a KeyError (a missing header, say) fails the
    system under test: it is judged as before, not excused as the suite's bug."""
    report = layer_report(_failing_layer(KeyError("ETag")), f"memory://{bucket}/run")
    assert report.outcome == "violated"
    assert status(report, "I1") == "violated"
    assert "KeyError('ETag')" in report.invariants["I1"].evidence[0]


def test_a_refusal_escaping_a_layer_makes_its_invariants_not_applicable(bucket: str) -> None:
    report = layer_report(
        _failing_layer(CapabilityError("no versioning")), f"memory://{bucket}/run"
    )
    assert status(report, "I1") == status(report, "I5") == "not applicable"
    assert "the store refuses this storage: no versioning" in report.invariants["I1"].evidence[0]
    assert report.outcome == "held"  # I2 held; a refusal is no verdict on the protocol


def test_the_command_exits_2_on_a_suite_error(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    layer = _failing_layer(SuiteError("a barrier timed out"))
    monkeypatch.setattr(runner, "layers_for", lambda kind: [layer])
    report_file = tmp_path / "report.json"
    status_code = main(["conformance", f"file://{tmp_path}/store", "--json-file", str(report_file)])
    assert status_code == 2
    assert json.loads(report_file.read_text())["outcome"] == "suite error"
    assert "SUITE ERRORS on" in capsys.readouterr().out


# -- a storage that hides what was just written ----------------------------------------------


def test_hidden_saves_are_blamed_on_the_listing_not_a_crash_of_the_suite(
    bucket: str, scheme: Any
) -> None:
    """``standard_workload`` called ``max(store.steps())`` on an empty listing: the layer died
    with ValueError, reported as I1, and every invariant read "held"."""
    name = scheme("empty-listing", EmptyListingDriver)
    report = layer_report(layer_named("crash points"), f"{name}://{bucket}/run")
    text = render_text([report])
    assert status(report, "I2") == "violated", text
    assert "the storage's listing omits what was just written" in text
    assert "ValueError" not in text and "SUITE ERROR" not in text
    assert "crash points: no case ran: the workload failed without any fault injected" in text
    assert status(report, "I1") == "not checked", text  # nothing was crashed: nothing held


def test_a_race_judged_by_a_listing_that_omits_steps_blames_the_listing(
    bucket: str, scheme: Any
) -> None:
    """The pointer race's judge read the published steps from a listing: an empty one made it
    call max() of nothing (a suite crash), and LATEST naming a step the listing omitted read
    as I1 "not published"."""
    name = scheme("empty-listing", EmptyListingDriver)
    result = run_races(
        LocationFactory(f"{name}://{bucket}/run"), RACE_PROFILES["ci"], processes=False
    )
    assert result.thread_rounds > 0
    assert {f.invariant for f in result.failures} == {"I2"}, result.failures
    assert all("the storage's listing" in f.message for f in result.failures)


def test_a_thread_racer_that_cannot_see_the_seed_blames_the_listing(
    bucket: str, scheme: Any
) -> None:
    """Reported before as I5, with the process crew's "not applicable" text."""
    name = scheme("hiding", HidingDriver)
    result = run_races(
        LocationFactory(f"{name}://{bucket}/run"), RACE_PROFILES["ci"], processes=False
    )
    assert [f.invariant for f in result.failures] == ["I2"], result.failures
    assert "the storage's listing omits what was just written" in result.failures[0].message
    assert "not applicable" not in result.failures[0].message
    report = BackendReport(url="hiding", strategy="test")
    runner.record(report, _races_findings(name, bucket))
    assert status(report, "I5") == "not checked"  # nothing was raced: nothing held


def _races_findings(name: str, bucket: str) -> Any:
    found = Findings()
    layer_named("parallel races").run(SuiteRun(LocationFactory(f"{name}://{bucket}/run2")), found)
    return found


# -- every built-in backend, under load ------------------------------------------------------


def _spin(stop: Any) -> None:
    while not stop.is_set():
        sum(range(10_000))


@pytest.fixture
def two_busy_processes() -> Iterator[None]:
    """Two CPU-bound processes beside the test, as a training node has."""
    context = multiprocessing.get_context("spawn")
    stop = context.Event()
    spinners = [context.Process(target=_spin, args=(stop,), daemon=True) for _ in range(2)]
    for spinner in spinners:
        spinner.start()
    yield
    stop.set()
    for spinner in spinners:
        spinner.join(10)
        if spinner.is_alive():
            spinner.kill()


@pytest.mark.slow  # a minute each: the whole ci profile
@pytest.mark.parametrize(
    "scheme_name",
    [
        pytest.param("file", marks=extended_conformance),
        pytest.param("memory", marks=extended_conformance),
        "memory+versioned",  # where the false I1 was: in CI, its spinners slow every worker
    ],
)
def test_a_correct_store_is_never_reported_broken_under_load(
    tmp_path: Any, bucket: str, scheme_name: str, two_busy_processes: None
) -> None:
    """The in-process built-in backends, ``ci`` profile, with two spinning processes beside
    (the object stores over HTTP: their own tests, test_s3, test_gcs, test_azure,
    test_fsspec, test_versioned, assert the same beside CI's other workers)."""
    if scheme_name == "file":
        url = f"file://{tmp_path}/store"
    else:
        url = f"{scheme_name}://{bucket}/run?{MEMORY_OPTIONS}"
    report = runner.run_backend(url, profile="ci")
    text = render_text([report])
    assert report.outcome == "held", text
    assert not report.errors, text


# -- --import reaches every process the suite starts -----------------------------------------

SHARED_FS_BACKEND = '''
"""A third-party scheme over a shared file system, registered when imported."""
from ckptstore.backends.posix import PosixDriver
from ckptstore.commit.rename import RenameCommit
from ckptstore.commit.version_pin import VersionPinCommit
from ckptstore.registry import register


def open_shared(url, options):
    return RenameCommit(PosixDriver(url.path))


register("sharedfs", open_shared, replace=True)
'''
SMALL_RACES = RaceProfile(threads=Crew(4, 1, 1, 0.0), processes=Crew(2, 1, 1, 0.0))


@pytest.fixture
def shared_fs_module(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A module in a directory of its own, found through the parent's ``sys.path`` only."""
    home = tmp_path / "backends"
    home.mkdir()
    (home / "sharedfs_backend.py").write_text(SHARED_FS_BACKEND)
    monkeypatch.syspath_prepend(str(home))
    yield "sharedfs_backend"
    registry.unregister("sharedfs")
    sys.modules.pop("sharedfs_backend", None)


def test_racer_processes_import_what_import_imported(shared_fs_module: str, tmp_path: Any) -> None:
    """``--import mypkg`` registered the scheme in the suite's process only: the racer
    processes skipped with UnknownSchemeError and the run passed."""
    registry.import_backend(shared_fs_module)  # what ``conformance --import`` does
    result = run_races(LocationFactory(f"sharedfs://{tmp_path}/store"), SMALL_RACES)
    assert result.processes_skipped == "", result.processes_skipped
    assert result.process_rounds == 1 and result.failures == []


def test_racer_processes_that_cannot_open_the_scheme_fail_the_run(tmp_path: Any) -> None:
    """A scheme no other process can import (registered from ``__main__``): the process races
    are reported as not run, a suite error, and the run does not pass."""

    def open_here(url: Any, options: Any) -> RenameCommit:
        return RenameCommit(PosixDriver(url.path))

    open_here.__module__ = "__main__"
    registry.register("heresfs", open_here, replace=True)
    try:
        found = Findings()
        layer = layer_named("parallel races")
        with pytest.MonkeyPatch.context() as patch:
            patch.setitem(races.RACE_PROFILES, "ci", SMALL_RACES)
            layer.run(SuiteRun(LocationFactory(f"heresfs://{tmp_path}/store")), found)
    finally:
        registry.unregister("heresfs")
    report = BackendReport(url="heresfs", strategy="test")
    runner.record(report, found)
    assert report.outcome == "suite error", render_text([report])
    (error,) = report.errors
    assert error.layer == "parallel races (processes)"
    assert "not run: a racer could not open the store" in error.message
    assert "UnknownSchemeError" in error.message


# -- shapes real storage gets wrong: many parts, hidden names ---------------------------------


def _probe_row(url: str, row: str) -> Any:
    location = LocationFactory(url)()
    try:
        return next(r for r in run_probes(location) if r.capability == row)
    finally:
        location.destroy()


def test_parts_assembled_by_name_are_caught_by_the_probe_and_the_workload(
    bucket: str, scheme: Any
) -> None:
    """Every upload the suite made had 2 or 3 parts: assembling by name (1, 10, 11, ...) is
    right up to 9 parts, so such a server passed."""
    name = scheme("parts-by-name", bv.PartsByNameDriver)
    probe = _probe_row(f"{name}://{bucket}/probe", "multipart")
    assert probe.measured == "violated"
    assert "holds its parts in the order 1, 10, 11, 12, 13, 2, 3" in probe.detail
    result = run_crash_points(LocationFactory(f"{name}://{bucket}/run"), limit=1)
    assert result.failures, "the workload's many-part shard read back right"
    assert "optimizer/big.bin" in result.failures[0].message


def test_the_workload_and_the_probe_upload_many_parts(bucket: str) -> None:
    url = f"memory://{bucket}/run?{MEMORY_OPTIONS}"
    location = LocationFactory(url)()
    try:
        big = big_shard_size(location)
        shard = standard_shards(2, big)["optimizer/big.bin"]
    finally:
        location.destroy()
    parts = [shard[i : i + PART] for i in range(0, len(shard), PART)]
    assert len(parts) == MANY_PARTS >= 12
    assert len(set(parts)) == len(parts)  # unequal content: an order of its own reads wrong
    assert "13 parts, uploaded out of order" in _probe_row(url, "multipart").detail


def test_names_real_trainers_write_are_in_the_workload() -> None:
    names = standard_shards(1, 0)
    assert any(n.startswith(".") for n in names) and any(n.startswith("_") for n in names)
    assert {".metadata", "__0_0.distcp"} <= set(names)
    assert max(n.count("/") for n in names) >= 4


@pytest.mark.parametrize("where", ["memory", "file"])
def test_a_listing_that_hides_dot_and_underscore_names_is_reported_missing(
    bucket: str, scheme: Any, tmp_path: Any, where: str
) -> None:
    if where == "memory":
        url = f"{scheme('hides-dot-names', bv.HidesDotNamesDriver)}://{bucket}/run"
    else:
        registry.register("hides-dot-files", _hiding_posix, replace=True)
        url = f"hides-dot-files://{tmp_path}/store"
    try:
        probe = _probe_row(url, HIDDEN_NAMES)
    finally:
        registry.unregister("hides-dot-files")
    assert probe.measured == "violated" and probe.required
    assert re.search(r"not listed: \.probe-\w+, _probe-\w+, probe-\w+/\.metadata", probe.detail)
    assert "torch DCP's .metadata" in probe.detail
    assert _probe_row(f"memory://{bucket}/sound", HIDDEN_NAMES).measured == "held"


class _HidingPosixDriver(PosixDriver):
    def listdir(self, path: str) -> list[str]:
        return [n for n in super().listdir(path) if not n.startswith((".", "_"))]


def _hiding_posix(url: Any, options: Any) -> RenameCommit:
    return RenameCommit(_HidingPosixDriver(url.path))


def test_a_versioned_url_on_a_bucket_without_versioning_is_not_applicable_not_violated(
    bucket: str,
) -> None:
    """The store refuses such a bucket at its first save (CapabilityError): the report
    labelled I1, I5 and I7 violated. The refusal is the probes' finding (versioning MISSING),
    and every layer's invariants are not applicable there, with the refusal as the reason."""
    url = f"memory+versioned://{bucket}/run?versioned=false&{MEMORY_OPTIONS}"
    report = runner.run_backend(url)
    text = render_text([report])
    assert {r.status for r in report.invariants.values()} == {"not applicable"}, text
    assert "the store refuses this storage" in report.invariants["I1"].evidence[0]
    assert "is versioning enabled?" in report.invariants["I1"].evidence[0]
    missing = {p.capability for p in report.capability_mismatches}
    assert {"versioning", "opening the store"} <= missing, text
    for layer in ("crash points", "unknown outcomes", "parallel races", "property-based"):
        assert "the store refuses this storage" in report.coverage[layer], text
    assert not report.errors, text


# -- servers that do not implement a listing -------------------------------------------------


class NoVersionListingDriver(MemoryDriver):
    """A server that answers 405 MethodNotAllowed to ListObjectVersions."""

    def list_versions(self, prefix: str) -> Iterator[Any]:
        raise StorageError(f"ListObjectVersions {prefix!r}: MethodNotAllowed", http_status=405)


class NoUploadListingDriver(MemoryDriver):
    """A server that answers an empty 200 to ListMultipartUploads."""

    def list_multipart_uploads(self, prefix: str) -> Iterator[UploadInfo]:
        return iter([])


def test_a_405_to_list_versions_is_a_no_and_cleanup_still_removes_the_objects(
    bucket: str, scheme: Any
) -> None:
    """Reported "versioning: STORAGE ERROR (undecided)", and the cleanup skipped the plain
    deletes after the versions listing failed: every run left its objects behind."""
    name = scheme("no-version-listing", NoVersionListingDriver)
    probe = _probe_row(f"{name}://{bucket}/probe", "versioning")
    assert probe.measured == "violated", probe  # puts give no version ids: a plain "no"
    location = LocationFactory(f"{name}://{bucket}/run")()
    Store(location.base).save(1, {"a.bin": b"x" * 100})
    assert get_bucket(bucket).objects
    location.destroy()
    assert not any(get_bucket(bucket).current(key) for key in get_bucket(bucket).objects)
    assert location.cleanup_problems == []  # nothing to list: no versions kept


def test_a_versioned_store_whose_versions_cannot_be_listed_is_told_and_cleanup_says_so(
    bucket: str,
) -> None:
    def open_variant(url: Any, options: Any) -> VersionPinCommit:
        versioned = get_bucket(url.netloc, min_part_size=PART, versioned=True)
        return VersionPinCommit(NoVersionListingDriver(versioned, url.path), part_size=PART)

    registry.register("versions-unlisted", open_variant, replace=True)
    try:
        probe = _probe_row(f"versions-unlisted://{bucket}/probe", "versioning")
        assert probe.measured == "violated"
        assert "answers 405 to ListObjectVersions" in probe.detail
        factory = LocationFactory(f"versions-unlisted://{bucket}/run")
        location = factory()
        Store(location.base).save(1, {"a.bin": b"x" * 100})
        location.destroy()
    finally:
        registry.unregister("versions-unlisted")
    (problem,) = factory.cleanup_problems
    assert problem.startswith("old object versions under versions-unlisted://")
    assert "MethodNotAllowed" in problem


def test_an_empty_listing_of_uploads_is_a_capability_missing_with_its_cost(
    bucket: str, scheme: Any
) -> None:
    name = scheme("no-upload-listing", NoUploadListingDriver)
    probe = _probe_row(f"{name}://{bucket}/probe", "incomplete uploads listed")
    assert probe.measured == "violated" and probe.required
    assert "does not list an incomplete upload: GC cannot find the uploads" in probe.detail
    assert "AbortIncompleteMultipartUpload" in probe.detail


class RaceLosersGet500Driver(MemoryDriver):
    """A server that answers 500 InternalError, not 412, to the losers of a race of
    conditional writes on one key (a lock timeout in its metadata store), every time; a
    conditional write refused alone gets its 412."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.in_flight: dict[str, int] = {}
        self.lock = threading.Lock()

    def put(self, key: str, data: Any, **kwargs: Any) -> Any:
        mode = kwargs.get("mode")
        if mode is None or not mode.conditional:
            return super().put(key, data, **kwargs)
        with self.lock:
            self.in_flight[key] = self.in_flight.get(key, 0) + 1
        try:
            time.sleep(0.02)  # the racers overlap here
            with self.lock:
                raced = self.in_flight[key] > 1
            try:
                return super().put(key, data, **kwargs)
            except PreconditionFailedError:
                if raced:
                    raise TransientStorageError(
                        f"PutObject {key}: InternalError", http_status=500
                    ) from None
                raise
        finally:
            with self.lock:
                self.in_flight[key] -= 1


def test_race_losers_told_by_500_are_a_measured_behaviour_not_a_storage_error(
    bucket: str, scheme: Any
) -> None:
    """Reported "compare-and-swap: STORAGE ERROR ... run again" though it reproduces."""
    name = scheme("losers-get-500", RaceLosersGet500Driver)
    for row, what in (("conditional-create", "conditional creates"),
                      ("compare-and-swap", "compare-and-swaps")):  # fmt: skip
        probe = _probe_row(f"{name}://{bucket}/{row}", row)
        assert probe.measured == "held", probe
        told = f"losers of racing {what} are told by an error status, not 412"
        assert re.search(rf"{told} \(\d+ got 500 over 3 rounds", probe.detail), probe.detail


ALIAS_BACKEND = '''
"""Registers a built-in factory under a scheme of its own: the factory's module is not the
module that registers the scheme."""
from ckptstore.backends.posix import open_posix
from ckptstore.registry import register

register("aliasfs", open_posix, replace=True)
'''


def test_a_child_imports_the_module_that_registered_its_scheme_and_only_that(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, shared_fs_module: str
) -> None:
    (tmp_path / "backends" / "aliasfs_backend.py").write_text(ALIAS_BACKEND)
    registry.import_backend(shared_fs_module)
    registry.import_backend("aliasfs_backend")
    try:
        assert registry.backend_modules("aliasfs") == (
            "aliasfs_backend",
            "ckptstore.backends.posix",
        )
        assert registry.backend_modules("sharedfs") == ("sharedfs_backend",)
        result = run_races(LocationFactory(f"aliasfs://{tmp_path}/store"), SMALL_RACES)
        assert result.processes_skipped == "" and result.process_rounds == 1, result
    finally:
        registry.unregister("aliasfs")
        sys.modules.pop("aliasfs_backend", None)
    assert registry.backend_modules("aliasfs") == ()


class RefusingAtSaveCommit(ConditionalPutCommit):
    """A store that refuses the storage at every save, for a reason no probe measures (a
    gateway that gives a version id to PutObject, not to CompleteMultipartUpload, say)."""

    def begin(self, step: int, attempt: str) -> None:
        raise CapabilityError(f"{self.url}: the storage gave no version id to a completion")


def test_a_refusal_no_probe_explains_does_not_pass(bucket: str) -> None:
    """Every layer read "not applicable", no probe failed: the run passed with exit 0,
    though ckptstore would refuse every save on that storage."""

    def open_variant(url: Any, options: Any) -> ConditionalPutCommit:
        bucket_ = get_bucket(url.netloc, min_part_size=PART)
        return RefusingAtSaveCommit(MemoryDriver(bucket_, url.path), part_size=PART)

    registry.register("refusing-at-save", open_variant, replace=True)
    try:
        report = runner.run_backend(f"refusing-at-save://{bucket}/run", budget_s=20)
    finally:
        registry.unregister("refusing-at-save")
    text = render_text([report])
    assert report.outcome == "violated", text
    (row,) = report.capability_mismatches
    assert row.capability == runner.ACCEPTED
    assert "the storage gave no version id to a completion" in row.detail
    assert not any(r.status == "violated" for r in report.invariants.values()), text
