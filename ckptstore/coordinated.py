"""One checkpoint from many processes: every process writes its shards, and one commit
publishes all of them or none.

The coordinator (rank 0) begins the attempt and shares its step and id; every process writes its own
shards into that attempt (``Store.join``) and seals them, so that they are durable before
their receipts (name, size, CRC32C, locator) travel; the receipts are gathered to the
coordinator, which checks that every process saved the same step and agrees on what the
caller says must be alike (``agreement``: JAX's tree structure), checks coverage (no shard
twice) and publishes through the store's protocol; the outcome goes back to every process. A
process that fails before its receipts reach the coordinator means nothing is published, and
every process raises; a process that dies means the same, once the transport gives up on it
(its timeout, or the launcher stopping the job). The transport is a ``Collective``:
torch.distributed (``ckptstore.torch.distributed``) or JAX's distributed runtime
(``ckptstore.jax``); what travels is JSON, never a pickle.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from ckptstore.checkpoint import Checkpoint
from ckptstore.errors import CheckpointNotFoundError, CkptStoreError, CoordinationError
from ckptstore.interface import CheckpointStore
from ckptstore.manifest import ShardRecord
from ckptstore.pending import PendingCheckpoint

__all__ = ["COORDINATOR", "Collective", "agreed_checkpoint", "save_coordinated"]

COORDINATOR = 0
"""The rank that begins, checks and publishes."""


class Collective(Protocol):
    """How the processes of one job exchange small JSON values; every call is collective
    (each process makes the same calls in the same order)."""

    @property
    def rank(self) -> int:
        """This process's rank, 0 to ``size - 1``."""
        ...

    @property
    def size(self) -> int:
        """The number of processes."""
        ...

    def broadcast(self, value: Any) -> Any:
        """The coordinator's ``value`` on every process (the others' are ignored)."""
        ...

    def gather(self, value: Any) -> list[Any] | None:
        """Every process's ``value`` by rank, on the coordinator; None elsewhere."""
        ...


def save_coordinated(
    store: CheckpointStore,
    step: int,
    write: Callable[[PendingCheckpoint], None],
    collective: Collective,
    *,
    metadata: Mapping[str, Any] | None = None,
    agreement: str | None = None,
) -> Checkpoint:
    """Save checkpoint ``step`` from every process of ``collective``; a collective call.

    Each process's ``write(pending)`` writes that process's shards (names must differ across
    processes); ``metadata`` is the coordinator's. ``agreement``: what every process must
    hold alike for the shards to make one checkpoint (a digest of the saved structure); a
    process that saves another step, or holds another ``agreement``, means nothing is
    published. Returns the published checkpoint on every process, or raises CkptStoreError on
    every process (a process whose own ``write`` failed raises it from that failure).
    """
    rank, size = collective.rank, collective.size
    pending: PendingCheckpoint | None = None
    begun: Any = None
    if rank == COORDINATOR:
        try:
            pending = store.begin(step, metadata, world_size=size)
            begun = ["ok", [step, pending.attempt, agreement]]
        except Exception as exc:  # every process must hear of it, or the others wait
            begun = ["error", f"rank {rank}: {type(exc).__name__}: {exc}"]
    status, value = collective.broadcast(begun)
    if status != "ok":
        raise CkptStoreError(f"step {step} not saved: {value}", step=step)

    failure: BaseException | None = None
    try:
        if pending is None:
            _check_alike(rank, step, agreement, value)
            pending = store.join(step, str(value[1]))
        write(pending)
        receipts = pending.seal()  # durable before the receipts travel
        mine: Any = ["ok", [dataclasses.asdict(record) for record in receipts]]
    except Exception as exc:  # every process must hear of it, or the coordinator waits
        failure = exc
        mine = ["error", f"rank {rank}: {type(exc).__name__}: {exc}"]
    try:
        gathered = collective.gather(mine)
    except Exception as exc:  # the transport lost a process: nothing may be published
        if rank == COORDINATOR:
            assert pending is not None
            if pending.state == "open":
                pending.abort()
            with contextlib.suppress(Exception):  # the living ones fail now, not at a timeout
                collective.broadcast(["error", f"the coordinator lost a process: {exc}"])
        raise CkptStoreError(f"step {step} not saved: {exc}", step=step) from exc

    outcome: Any = None
    if rank == COORDINATOR:
        assert gathered is not None
        assert pending is not None
        outcome = _publish(pending, gathered)
    status, value = collective.broadcast(outcome)
    if status != "ok":
        error = CkptStoreError(f"step {step} not saved: {value}", step=step)
        if failure is not None:
            raise error from failure
        raise error
    return store.get(step)


