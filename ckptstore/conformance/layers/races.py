"""True concurrency: writers racing for one step, and for the LATEST pointer, released together.

The state machine's ``concurrent_writers`` rule runs two writers one after the other; a
storage whose conditional check is not atomic with its write passes it. Here K writers run at
the same time, in threads and, where the store can be reached from several processes
(``file://``, ``s3://``; not ``memory://``, whose data lives in one process), in processes.
Each writer's driver is wrapped in a ``RaceGate`` that holds it at its commit point until
every racer has reached its own, then lets them all go at once:

- **publish races**: K writers save the same step; they meet at the conditional publish (the
  ``If-None-Match: *`` put of the manifest, or the no-replace rename). Exactly one may
  publish, the others get ``CheckpointExistsError``, and the published checkpoint holds
  exactly the winner's data (I5).
- **pointer races**: K writers save K different steps; they meet at the LATEST update (the
  compare-and-swap, or the rename over LATEST). Afterwards LATEST names a published step
  (I1), never an older one than before the round (I4), ``latest()`` is the newest step (I4),
  and where the hint is moved by compare-and-swap it names the newest step raced: one that
  names another lost an update (I4).
- **takeover races** (stores that keep lineages): K restarted runs take the store over at
  once, resumed from the seed; they meet at the epoch record's conditional create. No two may
  be told they took the same epoch, each epoch record holds its own taker's note, no epoch
  exists that no taker was told of, and then each saves a step: readers see only the newest
  taker's, and ``latest()`` returns it (I9). The racers then join the newest epoch and the
  other races follow in it.

Whether a child process sees the store is found by trying: the parent saves a checkpoint
first, and each child must see it.
"""

from __future__ import annotations

import importlib
import logging
import multiprocessing
import os
import queue
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ckptstore.commit.base import CommitStrategy
from ckptstore.commit.conditional_put import LATEST_KEY
from ckptstore.conformance.layers.layer import Findings, SuiteRun
from ckptstore.conformance.layers.workload import pattern
from ckptstore.conformance.location import Location, open_for_measuring
from ckptstore.conformance.outcomes import SuiteError, storage_failure
from ckptstore.conformance.settling import settled
from ckptstore.driver import Capability, DriverFamily, PutMode, driver_family, storage_calls
from ckptstore.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    CkptStoreError,
    SupersededError,
)
from ckptstore.registry import backend_modules
from ckptstore.store import Store
from ckptstore.urls import parse_url

__all__ = [
    "INVARIANTS",
    "RACE_PROFILES",
    "RaceGate",
    "RaceProfile",
    "RaceResult",
    "run_layer",
    "run_races",
]

INVARIANTS = ("I5", "I1", "I4", "I9")

PUBLISH, POINTER, TAKEOVER, ROLLBACK = "publish", "pointer", "takeover", "rollback"
EPOCH_ROUNDS = (TAKEOVER, ROLLBACK)
"""Rounds whose racers create an epoch record each (a rollback is a takeover from a step)."""
POINTER_NAME = "LATEST"
"""The pointer's key (object stores) and file name (file systems)."""
WAIT_S = 120.0
"""How long a racer waits for the others at a barrier before the round is called broken."""
SEED_STEP = 0
NOT_APPLICABLE = "not applicable"
COULD_NOT_OPEN = "a racer could not open the store"
"""How a crew's reason for not racing starts where it cannot race there (not a failure)."""
"""A checkpoint the parent saves first: a child process that cannot see it cannot race."""


_RACER_LOG = logging.getLogger("ckptstore.conformance.racers")


@dataclass(frozen=True)
class _Logged:
    """A warning ckptstore logged in a racer process, sent to the leader to be logged there
    (where the run's capture counts it in the report instead of printing it)."""

    level: int
    message: str


class _ToLeader(logging.Handler):
    """In a racer process: ckptstore's warnings go to the leader, never to stderr."""

    def __init__(self, results: Any) -> None:
        super().__init__(logging.WARNING)
        self.results = results

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.results.put(_Logged(record.levelno, record.getMessage()))
        except Exception:  # a record that cannot be sent is dropped, never printed
            pass


def _log_to_leader(results: Any) -> None:
    """Send this racer process's ckptstore warnings to the leader (``_Collector.get``)."""
    logger = logging.getLogger("ckptstore")
    logger.handlers = [_ToLeader(results)]
    logger.setLevel(logging.WARNING)
    logger.propagate = False


@dataclass(frozen=True)
class Crew:
    """How many writers race, in at least ``min_rounds`` and at most ``max_rounds`` rounds (each
    a publish race and a pointer race), more while the rounds so far took under ``budget_s``."""

    writers: int
    min_rounds: int
    max_rounds: int
    budget_s: float


@dataclass(frozen=True)
class RaceProfile:
    """The thread crew and the process crew of a profile."""

    threads: Crew
    processes: Crew


