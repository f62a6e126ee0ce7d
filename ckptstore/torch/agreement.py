"""Which checkpoint a multi-rank job loads: decided once, by the coordinator, for every rank.

Ranks that each ask ``store.latest()`` can get different answers when a checkpoint is published
(or retention deletes one) between their calls, and a model loaded from two checkpoints is
silently wrong. Here only the coordinator (rank 0 of the group) resolves the latest step; it
broadcasts the step and the attempt that published it, and every rank opens exactly that
checkpoint, or fails if it changed in between.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from ckptstore.checkpoint import Checkpoint
from ckptstore.errors import CheckpointNotFoundError, CkptStoreError
from ckptstore.interface import CheckpointStore
from ckptstore.store import Store
from ckptstore.tiers.tiered import TieredStore

__all__ = ["agreed_checkpoint", "in_multi_rank_job", "take_over"]

COORDINATOR = 0


def in_multi_rank_job(group: Any = None) -> bool:
    """True in an initialised torch.distributed job whose ``group`` has more than one rank."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def take_over(
    store: Store | TieredStore,
    resumed_from: int | None,
    *,
    group: Any = None,
    discard_history: bool = False,
) -> int:
    """Take the store over for this job once, on the coordinator, and have every rank of
    ``group`` write in that epoch; a collective call in a multi-rank job. Returns the epoch
    (a tiered store's: the durable one, the pair's history; every rank joins both tiers').

    ``resumed_from``: the step every rank loaded (``agreed_checkpoint``), None for a fresh
    start, refused over a history unless ``discard_history`` (``Store.take_over``). Outside
    a multi-rank job the process takes the store over itself.
    """
    if not in_multi_rank_job(group):
        return _take(store, resumed_from, discard_history)[-1]
    value = _decided(
        store, group, "take the store over", lambda: _take(store, resumed_from, discard_history)
    )
    epochs = tuple(int(number) for number in value)
    if dist.get_rank(group) != COORDINATOR:
        if isinstance(store, TieredStore):
            store.join_epochs(*epochs)
        else:
            store.join_epoch(*epochs)
    return epochs[-1]


def _decided(store: CheckpointStore, group: Any, what: str, decide: Callable[[], Any]) -> Any:
    """What the coordinator's ``decide()`` returned, on every rank of ``group`` (a collective
    call); its failure is raised on every rank, or the others would wait for it forever."""
    coordinator = dist.get_global_rank(group, COORDINATOR) if group is not None else COORDINATOR
    decision: list[Any] = [None]
    failure: BaseException | None = None
    if dist.get_rank(group) == COORDINATOR:
        try:
            decision = [("ok", decide())]
        except Exception as exc:  # every rank must hear of it, or the others wait forever
            failure = exc
            decision = [("error", f"{type(exc).__name__}: {exc}")]
    dist.broadcast_object_list(decision, src=coordinator, group=group)
    if failure is not None:
        raise failure
    status, value = decision[0]
    if status != "ok":
        raise CkptStoreError(
            f"{store.url}: the coordinator could not {what}: {value}", url=store.url
        )
    return value


def _take(
    store: Store | TieredStore, resumed_from: int | None, discard_history: bool
) -> tuple[int, ...]:
    """Take ``store`` over; the epoch numbers the other ranks join (a pair's: fast, durable)."""
    if isinstance(store, TieredStore):
        fast, durable = store.take_over(resumed_from, discard_history=discard_history)
        return fast.number, durable.number
    return (store.take_over(resumed_from, discard_history=discard_history).number,)


def agreed_checkpoint(
    store: CheckpointStore, step: int | None = None, *, group: Any = None
) -> Checkpoint:
    """The checkpoint every rank of ``group`` loads: ``step``, or the latest one as the
    coordinator saw it; a collective call in a multi-rank job (every rank must make it).

    Raises CheckpointNotFoundError on every rank when there is no checkpoint; outside a
    multi-rank job (or with an explicit ``step``) each process asks the store itself.
    """
    if step is not None or not in_multi_rank_job(group):
        checkpoint = store.latest() if step is None else store.get(step)
        if checkpoint is None:
            raise CheckpointNotFoundError(f"{store.url}: no checkpoint to load", url=store.url)
        return checkpoint

    def newest() -> tuple[int, str] | None:
        latest = store.latest()
        return None if latest is None else (latest.step, latest.manifest.attempt)

    value = _decided(store, group, "find the latest", newest)
    if value is None:
        raise CheckpointNotFoundError(f"{store.url}: no checkpoint to load", url=store.url)
    chosen_step, attempt = value
    checkpoint = store.get(chosen_step)
    if checkpoint.manifest.attempt != attempt:
        raise CheckpointNotFoundError(
            f"{store.url}: step {chosen_step} was deleted and saved again while the ranks "
            f"opened it (the coordinator chose attempt {attempt}, this rank found "
            f"{checkpoint.manifest.attempt})",
            url=store.url,
        )
    return checkpoint
