"""How costs grow: shards per checkpoint, checkpoints per store, dead attempts for GC.

    python benchmarks/bench_scale.py [--full]

publish + latest() + open with 10, 1,000 and 100,000 shards (file://); latest() with 10, 1,000
and 10,000 published checkpoints on file:// and s3:// (moto; up to 1,000 unless --full);
gc over 1,000 dead attempts (file://).
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time

import ckptstore
from ckptstore.tools.embedded import embedded_moto


def timed(call):  # type: ignore[no-untyped-def]
    started = time.perf_counter()
    result = call()
    return time.perf_counter() - started, result


def shards_scale(root: str) -> None:
    print("| shards | write all | publish | latest() | open all | per shard (publish) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for count in (10, 1000, 100_000):
        store = ckptstore.open(f"{root}/shards-{count}")
        pending = store.begin(1)
        started = time.perf_counter()
        for i in range(count):
            pending.write(f"s/{i:06d}", b"x")
        write = time.perf_counter() - started
        publish, _ = timed(pending.publish)
        latest_s, latest = timed(store.latest)
        started = time.perf_counter()
        for name in latest.names:
            latest.read(name)
        opened = time.perf_counter() - started
        print(f"| {count} | {write:.2f} s | {publish * 1000:.1f} ms | {latest_s * 1000:.1f} ms | "
              f"{opened:.2f} s | {publish / count * 1e6:.1f} us |")  # fmt: skip
    print()


def latest_scale(label: str, open_store, counts) -> None:  # type: ignore[no-untyped-def]
    print(f"| {label}: published checkpoints | latest() | latest() without hint |")
    print("| --- | --- | --- |")
    for count in counts:
        store = open_store(count)
        for step in range(1, count + 1):
            store.save(step, {"a": b"x"})
        samples = [timed(store.latest)[0] for _ in range(5)]
        store.strategy.reset_latest_hint(None)
        cold = [timed(store.latest)[0] for _ in range(3)]
        print(f"| {count} | {sorted(samples)[2] * 1000:.1f} ms | {sorted(cold)[1] * 1000:.1f} ms |")
    print()


def gc_scale(root: str) -> None:
    store = ckptstore.open(f"{root}/gc", clock=lambda: time.time() + 7200)
    store.save(1, {"a": b"x"})
    for step in range(2, 1002):
        store.begin(step).write("a", b"dead")  # writers that died
    seconds, report = timed(store.gc)
    print(f"gc over {len(report.removed)} dead attempts: {seconds:.2f} s "
          f"({seconds / max(1, len(report.removed)) * 1000:.2f} ms each)\n")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="10,000 checkpoints on s3:// too")
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="ckpt-scale-")
    shards_scale(root)
    latest_scale("file://", lambda n: ckptstore.open(f"{root}/latest-{n}"), (10, 1000, 10_000))
    with embedded_moto() as server:
        counts = (10, 1000, 10_000) if args.full else (10, 1000)
        latest_scale(
            "s3:// (moto)",
            lambda n: ckptstore.open(server.url(f"latest-{n}"), **server.options),
            counts,
        )
    gc_scale(root)
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
