"""What ``ckptstore ls`` and ``show`` say of a store's lineage: its epochs, their parents, the
checkpoints a takeover superseded, and a checkpoint's ancestry back to epoch 0 (§8)."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from ckptstore.lineage import Epoch, Lineage
from ckptstore.store import SupersededCheckpoint

__all__ = [
    "ancestry",
    "ancestry_text",
    "epoch_document",
    "epoch_rows",
    "superseded_document",
    "superseded_rows",
]


def epoch_document(epoch: Epoch) -> dict[str, Any]:
    """An epoch record as JSON: number, parent (None: a fresh start), when, by whom, note."""
    return {
        "epoch": epoch.number,
        "parent": epoch.parent,
        "started_at": epoch.started_at.isoformat(),
        "writer": {"host": epoch.writer.host, "pid": epoch.writer.pid},
        "note": epoch.note,
        "parent_epoch": None if epoch.parent is None else epoch.base,
    }


def epoch_rows(lineage: Lineage) -> list[list[str]]:
    """The table of epochs, epoch 0 (implicit, never recorded) first."""
    rows = [["EPOCH", "PARENT", "TAKEN (UTC)", "BY", "NOTE"], ["0", "-", "-", "-", "(implicit)"]]
    for epoch in lineage.epochs:
        rows.append(
            [
                str(epoch.number),
                "fresh start" if epoch.parent is None else f"step {epoch.parent}",
                epoch.started_at.isoformat()[:19].replace("T", " "),
                f"{epoch.writer.host} pid {epoch.writer.pid}",
                epoch.note or "-",
            ]
        )
    return rows


Since = dict[tuple[int, int], datetime | None]


def _goes(entry: SupersededCheckpoint, since: Since, grace: timedelta) -> datetime | None:
    left = since.get((entry.step, entry.epoch))
    return None if left is None else left + grace


def superseded_document(
    entries: list[SupersededCheckpoint], since: Since, grace: timedelta
) -> list[dict[str, Any]]:
    """Superseded checkpoints as JSON: step, its epoch, the epoch that owns the step now, when
    it left the history and from when ``gc`` (with ``grace``) removes it (storage clock)."""
    document = []
    for entry in entries:
        left, goes = since.get((entry.step, entry.epoch)), _goes(entry, since, grace)
        document.append(
            {
                "step": entry.step,
                "epoch": entry.epoch,
                "superseded_by": entry.owner,
                "superseded_at": None if left is None else left.isoformat(),
                "collected_after": None if goes is None else goes.isoformat(),
            }
        )
    return document


def superseded_rows(
    entries: list[SupersededCheckpoint], since: Since, grace: timedelta
) -> list[list[str]]:
    """The table of superseded checkpoints (never returned; ``gc`` unpublishes them once the
    superseded grace period has passed)."""
    rows = [["STEP", "EPOCH", "STATUS"]]
    for e in entries:
        goes = _goes(e, since, grace)
        when = "unknown" if goes is None else goes.isoformat()[:19].replace("T", " ") + " UTC"
        rows.append(
            [str(e.step), str(e.epoch), f"superseded by epoch {e.owner}; gc removes it from {when}"]
        )
    return rows


def ancestry(lineage: Lineage, step: int, epoch: int) -> list[dict[str, Any]]:
    """Checkpoint (``step``, ``epoch``)'s lineage, newest first: each epoch it descends from,
    with the step that epoch resumed from and the epoch that step belonged to when it was
    taken, back to epoch 0 or a fresh start."""
    chain: list[dict[str, Any]] = []
    current = epoch
    while True:
        record = lineage.epoch(current)
        if record is None:  # epoch 0: the start of every lineage
            chain.append({"epoch": 0, "parent": None, "parent_epoch": None})
            return chain
        if record.parent is None:
            chain.append({**epoch_document(record), "parent_epoch": None})
            return chain
        # The owner of the parent step in the history this epoch continues: what it resumed from.
        parent_epoch = lineage.owner_in(record.base, record.parent)
        chain.append({**epoch_document(record), "parent_epoch": parent_epoch})
        current = parent_epoch


def ancestry_text(chain: list[dict[str, Any]], step: int) -> str:
    """One line: ``step 5 (epoch 2) <- step 3 (epoch 1) <- step 1 (epoch 0) <- start``."""
    parts = [f"step {step} (epoch {chain[0]['epoch']})"]
    for link in chain:
        if link["epoch"] == 0:
            break
        if link["parent"] is None:
            parts.append("fresh start")
            return " <- ".join(parts)
        parts.append(f"step {link['parent']} (epoch {link['parent_epoch']})")
    return " <- ".join([*parts, "start"])
