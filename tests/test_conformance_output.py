"""Output a storage engineer can act on (issue 26, item 10): progress lines that name their
backend, and ckptstore's own warnings during a run counted in the report instead of printed."""

from __future__ import annotations

import io
import json
import logging
import os
import re
import threading
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest

from ckptstore.backends.memory import drop_bucket
from ckptstore.cli import main
from ckptstore.conformance import runner
from ckptstore.conformance.batch import run_targets
from ckptstore.conformance.layers.layer import Layer, SuiteRun
from ckptstore.conformance.library_log import captured
from ckptstore.conformance.location import LocationFactory
from ckptstore.conformance.report import render_text
from ckptstore.conformance.runner import LIBRARY_LOG, Target

SECRET = "hunter2-not-to-be-shown"


def _logging_layer(messages: list[str]) -> Layer:
    """A layer that says a progress line and logs what ckptstore logs about injected faults,
    naming its store (``{url}`` is filled in), from a thread of its own as layers do."""

    def run(run: SuiteRun, found: Any) -> None:
        run.say("racing")
        url = run.locations.base_url

        def log() -> None:
            for message in messages:
                logging.getLogger("ckptstore.store").warning(message, url)

        thread = threading.Thread(target=log)
        thread.start()
        thread.join()
        found.check("I1")

    return Layer("logging layer", ("I1",), run, doc="logs", announce="")


@pytest.fixture
def buckets() -> Iterator[list[str]]:
    names = [f"output-{os.getpid()}-{n}" for n in range(2)]
    yield names
    for name in names:
        drop_bucket(name)


