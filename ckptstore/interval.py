"""The checkpoint interval that loses the least work, computed from what the store measured.

A trainer that saves every T seconds of training pays the save's cost C each time (overhead
C/T) and, at each interruption, loses the work since the last save (T/2 on average) plus the
time to restart R; with interruptions every M seconds on average, the fraction of time lost
is about ``C/T + (T/2 + R)/M``, least at Young's ``T = sqrt(2·C·M)`` (1974). Daly's higher-order
estimate (2006) refines it for an exponential time to interruption,
``sqrt(2CM)·(1 + sqrt(C/2M)/3 + (C/2M)/9) - C`` (and ``M`` once ``C >= 2M``); the two agree
within a few percent while C is small against M, and Daly's stays right as C grows, so it is
the one recommended. Both are reported.

What the manifests record (``timings``) decides C, the cost of a save *to the trainer*:

- a save that went on in the background (``AsyncSaver``, ``dcp.async_save`` through
  ``CkptStoreWriter``) records ``blocked_s``, the time the trainer waited: that is its cost;
- any other save blocked the trainer throughout: its cost is the store's ``write_s`` (from
  ``begin`` to the commit, the sealing fsyncs included) plus what the trainer spent before
  ``begin`` (``snapshot_s``, recorded by ``save_state``). The manifest's own write cannot be
  in the manifest: C leaves out that one small write.

The step rate comes from consecutive saves: between the start of one save (its manifest's
``created_at``) and the next, the trainer trained, and paid the part of each save's cost that
fell in between; what remains is training time. The median over recent pairs is used, so a
restart between two saves (hours of wall time, few steps) does not drag it down. Where
retention deleted the saves in between, a pair spans several intervals, and the time of the
saves deleted counts as training: the step rate is then a slight underestimate.

M comes from the option when one is given; without it, from when each run started (the
store's epochs, ``mtbi_from_run_starts``: from the first start to now over the restarts, once
there are enough of them). A start in the future, earlier than an earlier run's start, or
older than any store (a node whose clock was wrong) is left out, and said so in
``IntervalAdvice.notes``; so is a save whose recorded timings are not durations a
save can take (not finite, or longer than ``MAX_TIMING_S``).
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any, Literal

from ckptstore.errors import (
    CheckpointNotFoundError,
    IntegrityError,
    InvalidOptionError,
    NotEnoughSavesError,
)
from ckptstore.manifest import Manifest
from ckptstore.store import Store

__all__ = [
    "DEFAULT_RECENT",
    "MAX_MTBI_S",
    "MAX_TIMING_S",
    "MIN_RESTARTS",
    "MIN_SAVES",
    "STORES_SINCE",
    "IntervalAdvice",
    "IntervalRow",
    "SaveCost",
    "Spread",
    "advise",
    "advise_from_manifests",
    "daly_interval",
    "mtbi_from_run_starts",
    "save_cost",
    "time_lost",
    "young_interval",
]

DEFAULT_RECENT = 20
"""How many of the newest checkpoints are measured."""
MIN_SAVES = 2
"""Checkpoints with timings needed: two give one interval between saves, hence a step rate."""
MIN_RESTARTS = 3
"""Restarts needed before their timestamps, not the option, give M."""
MAX_TIMING_S = 30 * 86400.0
"""The longest a recorded timing of one save may be (30 days): a manifest that records more
(or a value that is not finite) is left out of the measure, and reported."""
MAX_MTBI_S = 36500 * 86400.0
"""The longest mean time between interruptions (100 years), given or measured."""
STORES_SINCE = datetime(2020, 1, 1, tzinfo=timezone.utc)
"""No ckptstore store, hence no run start, is older than this: an earlier start is a clock
that was wrong (one that read 1970)."""
CLOCK_SKEW_S = 600.0
"""How far apart the clocks of a job's nodes may be before a run start is held wrong."""
_MULTIPLES = (0.25, 0.5, 2.0, 4.0)
"""The recommended interval's multiples that the table also shows."""


