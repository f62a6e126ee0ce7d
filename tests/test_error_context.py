"""Errors say in fields what their messages say in words: ``url`` (redacted), ``step``, ``key``.

A caller that handles an error (a trainer retrying another step, a tool reporting which shard is
damaged) reads ``exc.step`` and ``exc.key`` instead of parsing the message; ``exc.url`` is the
store's URL with its secrets shown as ``***``, as the message is.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

import ckptstore
from ckptstore.driver import PutMode
from ckptstore.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    CkptStoreError,
    RefusedError,
    ShardCorruptError,
    ShardExistsError,
    ShardNotFoundError,
    StorageError,
    SupersededError,
)
from ckptstore.tools.embedded import EmbeddedS3


def test_the_common_errors_carry_the_store_the_step_and_the_shard(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/store"
    store = ckptstore.open(url)
    store.save(1, {"model.bin": b"one"})
    store.save(2, {"model.bin": b"two"})
    with pytest.raises(CheckpointNotFoundError) as missing:
        store.get(7)
    assert (missing.value.url, missing.value.step) == (url, 7)
    with pytest.raises(CheckpointExistsError) as exists:
        store.save(2, {"model.bin": b"again"})
    assert (exists.value.url, exists.value.step) == (url, 2)
    with pytest.raises(RefusedError) as refused:
        store.delete(2)
    assert (refused.value.url, refused.value.step) == (url, 2)
    with pytest.raises(ShardNotFoundError) as no_shard:
        store.get(1).read("optimizer.bin")
    assert (no_shard.value.step, no_shard.value.key) == (1, "optimizer.bin")
    pending = store.begin(3)
    pending.write("model.bin", b"a")
    with pytest.raises(ShardExistsError) as twice:
        pending.write("model.bin", b"b")
    assert twice.value.key == "model.bin"
    pending.abort()
    [shard] = [p for p in (tmp_path / "store").rglob("model.bin") if p.parts[-3].endswith("1")]
    shard.write_bytes(b"ONE")
    with pytest.raises(ShardCorruptError) as corrupt:
        store.get(1).read("model.bin")
    assert corrupt.value.key == "model.bin"


def test_a_superseded_writer_is_told_its_store_and_step(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/store"
    zombie = ckptstore.open(url)
    zombie.save(1, {"a": b"1"})
    ckptstore.open(url).take_over(1)
    with pytest.raises(SupersededError) as superseded:
        zombie.save(2, {"a": b"2"})
    assert (superseded.value.url, superseded.value.step) == (url, 2)


def test_the_url_field_is_redacted_and_fields_default_to_none() -> None:
    error = CheckpointNotFoundError(
        "no step 3 in s3://KEY:SECRET@bucket/run", url="s3://KEY:SECRET@bucket/run", step=3
    )
    assert error.url == "s3://KEY:***@bucket/run" and "SECRET" not in str(error)
    assert (error.step, error.key) == (3, None)
    bare = CkptStoreError("something")
    assert (bare.url, bare.step, bare.key) == (None, None, None)
    storage = StorageError(5, "read failed", http_status=503, key="run/step-1/a.bin")
    assert (storage.errno, storage.http_status, storage.key) == (5, 503, "run/step-1/a.bin")
    again = pickle.loads(pickle.dumps(error))  # crosses a process boundary (DCP, ranks)
    assert isinstance(again, CheckpointNotFoundError) and str(again) == str(error)


def test_an_object_stores_translated_errors_name_the_store_and_the_object(
    moto_s3: EmbeddedS3,
) -> None:
    from ckptstore.backends.s3 import S3Driver
    from ckptstore.errors import ObjectNotFoundError, PreconditionFailedError

    url = moto_s3.url("error-context")
    store = ckptstore.open(url, **moto_s3.options)
    driver = store.strategy.driver
    assert isinstance(driver, S3Driver)
    with pytest.raises(ObjectNotFoundError) as missing:
        driver.get("no/such.bin")
    assert missing.value.key == "no/such.bin"
    assert missing.value.url is not None and "error-context" in missing.value.url
    assert moto_s3.options["aws_secret_access_key"] not in missing.value.url
    driver.put("taken.bin", b"1")
    with pytest.raises(PreconditionFailedError) as refused:
        driver.put("taken.bin", b"2", mode=PutMode.CREATE)
    assert (refused.value.key, refused.value.url) == ("taken.bin", missing.value.url)
    with pytest.raises(ObjectNotFoundError) as gone:  # any translated call: the store's URL
        driver.head("no/such.bin")
    assert gone.value.url == missing.value.url


@pytest.mark.parametrize("server", ["moto_s3", "fake_gcs", "azurite"])
def test_every_object_call_names_its_object(server: str, request: pytest.FixtureRequest) -> None:
    """A HEAD, a stream, a ranged read and a part upload name the object
    (``key``, relative to the store) and the store (``url``), on each object store."""
    from ckptstore.backends.object_store import ObjectStoreBase
    from ckptstore.errors import ObjectNotFoundError

    embedded = request.getfixturevalue(server)
    store = ckptstore.open(embedded.url(f"named-{server}"), **embedded.options)
    driver = store.strategy.driver
    assert isinstance(driver, ObjectStoreBase)
    missing = "no/such.bin"
    calls = {
        "head": lambda: driver.head(missing),
        "open_read": lambda: driver.open_read(missing).read(),
    }
    if server == "moto_s3":  # the driver that reads ranges into a buffer
        calls["read_range"] = lambda: driver.read_range(missing, 0, bytearray(4))  # type: ignore[attr-defined]
    for name, call in calls.items():
        with pytest.raises(ObjectNotFoundError) as raised:
            call()
        assert raised.value.key == missing, name
        assert raised.value.url is not None and f"named-{server}" in raised.value.url, name
    upload = driver.create_multipart("parts/big.bin")
    driver.abort_multipart("parts/big.bin", upload)
    if server != "azurite":  # Azure stages blocks on the blob itself: no upload to be gone
        with pytest.raises(ObjectNotFoundError) as no_upload:
            driver.upload_part("parts/big.bin", upload, 1, b"x" * 10)
        assert no_upload.value.key == "parts/big.bin"


@pytest.mark.parametrize("through", ["fsspec+s3", "fsspec+file"])
def test_every_fsspec_call_names_its_object(
    through: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """The generic driver's reads, deletes, streamed writes and conditional completions
    name the object and the store as the native drivers do: through s3fs (S3's own
    multipart calls) and through fsspec's local file system (one stream per shard)."""
    from conftest import fsspec_s3_options, fsspec_s3_url

    from ckptstore.backends.fsspec import UNSAFE_OPTION, FsspecDriver
    from ckptstore.driver import PartInfo
    from ckptstore.errors import ObjectNotFoundError, PreconditionFailedError

    if through == "fsspec+s3":
        server: EmbeddedS3 = request.getfixturevalue("moto_s3")
        store = ckptstore.open(fsspec_s3_url(server, "named-fsspec"), **fsspec_s3_options(server))
        where = "named-fsspec"
    else:
        store = ckptstore.open(f"fsspec+file://{tmp_path}/named?{UNSAFE_OPTION}=true")
        where = "named"
    driver = store.strategy.driver
    assert isinstance(driver, FsspecDriver)
    missing = "no/such.bin"
    calls = {
        "head": lambda: driver.head(missing),
        "open_read": lambda: driver.open_read(missing).read(),
        "upload_part": lambda: driver.upload_part(missing, "no-such-upload", 1, b"x"),
    }
    for name, call in calls.items():
        with pytest.raises(ObjectNotFoundError) as raised:
            call()
        assert raised.value.key == missing, name
        assert raised.value.url is not None and where in raised.value.url, name
    driver.put("taken.bin", b"1")
    with pytest.raises(PreconditionFailedError) as refused:
        driver.put("taken.bin", b"2", mode=PutMode.CREATE)
    assert refused.value.key == "taken.bin"
    if through == "fsspec+s3":  # S3's conditional completion (If-None-Match: *)
        upload = driver.create_multipart("taken.bin")
        part = driver.upload_part("taken.bin", upload, 1, b"2")
        with pytest.raises(PreconditionFailedError) as lost:
            driver.complete_multipart(
                "taken.bin", upload, [PartInfo(1, part.etag, 1)], mode=PutMode.CREATE
            )
        assert lost.value.key == "taken.bin"
        driver.abort_multipart("taken.bin", upload)
