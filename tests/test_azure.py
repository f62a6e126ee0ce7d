"""The Azure Blob backend (az://) against Azurite on 127.0.0.1."""

from __future__ import annotations

import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import test_driver_contract as contract
from azure.core.exceptions import ResourceModifiedError, ServiceResponseError

import ckptstore
from ckptstore.backends.azure import (
    AzureBlobDriver,
    decode_metadata,
    encode_metadata,
    open_azure,
    parse_location,
)
from ckptstore.conformance.report import render_text
from ckptstore.conformance.runner import run_backend
from ckptstore.driver import ObjectStoreDriver, PutMode
from ckptstore.errors import (
    BackendUnavailableError,
    InvalidOptionError,
    InvalidURLError,
    ObjectNotFoundError,
    PreconditionFailedError,
    StorageAccessDeniedError,
    StoreNotFoundError,
    TransientStorageError,
)
from ckptstore.tools.embedded_azure import EmbeddedAzure
from ckptstore.urls import parse_url

MiB = 1024 * 1024


def _driver(server: EmbeddedAzure, prefix: str | None = None, **query: object) -> AzureBlobDriver:
    prefix = prefix or f"contract-{os.getpid()}-{secrets.token_hex(4)}"
    driver = ckptstore.open(server.url(prefix, **query), **server.options).strategy.driver
    assert isinstance(driver, AzureBlobDriver)
    return driver


def _names(server: EmbeddedAzure, prefix: str, *, uncommitted: bool = False) -> list[str]:
    include = ["uncommittedblobs"] if uncommitted else None
    with server.client() as client:
        container = client.get_container_client(server.container)
        return sorted(
            b.name for b in container.list_blobs(name_starts_with=prefix, include=include)
        )


# -- the object-store driver contract, on Azurite ------------------------------------------


class TestAzureDriverContract(contract.TestObjectStoreContract):
    """The contract every object-store driver meets, with Azure's answers where they differ
    from S3's: no minimum block size, no "-N" multipart ETags, no upload object to refuse a
    part after an abort (the completion refuses instead), no versioning on Azurite."""

    @pytest.fixture
    def objects(self, azurite: EmbeddedAzure) -> Iterator[ObjectStoreDriver]:
        driver = _driver(azurite, min_part_size=4096)
        yield driver
        for upload in driver.list_multipart_uploads(""):
            driver.abort_multipart(upload.key, upload.upload_id)
        for info in list(driver.list("")):
            driver.delete(info.key)

    @pytest.fixture
    def versions(self) -> ObjectStoreDriver:
        pytest.skip("Azurite 3.37 has no blob versioning; ckptstore offers no az+versioned")

    def test_multipart_is_invisible_until_complete(self, objects: ObjectStoreDriver) -> None:
        size = objects.min_part_size
        upload = objects.create_multipart("big", metadata={"ckptstore-attempt": "x2"})
        first = objects.upload_part("big", upload, 1, b"a" * size)
        second = objects.upload_part("big", upload, 2, b"b" * 3)
        assert list(objects.list("")) == []
        with pytest.raises(ObjectNotFoundError):
            objects.head("big")
        listed = list(objects.list_multipart_uploads(""))
        assert [(u.key, u.upload_id) for u in listed] == [("big", upload)]
        progress = objects.upload_progress(listed[0])
        assert progress.parts == 2 and progress.size == size + 3
        assert abs(progress.last_activity - time.time()) < 60  # the storage's clock
        info = objects.complete_multipart("big", upload, [first, second])
        assert info.etag.startswith('"') and info.size == size + 3
        assert objects.get("big")[0] == b"a" * size + b"b" * 3
        assert dict(objects.head("big").metadata or {}) == {"ckptstore-attempt": "x2"}
        assert list(objects.list_multipart_uploads("")) == []
        with pytest.raises(ObjectNotFoundError):
            objects.upload_progress(listed[0])

    def test_multipart_refuses_small_parts_and_aborts(self, objects: ObjectStoreDriver) -> None:
        """Azure takes blocks of any size; an abort frees the staged blocks, and a completion
        naming freed blocks fails as S3's does for an aborted upload (NoSuchUpload)."""
        upload = objects.create_multipart("big")
        first = objects.upload_part("big", upload, 1, b"a" * 5)
        objects.upload_part("big", upload, 2, b"b" * 5)
        objects.abort_multipart("big", upload)
        assert list(objects.list_multipart_uploads("")) == []
        assert list(objects.list("")) == []  # the empty blob of the abort is gone too
        third = objects.upload_part("big", upload, 3, b"c")
        with pytest.raises(ObjectNotFoundError):
            objects.complete_multipart("big", upload, [first, third])
        with pytest.raises(ObjectNotFoundError):
            objects.head("big")
        objects.abort_multipart("big", upload)
        objects.abort_multipart("big", upload)  # nothing left to free: not an error

    def test_uncommitted_blocks_of_a_dead_upload_are_listed_and_freed(
        self, objects: ObjectStoreDriver, azurite: EmbeddedAzure
    ) -> None:
        upload = objects.create_multipart("dead/shard")
        objects.upload_part("dead/shard", upload, 1, b"x" * 100)
        objects.put("alive", b"y")
        listed = list(objects.list_multipart_uploads(""))
        assert [(u.key, u.upload_id) for u in listed] == [("dead/shard", upload)]
        objects.abort_multipart("dead/shard", upload)
        prefix = objects.prefix  # type: ignore[attr-defined]
        assert _names(azurite, prefix, uncommitted=True) == [f"{prefix}alive"]


