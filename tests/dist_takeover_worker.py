"""A torchrun worker: the ranks take a store over once (rank 0 takes, the others join), then
each publishes a step of its own in that epoch, one rank after the other (in a tiered pair,
each save durable before the next); ``--store`` may be a tiered pair's URL.

Prints one line per rank: ``rank R epoch E fast F durable D`` (F and D: a pair's two epochs),
in one write(2) of under PIPE_BUF bytes, so the ranks' lines never interleave on the shared pipe
(``print`` writes the text and its newline apart when stdout is unbuffered).
"""

from __future__ import annotations

import argparse
import os
from datetime import timedelta

import torch.distributed as dist

import ckptstore
from ckptstore.torch.agreement import take_over

parser = argparse.ArgumentParser()
parser.add_argument("--store", required=True)
args = parser.parse_args()

dist.init_process_group("gloo", timeout=timedelta(seconds=60))
rank = dist.get_rank()
store = ckptstore.open(args.store)
epoch = take_over(store, resumed_from=1)
if isinstance(store, ckptstore.TieredStore):
    fast, durable = store.fast.epoch, store.durable_epoch
else:
    fast, durable = store.epoch, store.epoch
# One rank after the other, each save durable before the next: a replicator copies only
# checkpoints newer than the durable tier's newest, so rank 1's step 11 copied first would
# leave rank 0's step 10 rightly uncopied (not owed), whichever rank saved it first.
for turn in range(dist.get_world_size()):
    if turn == rank:
        store.save(10 + rank, {f"rank{rank}.bin": bytes([rank]) * 10})
        if isinstance(store, ckptstore.TieredStore):
            store.wait_replicated(timeout=120)
    dist.barrier()
store.close()
os.write(1, f"rank {rank} epoch {epoch} fast {fast} durable {durable}\n".encode())
dist.destroy_process_group()
