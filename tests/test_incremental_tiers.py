"""Tiers and incremental saves (docs/protocol.md §12.4): the replicator shares in the durable
store what it holds already, so an incremental save's replication moves only changed bytes."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from conftest import EmbeddedS3

import ckptstore
from ckptstore.backends.fsspec import UNSAFE_OPTION
from ckptstore.commit.blob_leases import BLOBS

MiB = 2**20


def _durable_bytes(store: ckptstore.Store, where: str, tmp_path: Path) -> int:
    """Bytes the durable store holds: distinct files, or objects."""
    if where == "file":
        seen = {}
        for path in (tmp_path / "durable").rglob("*"):
            if path.is_file():
                info = path.stat()
                seen[info.st_dev, info.st_ino] = info.st_size
        return sum(seen.values())
    return sum(info.size for info in store.strategy.driver.list(""))


@pytest.mark.parametrize("where", ["file", "s3"])
def test_replication_of_an_incremental_save_moves_only_changed_bytes(
    where: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    options: dict[str, Any] = {}
    if where == "file":
        durable_url = f"file://{tmp_path}/durable"
    else:
        server: EmbeddedS3 = request.getfixturevalue("moto_s3")
        durable_url = server.url(f"tiers/{os.getpid()}-{tmp_path.name}")
        options = {"durable_options": dict(server.options)}
    store = ckptstore.open(
        f"file://{tmp_path}/fast", replicate_to=durable_url, incremental=True,
        background=False, **options,
    )  # fmt: skip
    durable = store.replicator.durable
    assert durable.incremental  # the replicator's durable writer shares too
    base = {f"base/{i}.bin": os.urandom(MiB) for i in range(4)}
    grown = []
    try:
        for step in range(1, 5):
            before = _durable_bytes(durable, where, tmp_path)
            adapter = os.urandom(64 * 1024)
            store.save(step, {**base, "lora.bin": adapter})
            store.wait_replicated(timeout=120)
            grown.append(_durable_bytes(durable, where, tmp_path) - before)
            copy = durable.get(step)
            assert copy.read("lora.bin") == adapter and copy.verify().ok
            assert all(copy.read(name) == data for name, data in base.items())
        # the first copy holds the base; each later one only its adapter (and a manifest)
        assert grown[0] >= 4 * MiB
        for growth in grown[1:]:
            assert growth <= 1.05 * 64 * 1024 + 16 * 1024, grown
        if where == "s3":
            shared = {durable.get(s).manifest.shard("base/0.bin").locator["key"] for s in (1, 4)}
            assert len(shared) == 1 and shared.pop().startswith(BLOBS)
    finally:
        store.close()


def test_a_versioned_durable_store_shares_and_one_that_cannot_gets_plain_copies(
    moto_s3: EmbeddedS3, tmp_path: Path
) -> None:
    """A versioned durable bucket shares under leases, pinning versions (§12.3.1); a store
    without compare-and-swap (fsspec+) cannot share: the pair opens, and copies whole."""
    server = moto_s3.versioned_bucket("tiers-versioned")
    durables = {
        "versioned": (server.url(f"v/{tmp_path.name}", scheme="s3+versioned"), server.options),
        "fsspec": (f"fsspec+file://{tmp_path}/durable?{UNSAFE_OPTION}=true", {}),
    }
    for kind, (durable_url, options) in durables.items():
        store = ckptstore.open(
            f"file://{tmp_path}/fast-{kind}", replicate_to=durable_url, incremental=True,
            background=False, durable_options=dict(options),
        )  # fmt: skip
        try:
            assert store.replicator.durable.incremental == (kind == "versioned")
            base = os.urandom(100_000)
            for step in (1, 2):
                store.save(step, {"a": base, "b": os.urandom(100)})
            store.wait_replicated(timeout=60)
            durable = store.replicator.durable
            for step in (1, 2):
                assert durable.get(step).read("a") == base
            keys = {durable.get(s).manifest.shard("a").locator.get("key") for s in (1, 2)}
            if kind == "versioned":
                assert len(keys) == 1 and keys.pop().startswith(BLOBS)
                assert durable.get(2).manifest.shard("a").locator.get("version_id")
        finally:
            store.close()
