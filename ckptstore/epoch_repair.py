"""Rewrite a damaged epoch record, the one way out of a store whose history cannot be told.

An epoch record that does not read back (docs/protocol.md §8.6) stops every reader and writer
with LineageCorruptError: the record's parent decides which checkpoints are the history, and
ckptstore refuses to guess it. What was damaged can be written again by someone who knows the
parent (the step the run that took epoch E resumed from: its log says it, and it is below the
first step saved in epoch E). ``repair_epoch`` does that, and only that:

- it refuses a record that reads back intact (records are never changed), and one that is
  absent (a missing epoch is not damage: a takeover creates it);
- it replaces the damaged record only, atomically: a sibling temporary file renamed over it
  (file systems), or a put conditional on the damaged object's ETag (object stores), so a
  record someone else repaired meanwhile is left alone;
- while the record is damaged no takeover can create a later epoch (every taker reads the
  epochs first and stops at the damaged one), so the repaired record takes its place in an
  unchanged lineage.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime, timezone
from typing import Any

from ckptstore.commit.conditional_put import ConditionalPutCommit
from ckptstore.commit.rename import EPOCH_RECORD, EPOCHS_DIR, RenameCommit
from ckptstore.driver import PutMode
from ckptstore.errors import (
    CapabilityError,
    EpochNotFoundError,
    InvalidOptionError,
    LineageCorruptError,
    PreconditionFailedError,
    RefusedError,
)
from ckptstore.lineage import Epoch
from ckptstore.manifest import WriterInfo
from ckptstore.names import check_epoch, check_step, epoch_token, new_attempt_id
from ckptstore.store import Store

__all__ = ["repair_epoch", "resign_epoch"]


def resign_epoch(store: Store, epoch: int) -> Epoch:
    """Sign the intact record of ``epoch`` with ``store``'s signing key, its content unchanged;
    return the record written.

    The way out of a takeover written without the key (docs/protocol.md §10): every reader
    that trusts the key refuses the store's history while one of its epochs is unsigned or
    signed by another key. The key holder, having checked that the takeover was legitimate
    (its parent step, who took it: ``ckptstore ls`` with ``trust=False``), endorses it. The
    same atomic replacement as a repair; a record that does not read back is repaired with
    ``repair_epoch`` instead. InvalidOptionError without a signing key; RefusedError for a
    record already signed by that key.
    """
    number = check_epoch(epoch)
    strategy = store.strategy
    key = store.signing_key
    if key is None:
        raise InvalidOptionError(
            f"{strategy.url}: re-signing epoch {number} needs the signing key (--signing-key, "
            f"$CKPTSTORE_SIGNING_KEY)"
        )
    where, data = _stored_record(strategy, number, "sign")
    record = Epoch.decode(data, where=where, expected=number)  # damaged: LineageCorruptError
    if record.signature is not None and record.signature.key_id == key.key_id:
        raise RefusedError(f"{where}: epoch {number} is already signed by {key.key_id}")
    signed = replace(record, signature=None, signed=b"").signed_by(key)
    _replace(strategy, number, data, signed.encode())
    return signed


def repair_epoch(store: Store, epoch: int, parent: int | None, *, note: str = "") -> Epoch:
    """Replace the damaged record of ``epoch`` by one that resumed from ``parent`` (None: a
    fresh start); return the record written.

    Raises RefusedError if the record reads back intact, EpochNotFoundError if there is none,
    CapabilityError on a store whose strategy keeps no epoch records this knows how to write.
    """
    number = check_epoch(epoch)
    resumed_from = None if parent is None else check_step(parent)
    strategy = store.strategy
    where, data = _stored_record(strategy, number, "repair")
    try:
        Epoch.decode(data, where=where, expected=number)
    except LineageCorruptError:
        pass
    else:
        raise RefusedError(
            f"{where}: the record of epoch {number} reads back intact; records are never "
            f"changed, and only a damaged one is repaired"
        )
    record = Epoch(
        number=number,
        parent=resumed_from,
        started_at=_started_at(store, number),
        writer=WriterInfo.current(),
        note=("repaired by ckptstore repair-epoch" + (f": {note}" if note else ""))[:1000],
    )
    if store.signing_key is not None:  # a store that trusts keys reads only a signed repair
        record = record.signed_by(store.signing_key)
    _replace(strategy, number, data, record.encode())
    return record


def _stored_record(strategy: Any, number: int, doing: str) -> tuple[str, bytes]:
    """Where the record of epoch ``number`` is (as messages name it) and its stored bytes;
    RefusedError for epoch 0, EpochNotFoundError if there is none to ``doing``."""
    if number == 0:
        raise RefusedError(f"{strategy.url}: epoch 0 has no record (it is implicit)")
    where = f"{strategy.url}/{EPOCHS_DIR}/{epoch_token(number)}"
    data = strategy.read_epoch(number)
    if data is None:
        raise EpochNotFoundError(f"{where}: there is no record of epoch {number} to {doing}")
    return where, data


def _started_at(store: Store, number: int) -> datetime:
    """When the repaired epoch started, as near as the records around it tell (its own time is
    lost): the start of the epoch before it, else of the one after it, else now. Kept in order,
    so that ``advise`` counts every start (its order is how it tells a wrong clock)."""
    for neighbour in (number - 1, number + 1):
        data = store.strategy.read_epoch(neighbour) if neighbour >= 1 else None
        if data is not None:
            try:
                return Epoch.decode(data, where="", expected=neighbour).started_at
            except LineageCorruptError:
                continue
    return datetime.fromtimestamp(store.clock(), timezone.utc)


def _replace(strategy: object, number: int, damaged: bytes, record: bytes) -> None:
    if isinstance(strategy, RenameCommit):
        directory = f"{EPOCHS_DIR}/{epoch_token(number)}"
        temporary = f"{directory}/.{EPOCH_RECORD}.repair-{new_attempt_id()}"
        driver = strategy.driver
        handle = driver.create(temporary)
        try:
            driver.write(handle, memoryview(record))
            driver.fsync(handle)
        finally:
            driver.close(handle)
        try:
            driver.rename_replace(temporary, f"{directory}/{EPOCH_RECORD}")
        except BaseException:
            driver.unlink(temporary)
            raise
        driver.fsync_dir(directory)
    elif isinstance(strategy, ConditionalPutCommit):
        key = strategy.epoch_key(number)
        stored, info = strategy.driver.get(key)
        if stored != damaged:
            raise RefusedError(
                f"{strategy.url}/{key}: the record changed while it was being repaired; run "
                f"the repair again if it is still damaged"
            )
        try:
            strategy.driver.put(key, record, mode=PutMode.update(info.etag))
        except PreconditionFailedError as exc:
            raise RefusedError(
                f"{strategy.url}/{key}: the record changed while it was being repaired; run "
                f"the repair again if it is still damaged"
            ) from exc
    else:
        raise CapabilityError(
            f"{getattr(strategy, 'url', 'this store')}: its commit strategy keeps no epoch "
            f"records that ckptstore repair-epoch can write; restore the record from a copy"
        )
