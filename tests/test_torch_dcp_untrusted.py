"""A DCP checkpoint whose non-tensor value was replaced by a malicious ``torch.save`` blob, with
every CRC32C and the manifest's checksum recomputed (it passes ``verify()``): loading it
through ``CkptStoreReader`` refuses it, and nothing in it runs (issue 24, item 15)."""

from __future__ import annotations

import dataclasses
import io
import json
import os
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
import torch.distributed.checkpoint as dcp  # noqa: E402
from conftest import BackendUnderTest, FileBackend, S3Backend  # noqa: E402
from torch.distributed.checkpoint.api import CheckpointException  # noqa: E402

from ckptstore.checksum import crc32c_hex  # noqa: E402
from ckptstore.errors import UnsafePickleError  # noqa: E402
from ckptstore.manifest import Manifest  # noqa: E402
from ckptstore.store import Store  # noqa: E402
from ckptstore.torch.dcp import METADATA_SHARD, CkptStoreReader, CkptStoreWriter  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

STEP = 7
SHARD = "__0.distcp"


class _MakesADirectory:
    """Unpickled with ``weights_only=False``, this runs ``os.mkdir(path)``: the planted code."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.mkdir, (self.path,))


@pytest.fixture(params=["file", "s3"])
def where(request: pytest.FixtureRequest, tmp_path: Path) -> BackendUnderTest:
    if request.param == "file":
        return FileBackend(tmp_path)
    return S3Backend(tmp_path, request.getfixturevalue("moto_s3"))


def _state(note: object = "hello") -> dict[str, Any]:
    return {"w": torch.arange(6.0).reshape(2, 3), "note": note}


def _resign(backend: BackendUnderTest, store: Store, edits: dict[str, bytes]) -> None:
    """Replace shards' bytes and rewrite the manifest to match, as a careful attacker would:
    sizes, CRC32Cs, block CRC32Cs and the manifest's own checksum all recomputed."""
    manifest = store.strategy.read_manifest(STEP)
    records = []
    for record in manifest.shards:
        data = edits.get(record.name)
        if data is None:
            records.append(record)
            continue
        backend.rewrite_shard(store, STEP, record.name, lambda _old, data=data: data)
        blocks = ""
        if record.block_size:
            size = record.block_size
            blocks = "".join(crc32c_hex(data[i : i + size]) for i in range(0, len(data), size))
        records.append(
            dataclasses.replace(
                record, size=len(data), crc32c=crc32c_hex(data), block_crc32c=blocks
            )
        )
    forged = dataclasses.replace(manifest, shards=tuple(records)).encode()
    backend.rewrite_manifest(store, STEP, lambda _old: forged)


def _plant(backend: BackendUnderTest, blob: bytes) -> None:
    """Save a checkpoint through CkptStoreWriter, then point its "note" item at ``blob``."""
    store = backend.open()
    dcp.save(_state(), storage_writer=CkptStoreWriter(store), checkpoint_id=STEP)
    checkpoint = store.get(STEP)
    shard = checkpoint.read(SHARD)
    metadata = json.loads(checkpoint.read(METADATA_SHARD))
    (entry,) = [e for e in metadata["storage_data"] if e["index"]["fqn"] == "note"]
    entry["info"].update(offset=len(shard), length=len(blob))
    _resign(backend, store, {SHARD: shard + blob, METADATA_SHARD: json.dumps(metadata).encode()})


def _failure(caught: pytest.ExceptionInfo[CheckpointException]) -> BaseException:
    (failure,) = caught.value.failures.values()
    return failure[0] if isinstance(failure, tuple) else failure  # (error, frames)


def _torch_save(value: object) -> bytes:
    stream = io.BytesIO()
    torch.save(value, stream)
    return stream.getvalue()