def test_warnings_of_a_run_are_counted_in_its_report_and_not_printed(
    buckets: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    messages = ["skipping damaged step 4 of %s", "ignoring the LATEST hint of %s: it holds b' 7'"]
    monkeypatch.setattr(runner, "layers_for", lambda kind: [_logging_layer(messages)])
    out = io.StringIO()
    status = main(["conformance", f"memory://{buckets[0]}/run"], out)
    err = capsys.readouterr().err
    assert status == 0, out.getvalue() + err
    assert "skipping damaged step" not in err and "LATEST hint" not in err
    line = next(line for line in out.getvalue().splitlines() if LIBRARY_LOG in line)
    assert "ckptstore logged 2 warnings during the run, not printed" in line
    assert f"the first: skipping damaged step 4 of memory://{buckets[0]}/run" in line
    assert logging.getLogger("ckptstore").propagate  # restored after the run


def test_runs_at_once_each_count_the_warnings_about_their_own_store(
    buckets: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(
        runner, "layers_for", lambda kind: [_logging_layer(["lagging listing under %s"])]
    )
    said: list[str] = []
    targets = [Target(f"memory://{bucket}/run?min_part_size=1024") for bucket in buckets]
    reports = run_targets(targets, jobs=2, progress=said.append)
    for bucket, report in zip(buckets, reports, strict=True):
        line = report.coverage[LIBRARY_LOG]
        assert f"the first: lagging listing under memory://{bucket}/run" in line, line
        assert "logged 1 warning during" in line
    # Each progress line names its backend, not only its index.
    for number, bucket in enumerate(buckets, 1):
        assert f"[{number}/2 memory://{bucket}/run] racing" in said, said


def test_a_record_that_names_no_store_goes_to_every_run_and_secrets_are_redacted() -> None:
    logger = logging.getLogger("ckptstore.driver")
    with captured("s3://bucket-a/run") as first, captured("s3://bucket-b/run") as second:
        logger.warning("a server error for s3://key:%s@host/x", SECRET)
        logger.info("not captured: below a warning")
    for run in (first, second):
        assert run.count == 1
        assert SECRET not in run.line() and "a server error" in run.line()
    assert not logging.getLogger("ckptstore").handlers  # the capture is gone


def test_a_record_of_a_thread_older_than_the_run_is_not_counted_but_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A thread that ran before the suite began (an application's, a test's leftover) is not
    the suite's: its record about no run going is logged as usual, and counted in no run."""
    import threading

    logger = logging.getLogger("ckptstore.tiers")
    go, done = threading.Event(), threading.Event()

    def leftover() -> None:
        go.wait(30)
        logger.warning("a replicator of another store gave up")
        done.set()

    older = threading.Thread(target=leftover)
    older.start()
    with caplog.at_level(logging.WARNING, logger="ckptstore"):
        with captured("s3://bucket-a/run") as run:
            go.set()
            assert done.wait(30)
            newer = threading.Thread(target=lambda: logger.warning("a racer of the suite"))
            newer.start()
            newer.join()
            logger.warning("the suite's own")
        older.join()
    assert run.count == 2 and "a racer of the suite" in run.line(), run
    assert [r.getMessage() for r in caplog.records] == ["a replicator of another store gave up"]


def test_a_record_of_an_older_thread_reaches_logging_s_last_resort_where_nothing_is_set_up(
    capfd: pytest.CaptureFixture[str],
) -> None:
    """An application that never configured logging still sees ckptstore's warnings of its own
    threads on stderr while the suite runs, as without it (``logging.lastResort``)."""
    import threading

    root = logging.getLogger()
    saved = root.handlers[:]
    root.handlers = []  # nothing set up (pytest's own capture handlers aside)
    go, done = threading.Event(), threading.Event()

    def application_thread() -> None:
        go.wait(30)
        logging.getLogger("ckptstore.store").warning("the application's own warning")
        done.set()

    older = threading.Thread(target=application_thread)
    older.start()
    try:
        with captured("s3://bucket-a/run") as run:
            go.set()
            assert done.wait(30)
    finally:
        older.join()
        root.handlers = saved
    assert run.count == 0
    assert "the application's own warning" in capfd.readouterr().err


def test_the_report_prints_the_count(buckets: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runner, "layers_for", lambda kind: [_logging_layer(["damaged %s"])])
    report = runner.run_backend(f"memory://{buckets[1]}/run")
    assert f"  {LIBRARY_LOG}: ckptstore logged 1 warning during" in render_text([report])


# -- a failure replayed alone from the report (item 12) --------------------------------------


@pytest.fixture
def blind_marker(buckets: list[str]) -> Iterator[str]:
    """A broken backend the state machine catches (I7) within a few examples, the same way
    every time: GC that ignores the grace period (no race, no timing in it)."""
    from ckptstore import registry
    from ckptstore.backends.memory import MemoryDriver, get_bucket
    from ckptstore.commit.conditional_put import ConditionalPutCommit

    class GreedyGc(ConditionalPutCommit):
        def collect_garbage(self, *, grace_s: float, now: float, dry_run: bool) -> Any:
            return super().collect_garbage(grace_s=0.0, now=now, dry_run=dry_run)

    def open_variant(url: Any, options: Any) -> Any:
        bucket = get_bucket(url.netloc, min_part_size=1024)
        return GreedyGc(MemoryDriver(bucket, url.path), part_size=1024)

    registry.register("greedy-gc-replay", open_variant, replace=True)
    yield f"greedy-gc-replay://{buckets[0]}/run"
    registry.unregister("greedy-gc-replay")


@pytest.mark.parametrize("steps", [None, 12], ids=["profile-steps", "networked-steps"])
def test_a_failing_example_is_replayed_alone_from_the_report(
    steps: int | None, blind_marker: str, tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """With examples of fewer steps than the profile's (networked storage), the command names
    the step count: a blob replays only under the step count it was found with."""
    from hypothesis import Phase, settings

    from ckptstore.conformance.layers.layer import Findings
    from ckptstore.conformance.layers.property_based import machine_findings
    from ckptstore.conformance.location import LocationFactory
    from ckptstore.conformance.machine import PROFILES, make_state_machine
    from ckptstore.conformance.reproducible import same_examples

    found = Findings()
    machine = make_state_machine(LocationFactory(blind_marker))
    derandomized = settings(
        PROFILES["ci"],
        max_examples=100,
        derandomize=True,
        phases=[Phase.generate],
        stateful_step_count=steps or PROFILES["ci"].stateful_step_count,
    )
    with same_examples():
        machine_findings(found, machine, derandomized, None)
    (invariant, evidence), *_ = found.violations
    replay = re.search(
        rf"replay it alone: ckptstore conformance {re.escape(blind_marker)} --reproduce (\S+)",
        evidence,
    )
    assert replay, evidence
    assert replay.group(1).endswith(f":{steps}") == (steps is not None), replay.group(1)
    report_file = tmp_path / "replay.json"
    out = io.StringIO()
    command = ["conformance", blind_marker, "--reproduce", replay.group(1)]
    status = main([*command, "--json-file", str(report_file)], out)
    assert status == 1, out.getvalue() + capsys.readouterr().err
    backend = json.loads(report_file.read_text())["backends"][0]
    assert backend["invariants"][invariant]["status"] == "violated"
    replayed = backend["invariants"][invariant]["evidence"][0]
    assert replayed.split(":")[0] == evidence.split(":")[0]  # the same failure (not names)
    assert backend["coverage"]["property-based"].startswith("replayed one example (--reproduce)")
    assert set(backend["coverage"]) <= {"property-based", LIBRARY_LOG}  # nothing else ran
    # On a sound store the same example holds, and the report says it did not fail again.
    sound = f"memory://{blind_marker.split('//')[1].split('/')[0]}/sound"
    out = io.StringIO()
    assert main(["conformance", sound, "--reproduce", replay.group(1)], out) == 0
    assert "the example passed this time: it did not fail again" in out.getvalue()


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("not-a-blob", "--reproduce takes VERSION:BLOB"),
        ("6.170.17:!!!", "--reproduce takes VERSION:BLOB"),
        ("6.170.17:AXic:0", "--reproduce takes VERSION:BLOB[:STEPS]"),
        ("6.170.17:AXic:twelve", "--reproduce takes VERSION:BLOB[:STEPS]"),
        ("1.0.0:AXicY2BkAAAABQAC", "the example was found with hypothesis 1.0.0"),
    ],
)
def test_a_reproduction_that_cannot_be_replayed_is_a_clear_error(
    value: str, message: str, buckets: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    status = main(["conformance", f"memory://{buckets[1]}/run", "--reproduce", value])
    assert status == 2
    assert message in capsys.readouterr().err


def test_reproduce_takes_one_url(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["conformance", "--reproduce", "6.170.17:AXic"]) == 2
    assert "replays an example on the one URL" in capsys.readouterr().err


def test_a_racer_processs_warnings_are_counted_by_the_leader_and_not_printed(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """The process races' racers printed ckptstore's warnings to the terminal ("the server
    deletes the live object ...", three times in a default run on gs+versioned): they go to
    the leading process now, whose run counts them in the report."""
    from ckptstore.conformance.layers import races
    from ckptstore.store import Store

    warm = races._process_context().Process(target=int)
    warm.start()  # the fork server runs from here on, with the environment of now
    warm.join(30)
    url = f"file://{tmp_path}/store"
    # The URL is in this run's environment: a racer forks from the fork server, whose own
    # environment is the one it started with (an earlier test's race), and takes the run's.
    monkeypatch.setenv("CKPTSTORE_TEST_RACER_URL", url)
    (tmp_path / "racer_warns.py").write_text(
        "import logging, os\n"
        "logging.getLogger('ckptstore.backends.test').warning("
        "'%s: the racer saw something odd', os.environ['CKPTSTORE_TEST_RACER_URL'])\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    location = LocationFactory(url)()
    Store(location.base).save(races.SEED_STEP, {"seed.bin": b"seed"})
    context = races._process_context()
    sync = races._Sync(context.Barrier(2), context.Barrier(1), context.Barrier(2),
                       context.Queue(), context.Event())  # fmt: skip
    source = races.ChildSource.of(location)
    source = replace(source, options={}, modules=("racer_warns",))
    racer = context.Process(target=races._writer, args=(source, 0, [], sync), daemon=True)
    with captured(url) as log:
        racer.start()
        try:
            outcome = races._Collector(sync, [racer]).get()
        finally:
            racer.join(30)
    assert outcome.kind == "ready", outcome
    assert log.count == 1 and "the racer saw something odd" in log.example, log
    assert "the racer saw something odd" not in capfd.readouterr().err
