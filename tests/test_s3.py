"""The S3 backend against real S3 servers on 127.0.0.1: moto and SeaweedFS."""

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

import pytest
from conftest import extended_conformance

import ckptstore
from ckptstore import TransientStorageError
from ckptstore.backends.s3 import install_abort_incomplete_uploads_rule
from ckptstore.checksum import Crc32c
from ckptstore.cli import main
from ckptstore.conformance.report import render_text
from ckptstore.conformance.runner import run_backend
from ckptstore.errors import (
    InvalidOptionError,
    InvalidURLError,
    StorageAccessDeniedError,
    StoreNotFoundError,
)
from ckptstore.tools.embedded import EmbeddedS3

MiB = 1024 * 1024


def _keys(server: EmbeddedS3, prefix: str) -> list[str]:
    client = server.client()
    listed = client.list_objects_v2(Bucket=server.bucket, Prefix=prefix)
    return sorted(item["Key"] for item in listed.get("Contents", []))


def _uploads(server: EmbeddedS3, prefix: str) -> list[str]:
    listed = server.client().list_multipart_uploads(Bucket=server.bucket, Prefix=prefix)
    return sorted(item["Key"] for item in listed.get("Uploads", []))


@pytest.mark.slow  # minutes: every crash point, over HTTP
@pytest.mark.parametrize(
    "server_name", ["moto_s3", pytest.param("seaweedfs_s3", marks=extended_conformance)]
)
def test_conformance_holds_on_real_s3_servers(
    server_name: str, request: pytest.FixtureRequest
) -> None:
    server: EmbeddedS3 = request.getfixturevalue(server_name)
    part = max(server.min_part_size, 4096)
    url = server.url(f"conformance-{os.getpid()}", part_size=part, concurrency=1)
    report = run_backend(url, options=server.options, profile="ci")
    text = render_text([report])
    print(text)  # the capability probe table of this server, in the test log
    assert not report.storage_errors, (  # CI's own server failing is not a violation
        f"storage error, not an invariant violation: the embedded server kept failing after "
        f"retries ({'; '.join(report.storage_errors)})\n{text}"
    )
    assert report.ok, text
    assert all(r.status == "held" for r in report.invariants.values()), text
    declared = {p.capability for p in report.capabilities if p.declared}
    assert {"conditional-create", "compare-and-swap", "multipart"} <= declared