@dataclass(frozen=True)
class SaveCost:
    """What one save cost the trainer, split around the store's ``begin`` (its ``created_at``).

    ``before_begin_s``: the trainer's wait before the save began in the store (the snapshot,
    or an asynchronous save's whole blocked time); ``after_begin_s``: its wait after (the
    write and commit of a synchronous save; 0 for an asynchronous one).
    """

    step: int
    started: datetime
    before_begin_s: float
    after_begin_s: float
    asynchronous: bool

    @property
    def seconds(self) -> float:
        """The trainer's whole wait for this save: C for this save."""
        return self.before_begin_s + self.after_begin_s


def absurd_timing(manifest: Manifest) -> str | None:
    """The first timing of ``manifest`` that no save can have taken (not finite, or longer
    than MAX_TIMING_S), as ``name = value``; None if all are durations."""
    for name, value in sorted(manifest.timings.items()):
        if not (math.isfinite(value) and value <= MAX_TIMING_S):
            return f"{name} = {value!r} s"
    return None


def save_cost(manifest: Manifest) -> SaveCost | None:
    """What the save of ``manifest`` cost the trainer, or None if it records no timings (or
    timings no save can have taken: ``absurd_timing``)."""
    timings = manifest.timings
    if absurd_timing(manifest) is not None:
        return None
    if "blocked_s" in timings:
        before, after, asynchronous = timings["blocked_s"], 0.0, True
    elif "write_s" in timings:
        before, after = timings.get("snapshot_s", 0.0), timings["write_s"]
        asynchronous = False
    else:
        return None
    return SaveCost(
        manifest.step, manifest.created_at, max(before, 0.0), max(after, 0.0), asynchronous
    )


@dataclass(frozen=True)
class Spread:
    """The median of measurements, their extremes and their number."""

    median: float
    low: float
    high: float
    count: int

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        """Summarise ``values`` (at least one)."""
        return cls(statistics.median(values), min(values), max(values), len(values))


def young_interval(cost_s: float, mtbi_s: float) -> float:
    """Young's interval ``sqrt(2·C·M)``: seconds of training between saves."""
    _check_positive(cost_s=cost_s, mtbi_s=mtbi_s)
    return math.sqrt(2.0 * cost_s * mtbi_s)


def daly_interval(cost_s: float, mtbi_s: float) -> float:
    """Daly's higher-order interval (2006): seconds of training between saves.

    ``sqrt(2CM)·(1 + sqrt(C/2M)/3 + (C/2M)/9) - C`` while ``C < 2M``, else ``M``.
    """
    _check_positive(cost_s=cost_s, mtbi_s=mtbi_s)
    if cost_s >= 2.0 * mtbi_s:
        return mtbi_s
    ratio = cost_s / (2.0 * mtbi_s)
    return math.sqrt(2.0 * cost_s * mtbi_s) * (1.0 + math.sqrt(ratio) / 3.0 + ratio / 9.0) - cost_s


def time_lost(
    interval_s: float, cost_s: float, mtbi_s: float, restart_s: float = 0.0
) -> tuple[float, float]:
    """The fractions of time lost to saving (``C/T``) and to interruptions (``(T/2 + R)/M``).

    First order, as Young's model: at each interruption the work since the last save is lost
    (half an interval on average) and the restart takes ``R``.
    """
    _check_positive(interval_s=interval_s, mtbi_s=mtbi_s)
    return cost_s / interval_s, (interval_s / 2.0 + restart_s) / mtbi_s


def mtbi_from_run_starts(
    starts: Iterable[datetime], *, now: datetime | None = None, min_restarts: int = MIN_RESTARTS
) -> float | None:
    """M in seconds from the times a run started (its first start, then each restart).

    The time observed divided by the interruptions seen: from the first start to ``now``
    (default: the last start) over the number of restarts. None with fewer than
    ``min_restarts`` restarts. Each gap holds the restart's own time too, so M is
    overestimated by R, little while R is small against M.
    """
    ordered = sorted(starts)
    restarts = len(ordered) - 1
    if restarts < max(min_restarts, 1):
        return None
    end = ordered[-1] if now is None else max(now, ordered[-1])
    seconds = (end - ordered[0]).total_seconds() / restarts
    return seconds if seconds > 0 else None


