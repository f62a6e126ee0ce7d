"""A torchrun worker: every rank loads "the latest" while a new step is published between the
ranks' arrivals; every rank must load the same step, through DCP and through load_state.

The publish is injected deterministically: rank 0's store publishes step 2 right after it has
found the latest, and every other rank's store waits for step 2 before it looks for the latest
itself. A rank that resolved the latest on its own would therefore load step 2 while rank 0
loads step 1.
"""

from __future__ import annotations

import argparse
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import ckptstore
from ckptstore import Store
from ckptstore.torch import load_state, save_state
from ckptstore.torch.dcp import CkptStoreReader, CkptStoreWriter

parser = argparse.ArgumentParser()
parser.add_argument("--store", required=True)
args = parser.parse_args()
WAIT_S = 60.0


def republish(store: Store, step: int, new_step: int) -> None:
    """Publish ``new_step`` with the shards of ``step`` (a concurrent trainer's save)."""
    source = store.get(step)
    with store.begin(new_step, source.metadata) as pending:
        for name in source.names:
            pending.write(name, source.read(name))


def racing(store: Store, rank: int) -> Store:
    """``store`` whose latest() races a publish of the step after the current latest."""
    real_latest = store.latest

    def latest() -> Any:
        if rank == 0:
            found = real_latest()
            assert found is not None
            republish(ckptstore.open(store.url), found.step, found.step + 1)
            return found
        deadline = time.monotonic() + WAIT_S
        target = max(store.steps()) + 1
        while target not in store.steps():  # the coordinator publishes it once it has looked
            assert time.monotonic() < deadline, f"step {target} never appeared"
            time.sleep(0.05)
        return real_latest()

    store.latest = latest  # type: ignore[method-assign]
    return store


def same_everywhere(value: int) -> list[int]:
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, value)
    return everyone


dist.init_process_group("gloo", timeout=timedelta(seconds=60))
rank = dist.get_rank()

# DCP: save step 1 on every rank, then load "the latest" while step 2 appears.
dcp_url = f"{args.store}/dcp"
state = {"weights": torch.full((8,), 1.0), "step": 1}
dcp.save(state, storage_writer=CkptStoreWriter(ckptstore.open(dcp_url)), checkpoint_id=1)
target = {"weights": torch.zeros(8), "step": -1}
reader = CkptStoreReader(racing(ckptstore.open(dcp_url), rank))
dcp.load(target, storage_reader=reader)
assert reader.loaded is not None
steps = same_everywhere(reader.loaded.step)
assert steps == [1] * len(steps), f"DCP: ranks loaded steps {steps}"
assert torch.equal(target["weights"], torch.full((8,), 1.0))

# load_state: rank 0 saves step 1 with the plain API; every rank loads the latest.
state_url = f"{args.store}/state"
if rank == 0:
    save_state(ckptstore.open(state_url), 1, {"model": {"w": torch.full((4,), 1.0)}}, rng=False)
dist.barrier()
loaded = load_state(racing(ckptstore.open(state_url), rank), {"model": {}}, rng=False)
steps = same_everywhere(loaded["step"])
assert steps == [1] * len(steps), f"load_state: ranks loaded steps {steps}"
assert torch.equal(loaded["model"]["w"], torch.full((4,), 1.0))

dist.barrier()
dist.destroy_process_group()
