"""Signed checkpoints against unsigned ones: save, and verified load, of 8 tensors on file://.

    python -m benchmarks.bench_signing [--size 1G] [--repeats 5] [--dir /fast/disk]
    python -m benchmarks.bench_signing --on seaweedfs [--size 1G]     # starts SeaweedFS

Baselines (issue 29): an unsigned save (CRC32Cs only), and an unsigned verified load (every
byte checked against its CRC32C). Contenders: a save that records BLAKE3 (or SHA-256) digests
of every 4 MiB block and signs the manifest with Ed25519; a load under ``trust`` (signature
checked, every byte checked against its digest instead of its CRC32C). On file://, loads are
measured from the page cache and with the checkpoint's files dropped from it (``evict``); with
``--on seaweedfs``, the stores are on an S3 server on 127.0.0.1 (the storage, not the CPU,
sets the pace: where ckptstore is used for real). Each save writes a
new step and the one before is deleted, untimed. Then the cost of signing and of checking a
signature, for a small and a large checkpoint's manifest: independent of the data's size.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import torch

import ckptstore
from ckptstore.signing import generate_key
from ckptstore.store import Store
from ckptstore.tools.embedded import embedded_seaweedfs
from ckptstore.tools.timing import evict, measure, print_table, sizes
from ckptstore.torch.state import load_state, save_state

TENSORS = 8


def _state(size: int) -> dict[str, torch.Tensor]:
    count = size // TENSORS // 4
    return {f"layer{i}.weight": torch.randn(count) for i in range(TENSORS)}


class _Model:
    """A trainer's model as ``load_state`` sees it (Stateful): loads land in its own tensors."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.tensors

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for name, tensor in state.items():
            if tensor is not self.tensors[name]:
                self.tensors[name].copy_(tensor)


def _step_dir(store: Store, step: int) -> str:
    return f"{store.url.removeprefix('file://')}/step-{step:020d}"


@contextlib.contextmanager
def _locations(on: str, directory: str | None) -> Iterator[Any]:
    """``open(name, **options)`` of a store named ``name`` on the storage benchmarked."""
    if on == "file":
        with tempfile.TemporaryDirectory(dir=directory) as root:
            yield lambda name, **options: ckptstore.open(f"file://{root}/{name}", **options)
        return
    with embedded_seaweedfs() as server:
        yield lambda name, **options: ckptstore.open(
            server.url(f"signing/{name}", part_size=16 * 2**20, concurrency=8),
            **server.options,
            **options,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--size", default="1G")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where the stores go (default: a temp dir)")
    parser.add_argument("--on", choices=("file", "seaweedfs"), default="file")
    args = parser.parse_args()
    [size] = sizes([args.size])
    key = generate_key()
    state = _state(size)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    with _locations(args.on, args.dir) as location:
        stores = {
            "unsigned save": location("plain"),
            "signed save (blake3)": location("blake3", signing_key=key),
            "signed save (sha256)": location("sha256", signing_key=key, digests="sha256"),
        }
        steps = dict.fromkeys(stores, 0)

        def saver(name: str) -> Any:
            def save(_: int) -> None:
                steps[name] += 1
                save_state(stores[name], steps[name], {"model": _Model(state)}, rng=False)

            return save

        def drop_previous(name: str, _: int) -> None:
            if steps[name] > 1:
                stores[name].delete(steps[name] - 1, force=True)

        saves = measure({n: saver(n) for n in stores}, args.repeats, after=drop_previous)
        print_table(
            f"save of {nbytes / 2**30:.2f} GiB in {TENSORS} tensors on {args.on}, "
            f"{args.repeats} repeats",
            saves,
            baseline="unsigned save",
            size_bytes=nbytes,
        )

        readers = {
            "unsigned verified load": location("plain"),
            "trusted load (blake3)": location("blake3", trust=[key]),
            "trusted load (sha256)": location("sha256", trust=[key]),
        }
        target = _Model({name: torch.empty_like(t) for name, t in state.items()})
        store_of = dict(zip(readers, stores, strict=True))

        def loader(name: str) -> Any:
            def load(_: int) -> None:
                loaded = load_state(readers[name], {"model": target}, rng=False)
                assert loaded["step"] == steps[store_of[name]]

            return load

        for cached in (True, False) if args.on == "file" else (True,):

            def cold(name: str, _: int, cached: bool = cached) -> None:
                if not cached:
                    evict(_step_dir(stores[store_of[name]], steps[store_of[name]]))

            loads = measure({n: loader(n) for n in readers}, args.repeats, before=cold)
            where = "from the page cache" if cached else "with the page cache dropped"
            if args.on != "file":
                where = f"from {args.on}"
            print_table(
                f"verified load {where}, {args.repeats} repeats",
                loads,
                baseline="unsigned verified load",
                size_bytes=nbytes,
            )
        assert all(torch.equal(target.tensors[k], state[k]) for k in state)

        trust = readers["trusted load (blake3)"].trust
        assert trust is not None
        print("### signing cost per manifest (independent of the data's size)\n")
        print("| manifest | shards | sign (median) | check signature (median) |")
        print("| --- | --- | --- | --- |")
        signed = stores["signed save (blake3)"]
        manifest = signed.manifest(steps["signed save (blake3)"])
        _print_signing_cost(f"{nbytes / 2**30:.2f} GiB checkpoint", manifest, key, trust)
        small = location("small", signing_key=key)
        with small.begin(1) as pending:
            pending.write("tiny", b"x" * 1024)
        _print_signing_cost("1 KiB checkpoint", small.manifest(1), key, trust)
    print()


def _print_signing_cost(label: str, manifest: Any, key: Any, trust: Any) -> None:
    sign, check = [], []
    for _ in range(200):
        started = time.perf_counter()
        signed = manifest.signed_by(key)
        sign.append(time.perf_counter() - started)
        started = time.perf_counter()
        signed.check_trust(trust, where="bench")
        check.append(time.perf_counter() - started)
    print(
        f"| {label} ({len(manifest.encode()) / 1024:.0f} KiB manifest) | {len(manifest.shards)} "
        f"| {statistics.median(sign) * 1e6:.0f} us | {statistics.median(check) * 1e6:.0f} us |"
    )


if __name__ == "__main__":
    main()
