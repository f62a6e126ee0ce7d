"""A torchrun worker for the multi-rank tests: each rank saves its shard of step N."""

from __future__ import annotations

import argparse
import os
import signal
from datetime import timedelta

import torch
import torch.distributed as dist

import ckptstore
from ckptstore.torch.distributed import save_sharded

parser = argparse.ArgumentParser()
parser.add_argument("--store", required=True)
parser.add_argument("--step", type=int, required=True)
parser.add_argument("--die-rank", type=int, default=-1, help="this rank SIGKILLs itself mid-save")
args = parser.parse_args()

dist.init_process_group("gloo", timeout=timedelta(seconds=60))
rank, world = dist.get_rank(), dist.get_world_size()
store = ckptstore.open(args.store)
weights = torch.full((1000,), float(rank + args.step))


class DyingShard:
    """Chunks of a shard; the process dies after the first one."""

    def __iter__(self):  # type: ignore[no-untyped-def]
        yield weights.numpy().tobytes()[:1000]
        os.kill(os.getpid(), signal.SIGKILL)


shard = DyingShard() if rank == args.die_rank else weights.numpy().tobytes()
checkpoint = save_sharded(
    store, args.step, {f"model/rank{rank:05d}.bin": shard}, metadata={"world": world}
)
assert checkpoint.step == args.step
assert checkpoint.manifest.writer.world_size == world
dist.barrier()
dist.destroy_process_group()
