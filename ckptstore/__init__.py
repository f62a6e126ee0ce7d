"""ckptstore: crash-safe ML training checkpoints on any storage system.

import ckptstore
store = ckptstore.open("file:///scratch/run42", retention=ckptstore.KeepLast(3))
with store.begin(step=1000, metadata={"samples": 64000}) as ckpt:
    ckpt.write("model/rank00000.bin", weights)
    ckpt.write("trainer.json", b"{...}")
latest = store.latest()          # the newest *published* checkpoint, or None
weights = latest.read("model/rank00000.bin")   # verified against its CRC32C
"""

from ckptstore.checkpoint import Checkpoint, ShardReader, VerifyReport
from ckptstore.commit.base import GcItem, GcReport
from ckptstore.errors import (
    BackendUnavailableError,
    CapabilityError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CheckpointStateError,
    CkptStoreError,
    CoverageError,
    IndeterminateOutcomeError,
    IntegrityError,
    InvalidInputError,
    InvalidMetadataError,
    InvalidOptionError,
    InvalidShardNameError,
    InvalidStepError,
    InvalidURLError,
    ManifestCorruptError,
    ObjectNotFoundError,
    PreconditionFailedError,
    RefusedError,
    ShardCorruptError,
    ShardExistsError,
    ShardMissingError,
    ShardNotFoundError,
    StorageAccessDeniedError,
    StorageError,
    StoreNotFoundError,
    TargetExistsError,
    TransientStorageError,
    UnknownSchemeError,
)
from ckptstore.manifest import Manifest, ShardRecord, WriterInfo
from ckptstore.pending import PendingCheckpoint, ShardWriter
from ckptstore.registry import known_schemes, register
from ckptstore.retention import KeepEvery, KeepLast, KeepNewerThan, RetentionPolicy
from ckptstore.store import DEFAULT_GRACE, Store, open_store

open = open_store

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_GRACE",
    "BackendUnavailableError",
    "CapabilityError",
    "Checkpoint",
    "CheckpointExistsError",
    "CheckpointNotFoundError",
    "CheckpointStateError",
    "CkptStoreError",
    "CoverageError",
    "GcItem",
    "GcReport",
    "IndeterminateOutcomeError",
    "IntegrityError",
    "InvalidInputError",
    "InvalidMetadataError",
    "InvalidOptionError",
    "InvalidShardNameError",
    "InvalidStepError",
    "InvalidURLError",
    "KeepEvery",
    "KeepLast",
    "KeepNewerThan",
    "Manifest",
    "ManifestCorruptError",
    "ObjectNotFoundError",
    "PendingCheckpoint",
    "PreconditionFailedError",
    "RefusedError",
    "RetentionPolicy",
    "ShardCorruptError",
    "ShardExistsError",
    "ShardMissingError",
    "ShardNotFoundError",
    "ShardReader",
    "ShardRecord",
    "ShardWriter",
    "StorageAccessDeniedError",
    "StorageError",
    "Store",
    "StoreNotFoundError",
    "TargetExistsError",
    "TransientStorageError",
    "UnknownSchemeError",
    "VerifyReport",
    "WriterInfo",
    "known_schemes",
    "open",
    "open_store",
    "register",
]