@dataclass(frozen=True)
class IntervalRow:
    """One interval of the table: what it costs in saving and what interruptions would cost."""

    label: str
    interval_s: float
    steps: int | None
    overhead: float
    lost: float

    @property
    def waste(self) -> float:
        """The fraction of time that does not advance training: overhead plus lost work."""
        return self.overhead + self.lost


@dataclass(frozen=True)
class IntervalAdvice:
    """The recommended checkpoint interval, what it rests on, and the table to compare with."""

    saves: int
    asynchronous: int
    cost: Spread
    mtbi_s: float
    mtbi_source: Literal["option", "restarts"]
    restart_s: float
    steps_per_s: float | None
    current_interval_s: float | None
    current_steps: int | None
    young_s: float
    daly_s: float
    table: tuple[IntervalRow, ...]
    notes: tuple[str, ...] = ()
    """What was left out of the measure, and why: a run start that cannot be right (a clock
    in the future or behind), a save whose timings are not durations."""

    @property
    def recommended_s(self) -> float:
        """Seconds of training between saves: Daly's interval."""
        return self.daly_s

    @property
    def recommended_steps(self) -> int | None:
        """The recommended interval in steps (at least 1), or None without a step rate."""
        return _steps(self.daly_s, self.steps_per_s)

    def to_document(self) -> dict[str, Any]:
        """The advice as a JSON-ready dict (``ckptstore advise --json``)."""
        return {
            "formula": "daly",
            "recommended": {
                "interval_s": self.recommended_s,
                "minutes": self.recommended_s / 60.0,
                "steps": self.recommended_steps,
            },
            "young_s": self.young_s,
            "daly_s": self.daly_s,
            "cost_s": {
                "median": self.cost.median,
                "min": self.cost.low,
                "max": self.cost.high,
                "saves": self.cost.count,
                "asynchronous": self.asynchronous,
            },
            "mtbi_s": self.mtbi_s,
            "mtbi_source": self.mtbi_source,
            "notes": list(self.notes),
            "restart_s": self.restart_s,
            "steps_per_s": self.steps_per_s,
            "current": {"interval_s": self.current_interval_s, "steps": self.current_steps},
            "table": [
                {
                    "label": row.label,
                    "interval_s": row.interval_s,
                    "steps": row.steps,
                    "overhead": row.overhead,
                    "lost": row.lost,
                    "waste": row.waste,
                }
                for row in self.table
            ],
        }


def advise(
    store: Store,
    *,
    mtbi: timedelta | float | None = None,
    recent: int = DEFAULT_RECENT,
    restart: timedelta | float = 0.0,
    run_starts: Iterable[datetime] | None = None,
    now: datetime | None = None,
) -> IntervalAdvice:
    """Recommend a checkpoint interval from the newest ``recent`` checkpoints of ``store``.

    For trainers that adapt their interval as they run, and for ``ckptstore advise``.
    ``mtbi``: the mean time between interruptions (seconds or a timedelta); when it is not
    given, M is measured from ``run_starts`` (when each run of the job started; default: when
    each epoch of the store was taken, docs/protocol.md §8, less the starts that cannot be
    right), which must hold at least MIN_RESTARTS restarts, up to ``now`` (default: the
    store's clock now).
    ``restart``: the time from an interruption to training again (only the table uses it).

    Raises NotEnoughSavesError when fewer than MIN_SAVES of those checkpoints record timings,
    InvalidOptionError without an M or with a bad value.
    """
    if isinstance(recent, bool) or not isinstance(recent, int) or recent < MIN_SAVES:
        raise InvalidOptionError(f"recent must be a whole number >= {MIN_SAVES}, got {recent!r}")
    if now is None:
        now = datetime.fromtimestamp(store.clock(), timezone.utc)
    notes: list[str] = []
    if run_starts is None and mtbi is None:
        run_starts = _epoch_starts(store, now, notes)
    return advise_from_manifests(
        _recent_manifests(store, recent),
        mtbi=mtbi,
        restart=restart,
        run_starts=() if run_starts is None else run_starts,
        now=now,
        where=store.url,
        notes=notes,
    )


