"""The run's time budget bounds the whole run, says what it cut, and never cuts what must
run (issue 26, items 11 and 12).

Crash points stop starting cases when their share of the budget is spent, and the report
says how many were left out; the property-based layer runs at least 25 examples in ``ci``
whatever the machine's load, unless the storage is slow (networked: then it says so);
shrinking gets a guaranteed share past the layer's deadline.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Iterator
from typing import Any

import pytest

from ckptstore.backends.memory import drop_bucket
from ckptstore.conformance.layers import crash_points, property_based
from ckptstore.conformance.layers.layer import Findings, SuiteRun
from ckptstore.conformance.location import LocationFactory
from ckptstore.conformance.machine import shrinking
from ckptstore.conformance.report import BackendReport, render_text, to_json
from ckptstore.conformance.runner import record

_buckets = itertools.count()


@pytest.fixture
def url() -> Iterator[str]:
    name = f"budget-{os.getpid()}-{next(_buckets)}"
    yield f"memory://{name}/run?min_part_size=1024&part_size=1024"
    drop_bucket(name)


def test_crash_points_past_their_share_of_the_budget_are_left_out_and_said(url: str) -> None:
    # the run began four budgets ago: the crash points' time is spent
    run = SuiteRun(LocationFactory(url), deadline=time.monotonic() - 180.0, budget_s=60.0)
    found = Findings()
    crash_points.run_layer(run, found)
    cut = found.cut_short["crash points"]
    assert cut.endswith("crash cases not run") and not cut.startswith("0 ")
    assert found.checked  # the workload ran through once: what ran is checked
    report = BackendReport(url=url, strategy="test")
    record(report, found)
    assert f"  cut short by the budget: crash points: {cut} (a larger --budget runs it)" in (
        render_text([report])
    )
    assert '"crash points": "' in to_json([report])
    whole = Findings()
    crash_points.run_layer(SuiteRun(LocationFactory(url)), whole)  # no budget: every case
    assert whole.cut_short == {}


def _machine_run(url: str, call_s: float, monkeypatch: pytest.MonkeyPatch) -> tuple[int, Any, Any]:
    """The property-based layer with its deadline spent, as it would be after slow layers;
    the number of examples it chose, its findings and its settings (the state machine is not
    run)."""
    chosen: list[Any] = []

    def counted(found: Findings, machine: Any, settings: Any, *args: Any) -> str:
        chosen.append(settings)
        return ""

    monkeypatch.setattr(property_based, "machine_findings", counted)
    run = SuiteRun(LocationFactory(url), deadline=time.monotonic(), budget_s=60.0)
    run.layer_deadline = time.monotonic()
    run.multipart_size = 0
    run.call_s = call_s
    found = Findings()
    property_based.run_layer(run, found)
    return chosen[0].max_examples, found, chosen[0]


def test_at_least_25_examples_run_whatever_the_load(
    url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 26 item 11: five examples ran on 7 of 8 backends when the machine was loaded."""
    examples, found, settings = _machine_run(url, 0.02, monkeypatch)  # an emulator, loaded
    assert examples == property_based.MIN_EXAMPLES["ci"] == 25
    assert found.cut_short["property-based"] == "25 of 40 examples (at least 25 always run)"
    assert settings.stateful_step_count == property_based.NETWORKED_STEPS["ci"] == 12
    examples, found, settings = _machine_run(url, 0.0002, monkeypatch)  # a local disk
    assert examples == 25 and settings.stateful_step_count == 20


def test_only_slow_storage_gets_fewer_examples_and_the_report_says_why(
    url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    examples, found, _ = _machine_run(url, 0.1, monkeypatch)  # a request takes 100 ms
    assert examples == property_based.SLOW_MIN_EXAMPLES == 5
    assert found.cut_short["property-based"] == (
        "5 of 40 examples (the storage is slow: a request took 100 ms, an example about 36 s)"
    )


def test_shrinking_gets_its_share_past_the_deadline() -> None:
    """Issue 26 item 12: a failure found at the deadline was left unshrunk."""
    from hypothesis.internal.conjecture import engine

    with shrinking.shrinking_stops_at(time.monotonic() - 5, least_s=15.0):
        limit = engine.MAX_SHRINKING_SECONDS
        now = time.perf_counter()
        assert now + limit == pytest.approx(now + 15.0)  # as the engine adds it
    with shrinking.shrinking_stops_at(time.monotonic() + 30, least_s=15.0):
        now = time.perf_counter()
        assert now + engine.MAX_SHRINKING_SECONDS == pytest.approx(now + 30, abs=0.5)
