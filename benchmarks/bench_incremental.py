"""Incremental saves against plain saves of the same state, on file:// or S3 (issue 28).

    python -m benchmarks.bench_incremental [--base 1G] [--saves 10] [--dir /tmp] [--busy 0]
        [--store file|s3] [--api shards|state]

``--store s3``: both stores on an embedded S3 server (moto, on 127.0.0.1), where the
incremental store shares blobs under leases (docs/protocol.md §12.3).

Two states, each saved ``--saves`` times into a plain store and into an incremental one,
interleaved save by save:

- **LoRA-style**: a frozen base (8 tensors, ``--base`` in all) that never changes, and 16 MiB
  of adapters plus 32 MiB of their optimizer state, all changed before every save.
- **Everything changes**: the same tensors, every one changed before every save (its first
  bytes are the save's number), where sharing cannot help and hashing must not cost.

``--api state``: the same two states as a torch model (frozen linear layers under low-rank
adapters) and its AdamW optimizer, saved with ``ckptstore.torch.save_state`` and loaded with
``load_state`` (the frozen parameters go into tensor parts of their own, which are shared).

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


class Workload:
    """A state saved again and again: ``change`` makes a save's changes, ``save`` and
    ``load`` write and read it back through one store."""

    def __init__(self, size: int, changed: int, layout: str) -> None:
        self.size, self.changed, self.layout = size, changed, layout

    def change(self, repeat: int, plain: bool) -> None:
        raise NotImplementedError

    def save(self, store: ckptstore.Store, step: int) -> None:
        raise NotImplementedError

    def load(self, store: ckptstore.Store, step: int) -> None:
        raise NotImplementedError


class ShardWorkload(Workload):
    """Shards given as buffers to ``Store.save``; the changing ones get the save's number."""

    def __init__(self, shards: dict[str, bytearray], changing: list[str]) -> None:
        size = sum(len(b) for b in shards.values())
        super().__init__(size, sum(len(shards[s]) for s in changing), _layout(shards))
        self.shards, self.changing = shards, changing
        self.buffers = {name: bytearray(len(data)) for name, data in shards.items()}

    def change(self, repeat: int, plain: bool) -> None:
        for shard in self.changing:  # the save's own bytes in every changed tensor
            self.shards[shard][:8] = (repeat * 2 + plain).to_bytes(8, "little")

    def save(self, store: ckptstore.Store, step: int) -> None:
        store.save(step, self.shards)

    def load(self, store: ckptstore.Store, step: int) -> None:
        checkpoint = store.get(step)
        for name, buffer in self.buffers.items():
            checkpoint.read_into(name, buffer)


def _run(title: str, work: Workload, saves: int, directory: str,
         server: EmbeddedS3 | None) -> None:  # fmt: skip
    size = work.size
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
                work.change(repeat, name == "plain")
                before = _held_by(store, root)
                work.save(store, repeat + 1)
                added[name].append(_held_by(store, root) - before)

            return save

        saved = measure(
            {"plain save": saver("plain", plain),
             "incremental save": saver("incremental", incremental)},
            saves,
            before=lambda _name, _repeat: os.sync(),  # no save pays for another's write-back
        )  # fmt: skip
        print_table(title, saved, "plain save", size, layout=work.layout)
        for name, growth in added.items():
            later = growth[1:] or growth
            print(
                f"{name}: first save added {growth[0] / MiB:.1f} MiB; later saves added "
                f"{statistics.median(later) / MiB:.1f} MiB (median; changed bytes "
                f"{work.changed / MiB:.1f} MiB); storage held after "
                f"{saves} saves: {_held_by(stores[name], roots[name]) / MiB:.1f} MiB "
                f"({_held_by(stores[name], roots[name]) / size:.2f}x one checkpoint)"
            )

        def loader(store: ckptstore.Store) -> Callable[[int], None]:
            return lambda _repeat: work.load(store, saves)

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
    parser.add_argument(
        "--api",
        choices=("shards", "state"),
        default="shards",
        help="shards: buffers to Store.save; state: a torch LoRA model and its AdamW state "
        "through ckptstore.torch.save_state/load_state",
    )
    args = parser.parse_args()
    base = sizes([args.base])[0]
    with contextlib.ExitStack() as stack:
        server = None
        if args.store == "s3":
            server = stack.enter_context(embedded_moto(min_part_size=5 * MiB))
            print(f"on an embedded S3 server (moto): {server.endpoint_url}")
        stack.enter_context(busy(args.busy))
        title = "LoRA-style: frozen base, changed adapters"
        if args.api == "state":
            from benchmarks.lora_state import LoraWorkload

            _run(title, LoraWorkload(base, everything=False), args.saves, args.dir, server)
            everything = LoraWorkload(base, everything=True)
            _run("Everything changes", everything, args.saves, args.dir, server)
            return
        shards, trained = _state(base)
        _run(title, ShardWorkload(shards, trained), args.saves, args.dir, server)
        _run("Everything changes", ShardWorkload(shards, list(shards)), args.saves, args.dir,
             server)  # fmt: skip


if __name__ == "__main__":
    main()
