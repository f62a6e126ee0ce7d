"""A store's epochs decide its one history: every step has exactly one owner epoch (I9).

The rule, and why it holds: docs/protocol.md §8. An epoch is taken by a run that takes the
store over; it records the step the run resumed from (its parent). The owner of step s is the
newest epoch whose parent is below s (a fresh start counting as -1, epoch 0 being the implicit
epoch of every store before its first takeover), and a checkpoint is part of the history only
if its epoch owns its step. An epoch may name the epoch of the checkpoint it resumed from (its
parent epoch; by default the epoch before it): that is how a mistaken takeover or a rollback is
undone, by a takeover from a checkpoint that left the history.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from typing import Any

from ckptstore.checksum import crc32c_hex
from ckptstore.errors import LineageCorruptError
from ckptstore.jsonload import load_json
from ckptstore.manifest import WriterInfo
from ckptstore.names import check_epoch, check_step
from ckptstore.signing import Signature, SigningKey, Trust, signed_payload

__all__ = ["EPOCH_FORMAT", "MAX_EPOCH_RECORD_BYTES", "Epoch", "Lineage"]

EPOCH_FORMAT = "ckptstore.epoch"
MAX_EPOCH_RECORD_BYTES = 64 * 1024


@dataclass(frozen=True)
class Epoch:
    """One takeover of a store: its number, the step it resumed from, when and by whom."""

    number: int
    parent: int | None
    """The step the run resumed from; None for a fresh start (it supersedes every step)."""
    started_at: datetime
    writer: WriterInfo
    note: str = ""
    """Free text from the taker (a job id, a launcher's name), shown by ``ckptstore ls``."""
    parent_epoch: int | None = None
    """The epoch of the checkpoint the run resumed from, when it is not the epoch before this
    one (None: ``number - 1``, the rule of every record written without the field)."""
    signature: Signature | None = None
    """The taker's signature of the record (``ckptstore.signing``), or None: unsigned."""
    signed: bytes = field(default=b"", compare=False, repr=False)
    """The payload ``signature`` covers: set when a record is signed or decoded signed."""

    def signed_by(self, key: SigningKey) -> Epoch:
        """This record signed with ``key``."""
        document = self._document()
        document.pop("signature", None)
        payload = signed_payload(EPOCH_FORMAT, document)
        return replace(self, signature=key.sign(payload), signed=payload)

    def check_trust(self, trust: Trust, *, where: str) -> str:
        """The id of the trusted key that signed this record; UntrustedCheckpointError if it
        is unsigned, signed by another key or changed since (a takeover nobody trusted)."""
        return trust.check(self.signature, self.signed, what=f"{where}: epoch {self.number}")

    @property
    def base(self) -> int:
        """The epoch whose history, up to the parent step, this epoch continues."""
        return self.number - 1 if self.parent_epoch is None else self.parent_epoch

    @property
    def floor(self) -> int:
        """The parent as a number: the epoch owns steps above it (-1 for a fresh start)."""
        return -1 if self.parent is None else self.parent

    def encode(self) -> bytes:
        """Serialise to UTF-8 JSON with an embedded CRC32C of the canonical form."""
        document = self._document()
        document["checksum"] = _checksum(document)
        return json.dumps(document, indent=1, sort_keys=True).encode("utf-8")

    def _document(self) -> dict[str, Any]:
        document: dict[str, Any] = {
            "format": EPOCH_FORMAT,
            "epoch": self.number,
            "parent": self.parent,
            "started_at": self.started_at.astimezone(timezone.utc).isoformat(),
            "writer": {"host": self.writer.host, "pid": self.writer.pid},
            "note": self.note,
        }
        if self.parent_epoch is not None and self.parent_epoch != self.number - 1:
            document["parent_epoch"] = self.parent_epoch  # absent: the epoch before (§8.2)
        if self.signature is not None:
            document["signature"] = self.signature.to_document()
        return document

    @classmethod
    def decode(cls, data: bytes, *, where: str, expected: int) -> Epoch:
        """Parse and check a stored record; LineageCorruptError naming ``where`` if it is not
        the intact record of epoch ``expected``."""
        try:
            # The record nests one object (its writer) in another: deeper is damage.
            document = load_json(data, max_bytes=MAX_EPOCH_RECORD_BYTES, max_depth=8)
            if not isinstance(document, dict) or document.get("format") != EPOCH_FORMAT:
                raise ValueError("not a ckptstore epoch record")
            if document.get("checksum") != _checksum(document):
                raise ValueError("checksum mismatch (tampered or corrupted)")
            parent = document["parent"]
            writer = document["writer"]
            parent_epoch = document.get("parent_epoch")
            signature = None
            if "signature" in document:
                signature = Signature.from_document(document["signature"])
            epoch = cls(
                number=check_epoch(document["epoch"]),
                parent=None if parent is None else check_step(parent),
                started_at=datetime.fromisoformat(document["started_at"]),
                writer=WriterInfo(host=str(writer["host"]), pid=int(writer["pid"])),
                note=str(document.get("note", "")),
                parent_epoch=None if parent_epoch is None else check_epoch(parent_epoch),
                signature=signature,
                signed=b"" if signature is None else signed_payload(EPOCH_FORMAT, document),
            )
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise LineageCorruptError(
                f"{where}: epoch record is unreadable ({exc}); {_repair_hint(expected)}"
            ) from exc
        if epoch.number != expected or epoch.number == 0:
            raise LineageCorruptError(
                f"{where}: epoch record is for epoch {epoch.number}, stored as epoch "
                f"{expected}; {_repair_hint(expected)}"
            )
        if epoch.base >= epoch.number:
            raise LineageCorruptError(
                f"{where}: epoch {epoch.number} names epoch {epoch.base}, not an older one, as "
                f"its parent epoch"
            )
        return epoch


def _repair_hint(epoch: int) -> str:
    return (
        f"the store's history cannot be told until it is repaired: if you know the step "
        f"epoch {epoch} resumed from, rewrite the record with `ckptstore repair-epoch URL "
        f"{epoch} --parent STEP` (--fresh-start if it started from nothing; "
        f"docs/protocol.md §8.5)"
    )


def _checksum(document: Mapping[str, Any]) -> str:
    body = {key: value for key, value in document.items() if key != "checksum"}
    return crc32c_hex(json.dumps(body, sort_keys=True, separators=(",", ":")).encode("utf-8"))


@dataclass(frozen=True)
class Lineage:
    """The epochs a store had when they were read, in order, without gaps: 1 .. newest."""

    epochs: tuple[Epoch, ...] = ()

    @classmethod
    def of(cls, epochs: Iterable[Epoch]) -> Lineage:
        """The lineage of ``epochs``, which must be numbered 1, 2, ... without a gap."""
        ordered = tuple(sorted(epochs, key=lambda epoch: epoch.number))
        for index, epoch in enumerate(ordered, start=1):
            if epoch.number != index:
                raise LineageCorruptError(f"epoch {index} is missing below epoch {epoch.number}")
        return cls(ordered)

    @property
    def newest(self) -> int:
        """The newest epoch's number (0: the store was never taken over)."""
        return len(self.epochs)

    def epoch(self, number: int) -> Epoch | None:
        """The record of epoch ``number``; None for epoch 0 (implicit) or one not read."""
        if 1 <= number <= len(self.epochs):
            return self.epochs[number - 1]
        return None

    def owner(self, step: int) -> int:
        """The epoch whose checkpoint of ``step`` is part of the history (of the newest epoch)."""
        return self.owner_in(self.newest, step)

    def owner_in(self, epoch: int, step: int) -> int:
        """The epoch whose checkpoint of ``step`` is part of the history of ``epoch``: ``epoch``
        itself if its parent is below ``step``, else the owner in its parent epoch's history
        (docs/protocol.md §8.2). Epoch 0 owns every step of its own history."""
        number = epoch
        while number > 0:
            record = self.epochs[number - 1]
            if record.floor < step:
                return number
            number = record.base
        return 0

    def left_history_at(self, step: int, epoch: int) -> int | None:
        """The takeover that removed checkpoint (``step``, ``epoch``) from the history: the
        epoch after the newest one whose history holds it (None: the history holds it now)."""
        if self.owner(step) == epoch:
            return None
        for number in range(self.newest - 1, epoch - 1, -1):
            if self.owner_in(number, step) == epoch:
                return number + 1
        return epoch + 1 if epoch < self.newest else None

    def knows(self, epoch: int) -> bool:
        """Whether ``epoch`` is one of the epochs read (0 always is)."""
        return 0 <= epoch <= len(self.epochs)

    def in_history(self, step: int, epoch: int) -> bool:
        """Whether checkpoint (``step``, ``epoch``) is part of the store's history."""
        return self.knows(epoch) and self.owner(step) == epoch

    def superseded_by(self, epoch: int) -> Epoch | None:
        """The first epoch newer than ``epoch``, if there is one: the writer's supersessor."""
        return self.epoch(epoch + 1) if epoch < len(self.epochs) else None
