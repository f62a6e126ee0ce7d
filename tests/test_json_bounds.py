"""Every JSON ckptstore reads back is bounded before it is parsed (issue 24, item 17): a
document nested thousands deep (a few KB of ``[``) is a named, ordinary error, never a
RecursionError that makes every command on the store die; a damaged epoch record says which
record, and how to repair it."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
from conftest import BackendUnderTest, S3Backend

import ckptstore
from ckptstore.cli import main
from ckptstore.errors import LineageCorruptError, ManifestCorruptError, NotACheckpointError
from ckptstore.lineage import Epoch
from ckptstore.manifest import Manifest, WriterInfo
from ckptstore.names import new_attempt_id
from ckptstore.store import Store

DEEP = b"[" * 5000 + b"]" * 5000
"""5 KB that make ``json.loads`` raise RecursionError."""

EPOCH_1 = "epoch-00000000000000000001"


def _cli(*words: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err):
        status = main(list(words), out)
    return status, out.getvalue(), err.getvalue()


# -- the parser ----------------------------------------------------------------------------


def test_the_parser_bounds_size_and_depth_before_parsing() -> None:
    from ckptstore.jsonload import JSONDocumentError, load_json, nesting_exceeds

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(1000)  # Python's default: an earlier test (hypothesis) may raise it
    try:
        with pytest.raises(RecursionError):
            json.loads(DEEP)  # what every reader called before
    finally:
        sys.setrecursionlimit(limit)
    with pytest.raises(JSONDocumentError, match="deeper than 64 levels"):
        load_json(DEEP, max_bytes=1 << 20, max_depth=64)
    with pytest.raises(JSONDocumentError, match="larger than 10 bytes"):
        load_json(b'{"a": "12345678"}', max_bytes=10, max_depth=64)
    assert load_json(b"[[1]]", max_bytes=10, max_depth=2) == [[1]]
    with pytest.raises(JSONDocumentError, match="deeper than 1 levels"):
        load_json(b"[[1]]", max_bytes=10, max_depth=1)
    # Brackets inside strings (escaped quotes included) are not nesting.
    text = json.dumps({"k": '[[[[{{{{\\"[[[[', "l": ["]]]]"]})
    assert not nesting_exceeds(text, 2)
    assert load_json(text, max_bytes=1000, max_depth=2)["l"] == ["]]]]"]
    # Escaped backslashes before a quote: the string ends, or does not, as JSON says.
    for value in ("a\\", '\\"[[[[', "[\\", "\\\\"):
        for depth, document in ((1, json.dumps([value])), (2, json.dumps([value, [value]]))):
            assert json.loads(document)[0] == value
            assert nesting_exceeds(document, depth - 1), document
            assert not nesting_exceeds(document, depth), document
    assert nesting_exceeds(json.dumps(["\\"]) + "[" * 100, 50)  # brackets after a string count


def test_the_parser_refuses_what_json_is_not() -> None:
    from ckptstore.jsonload import JSONDocumentError, load_json

    for constant in (b"NaN", b"Infinity", b"-Infinity"):
        with pytest.raises(JSONDocumentError, match="not JSON"):
            load_json(b'{"x": %s}' % constant, max_bytes=100, max_depth=4)
    with pytest.raises(JSONDocumentError, match="key 'a' twice"):
        load_json(b'{"b": 1, "a": 1, "a": 2}', max_bytes=100, max_depth=4)
    with pytest.raises(JSONDocumentError, match="not UTF-8"):
        load_json(b'{"a": "\xff"}', max_bytes=100, max_depth=4)
    with pytest.raises(JSONDocumentError, match="not valid JSON"):
        load_json(b'{"a": ', max_bytes=100, max_depth=4)


def test_a_manifest_that_names_a_key_twice_is_corrupt() -> None:
    now = datetime(2026, 1, 2, tzinfo=timezone.utc)
    manifest = Manifest(
        step=1,
        attempt=new_attempt_id(),
        shards=(),
        writer=WriterInfo("h", 1),
        created_at=now,
        committed_at=now,
    )
    data = manifest.encode()
    assert Manifest.decode(data, where="x").step == 1
    doubled = data.replace(b'"step": 1', b'"step": 2, "step": 1')
    assert doubled != data
    with pytest.raises(ManifestCorruptError, match="x: manifest names the key 'step' twice"):
        Manifest.decode(doubled, where="x")
    with pytest.raises(ManifestCorruptError, match="deeper than"):
        Manifest.decode(DEEP, where="x")


def test_an_epoch_record_nested_deep_is_corrupt_and_says_how_to_repair_it() -> None:
    with pytest.raises(LineageCorruptError) as caught:
        Epoch.decode(DEEP, where="file:///s/epochs/epoch-1", expected=1)
    message = str(caught.value)
    assert message.startswith("file:///s/epochs/epoch-1: epoch record is unreadable")
    assert "ckptstore repair-epoch URL 1 --parent STEP" in message
    assert "\n" not in message


# -- a deep epoch record, end to end ------------------------------------------------------


def _cli_credentials(backend: BackendUnderTest, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CLI signs in to the S3 server as any boto3 program does: from the environment."""
    server = getattr(backend, "server", None)
    if server is not None:
        for name, value in server.credentials_env().items():
            monkeypatch.setenv(name, value)


