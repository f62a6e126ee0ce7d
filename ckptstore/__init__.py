"""ckptstore: crash-safe ML training checkpoints on any storage system.

import ckptstore
store = ckptstore.open("file:///scratch/run42", retention=ckptstore.KeepLast(3))
with store.begin(step=1000, metadata={"samples": 64000}) as ckpt:
    ckpt.write("model/rank00000.bin", weights)
    ckpt.write("trainer.json", b"{...}")
latest = store.latest()          # the newest *published* checkpoint, or None
weights = latest.read("model/rank00000.bin")   # verified against its CRC32C
"""

from ckptstore.checkpoint import Checkpoint
from ckptstore.errors import (
    CapabilityError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CkptStoreError,
    IntegrityError,
    InvalidInputError,
    RefusedError,
    StorageError,
    TransientStorageError,
)
from ckptstore.interface import CheckpointStore
from ckptstore.pending import PendingCheckpoint
from ckptstore.retention import KeepEvery, KeepLast, KeepNewerThan, RetentionPolicy
from ckptstore.store import Store
from ckptstore.tiers.tiered import TieredStore, tiered_url
from ckptstore.tiers.tiered import open_checkpoints as open  # open(url, **options) -> Store

# ckptstore.tiered and ckptstore.replication, as they were before tiers/ (tiers/__init__.py).
from ckptstore import replication, tiered  # noqa: F401  # isort: skip

__version__ = "0.1.0"

# What a trainer uses. Everything else lives in its module: the whole error tree in
# ckptstore.errors (driver-level errors are also exported by ckptstore.driver, for backend
# authors), manifests in ckptstore.manifest, GC reports in ckptstore.commit.base, schemes in
# ckptstore.registry.
__all__ = [
    "CapabilityError",
    "Checkpoint",
    "CheckpointExistsError",
    "CheckpointNotFoundError",
    "CheckpointStore",
    "CkptStoreError",
    "IntegrityError",
    "InvalidInputError",
    "KeepEvery",
    "KeepLast",
    "KeepNewerThan",
    "PendingCheckpoint",
    "RefusedError",
    "RetentionPolicy",
    "StorageError",
    "Store",
    "TieredStore",
    "TransientStorageError",
    "open",
    "tiered_url",
]
