"""A torchrun worker for the DCP tests: save or load a DTensor-sharded state through ckptstore."""

from __future__ import annotations

import argparse
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
args = parser.parse_args()

dist.init_process_group("gloo", timeout=timedelta(seconds=60))
world, rank = dist.get_world_size(), dist.get_rank()
mesh = init_device_mesh("cpu", (world,))
store = ckptstore.open(args.store)


def full(step: int) -> torch.Tensor:
    return torch.arange(64 * 8, dtype=torch.float32).reshape(64, 8) * (step + 1)


if args.mode == "save":
    state = {
        "weights": distribute_tensor(full(args.step), mesh, [Shard(0)]),
        "bias": torch.full((4,), float(args.step)),
        "trainer": {"step": args.step, "world": world},
    }
    if rank == args.die_rank:
        original = CkptStoreWriter.write_data

        def dying_write(self, plan, planner):  # type: ignore[no-untyped-def]
            os.kill(os.getpid(), signal.SIGKILL)

        CkptStoreWriter.write_data = dying_write  # type: ignore[method-assign]
    dcp.save(state, storage_writer=CkptStoreWriter(store, args.step))
    assert store.latest().step == args.step
else:
    target = {
        "weights": distribute_tensor(torch.zeros(64, 8), mesh, [Shard(0)]),
        "bias": torch.zeros(4),
        "trainer": {"step": -1, "world": -1},
    }
    dcp.load(target, storage_reader=CkptStoreReader(store, args.step))
    assert torch.equal(target["weights"].full_tensor(), full(args.step)), "weights differ"
    assert torch.equal(target["bias"], torch.full((4,), float(args.step)))
    assert target["trainer"]["step"] == args.step
dist.barrier()
dist.destroy_process_group()