def _plant_deep_record(backend: BackendUnderTest, store: Store) -> str:
    """Replace epoch 1's record by 5 KB of brackets; return the record's path or key."""
    if backend.name == "file":
        path = os.path.join(backend.root, "epochs", EPOCH_1, "record.json")  # type: ignore[attr-defined]
        with open(path, "wb") as handle:
            handle.write(DEEP)
        return path
    assert isinstance(backend, S3Backend)  # a new version on a versioned bucket: the current
    key = f"epochs/{EPOCH_1}.json"
    backend.client.put_object(
        Bucket=backend.server.bucket, Key=f"{backend.prefix}/{key}", Body=DEEP
    )
    return key


@pytest.mark.parametrize("backend", ["file", "s3"], indirect=True)
def test_a_deeply_nested_epoch_record_is_a_lineage_error_for_every_reader(
    backend: BackendUnderTest, monkeypatch: pytest.MonkeyPatch
) -> None:
    _cli_credentials(backend, monkeypatch)
    store = backend.open()
    store.save(1, {"w": b"1"})
    store.take_over(resumed_from=1)
    store.save(2, {"w": b"2"})
    _plant_deep_record(backend, store)
    fresh = backend.open()
    with pytest.raises(LineageCorruptError, match=EPOCH_1):
        fresh.latest()
    with pytest.raises(LineageCorruptError, match="repair-epoch"):
        backend.open().save(3, {"w": b"3"})
    url = backend.url
    status, out, err = _cli("ls", url)
    assert status == 2 and out == ""
    assert err.startswith("ckptstore: error: ") and EPOCH_1 in err and "repair-epoch" in err
    assert len(err.splitlines()) == 1 and "Recursion" not in err
    status, out, err = _cli("ls", url, "--json")
    assert status == 2 and json.loads(out)["type"] == "LineageCorruptError"
    status, out, err = _cli("gc", url)  # gc goes on, leaving the history's checkpoints alone
    assert status == 0, err
    assert "superseded checkpoints were not collected" in out + err


# -- a deep component shard, through load_state and Lightning ------------------------------


def _republish_with_deep_skeleton(store: Store, step: int, component: str) -> int:
    """Publish the shards of ``step`` again as step + 1, with ``component``'s JSON skeleton
    replaced by 5 KB of brackets: a checkpoint whose every CRC32C is right."""
    source = store.get(step)
    shards = {name: source.read(name) for name in source.shards}
    shards[f"{component}.json"] = DEEP
    store.save(step + 1, shards, metadata=dict(source.metadata))
    return step + 1


@pytest.mark.parametrize("backend", ["file", "s3"], indirect=True)
def test_a_deeply_nested_state_skeleton_is_a_named_error_for_load_state(
    backend: BackendUnderTest,
) -> None:
    torch = pytest.importorskip("torch")
    from ckptstore.torch import load_state, save_state

    store = backend.open()
    save_state(store, 1, {"model": {"w": torch.zeros(2)}})
    step = _republish_with_deep_skeleton(store, 1, "model")
    with pytest.raises(
        ManifestCorruptError, match=re.escape("shard 'model.json': state skeleton nests")
    ):
        load_state(store.get(step), {"model": {}})
    module = torch.nn.Linear(2, 2)  # a Stateful component: read in place, same check first
    save_state(store, 10, {"model": module})
    step = _republish_with_deep_skeleton(store, 10, "model")
    with pytest.raises(ManifestCorruptError, match=f"step {step}: shard 'model.json'"):
        load_state(store.get(step), {"model": module})


