"""Tiers: how long the trainer is blocked and how long until durable, against saving straight
to the durable store; file:// fast (a temporary directory) + SeaweedFS durable.

    python benchmarks/bench_tiered.py [--size 512M] [--saves 4] [--dir /local/nvme]

Starts SeaweedFS on 127.0.0.1. Both ways run in this one process, one after the other, on the
same shards: the baseline (``ckptstore.open(durable)``, each save blocks until the durable
publish) and the tiered store (``ckptstore.open(fast, replicate_to=durable)``: each save
blocks until the fast publish; the durable copy is timed from the save's start to the durable
publish). Prints both and the ratios to the baseline (> 1.00x is faster, as in the other
benchmarks). It never fails on time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time

import numpy as np

import ckptstore
from ckptstore.tools.embedded import embedded_seaweedfs
from ckptstore.tools.timing import sizes

MiB = 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="512M", help="bytes per checkpoint (4 shards)")
    parser.add_argument("--saves", type=int, default=4)
    parser.add_argument("--dir", default=None, help="where the fast store lives (default: /tmp)")
    args = parser.parse_args()
    total = sizes([args.size])[0]
    rng = np.random.default_rng(0)
    shards = {f"model/rank{i}.bin": rng.bytes(total // 4) for i in range(4)}
    with embedded_seaweedfs() as server, tempfile.TemporaryDirectory(dir=args.dir) as local:
        options = server.options

        def durable(name: str) -> str:
            return server.url(name, part_size=16 * MiB, concurrency=8)

        direct = ckptstore.open(durable("direct"), **options)
        blocked_direct = []
        for step in range(1, args.saves + 1):
            started = time.perf_counter()
            direct.save(step, shards)
            blocked_direct.append(time.perf_counter() - started)
        direct.close()

        tiered = ckptstore.open(
            f"file://{os.path.join(local, 'fast')}",
            replicate_to=durable("tiered"),
            durable_options=options,
        )
        started_at: dict[int, float] = {}
        durable_at: dict[int, float] = {}
        done = threading.Condition()
        replicate = tiered.replicator.replicate

        def timed_replicate(step: int) -> bool:
            copied = replicate(step)
            with done:
                durable_at[step] = time.perf_counter()
                done.notify_all()
            return copied

        tiered.replicator.replicate = timed_replicate  # type: ignore[method-assign]
        blocked_tiered = []
        for step in range(1, args.saves + 1):
            started_at[step] = time.perf_counter()
            tiered.save(step, shards)
            blocked_tiered.append(time.perf_counter() - started_at[step])
            with done:  # one save per copy: a trainer computing between saves
                done.wait_for(lambda step=step: step in durable_at, timeout=600)
        tiered.close()
        to_durable = [durable_at[s] - started_at[s] for s in sorted(durable_at)]

    size = sum(len(b) for b in shards.values())
    base = statistics.median(blocked_direct)
    rows = [
        ("straight to durable: blocked = durable", base),
        ("tiered: trainer blocked", statistics.median(blocked_tiered)),
        ("tiered: save start to durable publish", statistics.median(to_durable)),
    ]
    print(f"{size / 2**20:.0f} MiB a checkpoint in 4 shards, {args.saves} saves, medians")
    print(f"{'':44} {'seconds':>8} {'GiB/s':>7} {'vs baseline':>12}")
    for label, seconds in rows:
        print(f"{label:44} {seconds:8.3f} {size / 2**30 / seconds:7.2f} {base / seconds:11.2f}x")


if __name__ == "__main__":
    main()
