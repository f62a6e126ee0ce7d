"""Incremental saves against plain saves of the same state, on file:// or S3 (issue 28).

    python -m benchmarks.bench_incremental [--base 1G] [--saves 10] [--dir /tmp] [--busy 0]
        [--store file|s3]

``--store s3``: both stores on an embedded S3 server (moto, on 127.0.0.1), where the
incremental store shares blobs under leases (docs/protocol.md §12.3).

Two states, each saved ``--saves`` times into a plain store and into an incremental one,
interleaved save by save:

- **LoRA-style**: a frozen base (8 tensors, ``--base`` in all) that never changes, and 16 MiB
  of adapters plus 32 MiB of their optimizer state, all changed before every save.
- **Everything changes**: the same tensors, every one changed before every save (its first
  bytes are the save's number), where sharing cannot help and hashing must not cost.

Prints the save times (min/median/max; the first incremental save is a full one), the bytes
each save added to the store's storage (unique inodes: a shared shard adds none), the storage
held after the last save, and a load of the last checkpoint of each store.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import tempfile
from collections.abc import Callable

import ckptstore
from ckptstore.tools.embedded import EmbeddedS3, embedded_moto
from ckptstore.tools.timing import busy, measure, print_table, sizes

MiB = 2**20


def _held_by(store: ckptstore.Store, root: str) -> int:
    """Bytes the store holds: its distinct files, or its objects."""
    if root.startswith("file://"):
        path = root.removeprefix("file://")
        return _held(path) if os.path.isdir(path) else 0
    return sum(info.size for info in store.strategy.driver.list(""))


def _held(root: str) -> int:
    """Bytes of the distinct files under ``root`` (a file with several links counts once)."""
    seen: dict[tuple[int, int], int] = {}
    for folder, _, files in os.walk(root):
        for name in files:
            info = os.lstat(os.path.join(folder, name))
            seen[info.st_dev, info.st_ino] = info.st_size
    return sum(seen.values())


def _state(base: int) -> tuple[dict[str, bytearray], list[str]]:
    frozen = {f"base/layer{i}.bin": bytearray(os.urandom(base // 8)) for i in range(8)}
    trained = {f"lora/adapter{i}.bin": bytearray(os.urandom(4 * MiB)) for i in range(4)}
    trained |= {f"optim/state{i}.bin": bytearray(os.urandom(8 * MiB)) for i in range(4)}
    return frozen | trained, list(trained)


def _run(title: str, shards: dict[str, bytearray], changing: list[str], saves: int,
         directory: str, server: EmbeddedS3 | None) -> None:  # fmt: skip
    size = sum(len(b) for b in shards.values())
    with tempfile.TemporaryDirectory(dir=directory) as scratch:
        roots: dict[str, str] = {}
        stores: dict[str, ckptstore.Store] = {}
        for name in ("plain", "incremental"):
            if server is None:
                roots[name] = f"file://{scratch}/{name}"
                options: dict[str, object] = {}
            else:
                roots[name] = server.url(f"bench/{os.path.basename(scratch)}/{name}")
                options = dict(server.options)
            stores[name] = ckptstore.open(roots[name], incremental=name == "incremental", **options)
        plain, incremental = stores["plain"], stores["incremental"]
        added: dict[str, list[int]] = {"plain": [], "incremental": []}

        def saver(name: str, store: ckptstore.Store) -> Callable[[int], None]:
            root = roots[name]

            def save(repeat: int) -> None:
                for shard in changing:  # the save's own bytes in every changed tensor
                    shards[shard][:8] = (repeat * 2 + (name == "plain")).to_bytes(8, "little")
                before = _held_by(store, root)
                store.save(repeat + 1, shards)
                added[name].append(_held_by(store, root) - before)

            return save

        saved = measure(
            {"plain save": saver("plain", plain),
             "incremental save": saver("incremental", incremental)},
            saves,
        )  # fmt: skip
        print_table(title, saved, "plain save", size, layout=_layout(shards))
        for name, growth in added.items():
            later = growth[1:] or growth
            print(
                f"{name}: first save added {growth[0] / MiB:.1f} MiB; later saves added "
                f"{statistics.median(later) / MiB:.1f} MiB (median; changed bytes "
                f"{sum(len(shards[s]) for s in changing) / MiB:.1f} MiB); storage held after "
                f"{saves} saves: {_held_by(stores[name], roots[name]) / MiB:.1f} MiB "
                f"({_held_by(stores[name], roots[name]) / size:.2f}x one checkpoint)"
            )
        buffers = {name: bytearray(len(data)) for name, data in shards.items()}

        def loader(store: ckptstore.Store) -> Callable[[int], None]:
            def load(repeat: int) -> None:
                checkpoint = store.get(saves)
                for name, buffer in buffers.items():
                    checkpoint.read_into(name, buffer)

            return load

        loaded = measure({"plain load": loader(plain), "incremental load": loader(incremental)}, 5)
        print_table(f"{title}: load of the last checkpoint", loaded, "plain load", size)


def _layout(shards: dict[str, bytearray]) -> str:
    counts: dict[int, int] = {}
    for data in shards.values():
        counts[len(data)] = counts.get(len(data), 0) + 1
    return ", ".join(f"{n} x {s // MiB} MiB" for s, n in sorted(counts.items(), reverse=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="1G", help="the frozen base's size")
    parser.add_argument("--saves", type=int, default=10)
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where the stores go")
    parser.add_argument("--busy", type=int, default=0, help="CPU-bound processes beside")
    parser.add_argument("--store", choices=("file", "s3"), default="file")
    args = parser.parse_args()
    base = sizes([args.base])[0]
    with contextlib.ExitStack() as stack:
        server = None
        if args.store == "s3":
            server = stack.enter_context(embedded_moto(min_part_size=5 * MiB))
            print(f"on an embedded S3 server (moto): {server.endpoint_url}")
        stack.enter_context(busy(args.busy))
        shards, trained = _state(base)
        title = "LoRA-style: frozen base, changed adapters"
        _run(title, shards, trained, args.saves, args.dir, server)
        _run("Everything changes", shards, list(shards), args.saves, args.dir, server)


if __name__ == "__main__":
    main()