def test_a_state_too_deep_to_load_back_is_refused_at_save(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    from ckptstore.errors import InvalidInputError
    from ckptstore.torch import save_state
    from ckptstore.torch.codec import MAX_SKELETON_DEPTH

    store = ckptstore.open(f"file://{tmp_path}/store")
    deep: Any = 1
    for _ in range(MAX_SKELETON_DEPTH + 1):
        deep = [deep]
    with pytest.raises(InvalidInputError, match="could not be loaded back"):
        save_state(store, 1, {"data": {"x": deep}})
    assert store.steps() == []
    shallow: Any = 1
    for _ in range(MAX_SKELETON_DEPTH - 2):
        shallow = [shallow]
    save_state(store, 1, {"data": {"x": shallow}})
    from ckptstore.torch import load_state

    assert load_state(store, {"data": {}})["data"]["x"] == shallow


def test_a_deeply_nested_component_is_a_named_error_for_lightning(tmp_path: Path) -> None:
    pytest.importorskip("pytorch_lightning")
    import torch

    from ckptstore.adapters.lightning import CkptStoreIO

    store = ckptstore.open(f"file://{tmp_path}/store")
    io_ = CkptStoreIO(store)
    pointer = tmp_path / "ckpts" / "step=1.ckpt"
    io_.save_checkpoint({"global_step": 1, "state_dict": {"w": torch.zeros(2)}}, pointer)
    step = _republish_with_deep_skeleton(store, 1, "lightning")
    pointer.write_text(pointer.read_text().replace('"step": 1', f'"step": {step}'))
    with pytest.raises(
        ManifestCorruptError, match=re.escape("shard 'lightning.json': state skeleton")
    ):
        io_.load_checkpoint(pointer)
    pointer.write_bytes(b"{" + DEEP)  # a pointer file nested deep: not a pointer, no crash
    with pytest.raises(NotACheckpointError, match="not a ckptstore pointer"):
        io_.load_checkpoint(pointer)


# -- the way out: ckptstore repair-epoch ----------------------------------------------------


@pytest.mark.parametrize("backend", ["file", "s3", "s3+versioned"], indirect=True)
def test_a_damaged_epoch_record_is_repaired_by_the_command_its_error_names(
    backend: BackendUnderTest, monkeypatch: pytest.MonkeyPatch
) -> None:
    _cli_credentials(backend, monkeypatch)
    store = backend.open()
    for step in (1, 2):
        store.save(step, {"w": bytes([step])})
    store.take_over(resumed_from=1)  # epoch 1 supersedes step 2 of epoch 0
    store.save(3, {"w": b"3"})
    _plant_deep_record(backend, store)
    with pytest.raises(LineageCorruptError):
        backend.open().latest()
    status, out, err = _cli("repair-epoch", backend.url, "1", "--parent", "1", "--json")
    assert status == 0, err
    assert json.loads(out) == {"url": json.loads(out)["url"], "epoch": 1, "parent": 1}
    repaired = backend.open()
    latest = repaired.latest()
    assert latest is not None and latest.step == 3
    assert repaired.steps() == [1, 3]  # the history as it was: step 2 superseded
    assert repaired.lineage().epochs[0].parent == 1
    assert "repaired by ckptstore repair-epoch" in repaired.lineage().epochs[0].note
    repaired.join_epoch(1)  # a fresh handle names its epoch once a store was taken over
    repaired.save(4, {"w": b"4"})
    status, out, err = _cli("ls", backend.url)
    assert status == 0, err
    # An intact record is never changed; a record that does not exist is not damage.
    status, out, err = _cli("repair-epoch", backend.url, "1", "--fresh-start")
    assert status == 2 and "reads back intact" in err and "RefusedError" not in out
    assert backend.open().lineage().epochs[0].parent == 1
    status, out, err = _cli("repair-epoch", backend.url, "2", "--parent", "3")
    assert status == 2 and "no record of epoch 2" in err
    status, out, err = _cli("repair-epoch", backend.url, "1")
    assert status == 2 and "--parent" in err
