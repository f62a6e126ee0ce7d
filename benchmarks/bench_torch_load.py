"""Loading a trainer's state: ckptstore.torch and its DCP reader against a raw read and DCP's
own FileSystemReader, with the memory each one needs beyond the state itself.

    python -m benchmarks.bench_torch_load [--layouts 8x128M,64x16M] [--busy 0,2] [--repeats 5]
        [--dir /path] [--world 2:4]

For each layout (tensor count x size) and each number of busy processes beside (CPU-bound
loops, as a training node has data-loader workers and other ranks), the tables compare loads
from the page cache (each file read once first: what the software costs, not the disk) and
from the disk (the page cache dropped before each load). Contenders, each filling tensors
that exist already:

- raw read: ``readinto`` of one file into preallocated tensors (the baseline);
- ckptstore read_into: the plain API, every shard verified;
- load_state: ``ckptstore.torch.load_state`` into a model's existing tensors;
- DCP FileSystemReader / CkptStoreReader: ``dcp.load`` of the same state saved by DCP.

Peak RSS growth is VmHWM after the load minus RSS before it (the high-water mark is reset
through ``/proc/self/clear_refs``). The resharding run saves a row-sharded DTensor from
``--world`` ranks A and loads it on B ranks (gloo, local processes), and counts the bytes each
reader read against the bytes its ranks needed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import tempfile
import warnings
from collections.abc import Callable

import torch
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

import ckptstore
from benchmarks.bench_posix import ExistingModel
from ckptstore.tools.timing import busy, evict, layout, measure, print_table, sizes
from ckptstore.torch import load_state
from ckptstore.torch.dcp import CkptStoreReader, CkptStoreWriter

warnings.filterwarnings("ignore", message=".*torch.distributed.*")
warnings.filterwarnings("ignore", message=".*process group.*")


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def peak_growth(action: Callable[[], object]) -> int:
    """Bytes by which ``action`` raised this process's peak RSS above its RSS before it."""
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # reset VmHWM to the current RSS
    before = _status_kib("VmRSS")
    action()
    return (_status_kib("VmHWM") - before) * 1024


