"""The conformance suite itself: it passes on the built-in backends, and it catches each
deliberately broken driver or commit strategy by the invariant that the breakage violates."""

from __future__ import annotations

import io
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import Phase, settings
from hypothesis.stateful import run_state_machine_as_test

import ckptstore
from ckptstore import CapabilityError, registry
from ckptstore.backends.memory import MemoryDriver, drop_bucket, get_bucket, open_memory
from ckptstore.backends.posix import PosixDriver
from ckptstore.checkpoint import ShardReader
from ckptstore.cli import main
from ckptstore.commit.conditional_put import ConditionalPutCommit
from ckptstore.commit.rename import DATA_DIR, MANIFEST_NAME, RenameCommit, directories_of
from ckptstore.conformance import outcomes
from ckptstore.conformance.faults import (
    CrashMode,
    FaultInjector,
    FaultPlan,
    InjectedTimeoutError,
    SimulatedCrash,
)
from ckptstore.conformance.layers.cases import crash_cases
from ckptstore.conformance.layers.crash_points import run_crash_points
from ckptstore.conformance.layers.power_loss import run_power_loss
from ckptstore.conformance.layers.probes import VIOLATED, run_probes
from ckptstore.conformance.layers.workload import big_shard_size, standard_workload
from ckptstore.conformance.location import Location, LocationFactory
from ckptstore.conformance.machine import PROFILES, make_state_machine, run_state_machine
from ckptstore.conformance.mixins import ConformanceTests
from ckptstore.conformance.model import InvariantViolation, Model
from ckptstore.conformance.outcomes import StorageFailure, storage_failure
from ckptstore.errors import (
    CkptStoreError,
    ObjectNotFoundError,
    StorageError,
    TransientStorageError,
)
from ckptstore.manifest import Manifest
from ckptstore.names import step_token
from ckptstore.store import Store
from ckptstore.urls import parse_url

MEMORY_OPTIONS = "min_part_size=1024&part_size=1024"


# -- the suite passes on the built-in backends (the mixin form) -------------------------


class TestFileConformance(ConformanceTests):
    @pytest.fixture
    def ckpt_url(self, tmp_path: Any) -> str:
        return f"file://{tmp_path}/conformance"


class TestMemoryConformance(ConformanceTests):
    @pytest.fixture
    def ckpt_url(self) -> Iterator[str]:
        name = f"conformance-{os.getpid()}"
        yield f"memory://{name}/run?{MEMORY_OPTIONS}"
        drop_bucket(name)


# -- the pytest plugin and the command line ----------------------------------------------