RACE_PROFILES = {
    "ci": RaceProfile(threads=Crew(4, 1, 30, 2.5), processes=Crew(3, 1, 10, 1.5)),
    "thorough": RaceProfile(threads=Crew(8, 20, 500, 60.0), processes=Crew(4, 5, 100, 30.0)),
}


@dataclass(frozen=True)
class RaceFinding:
    """A violation found by a race, attributed to the invariant it breaks."""

    invariant: str
    case: str
    message: str


@dataclass
class RaceResult:
    """What the races found, and how many were run."""

    thread_rounds: int = 0
    thread_writers: int = 0
    process_rounds: int = 0
    process_writers: int = 0
    processes_skipped: str = ""
    """Why no process races ran (empty: they ran)."""
    takeovers: int = 0
    """Takeover races judged (threads and processes; none where lineages are not kept)."""
    rollbacks: int = 0
    """Rollback races judged (rollers released together at the epoch record)."""
    failures: list[RaceFinding] = field(default_factory=list)
    storage_errors: list[RaceFinding] = field(default_factory=list)

    def coverage(self) -> str:
        """The report's coverage line."""
        line = f"{self.thread_rounds} rounds of {self.thread_writers} writers (threads)"
        if self.processes_skipped:
            line += f"; processes: {self.processes_skipped}"
        else:
            line += f" + {self.process_rounds} rounds of {self.process_writers} (processes)"
        if self.takeovers:
            line += f"; takeover races: {self.takeovers} (takers released at the epoch record)"
        if self.rollbacks:
            line += f"; rollback races: {self.rollbacks} (rollers released at the epoch record)"
        if self.storage_errors:
            line += f"; {len(self.storage_errors)} race(s) undecided (storage error)"
        return line


# -- the gate ----------------------------------------------------------------------------


Predicate = Callable[[DriverFamily, str, tuple[Any, ...], dict[str, Any]], bool]


def at_publish(family: DriverFamily, name: str, args: tuple[Any, ...], kw: dict[str, Any]) -> bool:
    """The commit point: a conditional put or completion; a no-replace rename."""
    if family is DriverFamily.FILE_SYSTEM:
        return name == "rename_noreplace"
    mode = kw.get("mode")
    return name in ("put", "complete_multipart") and isinstance(mode, PutMode) and mode.conditional


def at_pointer(family: DriverFamily, name: str, args: tuple[Any, ...], kw: dict[str, Any]) -> bool:
    """The pointer update: the write of LATEST (a rename over it; a put of it)."""
    if family is DriverFamily.FILE_SYSTEM:
        return name == "rename_replace" and len(args) > 1 and args[1] == POINTER_NAME
    return name == "put" and bool(args) and args[0] == POINTER_NAME


class RaceGate:
    """A driver that forwards to ``inner``, and holds the first call an armed predicate selects
    at ``barrier`` until every racer has reached its own such call (or given up on it)."""

    def __init__(self, inner: Any, barrier: Any) -> None:
        self._inner = inner
        self._barrier = barrier
        self._calls = storage_calls(inner)
        self.family = driver_family(inner)
        self._armed: Predicate | None = None
        self._lock = threading.Lock()
        self.hint_writes: list[str] = []
        """The puts of the LATEST hint the storage took: ``plain`` (no condition sent) or
        ``if-match <ETag>``; the pointer judge tells a lost update by them."""

    def arm(self, predicate: Predicate) -> None:
        """Hold the next call ``predicate`` selects at the barrier."""
        self._armed = predicate

    def release(self) -> None:
        """Arrive at the barrier without racing, if the armed call never came (the writer failed
        before it, or had nothing to write): the others must not wait for it."""
        if self._take(None):
            self._barrier.wait(WAIT_S)

    def _take(self, call: tuple[str, tuple[Any, ...], dict[str, Any]] | None) -> bool:
        with self._lock:
            predicate = self._armed
            if predicate is None or (call is not None and not predicate(self.family, *call)):
                return False
            self._armed = None
            return True

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._inner, name)
        if name not in self._calls:
            return attribute

        def call(*args: Any, **kwargs: Any) -> Any:
            if self._take((name, args, kwargs)):
                self._barrier.wait(WAIT_S)
            result = attribute(*args, **kwargs)
            written = _hint_write(args, kwargs) if name == "put" else None
            if written is not None:
                self.hint_writes.append(written)
            return result

        return call