def _epoch_starts(store: Store, now: datetime, notes: list[str]) -> list[datetime]:
    """When each run that took the store over started, less the starts that cannot be right
    (each said in ``notes``): none if an epoch is unreadable.

    Epochs are taken one after another (a taker reads epoch E before it creates E + 1): a
    start before an earlier epoch's, or before any ckptstore store existed, was stamped by a
    clock behind (a node whose clock read 1970); one after ``now``, by a clock ahead. Clocks
    ``CLOCK_SKEW_S`` apart are not held against a start.
    """
    try:
        epochs = store.lineage().epochs
    except IntegrityError as exc:
        notes.append(f"restarts not counted: {exc}")
        return []
    skew = timedelta(seconds=CLOCK_SKEW_S)
    kept: list[datetime] = []
    for epoch in epochs:
        problem = None
        if epoch.started_at > now + skew:
            problem = "in the future"
        elif epoch.started_at < STORES_SINCE:
            problem = "before any store existed"
        elif kept and epoch.started_at < kept[-1] - skew:
            problem = "before the start of an earlier epoch"
        if problem is None:
            kept.append(epoch.started_at)
        else:
            when = epoch.started_at.isoformat(timespec="seconds")
            notes.append(
                f"epoch {epoch.number}'s start ({when}, by {epoch.writer.host}) left out: it is "
                f"{problem} (a clock that was wrong)"
            )
    return kept


def _recent_manifests(store: Store, recent: int) -> list[Manifest]:
    """The manifests of the newest ``recent`` checkpoints that record timings, by step, and of
    those without timings newer than the oldest of them (counted in the error if too few)."""
    found: list[Manifest] = []
    timed = 0
    for step in reversed(store.named_steps()):
        try:
            manifest = store.manifest(step)
        except (CheckpointNotFoundError, IntegrityError):
            continue  # a stray, a damaged manifest, or deleted since the listing
        found.append(manifest)
        if save_cost(manifest) is not None:
            timed += 1
            if timed == recent:
                break
    return found[::-1]


def advise_from_manifests(
    manifests: Iterable[Manifest],
    *,
    mtbi: timedelta | float | None = None,
    restart: timedelta | float = 0.0,
    run_starts: Iterable[datetime] = (),
    now: datetime | None = None,
    where: str = "the store",
    notes: Iterable[str] = (),
) -> IntervalAdvice:
    """Recommend a checkpoint interval from ``manifests`` (see ``advise``; ``now``: default
    this host's clock now). ``notes``: what the caller already left out, to report."""
    listed = list(manifests)
    said = list(notes)
    for absurd in listed:
        timing = absurd_timing(absurd)
        if timing is not None:
            said.append(
                f"step {absurd.step} left out: its manifest records {timing}, not a duration "
                f"a save can take"
            )
    costs = sorted((c for c in map(save_cost, listed) if c is not None), key=lambda c: c.step)
    if len(costs) < MIN_SAVES:
        raise NotEnoughSavesError(
            f"{where}: {len(costs)} checkpoint(s) with recorded timings"
            + (f" (of {len(listed)})" if len(listed) != len(costs) else "")
            + f"; the interval needs at least {MIN_SAVES}: save a few times first"
            + "".join(f"; {note}" for note in said if note.startswith("step "))
        )
    cost = Spread.of([c.seconds for c in costs])
    if cost.median <= 0:
        raise NotEnoughSavesError(f"{where}: every recorded save cost is zero: nothing to weigh")
    restart_s = _seconds(restart, "restart (--restart)")
    source: Literal["option", "restarts"]
    if mtbi is not None:  # given: it wins over anything measured
        mtbi_s, source = _seconds(mtbi, "mtbi (--mtbi)"), "option"
        if mtbi_s <= 0:
            raise InvalidOptionError(
                f"the mean time between interruptions (mtbi, --mtbi) must be longer than "
                f"0 s, got {_shown_seconds(mtbi_s)}"
            )
    else:
        now = datetime.now(timezone.utc) if now is None else now
        starts = []
        for start in run_starts:
            if start > now + timedelta(seconds=CLOCK_SKEW_S):
                said.append(
                    f"a run start at {start.isoformat(timespec='seconds')} left out: it is in "
                    f"the future (a clock that was wrong)"
                )
            else:
                starts.append(start)
        measured = mtbi_from_run_starts(starts, now=now)
        if measured is None:
            raise InvalidOptionError(
                f"{where}: no mean time between interruptions: pass mtbi (--mtbi 6h); fewer "
                f"than {MIN_RESTARTS} restarts are known to measure it from"
            )
        mtbi_s, source = min(measured, MAX_MTBI_S), "restarts"
    training = _training_between(costs)
    rate = statistics.median(steps / s for steps, s in training) if training else None
    current_s = statistics.median(s for _, s in training) if training else None
    current_steps = round(statistics.median(steps for steps, _ in training)) if training else None
    young, daly = young_interval(cost.median, mtbi_s), daly_interval(cost.median, mtbi_s)
    candidates = [("recommended (Daly)", daly), ("Young sqrt(2CM)", young)]
    candidates += [(f"x{factor:g}", daly * factor) for factor in _MULTIPLES]
    rows = [(label, seconds, _steps(seconds, rate)) for label, seconds in candidates]
    if current_s is not None:
        rows.append(("current", current_s, current_steps))  # as measured, not from the rate
    return IntervalAdvice(
        saves=len(costs),
        asynchronous=sum(c.asynchronous for c in costs),
        cost=cost,
        mtbi_s=mtbi_s,
        mtbi_source=source,
        restart_s=restart_s,
        steps_per_s=rate,
        current_interval_s=current_s,
        current_steps=current_steps,
        young_s=young,
        daly_s=daly,
        table=_table(rows, cost.median, mtbi_s, restart_s),
        notes=tuple(said),
    )