def test_a_planted_pickle_is_refused_and_nothing_in_it_runs(
    where: BackendUnderTest, tmp_path: Path
) -> None:
    marker = tmp_path / "the-payload-ran"
    _plant(where, _torch_save(_MakesADirectory(marker)))
    store = where.open()
    report = store.get(STEP).verify()
    assert not report.problems  # every CRC32C and the manifest checksum hold: not proof of trust
    target = _state(note="")
    with pytest.raises(CheckpointException) as caught:
        dcp.load(target, storage_reader=CkptStoreReader(store))
    failure = _failure(caught)
    assert isinstance(failure, UnsafePickleError), repr(failure)
    message = str(failure)
    assert f"step {STEP}: note" in message and "nothing in it ran" in message
    assert "weights_only=False" in message and "posix.mkdir" in message
    assert not marker.exists()
    assert target["note"] == ""  # nothing loaded into the state either
    # the forgery is real: a caller who opts in to trusting the store runs it
    dcp.load(_state(note=""), storage_reader=CkptStoreReader(store, weights_only=False))
    assert marker.is_dir()


def test_bytes_that_are_no_pickle_are_refused_as_such(where: BackendUnderTest) -> None:
    _plant(where, b"\x80\x02garbage that is no pickle")
    with pytest.raises(CheckpointException) as caught:
        dcp.load(_state(note=""), storage_reader=CkptStoreReader(where.open()))
    assert isinstance(_failure(caught), UnsafePickleError)


@dataclasses.dataclass
class _Schedule:
    """A type of the user's own, allowed with torch.serialization.add_safe_globals."""

    warmup: int


def test_plain_values_and_allowed_types_load_by_default(tmp_path: Path) -> None:
    store = FileBackend(tmp_path).open()
    note = {"lr": 0.1, "betas": [0.9, 0.999], "name": "adamw", "none": None, "t": (1, 2)}
    state = {**_state(note), "schedule": _Schedule(5), "count": 3}
    dcp.save(state, storage_writer=CkptStoreWriter(store), checkpoint_id=STEP)
    zeros = {"lr": 0.0, "betas": [0.0, 0.0], "name": "", "none": 1, "t": (0, 0)}
    target = {**_state(zeros), "schedule": None, "count": 0}
    with pytest.raises(CheckpointException) as caught:  # a type of the user's own: not by default
        dcp.load(target, storage_reader=CkptStoreReader(store))
    assert isinstance(_failure(caught), UnsafePickleError)
    assert "add_safe_globals" in str(_failure(caught))
    with torch.serialization.safe_globals([_Schedule]):
        dcp.load(target, storage_reader=CkptStoreReader(store))
    assert target["note"] == note and target["count"] == 3
    assert target["schedule"] == _Schedule(5)
    assert torch.equal(target["w"], state["w"])


def test_a_stored_dtype_names_a_dtype_and_nothing_else_of_torch(tmp_path: Path) -> None:
    backend = FileBackend(tmp_path)
    store = backend.open()
    dcp.save(_state(), storage_writer=CkptStoreWriter(store), checkpoint_id=STEP)
    metadata = json.loads(store.get(STEP).read(METADATA_SHARD))
    metadata["state_dict_metadata"]["w"]["dtype"] = "load"  # torch.load, not a dtype
    _resign(backend, store, {METADATA_SHARD: json.dumps(metadata).encode()})
    with pytest.raises(CheckpointException, match="'load' is not a torch dtype"):
        dcp.load(_state(), storage_reader=CkptStoreReader(backend.open()))


def test_forged_manifests_still_decode(tmp_path: Path) -> None:
    """The forgery helper keeps manifests valid (a refused manifest would prove nothing)."""
    backend = FileBackend(tmp_path)
    _plant(backend, _torch_save("replaced"))
    store = backend.open()
    path = Path(backend.root) / f"step-{STEP:020d}" / "manifest.json"
    Manifest.decode(path.read_bytes(), where=str(path), expected_step=STEP)
    target = _state(note="")
    dcp.load(target, storage_reader=CkptStoreReader(store))
    assert target["note"] == "replaced"  # plain data a writer may store: loaded
