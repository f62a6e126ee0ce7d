"""A torchrun worker for the DCP tests: save or load a DTensor-sharded state through ckptstore."""

from __future__ import annotations

import argparse
import gc
import os
import signal
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

import ckptstore
from ckptstore.torch.dcp import CkptStoreReader, CkptStoreWriter

parser = argparse.ArgumentParser()
parser.add_argument("--store", required=True)
parser.add_argument("--mode", choices=("save", "load"), required=True)
parser.add_argument("--step", type=int, required=True)
parser.add_argument("--die-rank", type=int, default=-1)
parser.add_argument("--then-save", type=int, help="after a load, save this step (same job)")
args = parser.parse_args()


def full(step: int) -> torch.Tensor:
    return torch.arange(64 * 8, dtype=torch.float32).reshape(64, 8) * (step + 1)


def dying_write(self, plan, planner):  # type: ignore[no-untyped-def]
    os.kill(os.getpid(), signal.SIGKILL)


def run(world: int, rank: int, mode: str, step: int) -> None:
    """Save or load one step; the device mesh and its DTensors die when this returns."""
    mesh = init_device_mesh("cpu", (world,))
    store = ckptstore.open(args.store)
    if mode == "save":
        state = {
            "weights": distribute_tensor(full(step), mesh, [Shard(0)]),
            "bias": torch.full((4,), float(step)),
            "trainer": {"step": step, "world": world},
        }
        if rank == args.die_rank:
            CkptStoreWriter.write_data = dying_write  # type: ignore[method-assign]
        dcp.save(state, storage_writer=CkptStoreWriter(store, step))
        assert store.latest().step == step
    else:
        target = {
            "weights": distribute_tensor(torch.zeros(64, 8), mesh, [Shard(0)]),
            "bias": torch.zeros(4),
            "trainer": {"step": -1, "world": -1},
        }
        dcp.load(target, storage_reader=CkptStoreReader(store, step))
        rows = 64 // world
        mine = full(step)[rank * rows : (rank + 1) * rows]
        assert torch.equal(target["weights"].to_local(), mine), "weights differ"
        assert torch.equal(target["bias"], torch.full((4,), float(step)))
        assert target["trainer"]["step"] == step


dist.init_process_group("gloo", timeout=timedelta(seconds=60))
run(dist.get_world_size(), dist.get_rank(), args.mode, args.step)
if args.then_save is not None:  # one job, as a resumed run loads then saves
    gc.collect()
    run(dist.get_world_size(), dist.get_rank(), "save", args.then_save)
dist.barrier()
# No gloo group may outlive destroy_process_group(): one torn down during interpreter
# finalization aborts the process now and then (its worker threads are still joinable). The
# mesh dies with run(), and the load check reads local shards, since a functional collective
# (DTensor.full_tensor) keeps its group alive past destroy_process_group().
gc.collect()
dist.destroy_process_group()
