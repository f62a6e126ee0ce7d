"""The model of what was committed, and the checks of invariants I1 to I9 against a real store.

The model knows what every save wrote, which saves returned from commit (committed), which
may or may not have published (in doubt: a crash or an error during the save), and which
checkpoints may have been removed (a retention pass, a delete or a rollback in progress). A
check reads the store through its public API and either resolves each doubt to one outcome,
which every later check then holds the store to, or raises ``InvariantViolation`` naming the
protocol invariant (docs/protocol.md §0) that broke.

Lineages (I9): the model knows the parent of every epoch taken, so the epoch that owns each
step (docs/protocol.md §8.2). A takeover moves every save above its parent out of the
history, into ``superseded``: a reader that returns one of them, or a checkpoint of any epoch
but the step's owner, violates I9.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from ckptstore.checksum import crc32c_hex
from ckptstore.errors import CheckpointNotFoundError, IntegrityError, ShardCorruptError
from ckptstore.store import Store

__all__ = ["INVARIANTS", "InvariantViolation", "Model", "Saved", "check_invariants"]

INVARIANTS = {
    "I1": "atomic visibility",
    "I2": "durability",
    "I3": "a way back always exists",
    "I4": "monotonic latest",
    "I5": "exclusive publish",
    "I6": "integrity",
    "I7": "safe cleanup",
    "I8": "indeterminate outcomes resolved",
    "I9": "one history",
    "I10": "shared data outlives its users",
}


class InvariantViolation(AssertionError):
    """A protocol invariant does not hold; ``invariant`` is its id (``I1`` ... ``I10``).

    The invariants: docs/protocol.md §0.
    """

    def __init__(self, invariant: str, message: str) -> None:
        super().__init__(f"{invariant} ({INVARIANTS[invariant]}) violated: {message}")
        self.invariant = invariant
        self.detail = message


@dataclass
class Saved:
    """What one save attempt wrote."""

    step: int
    shards: dict[str, bytes]
    metadata: dict[str, Any]
    epoch: int = 0
    """The epoch its writer writes in (0: the store's implicit first epoch)."""

    def matches(self, checkpoint: Any) -> bool:
        """Whether a checkpoint's manifest records exactly these shards and metadata."""
        if dict(checkpoint.metadata) != self.metadata:
            return False
        if sorted(checkpoint.shards) != sorted(self.shards):
            return False
        return all(
            record.size == len(self.shards[name]) and record.crc32c == crc32c_hex(self.shards[name])
            for name, record in checkpoint.shards.items()
        )


@dataclass
class Model:
    """What the store must, may and must not contain."""

    committed: dict[int, Saved] = field(default_factory=dict)
    in_doubt: dict[int, list[Saved]] = field(default_factory=dict)
    removable: set[int] = field(default_factory=set)
    ever_published: set[int] = field(default_factory=set)
    contended: set[int] = field(default_factory=set)
    corrupted: dict[int, dict[str, str]] = field(default_factory=dict)
    latest_floor: int | None = None
    gc_since: dict[int, bool] = field(default_factory=dict)
    epoch: int = 0
    """Bumped by anything that may change stored checkpoints (GC, retention, corruption)."""
    read_at: dict[int, int] = field(default_factory=dict)
    """The epoch at which each step's shards were last read back in full."""
    events: int = 0
    """How many events (below) the model was told of: equal counts, equal models."""
    strays: dict[int, str] = field(default_factory=dict)
    """Steps at which the suite planted a foreign entry named like a step (what it is): never
    a checkpoint, never saved by the suite."""
    damaged_strays: set[int] = field(default_factory=set)
    """Planted steps whose manifest is present but unreadable (a FIFO or a directory in its
    place): damage by design, so ``latest()`` may raise for it while it is the newest."""
    planted_hints: set[int] = field(default_factory=set)
    """Steps that a LATEST pointer planted by the suite named (the protocol never wrote them)."""
    parents: list[int] = field(default_factory=list)
    """The floor of each epoch taken, 1 .. newest (its parent step; -1 for a fresh start)."""
    superseded: dict[int, list[Saved]] = field(default_factory=dict)
    """Saves that a takeover moved out of the history (or that published after one, racing
    past the writer's check): no reader may ever return them again (I9)."""

    # -- lineages ------------------------------------------------------------------------

    @property
    def newest_epoch(self) -> int:
        """The newest epoch taken (0: none)."""
        return len(self.parents)

    def owner(self, step: int) -> int:
        """The epoch whose checkpoint of ``step`` is the history's: the newest whose parent
        is below it (docs/protocol.md §8.2)."""
        for number in range(len(self.parents), 0, -1):
            if self.parents[number - 1] < step:
                return number
        return 0

    def in_history(self, saved: Saved) -> bool:
        """Whether ``saved`` belongs to the history as the epochs now stand."""
        return saved.epoch == self.owner(saved.step)

    def epoch_taken(self, parent: int | None) -> None:
        """A run took the store over from ``parent`` (None: a fresh start): every save above
        it leaves the history for good, and latest() may go back (as after a rollback)."""
        self.events += 1
        self.epoch += 1
        self.parents.append(-1 if parent is None else parent)
        for step in sorted(set(self.committed) | set(self.in_doubt)):
            gone = [s for s in [self.committed.get(step), *self.in_doubt.get(step, [])] if s]
            left = [s for s in gone if self.in_history(s)]
            gone = [s for s in gone if not self.in_history(s)]
            if not gone:
                continue
            self.superseded.setdefault(step, []).extend(gone)
            if step in self.committed and not self.in_history(self.committed[step]):
                del self.committed[step]
                self.removable.discard(step)
                self.gc_since.pop(step, None)
                self.read_at.pop(step, None)
            doubtful = [s for s in left if s is not self.committed.get(step)]
            if doubtful:
                self.in_doubt[step] = doubtful
            else:
                self.in_doubt.pop(step, None)
        floor = self.parents[-1]
        for step in [s for s in self.corrupted if s > floor]:
            del self.corrupted[step]  # damage to checkpoints no reader returns any more
        self.latest_floor = None

    # -- events --------------------------------------------------------------------------

    def save_started(self, saved: Saved) -> None:
        """A save began: until its commit returns, it may or may not publish (a save of an
        epoch that does not own its step must never be visible: superseded at once)."""
        self.events += 1
        if not self.in_history(saved):
            self.superseded.setdefault(saved.step, []).append(saved)
            return
        self.in_doubt.setdefault(saved.step, []).append(saved)

    def save_committed(self, saved: Saved) -> None:
        """commit() returned: the checkpoint must now be visible, exactly as saved (unless a
        takeover superseded it before it published: then it must never be visible)."""
        self.events += 1
        if not self.in_history(saved):
            self.superseded.setdefault(saved.step, []).append(saved)
            self.ever_published.add(saved.step)  # its LATEST update may name it
            doubtful = [c for c in self.in_doubt.get(saved.step, []) if c is not saved]
            if doubtful:
                self.in_doubt[saved.step] = doubtful
            else:
                self.in_doubt.pop(saved.step, None)
            return
        candidates = self.in_doubt.get(saved.step, [])
        if any(c is saved for c in candidates):
            candidates[:] = [c for c in candidates if c is not saved]
        if not candidates:
            self.in_doubt.pop(saved.step, None)
        self.committed[saved.step] = saved
        self.ever_published.add(saved.step)
        self.gc_since[saved.step] = False

    def removal_started(self, steps: set[int], *, explicit: bool) -> None:
        """Steps that a retention pass, delete or rollback may remove from now on."""
        self.events += 1
        self.removable |= steps
        self.epoch += 1
        if explicit:
            self.latest_floor = None  # an explicit deletion may move latest() back

    def gc_started(self) -> None:
        """A GC pass runs: a committed checkpoint lost after it is blamed on GC (I7)."""
        self.events += 1
        self.epoch += 1
        for step in self.gc_since:
            self.gc_since[step] = True

    def shard_corrupted(self, step: int, name: str, how: str) -> None:
        """A shard's stored bytes were damaged on purpose (``bitflip``, ``truncate``)."""
        self.events += 1
        self.corrupted.setdefault(step, {})[name] = how
        self.epoch += 1

    def stray_planted(self, step: int, what: str, *, damaged: bool = False) -> None:
        """The suite planted a foreign entry at ``step``: it must never be taken for a
        checkpoint (``damaged``: its manifest is present but unreadable, see ``damaged_strays``)."""
        self.strays.setdefault(step, what)
        if damaged:
            self.damaged_strays.add(step)

    def hint_planted(self, step: int) -> None:
        """The suite wrote a LATEST pointer naming ``step`` behind the store's back."""
        self.planted_hints.add(step)

    def damage_above(self, step: int | None) -> bool:
        """Whether a planted damaged entry is newer than ``step`` (None: than nothing)."""
        return any(step is None or s > step for s in self.damaged_strays)

    def newest_committed(self) -> int | None:
        """The newest step whose commit returned and which is not being removed."""
        steps = [s for s in self.committed if s not in self.removable]
        return max(steps) if steps else None


def check_invariants(
    store: Store,
    model: Model,
    *,
    writers_alive: bool = False,
    lost_blame: str | None = None,
    unchanged: Collection[int] = (),
) -> None:
    """Check I1 to I7 and I9 on ``store`` against ``model``, resolving doubts; raise
    InvariantViolation.

    ``writers_alive``: some attempt may still publish later, so a step in doubt that is not
    visible yet stays in doubt. ``lost_blame``: the invariant to blame for a committed step that
    vanished (after a power loss it is I2 whatever else ran). ``unchanged``: steps whose stored
    names no call changed since they were last read in full, which need not be read again
    (unless corrupted on purpose): a GC or retention pass that deleted nothing of theirs
    leaves them as they were read.
    """
    visible = store.steps()
    for step in visible:
        if step in unchanged and _read_since_last_change(model, step):
            model.save_committed(model.committed[step])
            continue
        _check_visible(store, model, step)
    _check_missing(model, set(visible), writers_alive, lost_blame)
    _check_latest(store, model, visible)


def _read_since_last_change(model: Model, step: int) -> bool:
    return step in model.committed and step in model.read_at and not model.corrupted.get(step)


def _candidates(model: Model, step: int) -> list[Saved]:
    if step in model.committed:
        return [model.committed[step]]
    return list(model.in_doubt.get(step, []))


def _check_visible(store: Store, model: Model, step: int) -> None:
    if step in model.strays:
        raise InvariantViolation(
            "I1", f"step {step} counts as a checkpoint, but it is {model.strays[step]}"
        )
    candidates = _candidates(model, step)
    if not candidates:
        if step in model.superseded:
            raise InvariantViolation(
                "I9", f"step {step} is visible, but only superseded writers ever saved it"
            )
        raise InvariantViolation("I1", f"step {step} is visible but no save of it ever began")
    damaged = model.corrupted.get(step, {})
    try:
        checkpoint = store.get(step)
    except CheckpointNotFoundError:
        return  # removed between listing and reading
    except IntegrityError as exc:
        if "truncate" in damaged.values() or "missing" in damaged.values():
            return
        blame = _raced(model, step) or (
            "I10"
            if _lost_a_shared_shard(store, model, step)
            else "I7"
            if model.gc_since.get(step)
            else "I1"
        )
        raise InvariantViolation(blame, f"published step {step} is incomplete: {exc}") from exc
    _check_history(model, checkpoint, "get()")
    match = next((c for c in candidates if c.matches(checkpoint)), None)
    if match is None:
        blame = _raced(model, step) or "I1"
        raise InvariantViolation(
            blame, f"step {step} does not hold what any save of it wrote ({checkpoint.names})"
        )
    if damaged or model.read_at.get(step) != model.epoch:  # unchanged since read: spare it
        for name in checkpoint.names:
            _check_shard(checkpoint, match, name, damaged.get(name), _raced(model, step))
        model.read_at[step] = model.epoch
    model.save_committed(match)


def _lost_a_shared_shard(store: Store, model: Model, step: int) -> bool:
    """Whether a shard step's checkpoint shares with others (a blob, §12.3) is missing."""
    try:
        manifest = store.strategy.read_manifest(step, model.owner(step))
        problems = store.strategy.shard_problems(manifest)
    except Exception:  # the step's manifest itself is what is wrong
        return False
    shared = {record.name for record in manifest.shards if "blob" in record.locator}
    return any(problem.name in shared for problem in problems)


def _check_history(model: Model, checkpoint: Any, reader: str) -> None:
    """I9: ``checkpoint``, returned by ``reader``, is of the epoch that owns its step (so
    never what a superseded writer saved)."""
    step, epoch = checkpoint.step, checkpoint.manifest.epoch
    owner = model.owner(step)
    if epoch != owner:
        raise InvariantViolation(
            "I9",
            f"{reader} returned step {step} of epoch {epoch}; the history's checkpoint of it "
            f"is epoch {owner}'s (the epochs' parents: {model.parents})",
        )


def _raced(model: Model, step: int) -> str | None:
    """``I5`` for a step that two writers raced for: damage to it is the loser's doing."""
    return "I5" if step in model.contended else None


def _check_shard(
    checkpoint: Any, saved: Saved, name: str, damage: str | None, raced: str | None
) -> None:
    if damage is None:
        try:
            data = checkpoint.read(name)
        except IntegrityError as exc:
            shared = "blob" in checkpoint.manifest.shard(name).locator  # §12.3
            raise InvariantViolation(
                raced or ("I10" if shared else "I1"),
                f"step {checkpoint.step} shard {name!r} unreadable: {exc}",
            ) from exc
        if data != saved.shards[name]:
            raise InvariantViolation(
                raced or "I6",
                f"step {checkpoint.step} shard {name!r} read back different bytes, and the "
                f"checksum check passed them",
            )
        return
    try:
        checkpoint.read(name)
    except ShardCorruptError:
        pass
    except IntegrityError:
        pass
    else:
        raise InvariantViolation(
            "I6", f"step {checkpoint.step} shard {name!r} was corrupted ({damage}) but read fine"
        )
    if checkpoint.verify().ok:
        raise InvariantViolation(
            "I6", f"verify passed step {checkpoint.step} with a corrupted shard {name!r}"
        )


def _check_missing(
    model: Model, visible: set[int], writers_alive: bool, lost_blame: str | None
) -> None:
    newest = model.newest_committed()
    for step in sorted(model.committed):
        if step in visible:
            continue
        if step in model.removable:
            model.committed.pop(step)
            model.removable.discard(step)
            continue
        raced = None if lost_blame else _raced(model, step)
        if raced:
            raise InvariantViolation(raced, f"committed step {step} disappeared after a race")
        if lost_blame is None and step == newest:
            raise InvariantViolation("I3", f"the newest committed step {step} disappeared")
        blame = lost_blame or ("I7" if model.gc_since.get(step) else "I2")
        raise InvariantViolation(blame, f"committed step {step} disappeared")
    model.removable &= visible
    if not writers_alive:
        for step in [s for s in model.in_doubt if s not in visible]:
            del model.in_doubt[step]  # its writer is gone: it was never published


def _check_latest(store: Store, model: Model, visible: list[int]) -> None:
    hint = store.strategy.read_latest_hint()
    if hint is not None and hint not in model.ever_published | model.planted_hints:
        raise InvariantViolation("I1", f"LATEST names step {hint}, which was never published")
    intact = [s for s in visible if not model.corrupted.get(s)]
    try:
        latest = store.latest()
    except IntegrityError as exc:
        newest_visible = visible[-1] if visible else None
        if (visible and model.corrupted.get(visible[-1])) or model.damage_above(newest_visible):
            latest = None
        else:
            raise InvariantViolation("I1", f"latest() failed on an intact store: {exc}") from exc
    else:
        newest = visible[-1] if visible else None
        got = latest.step if latest is not None else None
        if got in model.strays:
            raise InvariantViolation(
                "I1", f"latest() returned step {got}, which is {model.strays[got]}"
            )
        if got != newest:
            raise InvariantViolation("I4", f"latest() returned {got}, newest published is {newest}")
        if latest is not None:
            _check_history(model, latest, "latest()")
    if latest is not None:
        if model.latest_floor is not None and latest.step < model.latest_floor:
            raise InvariantViolation(
                "I4", f"latest() went back from {model.latest_floor} to {latest.step}"
            )
        model.latest_floor = latest.step
    if not model.corrupted and latest is not None:
        return  # with nothing corrupted, latest(verified=True) is latest(): spare the reads
    verified = store.latest(verified=True)
    expected = intact[-1] if intact else None
    got_verified = verified.step if verified is not None else None
    if got_verified != expected:
        raise InvariantViolation(
            "I6", f"latest(verified=True) returned {got_verified}, newest intact is {expected}"
        )
