"""POSIX save and load of a model-sized state: ckptstore against the physical limit and the
usual tools, side by side.

    python benchmarks/bench_posix.py [--size 2G] [--repeats 3] [--dir /path/on/the/disk]

Save contenders: raw sequential write + fsync of the same bytes (the physical limit, the
baseline), ckptstore (8 tensor shards, sync), ckptstore.torch.save_state (safetensors), torch.save
+ fsync, safetensors save_file + fsync, DCP FileSystemWriter (thread counts 1 and 4). Loads
read the disk (the page cache is dropped for each file first), then the page cache (what the
software itself costs): raw read, ckptstore read_into, ckptstore.torch.load_state, torch.load,
safetensors load_file (memory-mapped: it defers the reading to first use), DCP
FileSystemReader.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import warnings

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file

import ckptstore
from ckptstore.tools.timing import evict, fsync_tree, measure, print_table, sizes
from ckptstore.torch import load_state, save_state

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def make_state(total: int) -> dict[str, torch.Tensor]:
    per = total // 8 // 4
    return {f"layer{i}.weight": torch.randn(per) for i in range(8)}


class ExistingModel:
    """A trainer's model as load_state meets it: tensors that exist already (like a module's
    parameters), restored by ``load_state_dict``."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self.tensors)

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for name, tensor in state.items():
            if tensor.data_ptr() != self.tensors[name].data_ptr():  # not read in place
                self.tensors[name].copy_(tensor)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="2G")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()
    total = sizes([args.size])[0]
    root = tempfile.mkdtemp(prefix="ckpt-bench-", dir=args.dir)
    state = make_state(total)
    size = sum(t.numel() * t.element_size() for t in state.values())
    paths = {}

    def fresh(name: str, repeat: int) -> str:
        path = os.path.join(root, f"{name.replace(' ', '_')}-{repeat}")
        if name in paths:
            shutil.rmtree(paths[name], ignore_errors=True)  # this contender's previous save
        paths[name] = path
        os.sync()  # start every contender with no dirty pages left by the previous one
        return path

    def raw_save(repeat: int) -> None:
        path = paths["raw write+fsync"]
        os.makedirs(path)
        fd = os.open(os.path.join(path, "state.bin"), os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        try:
            for tensor in state.values():
                view = memoryview(tensor.numpy()).cast("B")
                while view:
                    view = view[os.write(fd, view[: 64 * 2**20]) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        fsync_tree(path)

    def ckpt_save(repeat: int) -> None:
        store = ckptstore.open(paths["ckptstore"])
        with store.begin(1) as pending:
            for name, tensor in state.items():
                pending.write(name, tensor.numpy())

    def ckpt_torch_save(repeat: int) -> None:
        save_state(ckptstore.open(paths["ckptstore.torch"]), 1, {"model": state}, rng=False)

    def torch_save(repeat: int) -> None:
        path = paths["torch.save+fsync"]
        os.makedirs(path)
        torch.save(state, os.path.join(path, "state.pt"))
        fsync_tree(path)

    def st_save(repeat: int) -> None:
        path = paths["safetensors+fsync"]
        os.makedirs(path)
        save_file(state, os.path.join(path, "state.safetensors"))
        fsync_tree(path)

    def dcp_save(threads: int) -> object:
        def run(repeat: int) -> None:
            path = paths[f"DCP x{threads}"]
            dcp.save(state, storage_writer=dcp.FileSystemWriter(path, thread_count=threads))
            fsync_tree(path)

        return run

    savers = {
        "raw write+fsync": raw_save,
        "ckptstore": ckpt_save,
        "ckptstore.torch": ckpt_torch_save,
        "torch.save+fsync": torch_save,
        "safetensors+fsync": st_save,
        "DCP x1": dcp_save(1),
        "DCP x4": dcp_save(4),
    }
    saved = measure(savers, args.repeats, before=lambda name, r: fresh(name, r))  # type: ignore[arg-type]
    print_table(f"POSIX save, {size / 2**30:.2f} GiB in 8 tensors", saved, "raw write+fsync", size)

    for path in paths.values():
        evict(path)
    buffers = {name: torch.empty_like(t) for name, t in state.items()}

    def raw_load(repeat: int) -> None:
        with open(os.path.join(paths["raw write+fsync"], "state.bin"), "rb", buffering=0) as f:
            for buffer in buffers.values():
                view = memoryview(buffer.numpy()).cast("B")
                while view:
                    view = view[f.readinto(view) :]

    def ckpt_load(repeat: int) -> None:
        checkpoint = ckptstore.open(paths["ckptstore"], create=False).latest()
        assert checkpoint is not None
        for name, buffer in buffers.items():
            checkpoint.read_into(name, buffer.numpy())

    model = ExistingModel(buffers)

    def ckpt_torch_load(repeat: int) -> None:  # into the tensors of a model that exists
        checkpoint = ckptstore.open(paths["ckptstore.torch"], create=False).latest()
        assert checkpoint is not None
        load_state(checkpoint, {"model": model}, rng=False)

    def torch_load(repeat: int) -> None:
        torch.load(os.path.join(paths["torch.save+fsync"], "state.pt"), weights_only=True)

    def st_load(repeat: int) -> None:
        load_file(os.path.join(paths["safetensors+fsync"], "state.safetensors"))

    def dcp_load(repeat: int) -> None:
        target = {name: torch.empty_like(t) for name, t in state.items()}
        dcp.load(target, storage_reader=dcp.FileSystemReader(paths["DCP x4"]))

    loaders = {
        "raw read": raw_load,
        "ckptstore": ckpt_load,
        "ckptstore.torch": ckpt_torch_load,
        "torch.load": torch_load,
        "safetensors": st_load,
        "DCP": dcp_load,
    }
    loaded = measure(
        loaders, args.repeats, before=lambda name, r: [evict(p) for p in paths.values()]
    )
    print_table(
        f"POSIX load, {size / 2**30:.2f} GiB (page cache dropped)", loaded, "raw read", size
    )
    # From the page cache: no disk in the way, so this measures what the software adds
    # (copies, checksums, parsing) and is steady even where the disk is not.
    for loader in loaders.values():
        loader(-1)
    warm = measure(loaders, args.repeats)
    print_table(
        f"POSIX load, {size / 2**30:.2f} GiB (in the page cache: the software's own cost)",
        warm, "raw read", size,
    )  # fmt: skip
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
