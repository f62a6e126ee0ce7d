"""A stray named like a future step never passes for a published one (issue 24, item 10).

An operator's ``mkdir step-00000000000000000040``, a partial copy, a stray
``step-60.epoch-1`` or an object at ``manifests/step-....json`` that is not a manifest holds
the very name the protocol publishes that step under. ``steps()`` and ``ls`` call it a stray;
a save of that step must not call it "already published" (a trainer may take
CheckpointExistsError for "someone else published" and skip, or die at that step on every
restart): it fails with StrayEntryError, naming what to remove, and publishes once it is gone.
"""

from __future__ import annotations

import os
import re
import shutil
from typing import Any

import pytest
from conftest import BackendUnderTest, FileBackend, S3Backend

from ckptstore.errors import CheckpointExistsError, StrayEntryError
from ckptstore.names import checkpoint_token
from ckptstore.store import Store

STRAY_BACKENDS = pytest.mark.parametrize(
    "backend", ["file", "memory", "s3", "s3+versioned"], indirect=True
)


def _save(store: Store, step: int) -> None:
    store.save(step, {"w.bin": bytes([step % 256]) * 100})


def _plant(backend: BackendUnderTest, store: Store, step: int, epoch: int = 0) -> str:
    """Make a stray under the name ``step`` publishes under; return that name (path or key)."""
    token = checkpoint_token(step, epoch)
    if isinstance(backend, FileBackend):
        os.mkdir(os.path.join(backend.root, token))  # an operator's mkdir
        return token
    key = f"manifests/{token}.json"
    if isinstance(backend, S3Backend):
        backend.client.put_object(
            Bucket=backend.server.bucket, Key=f"{backend.prefix}/{key}", Body=b"not a manifest"
        )
    else:
        store.strategy.driver.put(key, b"not a manifest")  # type: ignore[attr-defined]
    return key


def _remove(backend: BackendUnderTest, store: Store, name: str) -> None:
    if isinstance(backend, FileBackend):
        shutil.rmtree(os.path.join(backend.root, name))
    elif isinstance(backend, S3Backend):
        if backend.name == "s3+versioned":  # a plain DELETE only hides it behind a marker
            listed = backend.client.list_object_versions(
                Bucket=backend.server.bucket, Prefix=f"{backend.prefix}/{name}"
            )
            for version in listed.get("Versions", []) + listed.get("DeleteMarkers", []):
                backend.client.delete_object(
                    Bucket=backend.server.bucket, Key=version["Key"], VersionId=version["VersionId"]
                )
        else:
            backend.client.delete_object(
                Bucket=backend.server.bucket, Key=f"{backend.prefix}/{name}"
            )
    else:
        driver: Any = store.strategy.driver
        for info in list(driver.list_versions(name)):
            driver.delete(info.key, version_id=info.version_id)


def _refused(store: Store, step: int, name: str) -> StrayEntryError:
    with pytest.raises(StrayEntryError) as caught:
        _save(store, step)
    error = caught.value
    assert not isinstance(error, (CheckpointExistsError, FileExistsError))
    message = str(error)
    assert f"step {step} was not published" in message and "Remove it" in message
    assert f"{store.strategy.url}/{name} is in the way" in message
    assert "\n" not in message
    return error


@STRAY_BACKENDS
def test_a_stray_named_like_a_future_step_is_named_not_taken_for_a_checkpoint(
    backend: BackendUnderTest,
) -> None:
    store = backend.open()
    _save(store, 30)
    name = _plant(backend, store, 40)
    assert store.steps() == [30]
    assert 40 in {entry.step for entry in store.strays()}
    _refused(store, 40, name)
    _refused(backend.open(), 40, name)  # a restarted trainer: the same answer, not "exists"
    assert store.steps() == [30]
    assert not [n for n in backend.raw_names() if ".pending-" in n]  # the attempt is gone
    _save(store, 50)  # other steps save as ever
    _remove(backend, store, name)
    _save(backend.open(), 40)
    assert store.steps() == [30, 40, 50]
    assert store.get(40).read("w.bin") == bytes([40]) * 100
    with pytest.raises(CheckpointExistsError):  # a published step still is one
        _save(backend.open(), 40)


@STRAY_BACKENDS
def test_a_stray_named_like_a_step_of_the_writers_epoch_is_named(
    backend: BackendUnderTest,
) -> None:
    store = backend.open()
    _save(store, 30)
    epoch = store.take_over(resumed_from=30).number
    name = _plant(backend, store, 60, epoch)
    _refused(store, 60, name)
    _remove(backend, store, name)
    _save(store, 60)
    assert store.steps() == [30, 60]


def test_a_stray_that_appears_after_begin_is_named_at_publish(tmp_path: Any) -> None:
    """The publishing rename itself finds the stray (made while the shards were written)."""
    backend = FileBackend(tmp_path)
    store = backend.open()
    _save(store, 1)
    pending = store.begin(40)
    pending.write("w.bin", b"x" * 100)
    _plant(backend, store, 40)
    with pytest.raises(StrayEntryError, match=re.escape("it has no manifest")):
        pending.publish()
    assert not [n for n in backend.raw_names() if ".pending-" in n]
    # A plain file under the name, and a directory whose manifest does not parse, alike.
    os.rmdir(os.path.join(backend.root, checkpoint_token(40)))
    with open(os.path.join(backend.root, checkpoint_token(40)), "wb"):
        pass
    _refused(store, 40, checkpoint_token(40))
    os.unlink(os.path.join(backend.root, checkpoint_token(40)))
    _save(store, 40)
    with open(os.path.join(backend.root, checkpoint_token(40), "manifest.json"), "r+b") as f:
        f.truncate(10)
    error = _refused(store, 40, checkpoint_token(40))
    assert "its manifest does not read back" in str(error)