def local_loads(root: str, count: int, each: int, repeats: int, busy_processes: int) -> None:
    state = {f"layer{i}.weight": torch.randn(each // 4) for i in range(count)}
    size = sum(t.numel() * t.element_size() for t in state.values())
    shape = layout(count, each)
    raw_path = os.path.join(root, "raw.bin")
    with open(raw_path, "wb") as f:
        for tensor in state.values():
            f.write(memoryview(tensor.numpy()).cast("B"))
    plain = ckptstore.open(os.path.join(root, "plain"))
    with plain.begin(1) as pending:
        for name, tensor in state.items():
            pending.write(name, tensor.numpy())
    adapter = ckptstore.open(os.path.join(root, "adapter"))
    from ckptstore.torch import save_state

    save_state(adapter, 1, {"model": state}, rng=False)
    dcp_path = os.path.join(root, "dcp-fs")
    dcp.save(state, storage_writer=dcp.FileSystemWriter(dcp_path), no_dist=True)
    dcp_store = ckptstore.open(os.path.join(root, "dcp-ckptstore"))
    dcp.save(state, storage_writer=CkptStoreWriter(dcp_store), checkpoint_id=1, no_dist=True)
    os.sync()

    target = {name: torch.zeros_like(t) for name, t in state.items()}  # exists, touched
    del state
    model = ExistingModel(target)
    plain_checkpoint = plain.get(1)
    adapter_checkpoint = adapter.get(1)

    def raw(repeat: int) -> None:
        with open(raw_path, "rb", buffering=0) as f:
            for tensor in target.values():
                view = memoryview(tensor.numpy()).cast("B")
                while view:
                    view = view[f.readinto(view) :]

    def plain_read(repeat: int) -> None:
        for name, tensor in target.items():
            plain_checkpoint.read_into(name, tensor.numpy())

    def adapter_load(repeat: int) -> None:
        load_state(adapter_checkpoint, {"model": model}, rng=False)

    def dcp_fs(repeat: int) -> None:
        dcp.load(target, storage_reader=dcp.FileSystemReader(dcp_path), no_dist=True)

    def dcp_ckptstore(repeat: int) -> None:
        dcp.load(target, storage_reader=CkptStoreReader(dcp_store, 1), no_dist=True)

    contenders: dict[str, Callable[[int], object]] = {
        "raw read": raw,
        "ckptstore read_into": plain_read,
        "load_state": adapter_load,
        "DCP FileSystemReader": dcp_fs,
        "DCP CkptStoreReader": dcp_ckptstore,
    }
    plain_ones = {k: v for k, v in contenders.items() if not k.startswith("DCP")}
    for contender in contenders.values():
        contender(-1)  # every file into the page cache
    with busy(busy_processes):
        warm = measure(contenders, repeats)
        cold = measure(plain_ones, repeats, before=lambda name, repeat: evict(root))
    title = f"Load {size / 2**30:.2f} GiB into existing tensors"
    facts = {"layout": shape, "busy": busy_processes}
    print_table(f"{title}, page cache", {k: warm[k] for k in plain_ones}, "raw read", size,
                **facts)  # type: ignore[arg-type]  # fmt: skip
    print_table(f"{title}, page cache, through dcp.load",
                {k: v for k, v in warm.items() if k.startswith("DCP")},
                "DCP FileSystemReader", size, **facts)  # type: ignore[arg-type]  # fmt: skip
    print_table(f"{title}, from the disk (page cache dropped before each load)", cold,
                "raw read", size, **facts)  # type: ignore[arg-type]  # fmt: skip
    if busy_processes:
        return
    print(f"### Peak RSS growth beyond the destination tensors ({size / 2**20:.0f} MiB, {shape})\n")
    print("| contender | peak RSS growth | of the state |")
    print("| --- | --- | --- |")
    for name, contender in contenders.items():
        grown = max(peak_growth(lambda c=contender: c(-1)) for _ in range(2))  # type: ignore[misc]
        print(f"| {name} | {grown / 2**20:.1f} MiB | {grown / size:.1%} |")
    print()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank(
    rank: int, world: int, port: int, url: str, mode: str, rows: int, dim: int, out: object
) -> None:
    import torch.distributed as dist
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        store = ckptstore.open(url)
        full = torch.arange(rows * 1024, dtype=torch.float32).reshape(rows, 1024)
        if mode == "save":
            state = {"weights": distribute_tensor(full, mesh, [Shard(dim)])}
            dcp.save(state, storage_writer=CkptStoreWriter(store), checkpoint_id=1)
        else:
            target = {"weights": distribute_tensor(torch.zeros_like(full), mesh, [Shard(dim)])}
            reader = CkptStoreReader(store, 1)
            dcp.load(target, storage_reader=reader)
            local = target["weights"].to_local()
            width = local.shape[dim]
            assert torch.equal(local, full.narrow(dim, rank * width, width))
            out[rank] = (reader.bytes_read, local.numel() * local.element_size())  # type: ignore[index]
    finally:
        dist.destroy_process_group()


def reshard(root: str, total: int, saved_on: int, loaded_on: int) -> None:
    rows = max(total // 4096 // (saved_on * loaded_on) * (saved_on * loaded_on), 4)
    print(f"### Resharded DCP load: saved on {saved_on} ranks, loaded on {loaded_on}\n")
    print("| sharded by | tensor | bytes needed | bytes read | read / needed |")
    print("| --- | --- | --- | --- | --- |")
    for dim, by in ((0, "rows"), (1, "columns")):
        url = os.path.join(root, f"reshard-{by}")
        manager = mp.Manager()
        out = manager.dict()
        for world, mode in ((saved_on, "save"), (loaded_on, "load")):
            mp.spawn(_rank, args=(world, _free_port(), url, mode, rows, dim, out), nprocs=world)
        read = sum(got for got, _ in out.values())
        needed = sum(need for _, need in out.values())
        print(f"| {by} | {rows} x 1024 float32 | {needed / 2**20:.1f} MiB | "
              f"{read / 2**20:.1f} MiB | {read / needed:.3f}x |")  # fmt: skip
    print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", default="8x128M,64x16M", help="tensor count x size, ...")
    parser.add_argument("--busy", default="0,2", help="busy processes beside, one run each")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", default=None)
    parser.add_argument("--world", default="2:4", help="ranks that save : ranks that load")
    parser.add_argument("--reshard-size", default="256M")
    args = parser.parse_args()
    for shape in args.layouts.split(","):
        count, each = shape.lower().split("x")
        for busy_processes in (int(n) for n in args.busy.split(",")):
            root = tempfile.mkdtemp(prefix="ckpt-bench-load-", dir=args.dir)
            try:
                local_loads(root, int(count), sizes([each])[0], args.repeats, busy_processes)
            finally:
                shutil.rmtree(root, ignore_errors=True)
    if args.world:
        root = tempfile.mkdtemp(prefix="ckpt-bench-load-", dir=args.dir)
        try:
            saved_on, loaded_on = (int(n) for n in args.world.split(":"))
            reshard(root, sizes([args.reshard_size])[0], saved_on, loaded_on)
        finally:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
