"""A torchrun worker: the ranks take a store over once (rank 0 takes, the others join), then
each publishes a step of its own in that epoch; ``--store`` may be a tiered pair's URL.

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
store.save(10 + rank, {f"rank{rank}.bin": bytes([rank]) * 10})
dist.barrier()
store.close()
os.write(1, f"rank {rank} epoch {epoch} fast {fast} durable {durable}\n".encode())
dist.destroy_process_group()