def _check_alike(rank: int, step: int, agreement: str | None, begun: Any) -> None:
    """CoordinationError unless this process saves the coordinator's step and agrees with it:
    its shards would go into another step's checkpoint, or into one they do not fit."""
    chosen_step, _, chosen_agreement = begun
    if chosen_step != step:
        raise CoordinationError(
            f"rank {rank} saves step {step}, the coordinator step {chosen_step}: the processes "
            f"are out of step (each must make the same saves in the same order)",
            step=step,
        )
    if None not in (agreement, chosen_agreement) and chosen_agreement != agreement:
        raise CoordinationError(
            f"rank {rank} saves another structure than the coordinator's "
            f"({str(agreement)[:12]} against {str(chosen_agreement)[:12]}): every process must "
            f"save the same tree",
            step=step,
        )


def _publish(pending: PendingCheckpoint, gathered: list[Any]) -> list[Any]:
    """Publish every rank's receipts, or abort: ``["ok", step]`` or ``["error", why]``."""
    errors = [str(payload[1]) for payload in gathered if payload is None or payload[0] != "ok"]
    if errors:
        if pending.state == "open":
            pending.abort()
        return ["error", "; ".join(errors)]
    try:
        for rank, (_, receipts) in enumerate(gathered):
            if rank != COORDINATOR:
                pending.add_receipts(ShardRecord(**receipt) for receipt in receipts)
        return ["ok", pending.publish().step]
    except Exception as exc:  # every process must hear of it, or the others wait
        if pending.state == "open":
            pending.abort()
        return ["error", f"{type(exc).__name__}: {exc}"]


def agreed_checkpoint(
    store: CheckpointStore, collective: Collective, step: int | None = None
) -> Checkpoint:
    """The checkpoint every process loads: ``step``, or the latest one as the coordinator saw
    it (processes that each asked ``latest()`` could get different answers while a checkpoint
    is published or deleted); a collective call when ``step`` is None.

    Raises CheckpointNotFoundError on every process when there is no checkpoint, or when the
    chosen one was deleted and saved again while the processes opened it.
    """
    if step is not None or collective.size == 1:
        checkpoint = store.latest() if step is None else store.get(step)
        if checkpoint is None:
            raise CheckpointNotFoundError(f"{store.url}: no checkpoint to load", url=store.url)
        return checkpoint
    decision: Any = None
    failure: BaseException | None = None
    if collective.rank == COORDINATOR:
        try:
            latest = store.latest()
            chosen = None if latest is None else [latest.step, latest.manifest.attempt]
            decision = ["ok", chosen]
        except Exception as exc:  # every process must hear of it, or the others wait
            failure = exc
            decision = ["error", f"{type(exc).__name__}: {exc}"]
    status, value = collective.broadcast(decision)
    if failure is not None:
        raise failure
    if status != "ok":
        raise CkptStoreError(f"{store.url}: the coordinator could not find the latest: {value}")
    if value is None:
        raise CheckpointNotFoundError(f"{store.url}: no checkpoint to load", url=store.url)
    chosen_step, attempt = value
    checkpoint = store.get(int(chosen_step))
    if checkpoint.manifest.attempt != attempt:
        raise CheckpointNotFoundError(
            f"{store.url}: step {chosen_step} was deleted and saved again while the processes "
            f"opened it (the coordinator chose attempt {attempt}, this process found "
            f"{checkpoint.manifest.attempt})",
            url=store.url,
        )
    return checkpoint
