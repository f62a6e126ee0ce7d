"""Property-based crash injection: a hypothesis state machine over any backend.

``CheckpointStoreMachine`` holds the rules, read on their own; ``make_state_machine`` makes
its subclass for one backend (a location factory and the backend's capability flags), as
hypothesis's own database tests are parametrised over implementations. Rules save (random
shard counts and sizes, optionally crashing at a random storage call, before or after it took
effect), read, verify, apply retention, collect garbage (with and without aging the
leftovers, and while a save is still live), restart the store, race a second writer at the
same step, corrupt a shard behind the store's back, and inject transient faults, and take
the store over (a restarted run, resumed from an older step or fresh) while the old writer,
its zombie, keeps saving: before, across and racing the takeover; a tiered node whose
fast tier is cut off from this store across a takeover replicates what it owes when it
heals (tiers x takeovers); the rules of
``foreign.ForeignEntryRules`` plant strays and corrupt pointers and run an operator's delete,
rollback and retention under a resuming reader. After every step the model checks I1 to I7
and I9; a failure is shrunk by hypothesis to a short sequence of rules. Where the storage
itself fails a step (after its driver's retries), the example stops at once with
``StorageFailure``: undecided, not shrunk.
"""

from __future__ import annotations

import re
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from datetime import timedelta
from typing import Any, ClassVar

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from ckptstore.adapters.directory import DEFAULT_PARALLEL, publish_directory
from ckptstore.conformance.audit import audit_of
from ckptstore.conformance.faults import CrashMode, FaultPlan, SimulatedCrash
from ckptstore.conformance.layers.workload import (
    GRACE,
    MULTIPART_COMPLETION,
    pattern,
    push,
    save,
    write_directory,
)
from ckptstore.conformance.location import Location
from ckptstore.conformance.machine.foreign import ForeignEntryRules
from ckptstore.conformance.model import InvariantViolation, Model, Saved, check_invariants
from ckptstore.conformance.outcomes import (
    StorageFailure,
    SuiteError,
    abort_on_storage_failure,
    retry_storage_failures,
    storage_failure,
)
from ckptstore.conformance.reflinks import REFUSED, STAND_IN, THE_FILE_SYSTEMS, reflinks
from ckptstore.conformance.tiered_model import tell_model
from ckptstore.errors import (
    CheckpointExistsError,
    CkptStoreError,
    EpochRequiredError,
    StorageError,
    SupersededError,
)
from ckptstore.manifest import Manifest
from ckptstore.names import new_attempt_id
from ckptstore.retention import KeepLast
from ckptstore.store import Store
from ckptstore.tiers.replication import ReplicateAll, Replicator
from ckptstore.tiers.tiered import TieredStore

__all__ = ["PROFILES", "CheckpointStoreMachine", "make_state_machine", "run_state_machine"]

PART_WAIT_S = 30.0
"""How long a rule waits for parts a writer's threads are uploading."""


def _profile(examples: int, steps: int) -> settings:
    """Examples of up to ``steps`` rules; no per-example deadline (storage is slow), no
    example database (each run starts afresh), no health check (the rules draw much)."""
    return settings(
        max_examples=examples,
        stateful_step_count=steps,
        deadline=None,
        database=None,
        print_blob=True,  # the report prints it: ``conformance URL --reproduce VERSION:BLOB``
        suppress_health_check=list(HealthCheck),
    )


PROFILES = {"ci": _profile(40, 20), "thorough": _profile(300, 40)}

_modes = st.sampled_from([CrashMode.BEFORE, CrashMode.AFTER])
_ZOMBIE_SAVES = st.sampled_from(["idle", "across", "racing"])
"""What the old writer does when the store is taken over: nothing; a save begun before the
takeover and published after it; a save whose publish the takeover races past the check."""
_STEP_TOKENS = re.compile(r"step-([0-9]{20})", re.ASCII)
"""A step's token in a raw name (``names.step_token``)."""


SHARD_SIZES = (0, 1, 100, 4096)
"""The sizes a save's shards are drawn from; the backend's multipart size too where it has
one (``make_state_machine``)."""


def _save_rule(sizes: tuple[int, ...]) -> Any:
    """The ``save`` rule, its shard sizes drawn from ``sizes``: a rule's strategies are fixed
    when its class is made, so a backend with multipart uploads gets a ``save`` of its own
    (``make_state_machine``), drawing exactly as sampling ``sizes`` does."""

    @rule(
        shard_sizes=st.lists(st.sampled_from(sizes), min_size=1, max_size=4),
        crash=st.none() | st.tuples(st.integers(0, 40), _modes),
        skip=st.integers(0, 2),
    )
    @abort_on_storage_failure
    def save(
        self: CheckpointStoreMachine,
        shard_sizes: list[int],
        crash: tuple[int, CrashMode] | None,
        skip: int,
    ) -> None:
        self.save_shards(shard_sizes, crash, skip)

    return save


HEALS = ("its replicator resumes", "the job restarts on the node")
"""How a partitioned node comes back (``fast_tier_partitioned``)."""
PUSHES = ("its epoch", "no epoch", "a superseded epoch")
"""How a push after a takeover names its epoch (``push_a_directory``)."""
CLONES = {
    "copied": (False, THE_FILE_SYSTEMS),
    "cloned by the file system": (True, THE_FILE_SYSTEMS),
    "cloned by a stand-in FICLONE": (True, STAND_IN),
    "cloned, FICLONE refused": (True, REFUSED),
}
"""How a push's files become its shards (``push_a_directory``): ``publish_directory``'s
``clone``, and the ``FICLONE`` that ``PosixDriver.clone`` meets (``reflinks``): copied; cloned
by the file system's own (a clone on XFS or btrfs; refused on ext4 or tmpfs, then copied); by a
stand-in (a clone on every machine); refused (the fallback to copying on every machine)."""
_PUSH_CRASHES = st.none() | st.tuples(st.integers(0, 44) | st.just("clone"), _modes)
"""Where a push dies: before or after its call number k, or its first ``clone``."""


