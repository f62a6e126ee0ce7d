"""Every error ckptstore raises is a ``CkptStoreError``; the tree below is the whole hierarchy.

Errors that have a built-in meaning also subclass the built-in, so ``except FileNotFoundError``
and ``except ValueError`` keep working in code that does not know ckptstore::

    CkptStoreError
    ├── InvalidInputError (ValueError)
    │   ├── InvalidURLError
    │   │   └── UnknownSchemeError
    │   ├── InvalidStepError
    │   ├── InvalidShardNameError
    │   ├── InvalidMetadataError
    │   └── InvalidOptionError
    ├── BackendUnavailableError (ImportError)     optional dependency missing
    ├── CapabilityError                           storage lacks what the protocol needs
    ├── StoreNotFoundError (FileNotFoundError)    no store (directory, bucket) at the URL
    ├── CheckpointNotFoundError (FileNotFoundError)
    │   └── NotACheckpointError                   named like a step, not published: a stray
    ├── ShardNotFoundError (FileNotFoundError)    no such shard name in a checkpoint
    ├── CheckpointExistsError (FileExistsError)   the step is already published (I5)
    ├── ShardExistsError (FileExistsError)        a shard name written twice in one attempt
    ├── StrayEntryError                           a stray holds the name a save publishes under
    ├── CheckpointStateError (RuntimeError)       a pending checkpoint used after publish/abort
    ├── CoverageError                             expected shards missing at publish
    ├── CoordinationError                         a multi-process save's processes disagree
    ├── RefusedError                              an operation that would break I3 without force
    ├── NotEnoughSavesError                       too few saves with timings to measure from
    ├── UnsafePickleError (pickle.UnpicklingError)   stored bytes that would run code if unpickled
    ├── LineageError                              a write outside the writer's epoch (I9)
    │   ├── SupersededError                       a newer epoch took the store over
    │   │   └── EpochRequiredError                taken over, and the writer named no epoch
    │   ├── StepOutsideEpochError                 the step belongs to the history resumed from
    │   ├── EpochNotFoundError (FileNotFoundError)   joining an epoch that was never taken
    │   └── EpochExistsError (FileExistsError)    the epoch number is taken (take_over retries)
    ├── ReplicationError                          a checkpoint not (yet) copied to the durable tier
    │   └── ReplicationTimeoutError (TimeoutError)
    ├── IntegrityError                            stored data is not what was committed (I6)
    │   ├── ManifestCorruptError
    │   ├── ShardCorruptError
    │   ├── ShardMissingError
    │   ├── LineageCorruptError                   an epoch record does not parse
    │   └── UntrustedCheckpointError              unsigned, or signed by a key not trusted
    └── StorageError (OSError)                    a driver call failed
        ├── StorageAccessDeniedError (PermissionError)
        ├── ObjectNotFoundError (FileNotFoundError)
        ├── PreconditionFailedError               a conditional write lost (If-None-Match/If-Match)
        │   └── PreconditionInferredError         ... as read back after a broken call, no 412
        ├── TargetExistsError (FileExistsError)      create/mkdir/rename found the target
        └── TransientStorageError                 worth retrying (throttling, 5xx, timeouts)
            └── IndeterminateOutcomeError         the call may or may not have taken effect

Drivers translate third-party errors (OSError, botocore) into ``StorageError`` subclasses at one
place each, chained with ``raise ... from exc``.
"""

from __future__ import annotations

import pickle
from typing import Any

from ckptstore.redaction import redact

__all__ = [
    "BackendUnavailableError",
    "CapabilityError",
    "CheckpointExistsError",
    "CheckpointNotFoundError",
    "CheckpointStateError",
    "CkptStoreError",
    "CoordinationError",
    "CoverageError",
    "EpochExistsError",
    "EpochNotFoundError",
    "EpochRequiredError",
    "IndeterminateOutcomeError",
    "IntegrityError",
    "InvalidInputError",
    "InvalidMetadataError",
    "InvalidOptionError",
    "InvalidShardNameError",
    "InvalidStepError",
    "InvalidURLError",
    "LineageCorruptError",
    "LineageError",
    "ManifestCorruptError",
    "NotACheckpointError",
    "NotEnoughSavesError",
    "ObjectNotFoundError",
    "PreconditionFailedError",
    "PreconditionInferredError",
    "RefusedError",
    "ReplicationError",
    "ReplicationTimeoutError",
    "ShardCorruptError",
    "ShardExistsError",
    "ShardMissingError",
    "ShardNotFoundError",
    "StepOutsideEpochError",
    "StorageAccessDeniedError",
    "StorageError",
    "StoreNotFoundError",
    "StrayEntryError",
    "SupersededError",
    "TargetExistsError",
    "TransientStorageError",
    "UnknownSchemeError",
    "UnsafePickleError",
    "UntrustedCheckpointError",
]


