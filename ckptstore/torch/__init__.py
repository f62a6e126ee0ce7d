"""PyTorch integration (``pip install 'ckptstore[torch]'``): a trainer's full state to a
checkpoint and back, bitwise exact, synchronously or in the background.

    from ckptstore.torch import AsyncSaver, load_state, save_state

    save_state(store, step, {"model": model, "optimizer": opt, "scheduler": sched,
                             "sampler": sampler}, counters={"samples_read": n})
    latest = store.latest()
    counters = load_state(latest, {"model": model, "optimizer": opt, ...})["counters"]

Multi-rank: ``ckptstore.torch.distributed.save_sharded(store, step, {name: data})`` on every
rank of a torch.distributed group writes each rank's shards into one attempt and publishes
them in one commit. ``ckptstore.torch.dcp`` has the torch.distributed.checkpoint
StorageWriter and StorageReader.
"""

from ckptstore.torch.async_save import AsyncSaver
from ckptstore.torch.codec import decode_state, encode_state, read_tensors
from ckptstore.torch.rng import capture_rng, restore_rng
from ckptstore.torch.state import Snapshot, Stateful, load_state, save_state, snapshot_state

__all__ = [
    "AsyncSaver",
    "Snapshot",
    "Stateful",
    "capture_rng",
    "decode_state",
    "encode_state",
    "load_state",
    "read_tensors",
    "restore_rng",
    "save_state",
    "snapshot_state",
]