def _training_between(costs: Sequence[SaveCost]) -> list[tuple[int, float]]:
    """(steps, seconds of training) between each pair of consecutive saves.

    From one save's start to the next's, the trainer waited for the rest of the first save
    and the start of the second; the rest is training. Pairs with no training time left (a
    rollback, clocks apart) or no steps are left out.
    """
    pairs = []
    for first, second in itertools.pairwise(costs):
        elapsed = (second.started - first.started).total_seconds()
        training = elapsed - first.after_begin_s - second.before_begin_s
        steps = second.step - first.step
        if training > 0 and steps > 0:
            pairs.append((steps, training))
    return pairs


def _table(
    candidates: Sequence[tuple[str, float, int | None]],
    cost_s: float,
    mtbi_s: float,
    restart_s: float,
) -> tuple[IntervalRow, ...]:
    """The (label, seconds, steps) candidates by interval, one row per distinct interval."""
    rows: list[IntervalRow] = []
    for label, interval, steps in sorted(candidates, key=lambda item: item[1]):
        if rows and math.isclose(rows[-1].interval_s, interval, rel_tol=1e-3):
            last = rows.pop()
            rows.append(
                IntervalRow(
                    f"{last.label}, {label}", last.interval_s, last.steps, last.overhead, last.lost
                )
            )
            continue
        overhead, lost = time_lost(interval, cost_s, mtbi_s, restart_s)
        rows.append(IntervalRow(label, interval, steps, overhead, lost))
    return tuple(rows)


def _steps(interval_s: float, rate: float | None) -> int | None:
    return None if rate is None else max(1, round(interval_s * rate))


def _seconds(value: timedelta | float, what: str) -> float:
    try:
        seconds = value.total_seconds() if isinstance(value, timedelta) else float(value)
    except (TypeError, ValueError) as exc:
        raise InvalidOptionError(f"{what} must be seconds or a timedelta, got {value!r}") from exc
    if not (math.isfinite(seconds) and 0 <= seconds <= MAX_MTBI_S):
        raise InvalidOptionError(
            f"{what} must be a duration from 0 s to 100 years, got {_shown_seconds(seconds)}"
        )
    return seconds


def _shown_seconds(seconds: float) -> str:
    return f"{seconds:g} s"


def _check_positive(**values: float) -> None:
    for name, value in values.items():
        if not (math.isfinite(value) and value > 0):
            raise InvalidOptionError(f"{name} must be a positive number of seconds, got {value!r}")