def _changes_a_lease(method: str, key: object) -> bool:
    return method == "put" and isinstance(key, str) and key.endswith(".lease")


def _changes_the_area(method: str, key: object) -> bool:
    return _changes_a_lease(method, key) or _deletes_a_blob(method, key)


def _deletes_a_blob(method: str, key: object) -> bool:
    return method == "delete" and isinstance(key, str) and ".g" in key.rpartition("/")[2]


RACE_HOOKS: dict[str, Callable[[str, object], bool]] = {
    "gc's first change": _changes_the_area,
    "gc's delete": _deletes_a_blob,
}
INTERLEAVED = "the save's decision, gc's doom, the save's end, gc's delete"
RACE_POINTS = (*RACE_HOOKS, "the save's first change", INTERLEAVED)
RACE_WAIT_S = 120.0
"""How long one side of an interleaved race waits for the other, at most (a bound against a
hang, never reached when both make progress)."""


def _interleave(
    writer: Store, collector: Store, share: Callable[[], None], collect: Callable[[], None]
) -> None:
    """Run ``share`` on a thread up to its first lease change, then ``collect`` up to just
    after its first change of the blob area (its doom CAS), then the rest of ``share``, then
    the rest of ``collect``: GC's doom lands between a writer's decision and its append."""
    at_decision, doomed = threading.Event(), threading.Event()
    failed: list[BaseException] = []

    def decide() -> None:
        at_decision.set()
        doomed.wait(RACE_WAIT_S)

    def run_share() -> None:
        try:
            share()
        except BaseException as exc:  # raised again on the rule's thread
            failed.append(exc)
        finally:
            at_decision.set()

    _run_first(writer.strategy.driver, _changes_a_lease, decide)
    thread = threading.Thread(target=run_share, name="ckptstore-racing-save")
    thread.start()
    at_decision.wait(RACE_WAIT_S)

    def finish_share() -> None:
        doomed.set()
        thread.join(RACE_WAIT_S)

    _run_after_first(collector.strategy.driver, _changes_the_area, finish_share)
    try:
        collect()
    finally:
        finish_share()
    if failed:
        raise failed[0]


def _run_after_first(
    driver: Any, when: Callable[[str, object], bool], action: Callable[[], None]
) -> None:
    """Run ``action`` once, just after the first ``put``/``delete`` of ``driver`` that
    ``when(method, key)`` picks, whether it succeeded or failed."""
    done: list[bool] = []
    for method in ("put", "delete"):
        real = getattr(driver, method)

        def hooked(key: object, *args: Any, _real: Any = real, _method: str = method,
                   **kwargs: Any) -> Any:  # fmt: skip
            try:
                return _real(key, *args, **kwargs)
            finally:
                if not done and when(_method, key):
                    done.append(True)
                    action()

        setattr(driver, method, hooked)


def _run_first(
    driver: Any, when: Callable[[str, object], bool], action: Callable[[], None]
) -> None:
    """Run ``action`` once, just before the first ``put``/``delete`` of ``driver`` that
    ``when(method, key)`` picks (the driver's own methods are shadowed on the instance)."""
    done: list[bool] = []
    for method in ("put", "delete"):
        real = getattr(driver, method)

        def hooked(key: object, *args: Any, _real: Any = real, _method: str = method,
                   **kwargs: Any) -> Any:  # fmt: skip
            if not done and when(_method, key):
                done.append(True)
                action()
            return _real(key, *args, **kwargs)

        setattr(driver, method, hooked)


