"""Incremental saves of a trainer's state (``save_state``, ``AsyncSaver``): a module's frozen
parameters go into tensor parts of their own, which later saves share instead of writing
them again, on file:// (hard links) and on an object store (leased blobs); every load is
bitwise exact (docs/protocol.md §12)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import ckptstore  # noqa: E402
from ckptstore.sharing import storage_use  # noqa: E402
from ckptstore.tools.embedded import EmbeddedS3  # noqa: E402
from ckptstore.torch import AsyncSaver, load_state, save_state  # noqa: E402
from ckptstore.torch.state import PARTS_KEY  # noqa: E402


class LoraLinear(torch.nn.Module):  # type: ignore[misc]
    """A frozen linear layer plus a trainable low-rank update."""

    def __init__(self, width: int, rank: int) -> None:
        super().__init__()
        self.base = torch.nn.Linear(width, width)
        self.base.requires_grad_(False)
        self.down = torch.nn.Parameter(torch.randn(rank, width) * 0.01)
        self.up = torch.nn.Parameter(torch.randn(width, rank) * 0.01)

    def forward(self, x: Any) -> Any:
        return self.base(x) + x @ self.down.T @ self.up.T


def _lora(width: int = 256, layers: int = 3) -> tuple[Any, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(LoraLinear(width, 4) for _ in range(layers)))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    return model, optimizer


def _frozen_bytes(model: Any) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)


def _train(model: Any, optimizer: Any) -> None:
    x = torch.randn(8, model[0].base.in_features)
    model(x).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def _same(a: Any, b: Any) -> None:
    """Two modules' or optimizers' states are bitwise equal."""

    def equal(x: Any, y: Any, path: str) -> None:
        if isinstance(x, torch.Tensor):
            assert isinstance(y, torch.Tensor) and torch.equal(x, y), path
        elif isinstance(x, dict):
            assert isinstance(y, dict) and x.keys() == y.keys(), path
            for key in x:
                equal(x[key], y[key], f"{path}.{key}")
        elif isinstance(x, (list, tuple)):
            assert isinstance(y, (list, tuple)) and len(x) == len(y), path
            for i, (u, v) in enumerate(zip(x, y, strict=True)):
                equal(u, v, f"{path}[{i}]")
        else:
            assert x == y, path

    equal(a.state_dict(), b.state_dict(), "")


@pytest.fixture(params=["file", "s3"])
def where(
    request: pytest.FixtureRequest, tmp_path: Path
) -> tuple[str, dict[str, Any]]:  # a store that shares: a directory, or an S3 prefix
    if request.param == "file":
        return f"file://{tmp_path}/store", {}
    server: EmbeddedS3 = request.getfixturevalue("moto_s3")
    return server.url(f"incremental-torch/{os.getpid()}-{tmp_path.name}"), dict(server.options)


def test_frozen_parameters_are_shared_and_every_step_loads_exact(
    where: tuple[str, dict[str, Any]],
) -> None:
    url, options = where
    store = ckptstore.open(url, incremental=True, **options)
    model, optimizer = _lora()
    frozen_bytes = _frozen_bytes(model)
    saved = {}
    for step in (1, 2, 3):
        _train(model, optimizer)
        save_state(store, step, {"model": model, "optimizer": optimizer})
        saved[step] = {k: v.clone() for k, v in model.state_dict().items()}
    manifests = [store.get(step).manifest for step in (1, 2, 3)]
    for manifest in manifests:  # the frozen tensors apart, the adapters in a part of their own
        assert manifest.metadata[PARTS_KEY] == {"model": 2}
    use = storage_use(store.strategy, manifests[1:])
    assert use.shared[(2, manifests[1].epoch)] >= frozen_bytes
    assert use.listed - use.stored >= frozen_bytes  # stored once for steps 2 and 3
    first = {r.name: r for r in manifests[0].shards}["model.safetensors"]
    third = {r.name: r for r in manifests[2].shards}["model.safetensors"]
    assert (first.crc32c, first.size) == (third.crc32c, third.size)  # the frozen part
    for step in (1, 2, 3):
        fresh, fresh_optimizer = _lora()
        with torch.no_grad():
            for p in fresh.parameters():
                p.add_(1.0)  # differs from what is stored
        load_state(store.get(step), {"model": fresh, "optimizer": fresh_optimizer})
        for key, value in fresh.state_dict().items():
            assert torch.equal(value, saved[step][key]), (step, key)
        assert store.get(step).verify().ok


def test_a_parameter_unfrozen_between_saves_is_saved_with_the_changing_ones(
    tmp_path: Path,
) -> None:
    store = ckptstore.open(f"file://{tmp_path}/store", incremental=True)
    model, optimizer = _lora()
    save_state(store, 1, {"model": model})
    model[0].base.requires_grad_(True)  # the operator unfreezes a layer, then trains it
    optimizer.add_param_group({"params": list(model[0].base.parameters())})
    _train(model, optimizer)
    save_state(store, 2, {"model": model, "optimizer": optimizer})
    model[0].base.requires_grad_(False)
    model[1].base.requires_grad_(False)
    for module in model:
        module.down.requires_grad_(False)  # everything frozen
    save_state(store, 3, {"model": model})
    for step in (1, 2, 3):
        assert store.get(step).verify().ok
    fresh, _ = _lora()
    load_state(store.get(3), {"model": fresh})
    _same(fresh, model)
    assert store.get(3).manifest.metadata[PARTS_KEY] == {"model": 2}


def test_async_saves_share_what_did_not_change(tmp_path: Path) -> None:
    store = ckptstore.open(f"file://{tmp_path}/store", incremental=True)
    model, optimizer = _lora()
    with AsyncSaver(store) as saver:
        for step in (1, 2, 3):
            _train(model, optimizer)
            saver.save(step, {"model": model, "optimizer": optimizer}).result()
    part = [tmp_path / "store" / f"step-{s:020d}" / "data" / "model.safetensors" for s in (2, 3)]
    assert part[0].stat().st_ino == part[1].stat().st_ino  # one file, linked by both
    fresh, fresh_optimizer = _lora()
    load_state(store, {"model": fresh, "optimizer": fresh_optimizer})
    _same(fresh, model)
    _same(fresh_optimizer, optimizer)


def test_a_plain_store_keeps_the_layout_and_loads_exact(tmp_path: Path) -> None:
    store = ckptstore.open(f"file://{tmp_path}/store")
    model, optimizer = _lora()
    _train(model, optimizer)
    save_state(store, 1, {"model": model, "optimizer": optimizer})
    fresh, fresh_optimizer = _lora()
    load_state(store, {"model": fresh, "optimizer": fresh_optimizer})
    _same(fresh, model)
    _same(fresh_optimizer, optimizer)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("mode", ["save", "async_save"])
def test_dcp_saves_share_the_tensors_that_did_not_change(
    where: tuple[str, dict[str, Any]], mode: str
) -> None:
    import torch.distributed.checkpoint as dcp

    from ckptstore.torch.dcp import CkptStoreReader, CkptStoreWriter

    url, options = where
    store = ckptstore.open(url, incremental=True, **options)
    model, optimizer = _lora()
    writer = CkptStoreWriter(store)  # one writer for the run: it knows its last save
    saved = {}
    for step in (1, 2, 3):
        _train(model, optimizer)
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": step}
        if mode == "save":
            dcp.save(state, checkpoint_id=step, storage_writer=writer)
        else:
            dcp.async_save(state, checkpoint_id=step, storage_writer=writer).result()
        saved[step] = {k: v.clone() for k, v in model.state_dict().items()}
    writer.close()
    manifests = [store.get(step).manifest for step in (1, 2, 3)]
    assert "__0_steady.distcp" not in {r.name for r in manifests[0].shards}  # nothing before it
    steady = [{r.name: r for r in m.shards}["__0_steady.distcp"] for m in manifests[1:]]
    frozen_bytes = _frozen_bytes(model)
    assert steady[0].size >= frozen_bytes and (steady[0].crc32c, steady[0].size) == (
        steady[1].crc32c,
        steady[1].size,
    )
    use = storage_use(store.strategy, manifests[1:])
    assert use.listed - use.stored >= frozen_bytes  # stored once for steps 2 and 3
    for step in (1, 2, 3):
        assert store.get(step).verify().ok
        fresh, _ = _lora()
        target = {"model": fresh.state_dict(), "epoch": 0}
        dcp.load(target, storage_reader=CkptStoreReader(store, step))
        assert target["epoch"] == step
        for key, value in target["model"].items():
            assert torch.equal(value, saved[step][key]), (step, key)
