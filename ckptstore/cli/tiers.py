"""What ``ckptstore ls`` and ``rollback`` do with a tiered pair (``--replicate-to DURABLE``):
the pair's history across tiers, the fast checkpoints outside it, one rollback for both tiers,
and the refusal to roll back a fast tier alone (docs/tiers.md, docs/protocol.md §9)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ckptstore.checkpoint import Checkpoint
from ckptstore.errors import CheckpointNotFoundError, IntegrityError, RefusedError
from ckptstore.store import Store
from ckptstore.tiers.replication import OutsideCheckpoint, durable_epoch_of, shown_url, tier_record
from ckptstore.tiers.tiered import TieredStore, open_tiered

__all__ = ["open_pair", "outside_rows", "pair_document", "refuse_a_fast_tier_alone"]


def open_pair(url: str, durable_url: str, **keys: Any) -> TieredStore:
    """The pair for a command: nothing created, no replicator thread (close it with
    ``close(wait=False)``: a command never copies); ``keys``: its --trust and --signing-key
    (``cli.keys.key_options``)."""
    return open_tiered(url, replicate_to=durable_url, create=False, background=False, **keys)


def pair_document(
    pair: TieredStore, summary: Callable[[Checkpoint], dict[str, Any]]
) -> dict[str, Any]:
    """The pair's history (each checkpoint with its durable epoch and the tiers that hold
    it) and the fast tier's checkpoints outside it, as ``ls --json`` prints them."""
    durable_steps = set(pair.durable.steps())
    entries = []
    for checkpoint in pair.checkpoints():
        in_fast, in_durable = checkpoint.url == pair.url, checkpoint.step in durable_steps
        tier = "fast+durable" if in_fast and in_durable else "fast" if in_fast else "durable"
        epoch = durable_epoch_of(checkpoint.manifest) if in_fast else checkpoint.manifest.epoch
        entries.append({**summary(checkpoint), "epoch": epoch, "tier": tier})
    return {
        "url": pair.url,
        "durable_url": shown_url(pair.durable_url),
        "checkpoints": entries,
        "not_in_history": [outside_document(entry) for entry in pair.outside_history()],
    }


def outside_document(entry: OutsideCheckpoint) -> dict[str, Any]:
    """A fast checkpoint outside the pair's history, as JSON."""
    return {
        "step": entry.step,
        "attempt": entry.attempt,
        "durable_epoch": entry.durable_epoch,
        "owner": entry.owner,
    }


def outside_rows(entries: list[dict[str, Any]]) -> list[list[str]]:
    """The table of fast checkpoints outside the pair's history."""
    rows = [["STEP", "ATTEMPT", "DURABLE EPOCH", "STEP OWNED BY EPOCH"]]
    for entry in entries:
        epoch = "unreadable" if entry["durable_epoch"] is None else str(entry["durable_epoch"])
        rows.append([str(entry["step"]), entry["attempt"], epoch, str(entry["owner"])])
    return rows


def refuse_a_fast_tier_alone(store: Store, step: int) -> None:
    """RefusedError if ``store`` is the fast tier of a pair (a checkpoint at or above
    ``step`` records its durable store): rolled back alone, the durable tier would undo it."""
    for candidate in reversed(store.steps()):
        if candidate < step:
            return
        try:
            record = tier_record(store.manifest(candidate))
        except (CheckpointNotFoundError, IntegrityError):
            continue
        if record is not None:
            durable = str(record.get("durable", "its durable store"))
            raise RefusedError(
                f"{store.url} is the fast tier of a tiered pair (durable store: {durable}): "
                f"rolled back alone, the durable tier would undo it; roll back the pair: "
                f"ckptstore rollback {store.url} {step} --replicate-to DURABLE_URL"
            )