class CkptStoreError(Exception):
    """Base of every error raised by ckptstore; its message and ``url`` show no secret.

    Every URL in a message has its secrets redacted (``ckptstore.redaction.redact``), so no
    error, printed, logged or in a traceback, shows a credential a URL carried. Where they
    apply, an error also says in fields what its message says in words: ``url`` (the store,
    redacted), ``step`` (the checkpoint's) and ``key`` (the shard name, or the file or object
    key a storage call was about); None where it does not apply or is not known.
    """

    url: str | None
    step: int | None
    key: str | None

    def __init__(
        self,
        *args: object,
        url: str | None = None,
        step: int | None = None,
        key: str | None = None,
    ) -> None:
        super().__init__(*(redact(arg) if isinstance(arg, str) else arg for arg in args))
        self.url = None if url is None else redact(url)
        self.step = step
        self.key = key


class InvalidInputError(CkptStoreError, ValueError):
    """An argument is malformed; nothing was written."""


class InvalidURLError(InvalidInputError):
    """A store URL cannot be parsed or is not valid for its scheme."""


class UnknownSchemeError(InvalidURLError):
    """No backend is registered for a URL's scheme."""


class InvalidStepError(InvalidInputError):
    """A step is not an integer in [0, 10**20)."""


class InvalidShardNameError(InvalidInputError):
    """A shard name is not a safe relative, '/'-separated name (docs/protocol.md §1)."""


class InvalidMetadataError(InvalidInputError):
    """Trainer metadata is not a JSON object of finite values, or is too large."""


class InvalidOptionError(InvalidInputError):
    """A store option (keyword argument or URL query parameter) is unknown or has a bad value."""


class BackendUnavailableError(CkptStoreError, ImportError):
    """A built-in backend needs an optional dependency that is not installed."""


class CapabilityError(CkptStoreError):
    """The storage lacks a capability the commit strategy needs; the store refuses to open."""


class StoreNotFoundError(CkptStoreError, FileNotFoundError):
    """There is no store at the URL (missing directory or bucket) and it may not be created."""


class CheckpointNotFoundError(CkptStoreError, FileNotFoundError):
    """No published checkpoint exists at the requested step (or at all)."""


class NotACheckpointError(CheckpointNotFoundError):
    """An entry is named like a step but the protocol did not publish it (a stray: an
    operator's mkdir, a partial copy); ckptstore never counts, returns or deletes it."""


class ShardNotFoundError(CkptStoreError, FileNotFoundError):
    """A checkpoint's manifest lists no shard of that name."""


class CheckpointExistsError(CkptStoreError, FileExistsError):
    """The step is already published; the existing checkpoint was left intact (I5)."""


class StrayEntryError(CkptStoreError):
    """A save could not publish: an entry that is not a checkpoint (a stray: an operator's
    ``mkdir``, a partial copy, an object that is not a manifest) holds the very name the
    protocol publishes the step under. Nothing was published, and no other writer published
    the step: this is deliberately not a ``CheckpointExistsError`` (nor a FileExistsError),
    which a trainer may take for "someone else published". The message names the entry to
    remove; every later save of the step fails the same way until it is removed."""

    @classmethod
    def in_the_way(cls, entry: str, step: int, problem: str) -> StrayEntryError:
        """The error for ``entry`` (a URL, credentials already left out) that blocks ``step``."""
        return cls(
            f"step {step} was not published: {entry} is in the way, and it is not a readable "
            f"checkpoint ({problem}). The protocol publishes step {step} under that very name, "
            f"so no save of step {step} can publish while it is there. Remove it (or move it "
            f"out of the store; `ckptstore verify` shows what it holds), then save again"
        )


class ShardExistsError(CkptStoreError, FileExistsError):
    """A shard name was written twice, or clashes with another shard's directory, in one attempt."""


class CheckpointStateError(CkptStoreError, RuntimeError):
    """A pending checkpoint was used after it was published or aborted."""


class CoverageError(CkptStoreError):
    """Shards that were declared as expected are missing at publish; nothing was published."""


class CoordinationError(CkptStoreError):
    """The processes of a multi-process save disagree (another step, another structure):
    nothing was published."""


class RefusedError(CkptStoreError):
    """The operation would remove the newest checkpoint (I3); pass force=True to do it anyway."""