class CheckpointStoreMachine(ForeignEntryRules):
    """One store, one model, and every way a trainer, a crash or a disk can treat it.

    What it runs on is given by the class attributes below, which ``make_state_machine`` sets
    on a subclass per backend (as hypothesis's own database tests parametrise one machine over
    several backends).
    """

    new_location: ClassVar[Callable[[], Location]]
    """Makes the fresh location each example runs in."""
    multipart_size: ClassVar[int] = 0
    """A shard size that needs a multipart upload (0: the backend has none)."""
    can_corrupt: ClassVar[bool] = True
    """Stored shard bytes can be rewritten behind the store's back."""
    completion_crashes: ClassVar[Counter[str]] = Counter()
    """Crashes just ``before`` and just ``after`` a multipart completion, in all examples (a
    counter of its own per backend's subclass)."""
    sharing: ClassVar[Counter[str]] = Counter()
    """Incremental saves (``saves``) and sharing races with GC (``races``) that ran, in all
    examples (I10 is checked only where some did)."""

    @abort_on_storage_failure
    def __init__(self) -> None:
        super().__init__()
        self.location = type(self).new_location()
        self.model = Model()
        self.store, _ = self.location.open()
        self.next_step = 1
        self.checked: object = None
        self.zombie: Store | None = None
        """A writer joined to an epoch that a takeover superseded, still saving."""
        self.zombie_step = 0

    def _new_save(self, shard_sizes: list[int]) -> Saved:
        step = self.next_step
        while step in self.model.strays:  # a run resumed from below reaches them
            step += 1
        self.next_step = step + 1
        shards = {
            f"rank{i:02d}/part.bin": pattern(size, step * 10 + i)
            for i, size in enumerate(shard_sizes)
        }
        # self.store, and a store opened afresh (told the run's epoch), write in the newest
        epoch = self.model.newest_epoch
        return Saved(step, shards, {"step": step, "tokens": step * 1000}, epoch)

    def _writer(self, plan: FaultPlan | None = None, *, incremental: bool = False) -> Store:
        """A store opened afresh by the run: told the run's epoch once the store was taken
        over, as every writer then must be (a writer that names none is refused, §8.3)."""
        store, _ = self.location.open(plan, incremental=incremental)
        if self.model.newest_epoch > 0:
            store.join_epoch(self.model.newest_epoch)
        return store

    def _zombie_save(self, zombie: Store) -> Saved:
        """The old writer's next save: its own step counter, other bytes than the new
        run's save of the same step."""
        self.zombie_step = step = max(self.zombie_step + 1, self.next_step)
        shards = {"rank00/part.bin": pattern(100, 7919 * step + 1)}
        epoch = zombie.epoch if zombie.epoch is not None else self.model.newest_epoch
        return Saved(step, shards, {"step": step, "writer": "zombie"}, epoch)

    def save_shards(
        self, shard_sizes: list[int], crash: tuple[int, CrashMode] | None, skip: int
    ) -> None:
        """The ``save`` rule: a save of shards of those sizes, ``skip`` steps on, crashing at
        call ``crash[0]`` (before or after it) unless ``crash`` is None."""
        self.next_step += skip
        saved = self._new_save(shard_sizes)
        if crash is None:
            save(self.store, self.model, saved)
            return
        try:
            store = self._writer(FaultPlan(crash_at=crash[0], crash_mode=crash[1]))
            save(store, self.model, saved)
        except SimulatedCrash as died:
            self.completion_crashes.update(_around_completion(died))
            self.restart()

    save = _save_rule(SHARD_SIZES)

    @precondition(lambda self: self.location.base.shares_shards)
    @rule(
        reuse=st.lists(st.booleans(), min_size=1, max_size=3),
        crash=st.none() | st.tuples(st.integers(0, 40), _modes),
        given=st.sampled_from(("buffers", "chunks", "push")),
    )
    @abort_on_storage_failure
    def save_incrementally(
        self, reuse: list[bool], crash: tuple[int, CrashMode] | None, given: str = "buffers"
    ) -> None:
        """An incremental save (docs/protocol.md §12) whose shards repeat, where ``reuse``
        says, the bytes of a shard an earlier save committed (a frozen base): shared with
        that checkpoint (a hard link, a leased blob) where an incremental save stored them,
        else written; crashing at call ``crash[0]`` (the sharing links, lease CASes and
        uploads among the calls) unless None. The shards are ``given`` as buffers, as lists
        of three buffers (a snapshot's chunks), or as the files of a pushed directory. I10 is
        checked with every other invariant: each published checkpoint reads back whole, its
        shared shards included."""
        earlier = [
            blob for saved in self.model.committed.values() for blob in saved.shards.values()
        ]
        saved = self._new_save([100] * len(reuse))
        shards = dict(saved.shards)
        for index, (name, reused) in enumerate(zip(list(shards), reuse, strict=True)):
            if reused and earlier:
                shards[name] = earlier[-1 - index % len(earlier)]
        saved = Saved(saved.step, shards, saved.metadata, saved.epoch)
        plan = None if crash is None else FaultPlan(crash_at=crash[0], crash_mode=crash[1])
        self.sharing["saves"] += 1
        try:
            store = self._writer(plan, incremental=True)
            if given == "push":  # one file at a time: the same call dies on every replay
                push(
                    store, self.model, saved, clone=False, parallel=1 if plan else DEFAULT_PARALLEL
                )
            else:
                save(store, self.model, saved, pieces=3 if given == "chunks" else 1)
        except SimulatedCrash as died:
            self.completion_crashes.update(_around_completion(died))
            self.restart()

    @precondition(lambda self: self.location.base.sharing_digest is not None)
    @rule(at=st.sampled_from(RACE_POINTS))
    @abort_on_storage_failure
    def share_racing_gc(self, at: str) -> None:
        """An incremental save sharing a blob whose only checkpoint was just deleted, and a
        GC aged past the grace period, each run at the other's decision (object stores,
        docs/protocol.md §12.3): ``at`` "gc's first change" (the whole save runs just before
        GC's first change of the blob area, its doom CAS: the CAS must fail, and GC keep the
        blob), "gc's delete" (just before GC deletes a generation it doomed: the save must
        not use it), or "the save's first change" (GC runs just before the save's first
        lease CAS: the save must not use what GC dooms). Then a GC again: every published
        checkpoint reads back whole, its shared shards included (I10)."""
        frozen = pattern(100, 7001 + 13 * self.next_step)  # bytes no other save has
        first = self._new_save([])
        first = Saved(first.step, {"rank00/frozen.bin": frozen}, first.metadata, first.epoch)
        save(self._writer(incremental=True), self.model, first)
        self.model.removal_started({first.step}, explicit=True)
        self.store.delete(first.step, force=True)
        racing = self._new_save([100])
        shards = {"rank00/frozen.bin": frozen, **racing.shards}
        racing = Saved(racing.step, shards, racing.metadata, racing.epoch)
        writer, collector = self._writer(incremental=True), self._writer()
        self.sharing["races"] += 1

        def collect() -> None:
            self.location.clock.advance(2 * GRACE.total_seconds())
            self.model.gc_started()
            collector.gc(grace=GRACE, superseded_grace=timedelta(0))

        def share() -> None:
            try:
                save(writer, self.model, racing)
            except CkptStoreError:
                pass  # GC, its clock past the grace period, may judge the save dead: it fails

        if at == "the save's first change":
            _run_first(writer.strategy.driver, _changes_a_lease, collect)
            share()
        elif at == INTERLEAVED:
            _interleave(writer, collector, share, collect)
        else:
            _run_first(collector.strategy.driver, RACE_HOOKS[at], share)
            collect()
        collect()

    @precondition(lambda self: self.location.base.sharing_digest is not None)
    @precondition(lambda self: self.can_corrupt)
    @rule()
    @abort_on_storage_failure
    def share_a_truncated_blob(self) -> None:
        """An incremental save of bytes whose blob was truncated behind the store's back
        (object stores, §12.3): every checkpoint that named the blob is damaged, and the new
        checkpoint must not be (the save finds the blob's object shorter than its name says,
        and writes the shard unshared)."""
        frozen = pattern(100, 9001 + 13 * self.next_step)
        first = self._new_save([])
        first = Saved(first.step, {"rank00/frozen.bin": frozen}, first.metadata, first.epoch)
        save(self._writer(incremental=True), self.model, first)
        locator = self.store.get(first.step).shards["rank00/frozen.bin"].locator
        hit = self._sharing_blob(locator["key"], locator.get("version_id"))
        epoch = self.store.get(first.step).manifest.epoch
        done = self.location.corrupt(first.step, "rank00/frozen.bin", "truncate", epoch)
        if done is None:
            return
        for damaged_step, damaged_name in hit:
            self.model.shard_corrupted(damaged_step, damaged_name, done)
        again = self._new_save([])
        again = Saved(again.step, {"rank00/frozen.bin": frozen}, again.metadata, again.epoch)
        self.sharing["saves"] += 1
        save(self._writer(incremental=True), self.model, again)

    @precondition(lambda self: self.location.base.shares_shards)
    @rule()
    @abort_on_storage_failure
    def gc_without_grace(self) -> None:
        """GC with no grace period, between saves (none is live): every leftover of a dead
        attempt goes, and every blob-area entry no checkpoint links (a file system's GC ages
        leftovers on its own clock, which the suite cannot move)."""
        self.model.gc_started()
        self.store.gc(grace=timedelta(0), superseded_grace=timedelta(0))

    @precondition(lambda self: self.multipart_size > 0)
    @rule(mode=_modes)
    @abort_on_storage_failure
    def save_crashing_at_a_multipart_completion(self, mode: CrashMode) -> None:
        saved = self._new_save([100, self.multipart_size])
        plan = FaultPlan(crash_mode=mode, crash_on=MULTIPART_COMPLETION)
        try:
            store = self._writer(plan)
            save(store, self.model, saved)
        except SimulatedCrash as died:
            self.completion_crashes.update(_around_completion(died))
            self.restart()

    @rule(index=st.integers(0, 40), mode=_modes)
    @abort_on_storage_failure
    def save_with_transient_fault(self, index: int, mode: CrashMode) -> None:
        saved = self._new_save([100, 4096])
        try:
            store = self._writer(FaultPlan(transient={index: mode}))
            save(store, self.model, saved)
        except CkptStoreError:
            pass  # the save may fail; whatever it left must still satisfy the model

    @rule()
    @abort_on_storage_failure
    def read_latest(self) -> None:
        try:
            latest = self.store.latest()
        except CkptStoreError:
            return  # a damaged newest checkpoint: the invariant check judges it
        if latest is not None:
            for name in latest.names:
                try:
                    latest.read(name)
                except CkptStoreError:
                    pass

    @rule()
    @abort_on_storage_failure
    def read_all_and_verify(self) -> None:
        for checkpoint in self.store.checkpoints():
            checkpoint.verify()

    @rule(keep=st.integers(1, 3))
    @abort_on_storage_failure
    def retention(self, keep: int) -> None:
        steps = self.store.steps()
        if steps:
            self.model.removal_started(set(steps[:-keep]), explicit=False)
        self.store.apply_retention(KeepLast(keep))
        kept = set(self.store.steps())
        if self.model.superseded and not set(steps[-keep:]) <= kept:
            raise InvariantViolation(
                "I9",
                f"retention kept {sorted(kept)} of the history's {steps}, not the newest "
                f"{keep}: it counted superseded checkpoints",
            )

    @rule(age=st.booleans())
    @abort_on_storage_failure
    def gc(self, age: bool) -> None:
        if age:
            self.location.clock.advance(2 * GRACE.total_seconds())
        self.model.gc_started()
        # Superseded checkpoints are kept for a grace period after their takeover (an
        # undo may bring them back, docs/protocol.md §8.4): none here, to check that GC
        # collects every one of them.
        self.store.gc(grace=GRACE, superseded_grace=timedelta(0))
        left = [e for e in self.store.superseded() if e.step not in self.model.strays]
        if left:
            raise InvariantViolation("I9", f"GC left superseded checkpoints published: {left[:3]}")

    @rule()
    @abort_on_storage_failure
    def gc_during_a_live_save(self) -> None:
        saved = self._new_save([100, 100])
        self.model.save_started(saved)
        pending = self.store.begin(saved.step, saved.metadata)
        pending.write("rank00/part.bin", saved.shards["rank00/part.bin"])
        self.model.gc_started()
        grace = timedelta(seconds=self.location.clock.offset) + GRACE
        self.store.gc(grace=grace)
        try:
            pending.write("rank01/part.bin", saved.shards["rank01/part.bin"])
            pending.publish()
        except CkptStoreError as exc:
            raise InvariantViolation(
                "I7", f"GC removed a live save younger than the grace period: {exc}"
            ) from exc
        self.model.save_committed(saved)

    @precondition(lambda self: self.multipart_size > 0)
    @rule(age=st.booleans())
    @abort_on_storage_failure
    def gc_during_a_live_multipart_upload(self, age: bool) -> None:
        self._gc_mid_shard(age, size_hint=self.multipart_size)

    @rule(age=st.booleans())
    @abort_on_storage_failure
    def gc_during_a_live_streamed_shard(self, age: bool) -> None:
        self._gc_mid_shard(age, size_hint=None)

    def _gc_mid_shard(self, age: bool, size_hint: int | None) -> None:
        """GC between the writes of one shard (a multipart upload with a part uploaded,
        or a stream left open), then finish and publish. Younger than the grace period,
        the save must publish; aged past it, it may fail, cleanly (I7, and the
        invariants judge whatever it left)."""
        saved = self._new_save([100, self.multipart_size or 4096])
        data = saved.shards["rank01/part.bin"]
        self.model.save_started(saved)
        pending = self.store.begin(saved.step, saved.metadata)
        pending.write("rank00/part.bin", saved.shards["rank00/part.bin"])
        writer = pending.open_shard("rank01/part.bin", size_hint)
        writer.write(data[:-1])  # more than a part: the upload has begun
        self.model.gc_started()
        if age:
            self.location.clock.advance(2 * GRACE.total_seconds())
            self.store.gc(grace=GRACE)
        else:
            self.store.gc(grace=timedelta(seconds=self.location.clock.offset) + GRACE)
        try:
            writer.write(data[-1:])
            writer.close()
            pending.publish()
        except CkptStoreError as exc:
            pending.abort()
            if age:
                return  # GC took it for dead, as it may: failing cleanly is allowed
            what = "multipart upload" if size_hint else "streamed shard"
            raise InvariantViolation(
                "I7", f"GC broke a save with a live {what} younger than the grace period: {exc}"
            ) from exc
        self.model.save_committed(saved)

    @precondition(lambda self: self.multipart_size > 0 and self.location.storage_follows_clock)
    @rule()
    @abort_on_storage_failure
    def gc_during_a_long_multipart_upload(self) -> None:
        """An upload that began longer ago than the grace period, its parts still arriving
        (a large shard on a slow link): GC must age it by its last part, not its start.
        Only where the storage stamps its writes with the suite's clock (memory://), so
        that the upload's start is old on the storage's own clock."""
        part = int(getattr(self.location.base, "part_size", 0) or 0)
        if part <= 0 or not self._lists_uploads():
            return
        saved = self._new_save([2 * part + 123])
        data = saved.shards["rank00/part.bin"]
        self.model.save_started(saved)
        pending = self.store.begin(saved.step, saved.metadata)
        before = self._uploads()
        writer = pending.open_shard("rank00/part.bin", len(data))
        writer.write(data[: part + 1])  # the upload begins: its first part
        self.location.clock.advance(2 * GRACE.total_seconds())
        writer.write(data[part + 1 : 2 * part + 1])  # its second part, now
        if not self._wait_for_parts(before, 2):
            pending.abort()  # the storage lists no incomplete upload (the probe says so)
            return
        self.model.gc_started()
        self.store.gc(grace=GRACE)
        try:
            writer.write(data[2 * part + 1 :])
            writer.close()
            pending.publish()
        except CkptStoreError as exc:
            pending.abort()
            raise InvariantViolation(
                "I7",
                f"GC removed a multipart upload whose parts were still arriving (it began "
                f"{2 * GRACE} ago, its last part a moment ago): {exc}",
            ) from exc
        self.model.save_committed(saved)

    def _lists_uploads(self) -> bool:
        """Whether the storage lists incomplete uploads (the rule waits on that); one
        that cannot (501) does not get this rule."""
        try:
            list(self.location.base.driver.list_multipart_uploads(""))
        except StorageError as exc:
            if storage_failure(exc) is None:
                raise
            return False
        return True

    def _uploads(self) -> set[tuple[str, str]]:
        """The storage's incomplete uploads now, by key and upload id."""
        driver = self.location.base.driver
        return {(u.key, u.upload_id) for u in driver.list_multipart_uploads("")}

    def _wait_for_parts(self, before: set[tuple[str, str]], parts: int) -> bool:
        """Until an upload begun since ``before`` (the uploads listed then) holds ``parts``
        parts: parts may go up on threads of their own. The upload is told by being new, not
        by its name, which is the layout's to choose (a version-pinning layout keys uploads
        by shard, not by step). False if no new upload was ever listed (a storage that lists
        none: the probe ``incomplete uploads listed`` judges it, and the rule cannot run); a
        listed upload that never holds the parts is the suite's failure (``SuiteError``),
        never an invariant."""
        driver = self.location.base.driver
        deadline = time.monotonic() + PART_WAIT_S
        seen: dict[tuple[str, str], int] = {}
        while time.monotonic() < deadline:
            for upload in driver.list_multipart_uploads(""):
                if (upload.key, upload.upload_id) in before:
                    continue
                seen[(upload.key, upload.upload_id)] = driver.upload_progress(upload).parts
                if seen[(upload.key, upload.upload_id)] >= parts:
                    return True
            time.sleep(0.005)
        if not seen:
            return False
        found = ", ".join(f"{key} ({n} parts)" for (key, _), n in seen.items()) or "none"
        raise SuiteError(
            f"waited {PART_WAIT_S:g} s for a new multipart upload to hold {parts} parts; "
            f"new uploads listed: {found}"
        )

    @precondition(lambda self: self.location.base.keeps_lineages)
    @rule(data=st.data(), fresh=st.booleans(), zombie=_ZOMBIE_SAVES)
    @abort_on_storage_failure
    def take_over(self, data: Any, fresh: bool, zombie: str) -> None:
        """A restarted run takes the store over, resumed from a published step (or
        fresh), while the old writer still saves: its save across the takeover fails
        with SupersededError; one whose publish races past its check publishes, never
        to be returned (I9). The new run then saves the steps after its parent, names
        the old writer may have taken already."""
        steps = self.store.steps()
        parent = None if fresh or not steps else data.draw(st.sampled_from(steps))
        old = self.store
        if old.epoch is None:
            old.join_epoch(self.model.newest_epoch)
        self.zombie_step = max(self.zombie_step, self.next_step - 1)
        if zombie == "racing":
            self._race_a_takeover(old, parent)
        elif zombie == "across":
            saved = self._zombie_save(old)
            self.model.save_started(saved)
            pending = old.begin(saved.step, saved.metadata)
            for name, blob in saved.shards.items():
                pending.write(name, blob)
            self._take_over(parent)
            try:
                pending.publish()
            except SupersededError as exc:
                _names_its_supersessor(exc, saved.epoch + 1)
            else:
                raise InvariantViolation(
                    "I9", f"a writer superseded before its publish published step {saved.step}"
                )
        else:
            self._take_over(parent)
        self.zombie = old
        self.next_step = 1 if parent is None else parent + 1

    def _take_over(self, parent: int | None) -> None:
        store, _ = self.location.open()
        epoch = store.take_over(parent, discard_history=parent is None)
        expected = self.model.newest_epoch + 1
        if epoch.number != expected or store.lineage().newest != expected:
            raise InvariantViolation(
                "I9", f"a takeover took epoch {epoch.number}; the next epoch is {expected}"
            )
        self.model.epoch_taken(parent)
        self.store = store

    def _race_a_takeover(self, zombie: Store, parent: int | None) -> None:
        """The zombie passes its check, then the store is taken over, then its commit
        point: published, but superseded before it was (§8.2, point 4)."""
        saved = self._zombie_save(zombie)
        strategy = zombie.strategy
        publish = strategy.publish

        def taken_over_first(manifest: Manifest) -> None:
            self._take_over(parent)
            publish(manifest)

        strategy.publish = taken_over_first  # type: ignore[method-assign]
        try:
            save(zombie, self.model, saved)  # restores the strategy's own publish
        except CheckpointExistsError:
            pass  # the step was taken in the old epoch: the zombie lost its race

    @precondition(lambda self: self.location.base.keeps_lineages)
    @rule(
        before=st.integers(0, 2),
        during=st.integers(1, 2),
        taken=st.booleans(),
        heal=st.sampled_from(HEALS),
    )
    @abort_on_storage_failure
    def fast_tier_partitioned(self, before: int, during: int, taken: bool, heal: str) -> None:
        """Tiers across a takeover: a node trains on a fast tier of its own (memory)
        replicating into this store, its durable tier. It saves ``before`` steps, replicated;
        then, cut off from this store, ``during`` more, to its fast tier alone. Meanwhile
        (``taken``) a restarted run resumes from the newest durable step and takes this store
        over. When the partition heals (``heal``), the node's replicator resumes, or the job
        restarts on the node (a new pair on the same fast tier, in the store's newest epoch),
        and copies what it owes: into the history if the store was not taken over; else
        nothing of the node's branch (a copy of it published is I9, one lost is I2)."""
        node = self._tiered_node()
        restarted: _TieredNode | None = None
        try:
            for _ in range(before):
                self._save_to_fast_tier(node)
            node.replicator.run_pass()
            for _ in range(during):
                self._save_to_fast_tier(node)
            if taken:
                steps = self.store.steps()
                parent = steps[-1] if steps else None
                self._take_over(parent)
                self.next_step = 1 if parent is None else parent + 1
            if heal == HEALS[1]:
                restarted = node = self._tiered_node(node.fast_location)
            try:
                node.replicator.run_pass()
            except SupersededError:
                if not taken or restarted is not None:
                    raise
        finally:
            for pair in {id(p): p for p in (node, restarted) if p is not None}.values():
                pair.close(wait=False)  # what it still owes is not for this store now
            node.fast_location.destroy()

    def _tiered_node(self, fast_location: Location | None = None) -> _TieredNode:
        """A TieredStore whose fast tier is ``fast_location`` (default: a fresh memory
        location) and whose durable tier is this store, opened afresh in the run's newest
        epoch, as ``open_tiered`` does; the model learns of each copy."""
        if fast_location is None:
            fast_location = Location(f"memory://machine-fast-{new_attempt_id()}/fast")
        fast, _ = fast_location.open()
        durable = self._writer()
        replicator = Replicator(fast, durable, ReplicateAll())
        tell_model(replicator, self.model, durable.epoch or 0)
        return _TieredNode(fast, durable, replicator, fast_location)

    def _save_to_fast_tier(self, node: _TieredNode) -> None:
        saved = self._new_save([100])
        node.save(saved.step, saved.shards, saved.metadata)

    @precondition(lambda self: self.zombie is not None)
    @rule()
    @abort_on_storage_failure
    def zombie_saves(self) -> None:
        """The superseded writer saves again: SupersededError naming the newest epoch,
        and nothing of it is ever returned."""
        assert self.zombie is not None
        saved = self._zombie_save(self.zombie)
        try:
            save(self.zombie, self.model, saved)
        except SupersededError as exc:
            _names_its_supersessor(exc, saved.epoch + 1)
            return
        raise InvariantViolation(
            "I9", f"a superseded writer (epoch {saved.epoch}) published step {saved.step}"
        )

    @precondition(lambda self: self.model.newest_epoch > 0)
    @rule(how=st.sampled_from(PUSHES), cloning=st.sampled_from(list(CLONES)), crash=_PUSH_CRASHES)
    @abort_on_storage_failure
    def push_a_directory(
        self, how: str, cloning: str, crash: tuple[int | str, CrashMode] | None
    ) -> None:
        """``ckptstore push`` after a takeover: a directory published from a fresh store
        (``publish_directory``, as every push opens one), its files copied or cloned
        (``CLONES``), the process dying at call ``crash[0]`` (a number, or ``clone``: the
        first) unless ``crash`` is None. Told the run's epoch, it publishes in it; naming none,
        it is refused (EpochRequiredError: it may be the zombie); naming a superseded epoch,
        SupersededError. Refused, nothing of it is ever returned (I9)."""
        newest = self.model.newest_epoch
        epoch = {"its epoch": newest, "no epoch": None}.get(how, newest - 1)
        saved = self._new_save([100, 37])
        saved.metadata = {"step": saved.step, "pushed": how}
        clone, ficlone = CLONES[cloning]
        plan = None if crash is None else _crash_plan(*crash)
        # One file at a time where the push may die: the same call dies on every replay.
        parallel = DEFAULT_PARALLEL if plan is None else 1
        store, _ = self.location.open(plan)
        try:
            with reflinks(ficlone):
                if how == "its epoch":
                    push(store, self.model, saved, clone=clone, epoch=epoch, parallel=parallel)
                    return
                try:
                    with tempfile.TemporaryDirectory(prefix="ckptstore-push-") as directory:
                        write_directory(directory, saved.shards)
                        publish_directory(store, saved.step, directory, metadata=saved.metadata,
                                          epoch=epoch, clone=clone, parallel=parallel)  # fmt: skip
                except EpochRequiredError:
                    return
                except SupersededError:
                    if epoch is None:
                        raise
                    return
        except SimulatedCrash:
            self.restart()  # a push that was to publish stays in doubt
            return
        raise InvariantViolation(
            "I9", f"a push naming {how} (epoch {epoch}) published step {saved.step} after "
            f"the store was taken over in epoch {newest}"
        )  # fmt: skip

    @rule()
    @abort_on_storage_failure
    def restart(self) -> None:
        self.store = self._writer()

    @rule(first_wins=st.booleans())
    @abort_on_storage_failure
    def concurrent_writers(self, first_wins: bool) -> None:
        one, two = self._new_save([100]), self._new_save([4096, 1])
        two.step = one.step
        self.model.contended.add(one.step)
        self.model.save_started(one)
        self.model.save_started(two)
        first, second = (
            self.store.begin(one.step, one.metadata),
            self.store.begin(two.step, two.metadata),
        )
        for pending, saved in ((first, one), (second, two)):
            for name, data in saved.shards.items():
                pending.write(name, data)
        order = [(first, one), (second, two)] if first_wins else [(second, two), (first, one)]
        order[0][0].publish()
        self.model.save_committed(order[0][1])
        try:
            order[1][0].publish()
        except CheckpointExistsError:
            return
        raise InvariantViolation("I5", f"two attempts both published step {one.step}")

    @precondition(lambda self: self.can_corrupt and bool(self.store.steps()))
    @rule(data=st.data(), how=st.sampled_from(["bitflip", "truncate"]))
    @abort_on_storage_failure
    def corrupt_a_shard(self, data: Any, how: str) -> None:
        step = data.draw(st.sampled_from(self.store.steps()))
        try:
            checkpoint = self.store.get(step)
        except CkptStoreError:
            return
        names = [n for n, r in checkpoint.shards.items() if r.size > 0]
        if not names or self.model.corrupted.get(step):
            return
        name = data.draw(st.sampled_from(names))
        hit = [(step, name)]
        locator = checkpoint.shards[name].locator
        if "blob" in locator:  # shared (§12.3)
            if how == "bitflip":
                return  # a sharing save trusts a blob's digest: bit rot at rest would spread
            # every checkpoint that names it (in that version) is damaged
            hit = self._sharing_blob(locator["key"], locator.get("version_id"))
        done = self.location.corrupt(step, name, how, checkpoint.manifest.epoch)
        if done is not None:
            for damaged_step, damaged_name in hit:
                self.model.shard_corrupted(damaged_step, damaged_name, done)

    def _sharing_blob(self, key: str, version_id: str | None = None) -> list[tuple[int, str]]:
        """The (step, shard) of every published checkpoint whose shard is the object ``key``
        (in its version ``version_id``, on a versioned bucket: a shard written unshared there
        has a key that every step's shard of its name has, each in a version of its own)."""
        found = []
        for step in self.store.steps():
            try:
                manifest = self.store.get(step).manifest
            except CkptStoreError:
                continue
            found += [
                (step, r.name)
                for r in manifest.shards
                if (r.locator.get("key"), r.locator.get("version_id")) == (key, version_id)
            ]
        return found

    def _unchanged_since(self) -> object:
        """What a check's verdict depends on: the storage (changes made through the
        location) and the model (what it expects)."""
        model = self.model
        return (
            self.location.changes,
            model.epoch,
            tuple(sorted(model.committed)),
            tuple(sorted((s, len(c)) for s, c in model.in_doubt.items())),
            tuple(sorted(model.removable)),
            tuple(sorted(model.contended)),
            model.latest_floor,
        )

    @invariant()
    @abort_on_storage_failure
    def invariants_hold(self) -> None:
        if self.checked == self._unchanged_since():
            return  # neither the storage nor the model changed: the same verdict
        unchanged = self._untouched(self.location.take_touched())
        check_invariants(self.store, self.model, unchanged=unchanged)
        self.checked = self._unchanged_since()

    def _untouched(self, touched: set[str] | None) -> frozenset[int]:
        """Committed steps none of whose names a call changed since the last check; none
        if a change touched a name that belongs to no step (nor to the store itself, nor to
        its probes)."""
        if touched is None:
            return frozenset()
        audit = audit_of(self.location.base)
        fixed: frozenset[str] = getattr(self.location.base, "fixed_names", frozenset())
        steps: set[int] = set()
        for name in touched:
            found = _STEP_TOKENS.findall(name)
            if found or name in fixed or (audit is not None and audit.is_scratch(name)):
                steps.update(int(number) for number in found)
                continue
            return frozenset()
        return frozenset(s for s in self.model.committed if s not in steps)

    def teardown(self) -> None:
        """At the end of an example that held, a check that reads again every checkpoint not
        read in full since the last pass that deleted (GC, retention, a corruption, a
        takeover): ``check_invariants`` after each step skips those whose names no call
        changed, and damage that no call named, a storage's own doing (a delete that took
        more than it named), is found here. Then the location is removed."""
        try:
            if sys.exc_info()[1] is None:  # else hypothesis is reporting the example's failure
                self._final_check()
        finally:
            self.location.destroy()

    @abort_on_storage_failure
    def _final_check(self) -> None:
        model = self.model
        read = frozenset(s for s in model.committed if model.read_at.get(s) == model.epoch)
        check_invariants(self.store, model, unchanged=read)


