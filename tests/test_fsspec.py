"""fsspec+<protocol>:// on real servers (s3fs on moto, gcsfs on fake-gcs-server, adlfs on
Azurite) and on fsspec's local file system, whose create is not atomic: refused for writing,
and caught by the suite when the user overrides the refusal."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from datetime import timedelta
from typing import Any

import fsspec
import pytest
from conftest import extended_conformance, fsspec_s3_options, fsspec_s3_url
from fsspec.implementations.local import LocalFileSystem
from fsspec.registry import known_implementations

import ckptstore
from ckptstore.backends.fsspec import UNSAFE_OPTION, FsspecDriver
from ckptstore.conformance.report import render_text
from ckptstore.conformance.runner import run_backend
from ckptstore.driver import Capability, PutMode
from ckptstore.errors import (
    BackendUnavailableError,
    CapabilityError,
    InvalidOptionError,
    InvalidURLError,
    ObjectNotFoundError,
    PreconditionFailedError,
    StorageAccessDeniedError,
    StoreNotFoundError,
    TransientStorageError,
    UnknownSchemeError,
)
from ckptstore.tools.embedded import EmbeddedS3
from ckptstore.tools.embedded_azure import EmbeddedAzure
from ckptstore.tools.embedded_gcs import EmbeddedGCS

MiB = 1024 * 1024


def _uploads(server: EmbeddedS3, prefix: str) -> list[str]:
    listed = server.client().list_multipart_uploads(Bucket=server.bucket, Prefix=prefix)
    return sorted(item["Key"] for item in listed.get("Uploads", []))


def _keys(server: EmbeddedS3, prefix: str) -> list[str]:
    listed = server.client().list_objects_v2(Bucket=server.bucket, Prefix=prefix)
    return sorted(item["Key"] for item in listed.get("Contents", []))


# -- fsspec's local file system: not atomic, so read-only unless overridden --------------


def test_fsspec_file_is_refused_for_writing_and_says_why(tmp_path: Any) -> None:
    store = ckptstore.open(f"fsspec+file://{tmp_path}/store")  # opening (to read) works
    with pytest.raises(CapabilityError) as refused:
        store.save(1, {"w.bin": b"x"})
    message = str(refused.value)
    assert "not atomic" in message and "two writers can both publish" in message
    assert f"{UNSAFE_OPTION}=true" in message
    assert not os.path.exists(f"{tmp_path}/store")  # nothing was written, not even a probe
    assert store.latest() is None
    with pytest.raises(CapabilityError, match="read-only"):
        store.gc()


def test_fsspec_file_with_the_unsafe_option_saves_and_reads(tmp_path: Any) -> None:
    url = f"fsspec+file://{tmp_path}/store?{UNSAFE_OPTION}=true&part_size=1000"
    store = ckptstore.open(url)
    store.save(1, {"model.bin": b"m" * 5000, "empty.bin": b""})
    store.save(2, {"model.bin": b"n" * 10})
    reader = ckptstore.open(f"fsspec+file://{tmp_path}/store")  # a read-only handle reads
    latest = reader.latest()
    assert latest is not None and latest.step == 2
    assert reader.get(1).read("model.bin") == b"m" * 5000
    assert reader.get(1).read("empty.bin") == b""
    driver = store.strategy.driver
    assert isinstance(driver, FsspecDriver)
    assert Capability.COMPARE_AND_SWAP not in driver.capabilities
    with pytest.raises(CapabilityError, match="no compare-and-swap"):
        driver.put("LATEST", b"9\n", mode=PutMode.update("x"))


def test_latest_is_a_forward_only_overwrite_without_compare_and_swap(tmp_path: Any) -> None:
    store = ckptstore.open(f"fsspec+file://{tmp_path}/store?{UNSAFE_OPTION}=true")
    for step in (1, 2, 3):
        store.save(step, {"w.bin": b"x"})
    strategy = store.strategy
    assert strategy.read_latest_hint() == 3
    strategy.advance_latest_hint(2)  # a slower writer of an older step: never backward
    assert strategy.read_latest_hint() == 3
    store.delete(3, force=True)
    assert store.latest().step == 2


@pytest.fixture
def network_latency_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """Widen the local file system's check-then-write gap to a network file system's (a few
    milliseconds), so that the race, which exists anyway (two winners in 23 of 200 trials of 4
    threads without it), is caught on every run instead of most."""
    real = LocalFileSystem.exists

    def exists(self: LocalFileSystem, path: str, **kwargs: Any) -> bool:
        found = bool(real(self, path, **kwargs))
        if not found:
            time.sleep(0.005)
        return found

    monkeypatch.setattr(LocalFileSystem, "exists", exists)


@pytest.mark.slow  # the whole suite on a local directory
@pytest.mark.usefixtures("network_latency_check")
def test_fsspec_file_unsafe_run_reports_conditional_create_missing_and_i5(tmp_path: Any) -> None:
    started = time.monotonic()
    report = run_backend(f"fsspec+file://{tmp_path}/store?{UNSAFE_OPTION}=true", profile="ci")
    text = render_text([report])
    print(f"fsspec+file (unsafe) conformance: {time.monotonic() - started:.0f} s\n{text}")
    create = next(p for p in report.capabilities if p.capability == "conditional-create")
    assert create.declared and create.measured == "violated", text
    assert "racing conditional creates succeeded on one key" in create.detail, text
    assert "MISSING (declared, not found)" in text
    assert report.invariants["I5"].status == "violated", text
    assert not report.ok


# -- s3fs on moto -----------------------------------------------------------------------


@pytest.mark.slow  # minutes: every crash point, over HTTP
@extended_conformance
def test_conformance_holds_on_fsspec_s3(moto_s3: EmbeddedS3) -> None:
    started = time.monotonic()
    part = max(moto_s3.min_part_size, 4096)
    url = fsspec_s3_url(moto_s3, f"fsspec-conformance-{os.getpid()}", part_size=part,
                        concurrency=1)  # fmt: skip
    report = run_backend(url, options=fsspec_s3_options(moto_s3), profile="ci")
    text = render_text([report])
    print(f"fsspec+s3 (s3fs on moto) conformance: {time.monotonic() - started:.0f} s\n{text}")
    assert not report.storage_errors, text
    assert report.ok, text
    assert all(r.status == "held" for r in report.invariants.values()), text
    declared = {p.capability for p in report.capabilities if p.declared}
    assert declared == {"conditional-create", "multipart", "strong-list-after-write"}


@pytest.mark.slow  # minutes: every crash point, over HTTP
def test_conformance_holds_on_fsspec_gcs(fake_gcs: EmbeddedGCS) -> None:
    started = time.monotonic()
    url = (f"fsspec+gcs://{fake_gcs.bucket}/fsspec-conformance-{os.getpid()}"
           f"?endpoint_url={fake_gcs.endpoint_url}&part_size=4096")  # fmt: skip
    report = run_backend(url, options={"token": "anon"}, profile="ci")
    text = render_text([report])
    print(f"fsspec+gcs (gcsfs on fake-gcs-server) conformance: "
          f"{time.monotonic() - started:.0f} s\n{text}")  # fmt: skip
    assert not report.storage_errors, text
    assert report.ok, text
    assert all(r.status == "held" for r in report.invariants.values()), text
    declared = {p.capability for p in report.capabilities if p.declared}
    assert declared == {"conditional-create", "strong-list-after-write"}


@pytest.mark.slow  # minutes: every crash point, over HTTP
@extended_conformance
def test_conformance_holds_on_fsspec_abfs(azurite: EmbeddedAzure) -> None:
    started = time.monotonic()
    url = f"fsspec+abfs://{azurite.container}/fsspec-conformance-{os.getpid()}?part_size=4096"
    report = run_backend(url, options=_abfs_options(azurite), profile="ci")
    text = render_text([report])
    print(f"fsspec+abfs (adlfs on Azurite) conformance: "
          f"{time.monotonic() - started:.0f} s\n{text}")  # fmt: skip
    assert not report.storage_errors, text
    assert report.ok, text
    assert all(r.status == "held" for r in report.invariants.values()), text
    declared = {p.capability for p in report.capabilities if p.declared}
    assert declared == {"conditional-create", "strong-list-after-write"}


def _abfs_options(azurite: EmbeddedAzure) -> dict[str, Any]:
    return {"connection_string": azurite.connection_string}


def test_fsspec_gcs_and_abfs_save_stream_and_refuse_a_second_publish(
    fake_gcs: EmbeddedGCS, azurite: EmbeddedAzure
) -> None:
    gcs = (f"fsspec+gcs://{fake_gcs.bucket}/fsspec-{os.getpid()}"
           f"?endpoint_url={fake_gcs.endpoint_url}&part_size=65536")  # fmt: skip
    abfs = f"fsspec+abfs://{azurite.container}/fsspec-{os.getpid()}?part_size=65536"
    for url, options in ((gcs, {"token": "anon"}), (abfs, _abfs_options(azurite))):
        store = ckptstore.open(url, **options)
        big = bytes(range(256)) * 1200  # five parts, streamed through fs.open(key, "wb")
        store.save(1, {"big.bin": big, "empty.bin": b""})
        with pytest.raises(ckptstore.CheckpointExistsError):
            store.save(1, {"big.bin": b"other"})
        assert store.latest().read("big.bin") == big
        assert Capability.MULTIPART not in store.strategy.capabilities


def test_fsspec_abfs_bad_container_and_credentials(azurite: EmbeddedAzure) -> None:
    missing = "fsspec+abfs://no-such-container/x"
    with pytest.raises(StoreNotFoundError, match="'no-such-container' does not exist"):
        ckptstore.open(missing, **_abfs_options(azurite))
    wrong = azurite.connection_string.replace(azurite.account_key, "A" * 86 + "==")
    started = time.monotonic()
    with pytest.raises(StorageAccessDeniedError, match="credentials"):
        ckptstore.open(f"fsspec+abfs://{azurite.container}/x", connection_string=wrong)
    assert time.monotonic() - started < 10


def test_fsspec_gcs_missing_bucket(fake_gcs: EmbeddedGCS) -> None:
    url = f"fsspec+gcs://no-such-bucket-here/x?endpoint_url={fake_gcs.endpoint_url}"
    with pytest.raises(StoreNotFoundError, match="'no-such-bucket-here' does not exist"):
        ckptstore.open(url, token="anon")


WRITER = textwrap.dedent(
    """
    import sys, time, ckptstore
    store = ckptstore.open(sys.argv[1])
    with store.begin(2) as pending, pending.open_shard("model/rank0.bin") as shard:
        for index in range(1000):
            shard.write(bytes([index % 251]) * (64 * 1024))
            if index == 12:
                print("uploading", flush=True)
            time.sleep(0.05)
    """
)


def test_sigkill_mid_upload_on_fsspec_s3_then_gc_aborts_the_upload(moto_s3: EmbeddedS3) -> None:
    server = moto_s3
    prefix = f"fsspec-killed-{os.getpid()}"
    url = fsspec_s3_url(server, prefix, part_size=max(server.min_part_size, 65536),
                        concurrency=2)  # fmt: skip
    options = fsspec_s3_options(server)
    store = ckptstore.open(url, **options)
    store.save(1, {"model/rank0.bin": b"previous" * 1000})
    environment = {**os.environ, **server.credentials_env()}  # s3fs signs in through botocore
    with subprocess.Popen(
        [sys.executable, "-c", WRITER, url], stdout=subprocess.PIPE, env=environment
    ) as writer:
        assert writer.stdout is not None
        assert writer.stdout.readline().strip() == b"uploading"
        os.kill(writer.pid, signal.SIGKILL)
        writer.wait()
    assert store.latest().step == 1
    assert _uploads(server, f"{prefix}/step-00000000000000000002.")  # a multipart upload left
    assert store.gc().removed == []  # younger than the grace period: it may be alive
    later = ckptstore.open(url, clock=lambda: time.time() + 7200, **options)
    report = later.gc(grace=timedelta(hours=1))
    assert [item.kind for item in report.removed] == ["attempt"]
    assert _uploads(server, f"{prefix}/") == []
    assert not [k for k in _keys(server, f"{prefix}/") if "step-00000000000000000002." in k]
    assert store.latest().read("model/rank0.bin") == b"previous" * 1000


def test_s3fs_and_boto3_read_each_others_stores(moto_s3: EmbeddedS3) -> None:
    prefix = f"fsspec-shared-{os.getpid()}"
    by_s3fs = ckptstore.open(fsspec_s3_url(moto_s3, prefix), **fsspec_s3_options(moto_s3))
    by_boto3 = ckptstore.open(moto_s3.url(prefix), **moto_s3.options)
    by_s3fs.save(1, {"a.bin": b"from s3fs"})
    by_boto3.save(2, {"a.bin": b"from boto3"})
    assert by_s3fs.latest().read("a.bin") == b"from boto3"
    assert by_boto3.get(1).read("a.bin") == b"from s3fs"


# -- bad input --------------------------------------------------------------------------


def test_unknown_fsspec_protocol_names_the_known_ones() -> None:
    with pytest.raises(UnknownSchemeError, match=r"no protocol 'nosuchfs'.*\bs3\b.*") as raised:
        ckptstore.open("fsspec+nosuchfs://bucket/x")
    assert "gcs" in str(raised.value) and "abfs" in str(raised.value)


def test_missing_implementation_package_names_what_to_install() -> None:
    fsspec.register_implementation(
        "ckptnotinstalled", "ckpt_not_installed_pkg.FS", errtxt="Install ckpt-not-installed-pkg"
    )
    try:
        with pytest.raises(BackendUnavailableError) as raised:
            ckptstore.open("fsspec+ckptnotinstalled://bucket/x")
    finally:
        known_implementations.pop("ckptnotinstalled", None)
    message = str(raised.value)
    assert "pip install 'ckptstore[fsspec]' ckpt_not_installed_pkg" in message


@pytest.mark.parametrize(
    ("url", "error", "match"),
    [
        ("fsspec+s3://bucket/x?secret=s", InvalidOptionError, "do not belong in a URL"),
        ("fsspec+gcs://bucket/x?token=t", InvalidOptionError, "do not belong in a URL"),
        ("fsspec+s3:///", InvalidURLError, "no bucket"),
        ("fsspec+://bucket", UnknownSchemeError, "no ckptstore backend"),
    ],
)
def test_bad_fsspec_urls(url: str, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        ckptstore.open(url)


def test_missing_bucket_is_a_clear_error(moto_s3: EmbeddedS3) -> None:
    url = fsspec_s3_url(moto_s3, "x").replace(f"/{moto_s3.bucket}/", "/no-such-bucket-here/")
    with pytest.raises(StoreNotFoundError, match=r"'no-such-bucket-here' does not exist"):
        ckptstore.open(url, **fsspec_s3_options(moto_s3))


def test_wrong_credentials_are_a_clear_error(seaweedfs_s3: EmbeddedS3) -> None:
    started = time.monotonic()
    options = {**fsspec_s3_options(seaweedfs_s3), "secret": "wrong-secret"}
    with pytest.raises(StorageAccessDeniedError, match="credentials"):
        ckptstore.open(fsspec_s3_url(seaweedfs_s3, "denied"), **options)
    assert time.monotonic() - started < 10


def test_unreachable_endpoint_fails_within_seconds() -> None:
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    started = time.monotonic()
    with pytest.raises(TransientStorageError, match="cannot reach"):
        ckptstore.open(f"fsspec+s3://bucket/run?endpoint_url=http://127.0.0.1:{port}",
                       key="x", secret="y")  # fmt: skip
    assert time.monotonic() - started < 10


def test_a_missing_key_read_after_a_refused_create_is_missing_not_refused(
    moto_s3: EmbeddedS3,
) -> None:
    """Found by the suite's takeover race on s3fs: a taker whose epoch create was refused
    (412) read the record back before the winner's was visible; s3fs's FileNotFoundError,
    raised while that 412 was being handled, was taken for a 412 (PreconditionFailedError),
    and the taker failed instead of learning that another took the epoch."""
    store = ckptstore.open(
        fsspec_s3_url(moto_s3, f"refused-then-missing-{os.getpid()}"),
        **fsspec_s3_options(moto_s3),
    )
    driver = store.strategy.driver
    driver.put("taken.json", b"{}", mode=PutMode.CREATE)
    try:
        driver.put("taken.json", b"{}", mode=PutMode.CREATE)
    except PreconditionFailedError:
        with pytest.raises(ObjectNotFoundError):  # not PreconditionFailedError
            driver.get("not-yet-visible.json")
    else:
        pytest.fail("a create of an existing key was not refused")
    assert store.strategy.read_epoch(7) is None