class NotEnoughSavesError(CkptStoreError):
    """The store holds too few checkpoints with recorded timings to measure what a save costs
    the trainer and how fast it steps (``ckptstore advise``); nothing is wrong with them."""


class UnsafePickleError(CkptStoreError, pickle.UnpicklingError):
    """Stored bytes that a loader would unpickle name code to run (or are no pickle at all):
    refused before anything in them ran. A CRC32C proves bytes are those committed, not that
    whoever committed them is trusted."""


class LineageError(CkptStoreError):
    """A write the store's lineage forbids: nothing was published (docs/protocol.md §8)."""


class SupersededError(LineageError):
    """A newer epoch took the store over: this writer's checkpoints are no longer its history."""


class EpochRequiredError(SupersededError):
    """The store was taken over, and this writer neither took it over nor joined an epoch: it
    may be the superseded run (a zombie opening a new handle per save), so it publishes
    nothing until told its epoch (``epoch=``, ``--epoch``, ``?epoch=``) or it takes over."""


class StepOutsideEpochError(LineageError):
    """The step is at or below the step this writer's epoch resumed from: it belongs to the
    history before the takeover, not to this run."""


class EpochNotFoundError(LineageError, FileNotFoundError):
    """The epoch a writer was told to join was never taken in this store."""


class EpochExistsError(LineageError, FileExistsError):
    """An epoch record with that number exists already (records are created if absent)."""


class ReplicationError(CkptStoreError):
    """A tiered store could not copy checkpoints to its durable tier (it is unreachable, or a
    copy did not match the first write's CRC32C). Nothing published is lost: the checkpoints
    stay in the fast tier, and the next replication pass, in this process or a later one,
    copies them."""


class ReplicationTimeoutError(ReplicationError, TimeoutError):
    """Waiting for the durable tier to catch up took longer than the timeout given."""


class IntegrityError(CkptStoreError):
    """Stored data differs from what was committed: never returned as data (I6)."""


class ManifestCorruptError(IntegrityError):
    """A manifest is truncated, malformed, too large, unsafe, or fails its own checksum."""


class ShardCorruptError(IntegrityError):
    """A shard's bytes do not match the size or CRC32C recorded in the manifest."""


class LineageCorruptError(IntegrityError):
    """An epoch record is truncated, malformed or fails its checksum: the store's history
    cannot be told, so readers refuse to guess it."""


class UntrustedCheckpointError(IntegrityError):
    """A store opened with ``trust`` met a manifest or epoch record that is unsigned, signed
    by a key it does not trust, or changed since it was signed, or a signed manifest without
    digests; ``reason`` says which (``unsigned``, ``untrusted-key``, ``bad-signature``,
    ``no-digest``). Bytes that differ from a signed digest are a ShardCorruptError."""

    def __init__(self, *args: object, reason: str = "", **where: Any) -> None:
        super().__init__(*args, **where)
        self.reason = reason


class ShardMissingError(IntegrityError, FileNotFoundError):
    """A shard recorded in a published manifest is not in storage."""


class StorageError(CkptStoreError, OSError):
    """A storage call failed; the message names the object and the cause.

    ``errno`` is a real errno (``ENOENT``, ``EACCES``, ``ETIMEDOUT``...) or None; an HTTP
    storage's status code is ``http_status`` (None where there was no HTTP answer):
    ``StorageError("PutObject k: SlowDown", http_status=503)``.
    """

    http_status: int | None

    def __init__(
        self,
        *args: object,
        http_status: int | None = None,
        url: str | None = None,
        step: int | None = None,
        key: str | None = None,
    ) -> None:
        super().__init__(*args, url=url, step=step, key=key)
        self.http_status = http_status


class StorageAccessDeniedError(StorageError, PermissionError):
    """The storage system refused the credentials or the permission."""


class ObjectNotFoundError(StorageError, FileNotFoundError):
    """A file, directory, object or object version does not exist."""


class PreconditionFailedError(StorageError):
    """A conditional write was refused: the object exists (If-None-Match) or changed (If-Match)."""


class PreconditionInferredError(PreconditionFailedError):
    """A conditional create taken as refused without the server saying so: after a broken
    call, the key held other bytes. The server never answered 412, so this says nothing about
    whether it honours If-None-Match (the conditional-create probe must not count it)."""


class TargetExistsError(StorageError, FileExistsError):
    """A create, mkdir or no-replace rename found its target present; nothing was replaced."""


class TransientStorageError(StorageError):
    """A failure that may succeed when retried (throttling, 5xx, connection errors, timeouts)."""


class IndeterminateOutcomeError(TransientStorageError):
    """The call may or may not have taken effect; the caller must read back to decide (I8)."""
