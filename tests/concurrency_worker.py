"""One process of the concurrency test: a writer, a reader, a GC or an operator on one store.

Each role runs until a shared deadline (bounded in time and count) and appends one JSON line
per event to its own log; the test reads every log afterwards and checks what readers saw.
A role that meets an error it must never meet logs it as a violation.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
import zlib
from datetime import timedelta
from typing import Any

import ckptstore
from ckptstore.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    CkptStoreError,
    IntegrityError,
    RefusedError,
    StepOutsideEpochError,
    SupersededError,
)

SHARDS = ("model/rank0.bin", "model/rank1.bin", "optim.bin")


def shard_bytes(step: int, name: str) -> bytes:
    """The content every writer of ``step`` writes to shard ``name``: readers check it."""
    size = 2000 + zlib.crc32(f"{step}/{name}".encode()) % 30000
    return (f"{step}:{name}:".encode() * (size // 8 + 1))[:size]


class Log:
    def __init__(self, path: str) -> None:
        self._file = open(path, "a", buffering=1)  # noqa: SIM115

    def event(self, kind: str, **fields: Any) -> None:
        fields.update(kind=kind, t=time.monotonic())
        self._file.write(json.dumps(fields) + "\n")


def writer(store: ckptstore.Store, url: str, index: int, deadline: float, log: Log) -> None:
    # Writers i and i+4 save the same steps (contention); the four pairs interleave.
    step = index % 4 + 4
    while time.monotonic() < deadline:
        step += 4 + random.randint(0, 1) * 4
        try:
            store.save(step, {name: shard_bytes(step, name) for name in SHARDS})
        except CheckpointExistsError:
            log.event("lost", step=step)
            continue
        except SupersededError:
            # The operator rolled back (a takeover): this writer's epoch is fenced. It goes on
            # as the restarted trainer would, in the newest epoch, through a new handle that
            # names it (a handle that names none is refused once a store was taken over).
            log.event("superseded", step=step)
            store = ckptstore.open(url, retention=store.retention)
            store.join_epoch(store.lineage().newest)
            continue
        except StepOutsideEpochError:
            log.event("outside", step=step)  # at or below the rollback's step: the next one
            continue
        log.event("published", step=step)


def reader(store: ckptstore.Store, deadline: float, log: Log) -> None:
    while time.monotonic() < deadline:
        began = time.monotonic()
        try:
            checkpoint = store.latest()
        except IntegrityError as exc:
            log.event("violation", what=f"latest() raised {exc!r}")
            continue
        if checkpoint is None:
            log.event(
                "violation", what=f"latest() returned None while checkpoints exist: {_state(store)}"
            )
            continue
        try:
            names = set(checkpoint.names)
            if names != set(SHARDS):
                log.event("violation", what=f"step {checkpoint.step}: partial: {sorted(names)}")
            for name in SHARDS:
                if checkpoint.read(name) != shard_bytes(checkpoint.step, name):
                    log.event("violation", what=f"step {checkpoint.step} {name}: wrong bytes")
        except CheckpointNotFoundError:
            pass  # deleted by retention while being read: allowed, and not an integrity error
        except IntegrityError as exc:
            log.event("violation", what=f"reading step {checkpoint.step} raised {exc!r}")
        log.event("saw", step=checkpoint.step, began=began)


def _state(store: ckptstore.Store) -> str:
    """What the reader finds just after ``latest()`` returned None, for the failure message."""
    try:
        lineage = store._history.lineage()
        epochs = [(e.number, e.parent, e.base) for e in lineage.epochs]
        again = store.latest()
        return (
            f"hint {store._history.read_hint()}, listing "
            f"{store.strategy.published_checkpoints()}, epochs {epochs}, steps "
            f"{store.steps()}, latest() again: {None if again is None else again.step}"
        )
    except CkptStoreError as exc:
        return f"(the state could not be read: {exc!r})"


def collector(store: ckptstore.Store, deadline: float, log: Log) -> None:
    while time.monotonic() < deadline:
        report = store.gc(grace=timedelta(seconds=60))
        log.event("gc", removed=len(report.removed))
        time.sleep(0.2)


def operator(store: ckptstore.Store, deadline: float, log: Log) -> None:
    rollbacks = 0
    while time.monotonic() < deadline:
        time.sleep(0.3)
        steps = store.steps()
        if len(steps) < 2:
            continue
        if rollbacks < 2 and random.random() < 0.3:
            began = time.monotonic()
            try:
                done = store.rollback(steps[0])
            except CheckpointNotFoundError:
                continue  # retention removed the target first: no epoch was taken
            except RefusedError:
                continue  # a deletion of the target did not finish within the wait
            rollbacks += 1
            log.event("rollback", to=steps[0], left=done.left, began=began)
            continue
        try:
            store.delete(steps[0])
            log.event("deleted", step=steps[0])
        except (CheckpointNotFoundError, RefusedError):
            continue  # removed by retention meanwhile, or the newest by now


def _wait_for_go(path: str) -> float:
    """Wait until every process is ready and the test has written the common deadline."""
    give_up = time.monotonic() + 300
    while time.monotonic() < give_up:
        try:
            with open(path) as f:
                text = f.read()
            if text.endswith("\n"):
                return float(text)
        except FileNotFoundError:
            pass
        time.sleep(0.05)
    raise SystemExit("no go file: the test did not start the run")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=["writer", "reader", "gc", "operator"])
    parser.add_argument("--store", required=True)
    parser.add_argument("--index", type=int, default=0)
    parser.add_argument("--go", required=True, help="a file the test writes the deadline to")
    parser.add_argument("--log", required=True)
    args = parser.parse_args()
    log = Log(args.log)
    random.seed(args.index * 7919 + hash(args.role) % 1000)
    retention = ckptstore.KeepLast(2) if args.role == "writer" else None
    store = ckptstore.open(args.store, retention=retention)
    log.event("ready")
    deadline = _wait_for_go(args.go)
    role = {"reader": reader, "gc": collector, "operator": operator}
    try:
        if args.role == "writer":
            writer(store, args.store, args.index, deadline, log)
        else:
            role[args.role](store, deadline, log)
    except CkptStoreError as exc:
        log.event("violation", what=f"{args.role} {args.index} failed: {exc!r}")
        return 1
    log.event("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