class _TieredNode(TieredStore):
    """A trainer's tiered pair (``fast_tier_partitioned``), and its fast tier's location."""

    def __init__(
        self, fast: Store, durable: Store, replicator: Replicator, fast_location: Location
    ) -> None:
        super().__init__(fast, durable, replicator, background=False)
        self.fast_location = fast_location


def make_state_machine(
    new_location: Callable[[], Location], *, multipart_size: int = 0, can_corrupt: bool = True
) -> type[CheckpointStoreMachine]:
    """The state machine class for one backend: ``CheckpointStoreMachine`` on its locations.

    ``multipart_size``: a shard size that needs a multipart upload (0: the backend has none).
    ``can_corrupt``: stored shard bytes can be rewritten behind the store's back.
    """
    attributes = {
        "new_location": staticmethod(new_location),
        "multipart_size": multipart_size,
        "can_corrupt": can_corrupt,
        "completion_crashes": Counter(),
        "sharing": Counter(),
        **({"save": _save_rule((*SHARD_SIZES, multipart_size))} if multipart_size else {}),
        "__doc__": CheckpointStoreMachine.__doc__,
        "__module__": CheckpointStoreMachine.__module__,
    }
    # Named as the rules' class: hypothesis prints it in the shrunk steps it reports.
    return type("CheckpointStoreMachine", (CheckpointStoreMachine,), attributes)