# -- conditional writes: what Azurite does not show, injected --------------------------------


class _Replaced:
    """A blob client with ``upload_blob`` replaced."""

    def __init__(self, inner: Any, upload_blob: Any) -> None:
        self.inner, self.upload_blob = inner, upload_blob

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _with_upload(driver: AzureBlobDriver, monkeypatch: pytest.MonkeyPatch, make: Any) -> None:
    real = driver._blob  # the seam between the driver and the SDK

    def blob(key: str) -> Any:
        inner = real(key)
        return _Replaced(inner, make(inner))

    monkeypatch.setattr(driver, "_blob", blob)


def test_a_412_on_create_is_a_refusal_like_azurites_409(
    azurite: EmbeddedAzure, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Real Azure may refuse a create with 412 ConditionNotMet where Azurite answers 409."""
    driver = _driver(azurite)
    driver.put("k", b"first", mode=PutMode.CREATE)
    with pytest.raises(PreconditionFailedError):  # Azurite: 409 BlobAlreadyExists
        driver.put("k", b"second", mode=PutMode.CREATE)

    def refuse_with_412(inner: Any) -> Any:
        def upload_blob(*args: Any, **kwargs: Any) -> Any:
            error = ResourceModifiedError(message="The condition specified was not met.")
            error.status_code, error.error_code = 412, "ConditionNotMet"
            raise error

        return upload_blob

    _with_upload(driver, monkeypatch, refuse_with_412)
    with pytest.raises(PreconditionFailedError) as refused:
        driver.put("k", b"third", mode=PutMode.CREATE)
    assert refused.value.http_status == 412
    monkeypatch.undo()
    assert driver.get("k")[0] == b"first"


def test_a_create_whose_answer_was_lost_is_read_back(
    azurite: EmbeddedAzure, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The put took effect but its answer broke: the read-back finds our bytes (I8); a later
    create of other bytes is refused, never retried into an overwrite."""
    driver = _driver(azurite)

    def lose_the_answer(inner: Any) -> Any:
        def upload_blob(*args: Any, **kwargs: Any) -> Any:
            inner.upload_blob(*args, **kwargs)
            raise ServiceResponseError("Connection reset by peer")

        return upload_blob

    _with_upload(driver, monkeypatch, lose_the_answer)
    info = driver.put("m", b"ours", mode=PutMode.CREATE)
    assert info.size == 4
    monkeypatch.undo()
    _with_upload(driver, monkeypatch, lose_the_answer)
    with pytest.raises(PreconditionFailedError):
        driver.put("m", b"theirs", mode=PutMode.CREATE)
    monkeypatch.undo()
    assert driver.get("m")[0] == b"ours"


def test_large_blobs_are_read_in_parallel_ranges_pinned_to_one_object(
    azurite: EmbeddedAzure,
) -> None:
    store = ckptstore.open(
        azurite.url(f"ranges-{os.getpid()}", part_size=4 * MiB), **azurite.options
    )
    data = bytes(range(256)) * (40 * 4096)  # 40 MiB: five ranges
    store.save(1, {"w": data})
    assert store.latest().read("w") == data
    key = store.latest().shards["w"].locator["key"]
    driver = store.strategy.driver
    with driver.open_read(key) as stream:
        stream.seek(9 * MiB + 5)
        assert stream.read(10) == data[9 * MiB + 5 : 9 * MiB + 15]
    with driver.open_read(key) as stream:  # its first range is read; the others not yet
        assert stream.read(3) == data[:3]
        driver.put(key, b"replaced")
        stream.seek(9 * MiB)
        with pytest.raises(ObjectNotFoundError, match="replaced or deleted while being read"):
            stream.read()


# -- a writer killed mid-save, then GC --------------------------------------------------------

WRITER = textwrap.dedent(
    """
    import sys, time, ckptstore
    store = ckptstore.open(sys.argv[1])
    with store.begin(2) as pending, pending.open_shard("model/rank0.bin") as shard:
        for index in range(1000):
            shard.write(bytes([index % 251]) * (1024 * 1024))
            if index == 6:
                print("uploading", flush=True)
            time.sleep(0.05)
    """
)


def test_sigkill_mid_upload_then_gc_frees_the_staged_blocks(azurite: EmbeddedAzure) -> None:
    prefix = f"killed-{os.getpid()}"
    url = azurite.url(prefix, part_size=MiB, concurrency=2)
    store = ckptstore.open(url, **azurite.options)
    store.save(1, {"model/rank0.bin": b"previous" * 1000})
    driver = store.strategy.driver
    attempt = f"step-{2:020d}."
    with subprocess.Popen(
        [sys.executable, "-c", WRITER, url],
        stdout=subprocess.PIPE,
        env={**os.environ, **azurite.environment()},
    ) as writer:
        assert writer.stdout is not None
        assert writer.stdout.readline().strip() == b"uploading"
        deadline = time.monotonic() + 60
        while not any(u.key.startswith(attempt) for u in driver.list_multipart_uploads("")):
            assert time.monotonic() < deadline, "the writer never staged a block"
            assert writer.poll() is None, "the writer ended before it was killed"
            time.sleep(0.05)  # polling the storage for the state the test needs
        os.kill(writer.pid, signal.SIGKILL)
        writer.wait()
    assert store.latest().step == 1
    (upload,) = [u for u in driver.list_multipart_uploads("") if u.key.startswith(attempt)]
    assert driver.upload_progress(upload).size >= MiB
    assert store.gc().removed == []  # younger than the grace period: it may be alive
    later = ckptstore.open(url, clock=lambda: time.time() + 7200, **azurite.options)
    report = later.gc(grace=timedelta(hours=1))
    assert [item.kind for item in report.removed] == ["attempt"]
    assert report.removed[0].size >= MiB
    assert list(driver.list_multipart_uploads("")) == []
    left = _names(azurite, f"{prefix}/", uncommitted=True)
    assert not [name for name in left if name.startswith(f"{prefix}/{attempt}")], left
    assert store.latest().read("model/rank0.bin") == b"previous" * 1000


# -- the conformance suite ---------------------------------------------------------------------


@pytest.mark.slow  # minutes: every crash point, over HTTP
def test_conformance_holds_on_azurite(azurite: EmbeddedAzure) -> None:
    url = azurite.url(f"conformance-{os.getpid()}", part_size=4096, concurrency=1)
    report = run_backend(url, options=azurite.options, profile="ci")
    text = render_text([report])
    print(text)  # the capability probe table of Azurite, in the test log
    assert not report.storage_errors, f"the embedded server kept failing: {report.storage_errors}"
    assert report.ok, text
    assert all(r.status == "held" for r in report.invariants.values()), text
    declared = {p.capability for p in report.capabilities if p.declared}
    assert {"conditional-create", "compare-and-swap", "multipart"} <= declared


# -- bad input ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "error", "match"),
    [
        ("az://Bad_Container/x", InvalidURLError, "not a valid Azure container"),
        ("az://a/x", InvalidURLError, "not a valid Azure container"),
        ("az://c--c/x", InvalidURLError, "not a valid Azure container"),
        ("az://ckpt@example.com/x", InvalidURLError, "not an Azure storage host"),
        ("abfs://ckpt@Bad_Account.dfs.core.windows.net/x", InvalidURLError, "not a valid storage"),
        ("az://ckpt:secret@acct/x", InvalidURLError, "credentials"),
        ("az://ckpt/x?account_key=s", InvalidOptionError, "do not belong in a URL"),
        ("az://ckpt/x?sas_token=sv%3D1", InvalidOptionError, "do not belong in a URL"),
        ("az://ckpt/x?colour=blue", InvalidOptionError, "unknown option"),
        (
            "az://ckpt@acct.blob.core.windows.net/x?account_name=other",
            InvalidOptionError,
            "the URL names account",
        ),
    ],
)
def test_bad_azure_urls(url: str, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        ckptstore.open(url)


def test_no_account_anywhere_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("AZURE_STORAGE_ACCOUNT", "AZURE_STORAGE_CONNECTION_STRING"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(InvalidOptionError, match="no storage account"):
        ckptstore.open("az://ckpt/x")


@pytest.mark.parametrize(
    ("url", "container", "prefix", "account", "endpoint"),
    [
        ("az://ckpt/runs/r1", "ckpt", "runs/r1", None, None),
        (
            "abfss://ckpt@acct1.dfs.core.windows.net/runs/r1",
            "ckpt",
            "runs/r1",
            "acct1",
            "https://acct1.blob.core.windows.net",
        ),
        (
            "az://ckpt@acct1.blob.core.windows.net/r",
            "ckpt",
            "r",
            "acct1",
            "https://acct1.blob.core.windows.net",
        ),
        (
            "abfs://ckpt@acct1.dfs.core.chinacloudapi.cn/",
            "ckpt",
            "",
            "acct1",
            "https://acct1.blob.core.chinacloudapi.cn",
        ),
        ("az://ckpt@acct1/r", "ckpt", "r", "acct1", None),
    ],
)
def test_url_forms(
    url: str, container: str, prefix: str, account: str | None, endpoint: str | None
) -> None:
    assert parse_location(parse_url(url)) == (container, prefix, account, endpoint)


def test_the_abfs_form_opens_the_same_store(azurite: EmbeddedAzure) -> None:
    prefix = f"forms-{os.getpid()}"
    ckptstore.open(azurite.url(prefix), **azurite.options).save(3, {"w": b"abc"})
    url = (
        f"abfss://{azurite.container}@{azurite.account_name}.dfs.core.windows.net/{prefix}"
        f"?endpoint_url={azurite.endpoint_url}"
    )
    store = ckptstore.open(url, account_key=azurite.account_key)
    assert store.latest().read("w") == b"abc"


def test_connection_string_from_the_environment(
    azurite: EmbeddedAzure, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("AZURE_STORAGE_ACCOUNT", "AZURE_STORAGE_KEY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azurite.connection_string)
    store = ckptstore.open(f"az://{azurite.container}/env-{os.getpid()}")
    store.save(1, {"w": b"x"})
    assert store.latest().read("w") == b"x"


def test_a_client_made_from_the_environment_is_not_reused_once_it_changed(
    azurite: EmbeddedAzure, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found in CI, by test order: a store opened from the environment's connection string
    left its client cached under the URL's (empty) options, and a later store opened with
    no account anywhere got it instead of the "no storage account" error."""
    for name in ("AZURE_STORAGE_ACCOUNT", "AZURE_STORAGE_KEY", "AZURE_STORAGE_SAS_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azurite.connection_string)
    ckptstore.open(f"az://{azurite.container}/env-cache-{os.getpid()}").close()
    monkeypatch.delenv("AZURE_STORAGE_CONNECTION_STRING")
    with pytest.raises(InvalidOptionError, match="no storage account"):
        ckptstore.open(f"az://{azurite.container}/env-cache-{os.getpid()}")


def test_missing_container_is_a_clear_error(azurite: EmbeddedAzure) -> None:
    url = azurite.url("x").replace(f"az://{azurite.container}/", "az://no-such-container/")
    with pytest.raises(StoreNotFoundError, match=r"no-such-container.*does not exist"):
        ckptstore.open(url, **azurite.options)
    with azurite.client() as client:
        assert "no-such-container" not in [c.name for c in client.list_containers()]


def test_wrong_key_is_a_clear_error(azurite: EmbeddedAzure) -> None:
    options = {**azurite.options, "account_key": "d3Jvbmcta2V5"}
    started = time.monotonic()
    with pytest.raises(StorageAccessDeniedError, match="credentials"):
        ckptstore.open(azurite.url("denied"), **options)
    assert time.monotonic() - started < 10


def test_unreachable_endpoint_fails_within_seconds() -> None:
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    started = time.monotonic()
    with pytest.raises(TransientStorageError, match="cannot reach"):
        ckptstore.open(
            f"az://ckpt/run?endpoint_url=http://127.0.0.1:{port}/devstoreaccount1",
            account_key="a2V5",
        )
    assert time.monotonic() - started < 10


def test_open_azure_is_the_registered_factory() -> None:
    from ckptstore.registry import resolve

    assert {resolve(s) for s in ("az", "abfs", "abfss")} == {open_azure}


def test_without_credentials_nor_azure_identity_the_error_says_what_to_do(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in ("AZURE_STORAGE_KEY", "AZURE_STORAGE_SAS_TOKEN", "AZURE_STORAGE_CONNECTION_STRING"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setitem(sys.modules, "azure.identity", None)  # as if not installed
    with pytest.raises(BackendUnavailableError, match="pip install azure-identity"):
        ckptstore.open("az://ckpt@nocredsacct.blob.core.windows.net/x")


@pytest.mark.parametrize(
    "metadata",
    [{"ckptstore-attempt": "x"}, {"a_b": "1", "a-b": "2", "a.b": "3"}, {"9lives": "v"}],
)
def test_metadata_names_survive_azures_identifier_rule(metadata: dict[str, str]) -> None:
    encoded = encode_metadata(metadata)
    assert all(re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name) for name in encoded)
    assert decode_metadata(encoded) == metadata