def test_pytest_plugin_form(tmp_path: Any) -> None:
    result = subprocess.run(
        [
            sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
            "--pyargs", "ckptstore.conformance",
            "--ckpt-url", f"memory://plugin/run?{MEMORY_OPTIONS}",
            "-k", "capabilities or crash_point or unknown",
        ],
        cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "4 passed" in result.stdout  # capabilities, crash points, takeovers, unknown


def test_pytest_plugin_refuses_a_non_empty_location(tmp_path: Any) -> None:
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "data").write_text("precious")
    result = subprocess.run(
        [
            sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
            "--pyargs", "ckptstore.conformance", "--ckpt-url", f"file://{tmp_path}/busy",
            "-k", "capabilities",
        ],
        cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert result.returncode != 0
    assert "not empty" in result.stdout
    assert (tmp_path / "busy" / "data").read_text() == "precious"


def test_cli_report_json_and_junit(tmp_path: Any) -> None:
    out = io.StringIO()
    url = f"memory://cli-{os.getpid()}/run?{MEMORY_OPTIONS}"
    status = main(
        [
            "conformance", url,
            "--json-file", str(tmp_path / "r.json"), "--junit", str(tmp_path / "r.xml"),
        ],
        out,
    )  # fmt: skip
    text = out.getvalue()
    assert status == 0, text
    assert "I5 exclusive publish" in text
    assert "crash points:" in text
    assert "conformance: 1 backend(s); all invariants held" in text
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["ok"] is True
    invariants = report["backends"][0]["invariants"]
    assert {k: v["status"] for k, v in invariants.items()} == dict.fromkeys(
        [f"I{i}" for i in range(1, 11)], "held"
    )
    assert '<testsuite name="memory://' in (tmp_path / "r.xml").read_text()
    out = io.StringIO()  # --json: the same report on stdout, and nothing else there
    assert main(["conformance", f"memory://cli-json-{os.getpid()}/run", "--json"], out) == 0
    assert json.loads(out.getvalue())["ok"] is True


def test_cli_refuses_a_non_empty_url(tmp_path: Any, capsys: Any) -> None:
    (tmp_path / "keep").write_text("x")
    assert main(["conformance", str(tmp_path)], io.StringIO()) == 2
    assert "not empty" in capsys.readouterr().err
    assert (tmp_path / "keep").read_text() == "x"


# -- broken variants: each must be caught, by the invariant it breaks ---------------------


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


def _machine_violation(url: str, examples: int = 150) -> str:
    """The invariant the state machine finds broken: the same examples every run (no luck
    involved in CI), and the first failure is enough (no shrinking)."""
    machine = make_state_machine(LocationFactory(url), multipart_size=0)
    found = settings(
        PROFILES["ci"],
        max_examples=examples,
        derandomize=True,
        phases=[Phase.explicit, Phase.generate],
    )
    with pytest.raises(InvariantViolation) as caught:
        run_state_machine_as_test(machine, settings=found)
    return caught.value.invariant


def _crash_point_violations(url: str) -> set[str]:
    return {failure.invariant for failure in run_crash_points(LocationFactory(url)).failures}


class ReplacingPosixDriver(PosixDriver):
    """Broken: the publishing rename replaces an existing step."""

    def rename_noreplace(self, src: str, dst: str) -> None:
        target = self._abs(dst)
        with self._translate("rename", src):  # broken in one way only: errors still translated
            if os.path.isdir(target):
                shutil.rmtree(target)
            os.rename(self._abs(src), target)


class NoParentFsyncCommit(RenameCommit):
    """Broken: the root is not fsynced after the publishing rename."""

    def publish(self, manifest: Manifest) -> None:
        staging = self.staging_dir(manifest.step, manifest.attempt)
        handle = self.driver.create(f"{staging}/{MANIFEST_NAME}")
        self.driver.write(handle, manifest.encode())
        self.driver.fsync(handle)
        self.driver.close(handle)
        for directory in directories_of(manifest):
            self.driver.fsync_dir(f"{staging}/{DATA_DIR}/{directory}")
        self.driver.fsync_dir(f"{staging}/{DATA_DIR}")
        self.driver.fsync_dir(staging)
        self.driver.rename_noreplace(staging, step_token(manifest.step))


class ShardsNotSyncedCommit(RenameCommit):
    """Broken: the manifest is made durable, the shards are not."""

    def open_shard(self, step: int, attempt: str, name: str, size_hint: Any = None) -> Any:
        sink = super().open_shard(step, attempt, name, size_hint)
        driver, handle, locator = sink._driver, sink._handle, sink._locator  # type: ignore[attr-defined]

        def close_without_fsync() -> dict[str, str]:
            driver.close(handle)
            return {"path": locator}

        sink.close = close_without_fsync  # type: ignore[method-assign]
        return sink


class LatestFirstCommit(ConditionalPutCommit):
    """Broken: LATEST is advanced before the manifest is published."""

    def publish(self, manifest: Manifest) -> None:
        self.advance_latest_hint(manifest.step)
        super().publish(manifest)


class GreedyGcCommit(RenameCommit):
    """Broken: GC ignores the grace period."""

    def collect_garbage(self, *, grace_s: float, now: float, dry_run: bool) -> Any:
        return super().collect_garbage(grace_s=0.0, now=now, dry_run=dry_run)


class OverwritingMemoryDriver(MemoryDriver):
    """Broken: a conditional put that silently overwrites."""

    def put(self, key: str, data: Any, **kwargs: Any) -> Any:
        return super().put(key, data)


def _posix(cls: type[RenameCommit], driver_cls: type[PosixDriver] = PosixDriver) -> Any:
    return lambda url, options: cls(driver_cls(url.path))


def test_replacing_rename_is_caught_as_i5(tmp_path: Any, scheme: Any) -> None:
    scheme("broken-replace", _posix(RenameCommit, ReplacingPosixDriver))
    assert _machine_violation(f"broken-replace://{tmp_path}") == "I5"


def test_missing_parent_fsync_is_caught_by_power_loss_as_i2(tmp_path: Any, scheme: Any) -> None:
    result = run_power_loss(NoParentFsyncCommit(PosixDriver(str(tmp_path))))
    assert "I2" in {failure.invariant for failure in result.failures}
    # ... and only the power-loss layer can see it: real crashes leave the cache intact
    scheme("broken-nofsync", _posix(NoParentFsyncCommit))
    assert run_crash_points(LocationFactory(f"broken-nofsync://{tmp_path}/crash")).failures == []


def test_latest_before_publish_is_caught_as_i1(scheme: Any) -> None:
    scheme("broken-latest", lambda url, options: LatestFirstCommit(
        MemoryDriver(get_bucket(url.netloc), url.path)))  # fmt: skip
    assert "I1" in _crash_point_violations(f"broken-latest://latest-{os.getpid()}/run")


def test_manifest_durable_before_shards_is_caught_as_i1(tmp_path: Any) -> None:
    result = run_power_loss(ShardsNotSyncedCommit(PosixDriver(str(tmp_path))))
    assert "I1" in {failure.invariant for failure in result.failures}


def test_read_without_checksum_is_caught_as_i6(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    original = ShardReader._finish

    def finish_without_crc(self: ShardReader) -> None:
        self.record = type(self.record)(
            self.record.name, self.record.size, self._crc.hexdigest(), self.record.locator
        )
        original(self)

    monkeypatch.setattr(ShardReader, "_finish", finish_without_crc)
    assert _machine_violation(f"file://{tmp_path}") == "I6"


def test_gc_ignoring_the_grace_period_is_caught_as_i7(tmp_path: Any, scheme: Any) -> None:
    scheme("broken-gc", _posix(GreedyGcCommit))
    assert _machine_violation(f"broken-gc://{tmp_path}") == "I7"


def test_retention_deleting_the_newest_is_caught_as_i3(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    def careless_retention(self: Store, policy: Any = None) -> list[int]:
        steps = self._history.steps()
        for step in steps[1:]:  # keeps the oldest instead of the newest
            self._history.unpublish(step)
        return steps[1:]

    monkeypatch.setattr(Store, "apply_retention", careless_retention)
    assert "I3" in _crash_point_violations(f"file://{tmp_path}")


def test_overwriting_conditional_put_is_caught_as_i5_and_by_the_probe(scheme: Any) -> None:
    bucket = f"overwrite-{os.getpid()}"
    scheme("broken-put", lambda url, options: ConditionalPutCommit(
        OverwritingMemoryDriver(get_bucket(url.netloc), url.path)))  # fmt: skip
    url = f"broken-put://{bucket}/run"
    with pytest.raises(CapabilityError, match="If-None-Match"):
        ckptstore.open(url).begin(1)  # a writer refuses such storage outright...
    location = LocationFactory(url)()  # ... and the suite, which measures it, reports it
    probes = {p.capability: p for p in run_probes(location)}
    assert probes["conditional-create"].declared
    assert probes["conditional-create"].measured == VIOLATED
    assert _machine_violation(url) == "I5"


# -- a failing storage is a storage error: neither a pass nor a violation -----------------


class FailingLists:
    """Broken storage, not a broken protocol: listings under the suite's own locations answer
    500, as if the driver's retries had run out; the first ``times`` of them (None: all)."""

    def __init__(self, times: int | None) -> None:
        self.times, self.failed = times, 0
        self._lock = threading.Lock()

    def _fails(self, driver: MemoryDriver) -> bool:
        if "conformance-" not in driver.prefix:  # the URL's root: the suite can start
            return False
        with self._lock:  # crash cases run four at a time
            self.failed += 1
            return self.times is None or self.failed <= self.times

    def open(self, url: Any, options: Any) -> ConditionalPutCommit:
        storage = self

        class ListFailingMemoryDriver(MemoryDriver):
            def list(self, prefix: str, *, start_after: str | None = None) -> Any:
                if storage._fails(self):
                    raise TransientStorageError(
                        f"ListObjectsV2 {prefix!r}: InternalError", http_status=500
                    )
                return super().list(prefix, start_after=start_after)

        strategy = open_memory(url, options)
        return strategy.with_driver(ListFailingMemoryDriver(strategy.driver.bucket, url.path))


@pytest.fixture
def failing_lists(scheme: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """``make(times)``: the URL of a memory store whose listings fail ``times`` times (None:
    always), with no pause between the suite's runs of a case."""
    monkeypatch.setattr(outcomes, "RETRY_PAUSE_S", 0.0)
    bucket = f"failing-{os.getpid()}"

    def make(times: int | None) -> str:
        scheme("failing-list", FailingLists(times).open)
        return f"failing-list://{bucket}/run?{MEMORY_OPTIONS}"

    yield make
    drop_bucket(bucket)


def test_a_storage_that_keeps_failing_is_reported_as_a_storage_error(
    tmp_path: Any, failing_lists: Any
) -> None:
    out = io.StringIO()
    status = main(
        [
            "conformance", failing_lists(None),
            "--json-file", str(tmp_path / "r.json"), "--junit", str(tmp_path / "r.xml"),
        ],
        out,
    )  # fmt: skip
    text = out.getvalue()
    assert status == 2, text  # neither 0 (a pass) nor 1 (a violation)
    assert "VIOLATED" not in text
    assert "STORAGE ERRORS on failing-list://" in text
    assert "not violations" in text
    assert "InternalError" in text  # the storage's own message, as evidence
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["ok"] is False
    assert report["outcome"] == "storage error"
    backend = report["backends"][0]
    assert backend["outcome"] == "storage error"
    assert {v["status"] for v in backend["invariants"].values()} == {"storage error"}
    measured = {p["capability"]: p["measured"] for p in backend["capabilities"]}
    assert measured["strong-list-after-write"] == "storage error"  # its probe lists
    assert measured["conditional-create"] == "held"  # it does not
    junit = (tmp_path / "r.xml").read_text()
    assert '<error message="storage error"' in junit
    assert "<failure" not in junit


def test_a_case_the_storage_fails_is_run_again_and_then_judged(failing_lists: Any) -> None:
    result = run_crash_points(LocationFactory(failing_lists(2)), limit=3)
    assert result.retried >= 1  # the run without a crash met a 500, and was run again
    assert result.storage_errors == []
    assert result.failures == []
    # A save reads (its epoch, whether the step exists) before its first write: the run
    # without a crash, then a crash before the first write (the reads before it share that
    # crash's state) and one after it.
    assert [record.reads_only for record in result.records[:3]] == [True, True, False]
    assert result.cases == 1 + 1 + 1


def test_the_state_machine_stops_at_a_storage_failure_and_runs_again(
    failing_lists: Any,
) -> None:
    url = failing_lists(2)
    machine = make_state_machine(LocationFactory(url), multipart_size=0)
    run_state_machine(machine, settings(PROFILES["ci"], max_examples=3))  # third run: clean
    always = make_state_machine(LocationFactory(failing_lists(None)), multipart_size=0)
    with pytest.raises(
        StorageFailure, match=r"not an invariant violation \(the storage failed all 3 runs\)"
    ):
        run_state_machine(always, settings(PROFILES["ci"], max_examples=3))


def _from(error: BaseException, cause: BaseException) -> BaseException:
    error.__cause__ = cause  # as ``raise error from cause`` leaves it
    return error


def test_only_the_storage_own_failures_are_storage_errors() -> None:
    server = TransientStorageError("InternalError", http_status=500)
    assert storage_failure(server) is server
    broke_a_check = _from(InvariantViolation("I7", "a live save failed"), server)
    assert storage_failure(broke_a_check) is server  # undecided, not I7
    injected = InjectedTimeoutError(110, "injected timeout")
    assert storage_failure(injected) is None  # the suite's own fault...
    assert storage_failure(_from(CkptStoreError("outcome unknown"), injected)) is None  # and so
    gone = ObjectNotFoundError(2, "attempt removed by garbage collection")
    assert storage_failure(_from(StorageError(5, "cannot publish"), gone)) is None  # an answer
    assert storage_failure(InvariantViolation("I1", "torn")) is None


# -- the crash-point layer runs each distinct crash state --------------------------------

_ATTEMPT_ID = re.compile(r"[0-9a-z]{6,}[0-9a-f]{16}")


def _storage_after_crash(location: Location, index: int, mode: CrashMode) -> list[str]:
    """What the storage holds after the standard workload dies at call ``index`` (``mode``)."""
    injectors: list[FaultInjector] = []
    opener = location.open

    def open_and_keep(plan: FaultPlan | None = None, retention: Any = None) -> Any:
        store, injector = opener(plan, retention)
        injectors.append(injector)
        return store, injector

    location.open = open_and_keep  # type: ignore[method-assign]
    plan = FaultPlan(crash_at=index, crash_mode=mode)
    with pytest.raises(SimulatedCrash):
        standard_workload(location, plan, Model(), big_shard_size(location))
    assert [injector.overlapped for injector in injectors] == [False]
    return sorted(_ATTEMPT_ID.sub("<attempt>", name) for name in location.raw_names())


@pytest.mark.parametrize("url", ["file", "memory"])
def test_a_crash_after_a_call_leaves_what_a_crash_before_the_next_leaves(
    url: str, tmp_path: Any
) -> None:
    """The premise on which the layer runs one crash per call, not two."""
    base = (
        f"file://{tmp_path}/dedup"
        if url == "file"
        else f"memory://dedup-{os.getpid()}/run?{MEMORY_OPTIONS}"
    )
    factory = LocationFactory(base)
    result = run_crash_points(factory, limit=0)
    assert result.calls > 20 and not result.overlapped

    def storage(index: int, mode: CrashMode) -> list[str]:
        location = factory()
        try:
            return _storage_after_crash(location, index, mode)
        finally:
            location.destroy()

    before = [storage(index, CrashMode.BEFORE) for index in range(result.calls)]
    for index in range(result.calls - 1):
        assert storage(index, CrashMode.AFTER) == before[index + 1], f"call {index}"
    # And a call that only reads shares its crash with the next call: the storage is the same.
    reads = [r for r in result.records[:-1] if r.reads_only]
    assert result.reads >= len(reads) > 10
    for record in reads:
        assert before[record.index] == before[record.index + 1], str(record)
    # Skipped are only reads after which the model and the clock stood as before.
    cases = crash_cases(result.records, overlapped=False)
    run = {index for index, mode in cases if mode is CrashMode.BEFORE}
    for record, following in itertools.pairwise(result.records):
        if record.index not in run:
            assert record.reads_only and record.context == following.context, str(record)
    assert len(cases) < result.calls


class _TwoAtOnceDriver(MemoryDriver):
    """Each ``head`` waits until two calls are in it at once."""

    barrier = threading.Barrier(2, timeout=30)

    def head(self, key: str) -> Any:
        self.barrier.wait()
        return super().head(key)


def test_concurrent_calls_are_noticed_and_both_crash_modes_are_then_run() -> None:
    driver = open_memory(parse_url(f"memory://overlap-{os.getpid()}/run"), {}).driver
    driver.__class__ = _TwoAtOnceDriver
    injector = FaultInjector(driver)
    threads = [threading.Thread(target=_head_missing, args=(injector,)) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert injector.overlapped
    sequential = FaultInjector(open_memory(parse_url(f"memory://seq-{os.getpid()}/r"), {}).driver)
    _head_missing(sequential)
    _head_missing(sequential)
    assert not sequential.overlapped


def _head_missing(driver: Any) -> None:
    with pytest.raises(ObjectNotFoundError):
        driver.head("missing")