def _pattern_chunks(shard: int, total: int, chunk: int = 8 * MiB) -> Any:
    block = bytes((shard * 37 + i) % 256 for i in range(65536)) * (chunk // 65536)
    for offset in range(0, total, chunk):
        yield block[: min(chunk, total - offset)]


@pytest.mark.slow
def test_one_gib_checkpoint_through_seaweedfs_multipart(seaweedfs_s3: EmbeddedS3) -> None:
    server = seaweedfs_s3
    prefix = f"big-{os.getpid()}"
    store = ckptstore.open(server.url(prefix, part_size=16 * MiB), **server.options)
    expected = {}
    with store.begin(1, {"shards": 4}) as pending:
        for shard in range(4):
            crc = Crc32c()
            with pending.open_shard(f"model/rank{shard}.bin") as writer:
                for chunk in _pattern_chunks(shard, 256 * MiB):
                    crc.update(chunk)
                    writer.write(chunk)
            expected[f"model/rank{shard}.bin"] = crc.hexdigest()
    latest = store.latest()
    assert latest is not None
    assert latest.size == 1024 * MiB
    for name, crc_hex in expected.items():
        assert latest.shards[name].crc32c == crc_hex
        reread = Crc32c()
        with latest.open(name) as reader:
            while chunk := reader.read(8 * MiB):
                reread.update(chunk)
        assert reread.size == 256 * MiB
        assert reread.hexdigest() == crc_hex
    # ... and every shard went up as a multipart upload (an ETag of the form "md5-N")
    head = server.client().head_object(
        Bucket=server.bucket, Key=f"{prefix}/{latest.shards['model/rank0.bin'].locator['key']}"
    )
    assert head["ETag"].strip('"').endswith("-16")


WRITER = textwrap.dedent(
    """
    import os, sys, time, ckptstore
    store = ckptstore.open(sys.argv[1])
    with store.begin(2) as pending, pending.open_shard("model/rank0.bin") as shard:
        for index in range(1000):
            shard.write(bytes([index % 251]) * (1024 * 1024))
            if index == 12:
                print("uploading", flush=True)
            time.sleep(0.05)
    """
)


def test_sigkill_mid_upload_then_gc_aborts_the_upload(seaweedfs_s3: EmbeddedS3) -> None:
    server = seaweedfs_s3
    prefix = f"killed-{os.getpid()}"
    url = server.url(prefix, part_size=5 * MiB, concurrency=2)
    store = ckptstore.open(url, **server.options)
    store.save(1, {"model/rank0.bin": b"previous" * 1000})
    environment = {**os.environ, **server.credentials_env()}
    with subprocess.Popen(
        [sys.executable, "-c", WRITER, url], stdout=subprocess.PIPE, env=environment
    ) as writer:
        assert writer.stdout is not None
        assert writer.stdout.readline().strip() == b"uploading"
        os.kill(writer.pid, signal.SIGKILL)
        writer.wait()
    assert store.latest().step == 1
    assert store.latest().read("model/rank0.bin") == b"previous" * 1000
    assert _uploads(server, f"{prefix}/step-00000000000000000002.")  # a multipart upload left
    assert store.gc().removed == []  # younger than the grace period: it may be alive
    later = ckptstore.open(url, clock=lambda: time.time() + 7200, **server.options)
    report = later.gc(grace=timedelta(hours=1))
    assert [item.kind for item in report.removed] == ["attempt"]
    assert _uploads(server, f"{prefix}/") == []
    assert all(not key.startswith(f"{prefix}/step-00000000000000000002.") for key in
               _keys(server, f"{prefix}/"))  # fmt: skip
    assert store.latest().read("model/rank0.bin") == b"previous" * 1000


def test_wrong_credentials_are_a_clear_error(seaweedfs_s3: EmbeddedS3) -> None:
    server = seaweedfs_s3
    options = {**server.options, "aws_secret_access_key": "wrong-secret"}
    started = time.monotonic()
    with pytest.raises(StorageAccessDeniedError, match="credentials"):
        ckptstore.open(server.url("denied"), **options)
    assert time.monotonic() - started < 10
    assert _keys(server, "denied/") == []


@pytest.mark.parametrize(
    ("operation", "listing"),
    [("list_objects_v2", "list"), ("list_object_versions", "list_versions")],
)
def test_a_listing_survives_a_transient_error_between_its_pages(
    moto_s3: EmbeddedS3, operation: str, listing: str
) -> None:
    """A page that fails once is asked for again from its marker: the listing is whole."""
    from botocore.exceptions import ClientError

    store = ckptstore.open(moto_s3.url(f"pages-{operation}"), **moto_s3.options)
    for step in range(1, 8):
        store.save(step, {"w": b"x"})
    driver = store.strategy.driver
    whole = sorted(info.key for info in getattr(driver, listing)(""))
    real = getattr(driver.client, operation)
    calls = []

    def small_pages_and_one_throttle(**kwargs: Any) -> Any:
        calls.append(kwargs)
        if len(calls) == 3:
            error = {"Error": {"Code": "SlowDown", "Message": "slow down"}}
            raise ClientError(error, operation)  # type: ignore[arg-type]
        return real(**kwargs, MaxKeys=2)

    driver.client = _Wrapped(driver.client, operation, small_pages_and_one_throttle)
    try:
        assert sorted(info.key for info in getattr(driver, listing)("")) == whole
    finally:
        driver.client = driver.client.inner
    assert len(whole) >= 8
    assert len(calls) > 3  # several pages, one of them asked for twice


class _Wrapped:
    """A boto3 client with one operation replaced."""

    def __init__(self, inner: Any, operation: str, replacement: Any) -> None:
        self.inner, self._operation, self._replacement = inner, operation, replacement

    def __getattr__(self, name: str) -> Any:
        return self._replacement if name == self._operation else getattr(self.inner, name)


def test_missing_bucket_is_a_clear_error(moto_s3: EmbeddedS3) -> None:
    url = moto_s3.url("x").replace(f"s3://{moto_s3.bucket}/", "s3://no-such-bucket-here/")
    with pytest.raises(StoreNotFoundError, match=r"no-such-bucket-here.*does not exist"):
        ckptstore.open(url, **moto_s3.options)
    assert "no-such-bucket-here" not in [
        b["Name"] for b in moto_s3.client().list_buckets()["Buckets"]
    ]


def test_unreachable_endpoint_fails_within_seconds(moto_s3: EmbeddedS3) -> None:
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    started = time.monotonic()
    with pytest.raises(TransientStorageError, match="cannot reach"):
        ckptstore.open(
            f"s3://bucket/run?endpoint_url=http://127.0.0.1:{port}",
            aws_access_key_id="x",
            aws_secret_access_key="y",
        )
    assert time.monotonic() - started < 10


def test_cli_reports_s3_errors_in_one_line(
    moto_s3: EmbeddedS3, capsys: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = moto_s3.url("x").replace(f"s3://{moto_s3.bucket}/", "s3://absent-bucket/")
    for name, value in moto_s3.credentials_env().items():
        monkeypatch.setenv(name, value)  # and what was there before comes back after
    assert main(["ls", url]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ckptstore: error: ")
    assert "absent-bucket" in err
    assert err.count("\n") == 1


@pytest.mark.parametrize(
    ("url", "error", "match"),
    [
        ("s3://Bad_Bucket/x", InvalidURLError, "not a valid S3 bucket"),
        ("s3://ok-bucket/x?aws_secret_access_key=s", InvalidOptionError, "do not belong in a URL"),
        ("s3://ok-bucket/x?colour=blue", InvalidOptionError, "unknown option"),
        ("s3://ok-bucket/x?addressing_style=sideways", InvalidOptionError, "addressing_style"),
    ],
)
def test_bad_s3_urls(url: str, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        ckptstore.open(url)


def test_lifecycle_rule_is_installed_once_and_keeps_other_rules(moto_s3: EmbeddedS3) -> None:
    client = moto_s3.client()
    other = {
        "ID": "someone-elses",
        "Status": "Enabled",
        "Filter": {"Prefix": "logs/"},
        "Expiration": {"Days": 30},
    }
    client.put_bucket_lifecycle_configuration(
        Bucket=moto_s3.bucket, LifecycleConfiguration={"Rules": [other]}
    )
    url = moto_s3.url("runs/lifecycle")
    first = install_abort_incomplete_uploads_rule(url, days=3, **moto_s3.options)
    install_abort_incomplete_uploads_rule(url, days=3, **moto_s3.options)
    rules = client.get_bucket_lifecycle_configuration(Bucket=moto_s3.bucket)["Rules"]
    assert sorted(r["ID"] for r in rules) == sorted(["someone-elses", first["ID"]])
    ours = next(r for r in rules if r["ID"] == first["ID"])
    assert ours["AbortIncompleteMultipartUpload"]["DaysAfterInitiation"] == 3
    assert ours["Filter"]["Prefix"] == "runs/lifecycle/"


def test_the_private_body_layers_are_the_known_ones(moto_s3: EmbeddedS3) -> None:
    """Canary: ranged reads go straight to the socket below botocore's body (urllib3's
    ``_raw_stream._fp``, ``_fp_bytes_read``: private, behind ``s3._read_body_into`` only).
    A botocore or urllib3 that changed them fails here, loudly; reads stay correct meanwhile
    (they fall back to the body's public ``readinto``), only slower."""
    from ckptstore.backends import s3

    client = moto_s3.client()
    client.put_object(Bucket=moto_s3.bucket, Key="canary/body", Body=b"x" * 100)
    body = client.get_object(Bucket=moto_s3.bucket, Key="canary/body")["Body"]
    try:
        assert s3.direct_body_reads(body), "botocore/urllib3 changed the layers of a body"
    finally:
        body.close()


def test_the_embedded_moto_outlives_its_parents_open_file_limit(tmp_path: Any) -> None:
    """The embedded moto holds more objects, listed by version, than its parent may open
    files: it neither keeps a descriptor per object nor keeps the parent's soft limit (a long
    test session's server answered 500 and stopped accepting connections at 1024)."""
    script = textwrap.dedent(
        """
        import resource
        from ckptstore.tools.embedded import embedded_moto
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (128, hard))
        with embedded_moto() as server:
            client = server.client()
            for index in range(300):
                client.put_object(Bucket=server.bucket, Key=f"k/{index}", Body=b"x" * 65536)
            listed = client.list_object_versions(Bucket=server.bucket, Prefix="k/")
            assert len(listed["Versions"]) == 300, len(listed["Versions"])
            print("served")
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "served"
