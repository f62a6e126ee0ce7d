"""The checkpoint interval: Young's and Daly's formulas, the table, and ``ckptstore advise`` on
stores written by the example trainer, checked against the timings its manifests recorded."""

from __future__ import annotations

import importlib.util
import io
import json
import math
import re
import statistics
import sys
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest

import ckptstore
from ckptstore.cli import main
from ckptstore.errors import CkptStoreError, InvalidOptionError, NotEnoughSavesError
from ckptstore.interval import (
    MIN_RESTARTS,
    advise,
    advise_from_manifests,
    daly_interval,
    mtbi_from_run_starts,
    save_cost,
    time_lost,
    young_interval,
)
from ckptstore.manifest import Manifest, WriterInfo

EXAMPLE = Path(__file__).parent.parent / "examples" / "train_resume.py"
T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
HOUR = 3600.0


def run(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    return main(list(argv), out), out.getvalue()


def manifest(step: int, started_s: float, **timings: float) -> Manifest:
    """A manifest whose save began ``started_s`` seconds after T0 and recorded ``timings``."""
    started = T0 + timedelta(seconds=started_s)
    return Manifest(
        step=step,
        attempt="a" * 16,
        shards=(),
        writer=WriterInfo("host", 1),
        created_at=started,
        committed_at=started + timedelta(seconds=timings.get("write_s", 0.0)),
        timings=timings,
    )


# -- the formulas --------------------------------------------------------------------------


def test_young_is_sqrt_2cm_and_balances_saving_against_lost_work() -> None:
    cost, mtbi = 30.0, 6 * HOUR
    young = young_interval(cost, mtbi)
    assert young == math.sqrt(2 * cost * mtbi)
    overhead, lost = time_lost(young, cost, mtbi)
    assert overhead == pytest.approx(lost)  # C/T = T/2M exactly at the optimum
    waste = sum(time_lost(young, cost, mtbi, restart_s=60))
    for other in (0.5 * young, 0.9 * young, 1.1 * young, 2 * young):
        assert sum(time_lost(other, cost, mtbi, restart_s=60)) > waste  # R shifts, never moves


def test_daly_refines_young_by_terms_in_the_cost() -> None:
    for cost, mtbi in [(30.0, 6 * HOUR), (0.05, HOUR), (600.0, 2 * HOUR)]:
        ratio = cost / (2 * mtbi)
        # sqrt(2CM)·sqrt(C/2M) = C: Daly = Young - 2C/3 + C·sqrt(C/2M)/9
        expected = math.sqrt(2 * cost * mtbi) - 2 * cost / 3 + cost * math.sqrt(ratio) / 9
        assert daly_interval(cost, mtbi) == pytest.approx(expected, rel=1e-12)
        assert daly_interval(cost, mtbi) < young_interval(cost, mtbi)
    assert daly_interval(30.0, 6 * HOUR) == pytest.approx(young_interval(30.0, 6 * HOUR), rel=0.02)
    assert daly_interval(3 * HOUR, HOUR) == HOUR  # a save longer than 2M: save every M


@pytest.mark.parametrize("bad", [0.0, -1.0, math.inf, math.nan])
def test_formulas_refuse_what_is_not_a_positive_duration(bad: float) -> None:
    with pytest.raises(InvalidOptionError):
        young_interval(1.0, bad)
    with pytest.raises(InvalidOptionError):
        daly_interval(bad, HOUR)


def test_mtbi_from_run_starts_needs_enough_restarts() -> None:
    starts = [T0 + timedelta(hours=5 * n) for n in range(MIN_RESTARTS + 1)]
    assert mtbi_from_run_starts(starts[:-1]) is None  # one restart too few
    assert mtbi_from_run_starts(reversed(starts)) == 5 * HOUR
    later = starts[-1] + timedelta(hours=10)  # the run since the last restart counts too
    assert mtbi_from_run_starts(starts, now=later) == (15 + 10) * HOUR / MIN_RESTARTS


# -- what a save cost the trainer ----------------------------------------------------------


def test_save_cost_is_the_blocked_time_of_async_saves_and_the_whole_of_sync_ones() -> None:
    asynchronous = save_cost(manifest(1, 0, blocked_s=0.2, to_commit_s=9.0, write_s=8.5))
    assert asynchronous is not None
    assert (asynchronous.seconds, asynchronous.asynchronous) == (0.2, True)
    synchronous = save_cost(manifest(1, 0, snapshot_s=0.5, write_s=4.0))  # save_state
    assert synchronous is not None
    assert (synchronous.seconds, synchronous.asynchronous) == (4.5, False)
    plain = save_cost(manifest(1, 0, write_s=3.0))  # store.save, a pushed directory
    assert plain is not None and plain.seconds == 3.0
    assert save_cost(manifest(1, 0)) is None


def test_advice_from_manifests_with_known_timings() -> None:
    # Synchronous saves of 10 s (2 s snapshot + 8 s write) every 100 steps, 100 s of training
    # between them: a save begins (after its snapshot) 8 s + 100 s + 2 s after the last one.
    manifests = [manifest(100 * n, 110.0 * n, snapshot_s=2.0, write_s=8.0) for n in range(1, 6)]
    advice = advise_from_manifests(manifests, mtbi=timedelta(hours=6), restart=60)
    assert (advice.saves, advice.asynchronous, advice.cost.median) == (5, 0, 10.0)
    assert advice.current_interval_s == pytest.approx(100.0)
    assert advice.current_steps == 100
    assert advice.steps_per_s == pytest.approx(1.0)
    assert advice.young_s == math.sqrt(2 * 10.0 * 6 * HOUR)
    assert advice.recommended_s == daly_interval(10.0, 6 * HOUR)
    assert advice.recommended_steps == round(advice.recommended_s)
    labels = [row.label for row in advice.table]
    assert labels == ["current", "x0.25", "x0.5", "recommended (Daly)", "Young sqrt(2CM)", "x2",
                      "x4"]  # fmt: skip
    intervals = [row.interval_s for row in advice.table]
    assert intervals == sorted(intervals)
    current = advice.table[0]
    assert (current.overhead, current.lost) == pytest.approx((0.1, (50 + 60) / (6 * HOUR)))
    best = min(advice.table, key=lambda row: row.waste)
    assert best.label.startswith(("recommended", "Young"))


def test_async_saves_count_their_blocked_time_and_train_while_writing() -> None:
    # Each save blocks 1 s then writes for 50 s in the background, while 200 steps train in
    # 100 s: the next save begins 100 s + its own 1 s block after the last one began.
    manifests = [
        manifest(200 * n, 101.0 * n, blocked_s=1.0, to_commit_s=50.0, write_s=49.0)
        for n in range(1, 5)
    ]
    advice = advise_from_manifests(manifests, mtbi=2 * HOUR)
    assert (advice.cost.median, advice.asynchronous) == (1.0, 4)
    assert advice.current_interval_s == pytest.approx(100.0)
    assert advice.steps_per_s == pytest.approx(2.0)
    assert advice.young_s == math.sqrt(2 * 1.0 * 2 * HOUR)


def test_a_restart_between_saves_does_not_drag_the_step_rate_down() -> None:
    starts = [0.0, 110.0, 220.0, 330.0 + 3 * HOUR, 440.0 + 3 * HOUR]  # down 3 h after step 300
    manifests = [manifest(100 * n, s, write_s=10.0) for n, s in enumerate(starts, 1)]
    advice = advise_from_manifests(manifests, mtbi=HOUR)
    assert advice.steps_per_s == pytest.approx(1.0)


def test_a_given_mtbi_wins_over_the_restarts_recorded_by_the_store() -> None:
    """Issue 24 item 8: the option was ignored once there were enough restarts (this test
    asserted that the restarts took precedence); a given M is the user's word."""
    manifests = [manifest(n, 20.0 * n, write_s=1.0) for n in range(1, 4)]
    starts = [T0 + timedelta(hours=2 * n) for n in range(MIN_RESTARTS + 1)]
    advice = advise_from_manifests(manifests, mtbi=HOUR, run_starts=starts)
    assert (advice.mtbi_s, advice.mtbi_source) == (HOUR, "option")
    advice = advise_from_manifests(manifests, run_starts=starts, now=starts[-1])
    assert (advice.mtbi_s, advice.mtbi_source) == (2 * HOUR, "restarts")
    later = starts[-1] + timedelta(hours=6)  # measured M runs to now, not to the last restart
    advice = advise_from_manifests(manifests, run_starts=starts, now=later)
    assert advice.mtbi_s == pytest.approx((6 + 6) * HOUR / MIN_RESTARTS)
    with pytest.raises(InvalidOptionError, match="--mtbi"):
        advise_from_manifests(manifests, run_starts=starts[:2])


def test_clear_errors_for_too_few_saves_no_timings_and_no_mtbi() -> None:
    with pytest.raises(NotEnoughSavesError, match=r"1 checkpoint.*at least 2"):
        advise_from_manifests([manifest(1, 0, write_s=1.0)], mtbi=HOUR)
    with pytest.raises(
        NotEnoughSavesError, match=r"0 checkpoint\(s\) with recorded timings \(of 3\)"
    ):
        advise_from_manifests([manifest(n, n) for n in range(3)], mtbi=HOUR)
    assert issubclass(NotEnoughSavesError, CkptStoreError)
    two = [manifest(1, 0, write_s=1.0), manifest(2, 10, write_s=1.0)]
    with pytest.raises(InvalidOptionError, match="--mtbi"):
        advise_from_manifests(two)
    with pytest.raises(InvalidOptionError):
        advise_from_manifests(two, mtbi=0)
    with pytest.raises(InvalidOptionError):
        advise_from_manifests(two, mtbi=HOUR, restart=-1)


# -- on stores written by the example trainer ----------------------------------------------


def _train(store: Path, *extra: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Run examples/train_resume.py in this process (4 saves, the newest 3 kept)."""
    torch = pytest.importorskip("torch")
    spec = importlib.util.spec_from_file_location("train_resume_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    monkeypatch.setattr(sys, "stdout", io.StringIO())
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    rng_state = torch.random.get_rng_state()
    try:
        args = ["--store", str(store), "--steps", "40", "--save-every", "10", "--width", "16"]
        assert example.main([*args, *extra]) == 0
    finally:  # the example sets process-wide torch state: give the other tests theirs back
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)
        torch.random.set_rng_state(rng_state)


def _recorded(store: Path) -> list[dict[str, float]]:
    """The timings of every checkpoint in ``store``, read here without ckptstore.interval."""
    opened = ckptstore.open(str(store), create=False)
    return [dict(opened.get(step).manifest.timings) for step in opened.steps()]


def _number(pattern: str, text: str) -> tuple[float, str]:
    match = re.search(pattern + r" ([0-9.]+) (ms|s|min|h)\b", text)
    assert match is not None, text
    return float(match.group(1)), match.group(2)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_advise_on_the_example_trainers_store_matches_sqrt_2cm(
    tmp_path: Path, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = tmp_path / "run"
    _train(store, *(["--async"] if mode == "async" else []), monkeypatch=monkeypatch)
    recorded = _recorded(store)
    assert len(recorded) == 3  # the example keeps the newest 3
    if mode == "async":  # the trainer's cost is the blocked time, not the write
        costs = [timings["blocked_s"] for timings in recorded]
    else:  # blocked throughout: the snapshot, then the store's write
        assert all("blocked_s" not in timings for timings in recorded)
        costs = [timings["snapshot_s"] + timings["write_s"] for timings in recorded]
    cost = statistics.median(costs)
    young = math.sqrt(2 * cost * 6 * HOUR)

    status, text = run("advise", str(store), "--mtbi", "6h", "--json")
    assert status == 0, text
    document = json.loads(text)
    assert document["cost_s"]["median"] == pytest.approx(cost, rel=1e-9)
    assert document["cost_s"]["asynchronous"] == (3 if mode == "async" else 0)
    assert document["young_s"] == pytest.approx(young, rel=1e-9)
    recommended = document["recommended"]
    assert recommended["interval_s"] == pytest.approx(young, rel=0.01)  # Daly: C << M
    rate = document["steps_per_s"]
    assert rate > 0
    assert recommended["steps"] == max(1, round(recommended["interval_s"] * rate))
    assert document["current"]["steps"] == 10

    status, text = run("advise", str(store), "--mtbi", "6h")
    assert status == 0, text
    value, unit = _number(r"Young's sqrt\(2CM\) =", text)
    scale = {"ms": 0.001, "s": 1.0, "min": 60.0, "h": HOUR}[unit]
    assert value * scale == pytest.approx(young, abs=0.051 * scale)  # as printed: 1 decimal
    assert f"{recommended['steps']} steps" in text
    assert "recommended (Daly)" in text and "current" in text


def test_advise_json_schema_for_schedulers(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/run"
    store = ckptstore.open(url)
    for step in (10, 20, 30):
        store.save(step, {"w": b"x" * 1000})
    status, text = run("advise", url, "--mtbi", "2h", "--restart", "5m", "--recent", "2", "--json")
    assert status == 0, text
    document = json.loads(text)
    assert set(document) == {
        "url", "formula", "recommended", "young_s", "daly_s", "cost_s", "mtbi_s", "mtbi_source",
        "notes", "restart_s", "steps_per_s", "current", "table",
    }  # fmt: skip
    assert document["formula"] == "daly" and document["url"] == url
    assert set(document["recommended"]) == {"interval_s", "minutes", "steps"}
    assert document["recommended"]["minutes"] == document["recommended"]["interval_s"] / 60
    assert set(document["cost_s"]) == {"median", "min", "max", "saves", "asynchronous"}
    assert document["cost_s"]["saves"] == 2  # --recent 2
    assert (document["mtbi_s"], document["mtbi_source"], document["restart_s"]) == (
        7200.0,
        "option",
        300.0,
    )
    assert set(document["current"]) == {"interval_s", "steps"}
    for row in document["table"]:
        assert set(row) == {"label", "interval_s", "steps", "overhead", "lost", "waste"}
        assert row["waste"] == pytest.approx(row["overhead"] + row["lost"])
        assert row["lost"] == pytest.approx((row["interval_s"] / 2 + 300) / 7200)


def test_advise_says_clearly_when_there_is_too_little_to_measure(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/run"
    store = ckptstore.open(url)
    status, text = run("advise", url, "--mtbi", "6h", "--json")
    assert status == 2
    assert json.loads(text)["type"] == "NotEnoughSavesError"
    store.save(1, {"w": b"x"})
    status, text = run("advise", url, "--mtbi", "6h", "--json")
    assert (status, json.loads(text)["type"]) == (2, "NotEnoughSavesError")
    assert "at least 2" in json.loads(text)["error"]
    store.save(2, {"w": b"x"})
    status, text = run("advise", url, "--json")  # no --mtbi, no restarts recorded
    assert (status, json.loads(text)["type"]) == (2, "InvalidOptionError")
    status, text = run("advise", url, "--mtbi", "6h", "--recent", "1", "--json")
    assert (status, json.loads(text)["type"]) == (2, "InvalidInputError")
    status, _ = run("advise", url, "--mtbi", "6h")
    assert status == 0


def test_advise_for_a_trainer_reads_only_the_newest_checkpoints(tmp_path: Path) -> None:
    store = ckptstore.open(f"file://{tmp_path}/run")
    for step in range(1, 8):
        store.save(step, {"w": b"x"})
    advice = advise(store, mtbi=timedelta(hours=1), recent=4)
    assert advice.saves == 4
    assert advice.young_s == pytest.approx(math.sqrt(2 * advice.cost.median * HOUR))
    with pytest.raises(InvalidOptionError):
        advise(store, mtbi=HOUR, recent=1)
    empty: Any = ckptstore.open(f"file://{tmp_path}/empty")
    with pytest.raises(NotEnoughSavesError):
        advise(empty, mtbi=HOUR)


def test_a_store_whose_manifests_record_no_timings_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import ckptstore.pending

    def untimed(**fields: Any) -> Manifest:  # as a writer that records no timings would
        return Manifest(**{**fields, "timings": {}})

    store = ckptstore.open(f"file://{tmp_path}/run")
    with monkeypatch.context() as patched:
        patched.setattr(ckptstore.pending, "Manifest", untimed)  # the manifest's builder
        for step in (1, 2, 3):
            store.save(step, {"w": b"x"})
    store.save(4, {"w": b"x"})  # one with timings: still too few
    assert not store.get(1).manifest.timings
    with pytest.raises(
        NotEnoughSavesError, match=r"1 checkpoint\(s\) with recorded timings \(of 4\)"
    ):
        advise(store, mtbi=HOUR)


def test_advise_measures_m_from_the_epochs_runs_took(tmp_path: Path) -> None:
    """Each run that takes the store over records when it started (docs/protocol.md §8): with
    enough restarts, M is the time observed over the restarts, not the option."""
    now = [float(int(time.time()) - (MIN_RESTARTS + 2) * 4 * HOUR)]  # runs in the past
    url = f"file://{tmp_path}/run"
    step = 0
    for _run in range(MIN_RESTARTS + 1):  # the first start, then MIN_RESTARTS restarts
        store = ckptstore.open(url, clock=lambda: now[0])
        latest = store.latest()
        store.take_over(resumed_from=None if latest is None else latest.step)
        for _ in range(2):
            step += 1
            store.save(step, {"w": b"x"})
        now[0] += 4 * HOUR
    started = [epoch.started_at for epoch in store.lineage().epochs]
    assert len(started) == MIN_RESTARTS + 1
    advice = advise(store, now=started[-1])
    assert (advice.mtbi_s, advice.mtbi_source) == (4 * HOUR, "restarts")
    assert advice.young_s == pytest.approx(math.sqrt(2 * advice.cost.median * 4 * HOUR))
    status, text = run("advise", url, "--json")  # no --mtbi: the restarts suffice
    assert status == 0, text
    assert json.loads(text)["mtbi_source"] == "restarts"


# -- M as the user gave it, or measured up to now from starts that can be right ------------
# (issue 24 items 8 and 18)


def _runs(url: str, starts: list[float]) -> None:
    """A fresh start, then a restart at each of ``starts[1:]`` (seconds since 1970, as each
    run's own clock read them), each run saving two steps."""
    step = 0
    for start in starts:
        store = ckptstore.open(url, clock=lambda start=start: start)
        latest = store.latest()
        store.take_over(resumed_from=None if latest is None else latest.step)
        for _ in range(2):
            step += 1
            store.save(step, {"w": b"x"})


def test_a_given_mtbi_wins_and_measured_m_runs_to_now(tmp_path: Path) -> None:
    """Three restarts a minute apart ten days ago: M is ten days over three restarts (or the
    option, when given), not 60 s."""
    url = f"file://{tmp_path}/run"
    ten_days_ago = float(int(time.time()) - 10 * 86400)
    _runs(url, [ten_days_ago + 60 * n for n in range(MIN_RESTARTS + 1)])
    store = ckptstore.open(url)
    advice = advise(store)
    assert advice.mtbi_source == "restarts"
    assert advice.mtbi_s == pytest.approx(10 * 86400 / MIN_RESTARTS, rel=0.01)
    advice = advise(store, mtbi=timedelta(hours=6))
    assert (advice.mtbi_s, advice.mtbi_source) == (6 * HOUR, "option")
    status, text = run("advise", url, "--mtbi", "6h", "--json")
    assert status == 0, text
    document = json.loads(text)
    assert (document["mtbi_s"], document["mtbi_source"]) == (6 * HOUR, "option")
    status, text = run("advise", url, "--mtbi", "6h")
    assert status == 0 and "M every 6.0 h (from --mtbi)" in text, text


def test_run_starts_that_cannot_be_right_are_left_out_and_reported(tmp_path: Path) -> None:
    """A restart stamped by a node whose clock read 1970, and one from a clock a year ahead,
    are left out of M and said; the others measure it."""
    url = f"file://{tmp_path}/run"
    base = float(int(time.time()) - 8 * HOUR)
    starts = [base, base + HOUR, 0.0, base + 2 * HOUR, base + 3 * HOUR, base + 365 * 86400]
    _runs(url, starts)
    store = ckptstore.open(url)
    assert [e.started_at.year for e in store.lineage().epochs][2] == 1970
    advice = advise(store)
    assert advice.mtbi_source == "restarts"
    assert advice.mtbi_s == pytest.approx(8 * HOUR / 3, rel=0.01)  # 4 starts: 3 restarts
    notes = " | ".join(advice.notes)
    assert "epoch 3's start (1970-01-01T00:00:00+00:00" in notes and "left out" in notes
    assert "epoch 6's start" in notes and "in the future" in notes
    status, text = run("advise", url)
    assert status == 0, text
    assert "left out      epoch 3's start" in text and "in the future" in text
    assert json.loads(run("advise", url, "--json")[1])["notes"] == list(advice.notes)


def test_absurd_timings_and_a_zero_mtbi_name_the_step_and_the_option(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/run"
    store = ckptstore.open(url)
    for step in (1, 2, 3):
        with store.begin(step) as pending:
            pending.write("w", b"x")
            if step > 1:  # what the trainer says it spent before the save: absurd
                pending.add_timing("snapshot_s", 1e308)
    status, text = run("advise", url, "--mtbi", "6h")
    assert status == 2
    status, text = run("advise", url, "--mtbi", "6h", "--json")
    error = json.loads(text)["error"]
    assert "step 2 left out: its manifest records snapshot_s = 1e+308 s" in error, error
    assert "inf" not in error
    store.save(4, {"w": b"x"})
    status, text = run("advise", url, "--mtbi", "6h")
    assert status == 0, text
    assert "left out      step 3 left out: its manifest records snapshot_s" in text
    for zero in ("0s", "0"):
        status, text = run("advise", url, "--mtbi", zero, "--json")
        error = json.loads(text)["error"]
        assert status == 2 and "--mtbi" in error and "longer than 0 s" in error, error
        assert "timedelta" not in error
    with pytest.raises(InvalidOptionError, match=r"\(mtbi, --mtbi\) must be longer than 0 s"):
        advise(store, mtbi=timedelta(0))
    with pytest.raises(InvalidOptionError, match=r"from 0 s to 100 years, got 1e\+300 s"):
        advise(store, mtbi=1e300)