def _names_its_supersessor(error: SupersededError, epoch: int) -> None:
    """A superseded writer is told which epoch superseded it: ``epoch``, the first newer one."""
    named = re.search(r"superseded by epoch ([0-9]+)", str(error))
    if named is None or int(named.group(1)) != epoch:
        raise InvariantViolation(
            "I9", f"SupersededError does not name the epoch that superseded it: {error}"
        )


def _crash_plan(at: int | str, mode: CrashMode) -> FaultPlan:
    """Death ``mode`` call number ``at``, or the first call named ``at``."""
    if isinstance(at, str):
        return FaultPlan(crash_on=at, crash_mode=mode)
    return FaultPlan(crash_at=at, crash_mode=mode)


def _around_completion(crash: SimulatedCrash) -> list[str]:
    """Where ``crash`` died relative to a multipart completion, as the injector recorded it."""
    where = []
    if crash.record is not None and crash.record.name == MULTIPART_COMPLETION:
        where.append("before" if crash.mode is CrashMode.BEFORE else "after")
    if crash.previous is not None and crash.previous.name == MULTIPART_COMPLETION:
        where.append("after")
    return where


def run_state_machine(machine: type[RuleBasedStateMachine], profile: settings) -> None:
    """Run ``machine`` as a test; again, afresh, while the storage fails an example.

    Raises what hypothesis raises (``InvariantViolation``, shrunk), or ``StorageFailure`` if
    the storage failed every run: an undecided outcome, never a pass nor a violation.
    """

    def once() -> StorageFailure | None:
        try:
            run_state_machine_as_test(machine, settings=profile)
        except StorageFailure as failure:
            return failure
        return None

    failure, retries = retry_storage_failures(once, lambda outcome: outcome is not None)
    if failure is not None:
        raise StorageFailure(failure.error, runs=retries + 1) from failure