def _hint_write(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """How a put wrote the LATEST hint (a key named LATEST): ``plain``, ``if-match <ETag>``
    or ``create``; None: the put was of another key."""
    key = str(args[0]) if args else str(kwargs.get("key", ""))
    if key.rpartition("/")[2] != LATEST_KEY:
        return None
    mode = kwargs.get("mode", args[2] if len(args) > 2 else PutMode.OVERWRITE)
    if not isinstance(mode, PutMode) or mode.kind == "overwrite":
        return "plain"
    return f"if-match {str(mode.etag).strip(chr(34))}" if mode.kind == "update" else "create"


# -- what each writer does ---------------------------------------------------------------


@dataclass(frozen=True)
class Round:
    """One race: ``kind`` publish (every writer saves ``first``) or pointer (writer i saves
    ``first + i``)."""

    number: int
    kind: str
    first: int

    def step(self, writer: int) -> int:
        return self.first if self.kind == PUBLISH else self.first + writer

    def taker(self, writer: int) -> str:
        """The note a taker of a takeover round writes in its epoch record."""
        return f"race {self.number} taker {writer}"

    def steps(self, writers: int) -> list[int]:
        return sorted({self.step(i) for i in range(writers)})


@dataclass(frozen=True)
class Outcome:
    """What one writer's save ended in: ``published``, ``exists`` or ``error``."""

    writer: int
    kind: str
    detail: str = ""
    storage: bool = False
    """The error is the storage's failure (undecided), not the protocol's."""
    hint_writes: tuple[str, ...] = ()
    """How the writer's puts of the LATEST hint that the storage took were sent
    (``RaceGate.hint_writes``)."""


def writer_shards(step: int, writer: int) -> dict[str, bytes]:
    """Writer-specific data (size and bytes): no two writers' checkpoints of one step are
    alike. One shard: each storage call costs a round trip, and the race is at the publish."""
    return {"rank00/part.bin": pattern(300 + 37 * writer, step * 100 + writer)}


def _race_once(store: Store, gate: RaceGate, writer: int, race: Round) -> Outcome:
    if race.kind in EPOCH_ROUNDS:
        return _take_over_once(store, gate, writer, race)
    step = race.step(writer)
    # Armed from the start: a writer that fails before its commit point still arrives at the
    # barrier (``release``), so that the others are not left waiting for it.
    gate.arm(at_publish if race.kind == PUBLISH else at_pointer)
    writes_before = len(gate.hint_writes)
    try:
        pending = store.begin(step, {"writer": writer, "round": race.number})
        for name, data in writer_shards(step, writer).items():
            pending.write(name, data)
        pending.publish()
        written = tuple(gate.hint_writes[writes_before:])
        return Outcome(writer, "published", hint_writes=written)
    except CheckpointExistsError as exc:
        return Outcome(writer, "exists", str(exc))
    except Exception as exc:
        if isinstance(exc, threading.BrokenBarrierError):
            raise
        failure = storage_failure(exc)
        return Outcome(writer, "error", f"{type(exc).__name__}: {exc}", failure is not None)
    finally:
        gate.release()


def _take_over_once(store: Store, gate: RaceGate, writer: int, race: Round) -> Outcome:
    """Take the store over (or roll it back to the seed step: a takeover from it), held at the
    epoch record's conditional create until every taker reached its own; then save a step in
    the epoch taken. ``took`` with ``"<epoch> <what the save did>"``: ``published`` or
    ``superseded``."""
    gate.arm(at_publish)
    try:
        if race.kind == ROLLBACK:
            rolled = store.rollback(SEED_STEP)
            if rolled.epoch is None:
                left = rolled.left or "none"
                return Outcome(writer, "no epoch", f"rollback to step {SEED_STEP} took no "
                               f"epoch, though steps {left} were newer")  # fmt: skip
            epoch = rolled.epoch
        else:
            epoch = store.take_over(SEED_STEP, note=race.taker(writer))
    except Exception as exc:
        if isinstance(exc, threading.BrokenBarrierError):
            raise
        failure = storage_failure(exc)
        return Outcome(writer, "error", f"take_over: {type(exc).__name__}: {exc}", bool(failure))
    finally:
        gate.release()
    step = race.step(writer)
    try:
        store.save(step, writer_shards(step, writer), {"writer": writer, "round": race.number})
        saved = "published"
    except SupersededError:
        saved = "superseded"
    except Exception as exc:
        failure = storage_failure(exc)
        detail = f"epoch {epoch.number}, then saving step {step}: {type(exc).__name__}: {exc}"
        return Outcome(writer, "error", detail, failure is not None)
    return Outcome(writer, "took", f"{epoch.number} {saved}")


def _join_newest(store: Store, writer: int) -> Outcome | None:
    """Join the store's newest epoch after a takeover race; the outcome of every later round
    instead (an error: undecided where the storage failed) if the writer could not."""
    try:
        store.join_epoch(store.lineage().newest)
    except Exception as exc:
        detail = f"joining the newest epoch after the takeover race: {type(exc).__name__}: {exc}"
        return Outcome(writer, "error", detail, storage_failure(exc) is not None)
    return None


@dataclass
class _Sync:
    """The round's barriers: ``start`` and ``end`` include the parent, ``gate`` only racers."""

    start: Any
    gate: Any
    end: Any
    results: Any
    stop: Any
    """Set before a start: the racers leave instead of racing."""

    def abort(self) -> None:
        for barrier in (self.start, self.gate, self.end):
            barrier.abort()


@dataclass(frozen=True)
class ChildSource:
    """What a racer process opens, and what it imports first so that the URL's scheme opens
    there as here (a backend registered through ``--import`` or at run time: ``registry.
    backend_modules``), with the parent's module path to find them on and its environment
    as it is now (the fork server started with the environment of the first run)."""

    url: str
    options: dict[str, Any]
    modules: tuple[str, ...]
    path: tuple[str, ...]
    environment: dict[str, str] = field(repr=False)  # credentials among them

    @classmethod
    def of(cls, location: Location) -> ChildSource:
        scheme = parse_url(location.url).scheme
        return cls(
            location.url,
            location.options,
            backend_modules(scheme),
            tuple(sys.path),
            dict(os.environ),
        )

    def open(self) -> CommitStrategy[Any]:
        os.environ.clear()
        os.environ.update(self.environment)
        sys.path.extend(entry for entry in self.path if entry not in sys.path)
        for module in self.modules:
            importlib.import_module(module)
        return open_for_measuring(self.url, self.options)


def _writer(source: Any, writer: int, plan: list[Round], sync: _Sync) -> None:
    """One racer: open the store (``source``: a strategy shared by threads, or the
    ``ChildSource`` a process opens), say whether it sees the seed, then race every round."""
    try:
        shared = isinstance(source, CommitStrategy)
        if not shared:
            _log_to_leader(sync.results)
        strategy = source if shared else source.open()
        gate = RaceGate(strategy.driver, sync.gate)
        store = Store(strategy.with_driver(gate))
        seen = SEED_STEP in store.steps()
        # A strategy's one-time capability probe (its first conditional create), made now,
        # while the gate holds nothing: held at the gate, it would be raced instead of the
        # commit point, and racers of one process waiting on its lock would never arrive.
        probe = getattr(store.strategy, "ensure_conditional_create", None)
        if seen and callable(probe):
            probe()
    except Exception as exc:
        failed = storage_failure(exc) is not None
        sync.results.put(Outcome(writer, "error", f"{type(exc).__name__}: {exc}", failed))
        return
    sync.results.put(Outcome(writer, "ready" if seen else "unreachable"))
    if not seen:
        return
    try:
        stuck: Outcome | None = None
        for race in plan:
            sync.start.wait(WAIT_S)
            if sync.stop.is_set():
                break
            sync.results.put(stuck or _race_once(store, gate, writer, race))
            sync.end.wait(WAIT_S)
            if race.kind in EPOCH_ROUNDS and stuck is None:  # every taker is done: the later
                stuck = _join_newest(store, writer)  # races are in the newest epoch
    except threading.BrokenBarrierError:
        return
    finally:
        if not shared:
            strategy.close()


# -- the checks --------------------------------------------------------------------------


class _Judge:
    """Checks each round's outcome against the store, as a fresh reader sees it."""

    def __init__(self, location: Location, writers: int, how: str, result: RaceResult) -> None:
        self.location = location
        self.writers = writers
        self.how = how
        self.result = result
        self.hint: int | None = None
        self.cas = (
            driver_family(location.base.driver) is DriverFamily.OBJECT_STORE
            and Capability.COMPARE_AND_SWAP in location.base.capabilities
        )

    def fail(self, invariant: str, race: Round, message: str) -> None:
        case = f"{race.kind} race {race.number} ({self.writers} {self.how})"
        self.result.failures.append(RaceFinding(invariant, case, message))

    def judge(self, race: Round, outcomes: list[Outcome]) -> None:
        undecided = [o for o in outcomes if o.kind == "error" and o.storage]
        invariant = "I9" if race.kind in EPOCH_ROUNDS else "I5"
        for outcome in undecided:
            case = f"{race.kind} race {race.number} ({self.writers} {self.how})"
            self.result.storage_errors.append(
                RaceFinding(invariant, case, f"writer {outcome.writer}: {outcome.detail}")
            )
        try:
            if race.kind == PUBLISH:
                self._publish(race, outcomes, bool(undecided))
            elif race.kind in EPOCH_ROUNDS:
                self._takeover(race, outcomes, bool(undecided))
            else:
                self._pointer(race, outcomes)
        except CkptStoreError as exc:
            if storage_failure(exc) is None:
                raise
            case = f"{race.kind} race {race.number} ({self.writers} {self.how})"
            self.result.storage_errors.append(RaceFinding(invariant, case, f"checking: {exc!r}"))

    def _publish(self, race: Round, outcomes: list[Outcome], undecided: bool) -> None:
        step = race.first
        winners = sorted(o.writer for o in outcomes if o.kind == "published")
        for outcome in outcomes:
            if outcome.kind == "error" and not outcome.storage:
                self.fail("I5", race, f"writer {outcome.writer} racing for step {step} failed "
                          f"with {outcome.detail} instead of CheckpointExistsError")  # fmt: skip
        if len(winners) > 1:
            self.fail("I5", race, f"{len(winners)} of {self.writers} writers racing for step "
                      f"{step} were told they published it (writers "
                      f"{', '.join(map(str, winners))}): the conditional publish let more than "
                      f"one through")  # fmt: skip
        if not winners:
            if not undecided:
                self.fail("I5", race, f"none of {self.writers} writers racing for step {step} "
                          f"published it, yet none failed for the storage's sake")  # fmt: skip
            return
        self._holds_winner(race, step, winners)

    def _takeover(self, race: Round, outcomes: list[Outcome], undecided: bool) -> None:
        for outcome in outcomes:
            if outcome.kind == "error" and not outcome.storage:
                self.fail("I9", race, f"taker {outcome.writer} failed: {outcome.detail}")
        rollers = [o.writer for o in outcomes if o.kind == "no epoch"]
        if rollers:
            self._rolled_back_nothing(race, rollers)
        took = {o.writer: (int(o.detail.split()[0]), o.detail.split()[1])
                for o in outcomes if o.kind == "took"}  # fmt: skip
        if not took:
            return
        if race.kind == ROLLBACK:  # decided: at least one roller was told an epoch
            self.result.rollbacks += 1
        else:
            self.result.takeovers += 1
        told: dict[int, list[int]] = {}
        for writer, (epoch, _) in took.items():
            told.setdefault(epoch, []).append(writer)
        for epoch, writers in told.items():
            if len(writers) > 1:
                self.fail("I9", race, f"takers {', '.join(map(str, writers))} were all told "
                          f"they took epoch {epoch}: the epoch record's conditional create "
                          f"let more than one through")  # fmt: skip
        store = Store(self.location.base)
        lineage = store.lineage()
        for writer, (epoch, _) in sorted(took.items()):
            record = lineage.epoch(epoch)
            note = race.taker(writer) if race.kind == TAKEOVER else f"rollback to step {SEED_STEP}"
            if record is None or record.note != note:
                held = "nothing" if record is None else repr(record.note)
                self.fail("I9", race, f"taker {writer} was told it took epoch {epoch}, whose "
                          f"record holds {held}")  # fmt: skip
        newest = max(told)
        if undecided:  # a taker the storage failed may hold a newer epoch: judged no further
            return
        if lineage.newest != newest:
            self.fail("I9", race, f"the store's newest epoch is {lineage.newest}, but the "
                      f"takers were told of epochs up to {newest} only")  # fmt: skip
            return
        winner = told[newest][0]
        step, saved = race.step(winner), took[winner][1]
        if saved != "published":
            self.fail("I9", race, f"taker {winner}, told it took the newest epoch {newest}, "
                      f"could not publish step {step}: {saved}")  # fmt: skip
        # Read by name, not listed: the listing's own faults are the pointer race's to judge.
        seen = [s for s in race.steps(self.writers) if _found_directly(self.location.base, s)]
        if seen != ([step] if saved == "published" else []):
            self.fail("I9", race, f"after {self.writers} takers raced, readers find steps "
                      f"{seen} of theirs; only the newest epoch's (taker {winner}, step "
                      f"{step}) is in the history")  # fmt: skip
        latest = store.latest()
        if saved == "published" and (latest is None or latest.step != step):
            found = None if latest is None else latest.step
            listed = {s for s, _ in self.location.base.published_checkpoints()}
            if step not in listed:
                self.fail("I2", race, f"latest() is step {found} after the takeover race: "
                          f"step {step} of the newest epoch {newest} is published (a read "
                          f"by name finds it) but the store's listing omits it: the "
                          f"storage's listing does not show what was written")  # fmt: skip
            else:
                self.fail("I9", race, f"latest() is step {found} after the takeover race, "
                          f"not step {step} of the newest epoch {newest}")  # fmt: skip

    def _rolled_back_nothing(self, race: Round, rollers: list[int]) -> None:
        """Rollers found no step newer than the seed to roll back, though the rounds before
        published one: the listing's fault (I2) if it omits the steps a read by name finds
        (the LATEST hint, the other way to find them, is only a hint), else the rollback's."""
        earlier = range(SEED_STEP + 1, race.first)
        found = [step for step in earlier if _found_directly(self.location.base, step)]
        listed = {step for step, _ in self.location.base.published_checkpoints()}
        unlisted = [step for step in found if step not in listed]
        who = ", ".join(map(str, rollers))
        if unlisted:
            self.fail("I2", race, f"rollers {who} rolled back nothing: steps {unlisted} are "
                      f"published (a read by name finds them) but the store's listing omits "
                      f"them: the storage's listing does not show what was written")  # fmt: skip
        elif found:
            self.fail("I9", race, f"rollers {who} rolled back nothing, though steps {found} "
                      f"newer than step {SEED_STEP} are published and listed")  # fmt: skip

    def _holds_winner(self, race: Round, step: int, winners: list[int]) -> None:
        store = Store(self.location.base)
        try:
            checkpoint = store.get(step)
            holder = checkpoint.metadata.get("writer")
            expected = writer_shards(step, holder) if isinstance(holder, int) else {}
            data = {name: checkpoint.read(name) for name in checkpoint.names}
        except CkptStoreError as exc:
            if storage_failure(exc) is not None:
                raise
            self.fail("I5", race, f"step {step}, won by writer {winners[0]}, cannot be read "
                      f"after the race: {exc}")  # fmt: skip
            return
        if holder not in winners:
            told = ", ".join(map(str, winners))
            self.fail("I5", race, f"step {step} holds writer {holder}'s checkpoint, but only "
                      f"writer(s) {told} were told they published it")  # fmt: skip
        elif data != expected:
            self.fail("I5", race, f"step {step} holds writer {holder}'s manifest with other "
                      f"shards than it wrote ({sorted(data)} vs {sorted(expected)}, or other "
                      f"bytes): a losing writer's data got in")  # fmt: skip

    def _pointer(self, race: Round, outcomes: list[Outcome]) -> None:
        steps = race.steps(self.writers)
        for outcome in outcomes:
            if outcome.kind != "published" and not outcome.storage:
                self.fail("I5", race, f"writer {outcome.writer} could not publish step "
                          f"{race.step(outcome.writer)} while others published other steps: "
                          f"{outcome.detail or outcome.kind}")  # fmt: skip
        base = self.location.base
        before = self.hint
        every_one = all(o.kind == "published" for o in outcomes)

        def settles(hint: int | None) -> bool:  # what a sound store's hint reads after it
            lost = self.cas and every_one and hint in steps and hint != steps[-1]
            return not _behind(hint, before) and not lost

        # A hint read back stale for a moment (tolerated: ``settling``) is neither one that
        # went back nor a lost update: read until it is the newest, for a moment.
        hint = settled(base.read_latest_hint, settles)
        # Every commit point the listing shows, whatever its epoch (a takeover race ran first
        # where the store keeps lineages: the races after it publish in its epoch).
        published = {step for step, _ in base.published_checkpoints()}
        self.hint = hint
        if hint is not None and hint not in published and _found_directly(base, hint):
            # A direct read finds it: the listing, not the protocol, lost the step.
            self.fail("I2", race, f"LATEST names step {hint}, which a direct read finds "
                      f"published but the store's listing omits: the storage's listing does "
                      f"not show what was written")  # fmt: skip
            published.add(hint)
        elif hint is not None and hint not in published:
            self.fail("I1", race, f"after writers of steps {steps[0]}..{steps[-1]} raced to "
                      f"move it, LATEST names step {hint}, which is not published")  # fmt: skip
        if _behind(hint, before):
            self.fail("I4", race, f"LATEST went back from step {before} to {hint} when writers "
                      f"of steps {steps[0]}..{steps[-1]} raced to move it")  # fmt: skip
        # A hint left behind the newest raced step is one a writer gave up moving (a storage
        # that refuses the swap, or a stale read of it: readers list past it, and latest() is
        # checked below); it is a lost update when the storage took two swaps from one ETag,
        # or a put that sent no condition.
        lost = _lost_update(outcomes)
        if self.cas and hint in steps and hint != steps[-1] and every_one and lost:
            self.fail("I4", race, f"writers of steps {steps[0]}..{steps[-1]} raced to move "
                      f"LATEST; it names step {hint}: an update was lost ({lost}), so LATEST "
                      f"went back from {steps[-1]} to {hint}")  # fmt: skip
        if not published:  # the seed and the publish rounds' steps were all published
            self.fail("I2", race, "the store lists no published step after the pointer race: "
                      "the storage's listing omits what was written")  # fmt: skip
            return
        latest = Store(base).latest()
        newest = max(published)
        if latest is None or latest.step != newest:
            found = None if latest is None else latest.step
            self.fail("I4", race, f"latest() returned step {found} after the pointer race, "
                      f"not the newest published step {newest}")  # fmt: skip


def _lost_update(outcomes: list[Outcome]) -> str:
    """How the racers' puts of the LATEST hint could lose an update ("": they could not):
    some sent no condition, or the storage took two swaps from one ETag."""
    plain = sorted({o.writer for o in outcomes if "plain" in o.hint_writes})
    if plain:
        return (f"LATEST was written without compare-and-swap (writer(s) "
                f"{', '.join(map(str, plain))} put it plainly, no If-Match sent)")  # fmt: skip
    swaps = Counter(w for o in outcomes for w in o.hint_writes if w.startswith("if-match "))
    twice = sorted(w.partition(" ")[2] for w, n in swaps.items() if n > 1)
    if twice:
        return f"two writers' If-Match on one ETag ({twice[0]}) both let through"
    return ""


def _behind(hint: int | None, before: int | None) -> bool:
    """The hint read is behind the one read after the round before."""
    return before is not None and (hint is None or hint < before)


def _found_directly(base: CommitStrategy[Any], step: int) -> bool:
    """Whether a read of ``step``'s manifest by name (no listing) finds it published."""
    try:
        Store(base).get(step)
    except CheckpointNotFoundError:
        return False
    return True


# -- running -----------------------------------------------------------------------------


def _plan(rounds: int, writers: int, *, takeover: bool = False) -> list[Round]:
    """The rounds: where the store keeps lineages, a takeover race, then a rollback race
    (every racer rolls back to the seed step at once: a takeover each, from a step), both
    first so that a budget that ends the rounds early never leaves them out (the other races
    then run in the newest epoch); then publish and pointer races, alternating."""
    plan = []
    first = SEED_STEP + 1
    if takeover:
        plan.append(Round(0, TAKEOVER, first))
        plan.append(Round(0, ROLLBACK, first + writers))
        first += 2 * writers
    for number in range(rounds):
        plan.append(Round(number, PUBLISH, first))
        plan.append(Round(number, POINTER, first + 1))
        first += writers + 1
    return plan


PRELOAD = [
    "ckptstore.conformance.layers.races",
    "ckptstore.backends.posix",
    "ckptstore.backends.s3_open",
]
"""What the fork server imports once, so that each racer process starts in milliseconds."""


def _process_context() -> Any:
    """Fresh processes that share nothing with this one but what is on storage: forked from a
    fork server (not from this process, whose threads a fork would copy mid-flight)."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    return context


def _crew(location: Location, crew: Crew, how: str, result: RaceResult) -> int | str:
    """Race ``crew`` in threads or processes; return how many rounds ran, or why the crew
    could not race."""
    plan = _plan(crew.max_rounds, crew.writers, takeover=location.base.keeps_lineages)
    writers = crew.writers
    Store(location.base).save(SEED_STEP, {"seed.bin": b"seed"})
    context = _process_context() if how == "processes" else None
    if context is None:
        sync = _Sync(threading.Barrier(writers + 1), threading.Barrier(writers),
                     threading.Barrier(writers + 1), queue.Queue(), threading.Event())  # fmt: skip
    else:
        sync = _Sync(context.Barrier(writers + 1), context.Barrier(writers),
                     context.Barrier(writers + 1), context.Queue(), context.Event())  # fmt: skip
    runners: list[Any] = []
    for writer in range(writers):
        source = location.base if context is None else ChildSource.of(location)
        args = (source, writer, plan, sync)
        if context is None:
            runners.append(threading.Thread(target=_writer, args=args, daemon=True))
        else:
            runners.append(context.Process(target=_writer, args=args, daemon=True))
    for runner in runners:
        runner.start()
    try:
        return _lead(location, crew, plan, how, _Collector(sync, runners), result)
    except _RacerDied as died:
        sync.abort()
        return str(died)
    finally:
        for runner in runners:
            runner.join(WAIT_S)
            if context is not None and runner.is_alive():
                runner.kill()


class _RacerDied(Exception):
    """A racer process ended without a word (it could not even start)."""


class _Collector:
    """The racers' outcomes, as they come; ``_RacerDied`` where a racer is gone instead."""

    def __init__(self, sync: _Sync, runners: list[Any]) -> None:
        self.sync = sync
        self.runners = runners

    def get(self) -> Outcome:
        deadline = time.monotonic() + WAIT_S
        while True:
            try:
                item: Outcome | _Logged = self.sync.results.get(timeout=0.2)
            except queue.Empty:
                dead = [r for r in self.runners if getattr(r, "exitcode", None) not in (None, 0)]
                if dead:
                    raise _RacerDied(f"a racer process exited with status {dead[0].exitcode} "
                                     f"before it could race") from None  # fmt: skip
                if time.monotonic() > deadline:
                    raise _RacerDied(f"no word from a racer for {WAIT_S:.0f} s") from None
                continue
            if isinstance(item, _Logged):  # logged here, counted by the run's capture
                _RACER_LOG.log(item.level, "%s", item.message)
                continue
            return item


def _lead(
    location: Location,
    crew: Crew,
    plan: list[Round],
    how: str,
    collector: _Collector,
    result: RaceResult,
) -> int | str:
    sync = collector.sync
    ready = [collector.get() for _ in range(crew.writers)]
    unready = [o for o in ready if o.kind != "ready"]
    if unready:
        sync.abort()
        if any(o.kind == "unreachable" for o in unready) and how == "threads":
            # The racers share this process's strategy: the storage hides a fresh write.
            result.failures.append(RaceFinding("I2", how, (
                f"a writer does not list the checkpoint (step {SEED_STEP}) saved a moment "
                f"before through the same store object: the storage's listing omits what "
                f"was just written, so the races could not run")))  # fmt: skip
            return 0
        if any(o.kind == "unreachable" for o in unready):
            return (f"{NOT_APPLICABLE}: a process that opens {location.url} does not see a "
                    f"checkpoint saved by another (its data lives in one process)")  # fmt: skip
        if unready[0].storage:
            result.storage_errors.append(
                RaceFinding("I5", how, f"a racer could not open the store: {unready[0].detail}")
            )
            return 0
        return f"{COULD_NOT_OPEN}: {unready[0].detail}"
    judge = _Judge(location, crew.writers, how, result)
    started = time.monotonic()
    rounds = 0
    try:
        for race in plan:
            if race.kind == PUBLISH:
                spent = time.monotonic() - started
                if rounds >= crew.min_rounds and spent > crew.budget_s:
                    sync.stop.set()
                    sync.start.wait(WAIT_S)
                    break
                rounds += 1
            sync.start.wait(WAIT_S)
            sync.end.wait(WAIT_S)
            outcomes = sorted((collector.get() for _ in range(crew.writers)),
                              key=lambda o: o.writer)  # fmt: skip
            judge.judge(race, outcomes)
    except BaseException:
        sync.abort()  # no racer is left waiting for a round that will not come
        raise
    return rounds


def run_races(
    new_location: Callable[[], Location], profile: RaceProfile, *, processes: bool = True
) -> RaceResult:
    """Race writers in threads, then in processes where the store is shared between them.

    A failure of the storage itself (after the driver's retries) stops that crew and is
    recorded as a storage error: undecided, never a violation.
    """
    result = RaceResult(thread_writers=profile.threads.writers)
    ran = _undecided_on_storage_failure(
        result, "threads", lambda: _raced(new_location, profile.threads, "threads", result)
    )
    if isinstance(ran, str) and ran.startswith(COULD_NOT_OPEN):  # ckptstore's error: judged
        result.failures.append(RaceFinding("I5", "threads", ran))
    elif isinstance(ran, str):  # threads share the process: only the suite's failure stops them
        raise SuiteError(f"the writer threads could not race: {ran}")
    if isinstance(ran, int):
        result.thread_rounds = ran
    if not processes:
        result.processes_skipped = "not run"
        return result
    try:
        ran = _undecided_on_storage_failure(
            result,
            "processes",
            lambda: _raced(new_location, profile.processes, "processes", result),
        )
    except (SuiteError, threading.BrokenBarrierError) as exc:  # what the threads found stands
        ran = f"the racer processes stopped: {exc}"
    if isinstance(ran, str):
        result.processes_skipped = ran
    elif ran is not None:
        result.process_rounds, result.process_writers = ran, profile.processes.writers
    return result


def _raced(
    new_location: Callable[[], Location], crew: Crew, how: str, result: RaceResult
) -> int | str:
    location = new_location()
    try:
        driver = location.base.driver
        if how == "processes" and getattr(driver, "process_local", False):
            return f"{NOT_APPLICABLE}: {type(driver).__name__} keeps its data in one process"
        return _crew(location, crew, how, result)
    finally:
        location.destroy()


def _undecided_on_storage_failure(
    result: RaceResult, how: str, run: Callable[[], int | str]
) -> int | str | None:
    try:
        return run()
    except CkptStoreError as exc:
        failure = storage_failure(exc)
        if failure is None:
            raise
        result.storage_errors.append(RaceFinding("I5", how, f"the storage failed: {failure!r}"))
        return None


def run_layer(run: SuiteRun, found: Findings) -> None:
    """The layer on ``run``'s target, as hard as its profile says (``RACE_PROFILES``)."""
    result = run_races(run.locations, RACE_PROFILES[run.profile])
    if result.thread_rounds or result.process_rounds:  # else nothing was raced: not checked
        found.check("I1", "I4", "I5")
    if result.takeovers or result.rollbacks:
        found.check("I9")
    for failure in result.failures:
        found.violated(failure.invariant, f"{failure.case}: {failure.message}")
    for error in result.storage_errors:
        found.storage_error((error.invariant,), f"{error.case}: {error.message}")
    skipped = result.processes_skipped
    if skipped and not skipped.startswith(NOT_APPLICABLE):
        found.not_run["parallel races (processes)"] = skipped
    found.coverage["parallel races"] = result.coverage()
