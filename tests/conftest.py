"""Backends under test: each one knows how to open a fresh store and how to damage it raw."""

from __future__ import annotations

import dataclasses
import itertools
import os
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import ckptstore
from ckptstore.backends.lustre import LustreStripingWarning
from ckptstore.backends.memory import MemoryDriver, drop_bucket
from ckptstore.conformance.reproducible import same_examples
from ckptstore.store import Store
from ckptstore.tools.embedded import EmbeddedS3, embedded_moto, embedded_seaweedfs
from ckptstore.tools.embedded_azure import EmbeddedAzure, embedded_azurite
from ckptstore.tools.embedded_gcs import EmbeddedGCS, embedded_fake_gcs

# gcsfs reads this when imported: its default (true) probes every bucket over gRPC, which an
# emulator never answers (60 s per call). Set before any test imports gcsfs.
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

EXTENDED = "CKPTSTORE_EXTENDED_CONFORMANCE"
"""Set (to anything) to run the extended tests too: what CI leaves out to stay under 30 min."""


def extended(why: str) -> pytest.MarkDecorator:
    """A test (or case) CI leaves out because other CI tests cover it in part: ``why`` says
    which; it runs with CKPTSTORE_EXTENDED_CONFORMANCE=1."""
    return pytest.mark.skipif(
        not os.environ.get(EXTENDED),
        reason=f"{why}: set {EXTENDED}=1 to run it; CI leaves it out to stay under 30 minutes",
    )


extended_conformance = extended(
    "an extended conformance run (minutes on one emulator, covered in part by the other runs)"
)
"""For a whole-suite run whose driver or server another CI run already covers (fsspec+s3 beside
s3:// on moto, fsspec+abfs beside fsspec+gcs, s3+versioned on SeaweedFS beside moto,
gs+versioned beside s3+versioned on moto and gs:// on fake-gcs-server)."""

_counter = itertools.count()


class BackendUnderTest:
    """A fresh store location on one backend, with raw access for damage and inspection."""

    name = ""

    def __init__(self, tmp_path: Any) -> None:
        self.tmp_path = tmp_path

    url: str

    def open(self, **options: Any) -> Store:
        return ckptstore.open(self.url, **options)

    def raw_names(self) -> list[str]:
        raise NotImplementedError

    def rewrite_shard(self, store: Store, step: int, name: str, edit: Callable[[bytes], bytes]):
        raise NotImplementedError

    def rewrite_manifest(self, store: Store, step: int, edit: Callable[[bytes], bytes]) -> None:
        raise NotImplementedError

    def remove_shard(self, store: Store, step: int, name: str) -> None:
        raise NotImplementedError


class FileBackend(BackendUnderTest):
    name = "file"

    def __init__(self, tmp_path: Any) -> None:
        super().__init__(tmp_path)
        self.root = os.path.join(str(tmp_path), "store")
        self.url = f"file://{self.root}"

    def raw_names(self) -> list[str]:
        names = []
        for directory, subdirs, files in os.walk(self.root):
            rel = os.path.relpath(directory, self.root)
            names += [os.path.normpath(os.path.join(rel, f)) for f in files + subdirs]
        return sorted(names)

    def _shard_path(self, step: int, name: str) -> str:
        return os.path.join(self.root, f"step-{step:020d}", "data", name)

    def rewrite_shard(self, store: Store, step: int, name: str, edit: Callable[[bytes], bytes]):
        path = self._shard_path(step, name)
        with open(path, "rb") as f:
            data = f.read()
        with open(path, "wb") as f:
            f.write(edit(data))

    def rewrite_manifest(self, store: Store, step: int, edit: Callable[[bytes], bytes]) -> None:
        path = os.path.join(self.root, f"step-{step:020d}", "manifest.json")
        with open(path, "rb") as f:
            data = f.read()
        with open(path, "wb") as f:
            f.write(edit(data))

    def remove_shard(self, store: Store, step: int, name: str) -> None:
        os.unlink(self._shard_path(step, name))


class MemoryBackend(BackendUnderTest):
    name = "memory"

    def __init__(self, tmp_path: Any) -> None:
        super().__init__(tmp_path)
        self.bucket = f"test-{os.getpid()}-{next(_counter)}"
        # Small parts so that multi-megabyte shards go through multipart uploads.
        self.url = (
            f"memory://{self.bucket}/runs/r1?min_part_size=65536&part_size=262144&concurrency=3"
        )

    def _driver(self, store: Store) -> MemoryDriver:
        driver = store.strategy.driver  # type: ignore[attr-defined]
        assert isinstance(driver, MemoryDriver)
        return driver

    def raw_names(self) -> list[str]:
        from ckptstore.backends.memory import get_bucket

        bucket = get_bucket(self.bucket)
        return sorted(bucket.objects) + sorted(u.key for u in bucket.uploads.values())

    def _rewrite(self, store: Store, key: str, edit: Callable[[bytes], bytes]) -> None:
        driver = self._driver(store)
        version = driver.bucket.objects[driver.prefix + key][-1]
        version.data = edit(version.data)  # bit rot behind the store's back: etag unchanged

    def rewrite_shard(self, store: Store, step: int, name: str, edit: Callable[[bytes], bytes]):
        manifest = store.strategy.read_manifest(step)
        record = manifest.shard(name)
        assert record is not None
        self._rewrite(store, record.locator["key"], edit)

    def rewrite_manifest(self, store: Store, step: int, edit: Callable[[bytes], bytes]) -> None:
        self._rewrite(store, f"manifests/step-{step:020d}.json", edit)

    def remove_shard(self, store: Store, step: int, name: str) -> None:
        record = store.strategy.read_manifest(step).shard(name)
        assert record is not None
        self._driver(store).delete(record.locator["key"])

    def close(self) -> None:
        drop_bucket(self.bucket)


class LustreBackend(FileBackend):
    """The file layout through ``lustre://`` (no liblustreapi here: default striping)."""

    name = "lustre"

    def __init__(self, tmp_path: Any) -> None:
        super().__init__(tmp_path)
        self.url = f"lustre://{self.root}"

    def open(self, **options: Any) -> Store:
        with warnings.catch_warnings():  # "no liblustreapi", "not on Lustre": known here
            warnings.simplefilter("ignore", LustreStripingWarning)
            return ckptstore.open(self.url, **options)


class VersionedMemoryBackend(MemoryBackend):
    """``memory+versioned://``: manifests pin object versions (the damage edits a version's
    bytes in place, as bit rot would)."""

    name = "memory+versioned"

    def __init__(self, tmp_path: Any) -> None:
        super().__init__(tmp_path)
        self.url = self.url.replace("memory://", "memory+versioned://", 1)

    def remove_shard(self, store: Store, step: int, name: str) -> None:
        record = store.strategy.read_manifest(step).shard(name)
        assert record is not None  # the pinned version itself, not a delete marker over it
        locator = record.locator
        self._driver(store).delete(locator["key"], version_id=locator["version_id"])


class S3Backend(BackendUnderTest):
    name = "s3"

    def __init__(self, tmp_path: Any, server: EmbeddedS3) -> None:
        super().__init__(tmp_path)
        self.server = server
        self.prefix = f"runs/test-{os.getpid()}-{next(_counter)}"
        part = max(server.min_part_size, 65536)
        self.url = server.url(self.prefix, part_size=part, concurrency=3)
        self.client = server.client()

    def open(self, **options: Any) -> Store:
        return ckptstore.open(self.url, **{**self.server.options, **options})

    def raw_names(self) -> list[str]:
        listed = self.client.list_objects_v2(Bucket=self.server.bucket, Prefix=self.prefix + "/")
        uploads = self.client.list_multipart_uploads(
            Bucket=self.server.bucket, Prefix=self.prefix + "/"
        )
        return sorted(o["Key"] for o in listed.get("Contents", [])) + sorted(
            u["Key"] for u in uploads.get("Uploads", [])
        )

    def _rewrite(self, key: str, edit: Callable[[bytes], bytes]) -> None:
        full = f"{self.prefix}/{key}"
        body = self.client.get_object(Bucket=self.server.bucket, Key=full)["Body"].read()
        self.client.put_object(Bucket=self.server.bucket, Key=full, Body=edit(body))

    def rewrite_shard(self, store: Store, step: int, name: str, edit: Callable[[bytes], bytes]):
        record = store.strategy.read_manifest(step).shard(name)
        assert record is not None
        self._rewrite(record.locator["key"], edit)

    def rewrite_manifest(self, store: Store, step: int, edit: Callable[[bytes], bytes]) -> None:
        self._rewrite(f"manifests/step-{step:020d}.json", edit)

    def remove_shard(self, store: Store, step: int, name: str) -> None:
        record = store.strategy.read_manifest(step).shard(name)
        assert record is not None
        self.client.delete_object(
            Bucket=self.server.bucket, Key=f"{self.prefix}/{record.locator['key']}"
        )


LONGEST_FIRST = (
    "tests/test_torch.py",
    "tests/test_versioned.py",
    "tests/test_azure.py",
    "tests/test_s3.py",
    "tests/test_gcs.py",
    "tests/test_torch_distributed.py",
)
"""Files whose slow tests took longest in CI (three to five minutes each on three workers: the
killed trainers, the whole-suite runs on moto, Azurite and fake-gcs-server): run first."""


def _order(item: pytest.Item) -> tuple[bool, int]:
    path = f"tests/{item.path.name}"
    rank = LONGEST_FIRST.index(path) if path in LONGEST_FIRST else len(LONGEST_FIRST)
    return item.get_closest_marker("slow") is None, rank


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests marked ``slow`` run first, the longest of them first, in collection order
    otherwise.

    ``.ci/run`` uses ``--dist worksteal``: each worker starts on a third of this list, and a
    worker that finishes its share takes tests from the end of another's. So the first worker
    starts on the slow tests while the others run short ones beside it (mixing a whole-suite
    run's CPU with tests that wait on servers), and what is taken from its end late is the
    shortest of them: a five-minute test left to the end would run alone while the others
    idle. Every worker sorts the same way, so collections still agree.
    """
    items.sort(key=_order)


@pytest.fixture(scope="session", autouse=True)
def _same_examples() -> Iterator[None]:
    """Every derandomized hypothesis run explores the same examples whichever tests ran before
    it in this worker (hypothesis would otherwise draw constants from whatever local modules
    are imported by then): see ckptstore.conformance.reproducible."""
    with same_examples():
        yield


@pytest.fixture(scope="session")
def moto_server() -> Iterator[EmbeddedS3]:
    """moto's S3 server on 127.0.0.1 for the whole session (tests take ``moto_s3``)."""
    with embedded_moto() as server:
        yield server


@dataclasses.dataclass(frozen=True)
class OwnBucketS3(EmbeddedS3):
    """The session's moto server with a bucket of one test's own: the buckets it makes
    (``versioned_bucket``) are named after that bucket, so they are the test's own too."""

    def versioned_bucket(self, name: str) -> EmbeddedS3:
        return super().versioned_bucket(f"{self.bucket}-{name}"[:63])


@pytest.fixture
def moto_s3(moto_server: EmbeddedS3) -> Iterator[EmbeddedS3]:
    """moto's S3 server with buckets of this test's own, emptied and removed after it.

    moto lists object versions by copying every object of the bucket, under the embedded
    server's one lock (ckptstore.tools.moto_atomic): in one bucket shared by a whole session,
    each listing took seconds by the end of it, held up every other request meanwhile, and
    failed tests that had nothing to do with it (a read timeout, a 500)."""
    server = OwnBucketS3(**dataclasses.asdict(moto_server))
    server = dataclasses.replace(server, bucket=f"t{os.getpid()}-{next(_counter)}")
    client = server.client()
    client.create_bucket(Bucket=server.bucket)
    yield server
    for bucket in client.list_buckets()["Buckets"]:
        if bucket["Name"] == server.bucket or bucket["Name"].startswith(f"{server.bucket}-"):
            _remove_bucket(client, bucket["Name"])


def _remove_bucket(client: Any, bucket: str) -> None:
    """Empty the bucket and delete it; one that a test's leftover thread writes into again
    meanwhile is left there (it costs the server memory, never a test its result)."""
    from botocore.exceptions import ClientError

    for _ in range(3):
        try:
            _empty_and_delete(client, bucket)
            return
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") != "BucketNotEmpty":
                raise


def _empty_and_delete(client: Any, bucket: str) -> None:
    """Delete every object version, upload and the bucket itself (what a test left there)."""
    for page in client.get_paginator("list_object_versions").paginate(Bucket=bucket):
        versions = page.get("Versions", []) + page.get("DeleteMarkers", [])
        if versions:
            objects = [{"Key": v["Key"], "VersionId": v["VersionId"]} for v in versions]
            client.delete_objects(Bucket=bucket, Delete={"Objects": objects, "Quiet": True})
    for page in client.get_paginator("list_multipart_uploads").paginate(Bucket=bucket):
        for upload in page.get("Uploads", []):
            client.abort_multipart_upload(
                Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"]
            )
    client.delete_bucket(Bucket=bucket)


@pytest.fixture(scope="session")
def fake_gcs() -> Iterator[EmbeddedGCS]:
    """fake-gcs-server on 127.0.0.1 (in memory, HTTP) for the whole session."""
    with embedded_fake_gcs() as server:
        yield server


@pytest.fixture(scope="session")
def seaweedfs_s3() -> Iterator[EmbeddedS3]:
    """A SeaweedFS server on 127.0.0.1 for the whole session."""
    with embedded_seaweedfs() as server:
        yield server


class VersionedS3Backend(S3Backend):
    """``s3+versioned://`` on moto: manifests pin object versions. A stored version cannot
    be edited on S3, so damage tests that rewrite bytes do not apply (a pinned version
    deleted is covered by ``remove_shard`` and tests/test_versioned.py)."""

    name = "s3+versioned"

    def __init__(self, tmp_path: Any, server: EmbeddedS3) -> None:
        super().__init__(tmp_path, server.versioned_bucket("behaviour-versioned"))
        part = max(server.min_part_size, 65536)
        self.url = self.server.url(self.prefix, scheme="s3+versioned", part_size=part)

    def raw_names(self) -> list[str]:
        return super().raw_names()

    def _rewrite(self, key: str, edit: Callable[[bytes], bytes]) -> None:
        pytest.skip("a stored S3 object version cannot be edited: bit rot is not simulable")

    def remove_shard(self, store: Store, step: int, name: str) -> None:
        record = store.strategy.read_manifest(step).shard(name)
        assert record is not None
        self.client.delete_object(
            Bucket=self.server.bucket,
            Key=f"{self.prefix}/{record.locator['key']}",
            VersionId=record.locator["version_id"],
        )


class GCSBackend(BackendUnderTest):
    """``gs://`` on fake-gcs-server; 64 KiB parts, so that small shards are composite."""

    name = "gs"

    def __init__(self, tmp_path: Any, server: EmbeddedGCS, scheme: str = "gs") -> None:
        super().__init__(tmp_path)
        self.server = server
        self.prefix = f"runs/test-{os.getpid()}-{next(_counter)}"
        self.url = server.url(self.prefix, scheme=scheme, part_size=65536, concurrency=3)
        self.bucket = server.client().bucket(server.bucket)

    def open(self, **options: Any) -> Store:
        return ckptstore.open(self.url, **{**self.server.options, **options})

    def raw_names(self) -> list[str]:  # the driver's upload pieces included: they are stored
        return sorted(
            b.name for b in self.bucket.client.list_blobs(self.bucket, prefix=self.prefix + "/")
        )

    def _rewrite(self, key: str, edit: Callable[[bytes], bytes]) -> None:
        blob = self.bucket.blob(f"{self.prefix}/{key}")
        blob.upload_from_string(edit(blob.download_as_bytes()))

    def rewrite_shard(self, store: Store, step: int, name: str, edit: Callable[[bytes], bytes]):
        record = store.strategy.read_manifest(step).shard(name)
        assert record is not None
        self._rewrite(record.locator["key"], edit)

    def rewrite_manifest(self, store: Store, step: int, edit: Callable[[bytes], bytes]) -> None:
        self._rewrite(f"manifests/step-{step:020d}.json", edit)

    def remove_shard(self, store: Store, step: int, name: str) -> None:
        record = store.strategy.read_manifest(step).shard(name)
        assert record is not None
        generation = record.locator.get("version_id")
        blob = self.bucket.blob(f"{self.prefix}/{record.locator['key']}", generation=generation)
        blob.delete()


class VersionedGCSBackend(GCSBackend):
    """``gs+versioned://`` on fake-gcs-server: manifests pin generations. A stored generation
    cannot be edited, so damage tests that rewrite bytes do not apply (a pinned generation
    deleted is covered by ``remove_shard``)."""

    name = "gs+versioned"
    NEEDS_REAL_GCS = frozenset(
        {
            "test_concurrent_attempts_at_one_step",
            "test_keep_last",
            "test_dead_attempt_removed_only_after_the_grace_period",
            "test_checkpoint_unpublished_during_get_is_not_found_not_corrupt",
            "test_reading_a_checkpoint_deleted_meanwhile_is_not_found",
        }
    )
    """Tests that GC or retention free old generations, or that a deletion removes a pinned
    generation under a reader: fake-gcs-server cannot delete a noncurrent generation
    (docs/backends/gcs.md), so nothing old is ever freed there and the reader still reads it."""

    def __init__(self, tmp_path: Any, server: EmbeddedGCS) -> None:
        super().__init__(tmp_path, server.versioned_bucket("behaviour-versioned"), "gs+versioned")

    def _rewrite(self, key: str, edit: Callable[[bytes], bytes]) -> None:
        pytest.skip("a stored GCS generation cannot be edited: bit rot is not simulable")

    def remove_shard(self, store: Store, step: int, name: str) -> None:
        pytest.skip("fake-gcs-server cannot delete a given generation (it archives the live one)")


@pytest.fixture(scope="session")
def azurite() -> Iterator[EmbeddedAzure]:
    """Azurite's blob service on 127.0.0.1 for the whole session."""
    with embedded_azurite() as server:
        yield server


class AzureBackend(BackendUnderTest):
    """``az://`` on Azurite: 1 MiB blocks, so that multi-megabyte shards are staged blocks."""

    name = "az"

    def __init__(self, tmp_path: Any, server: EmbeddedAzure) -> None:
        super().__init__(tmp_path)
        self.server = server
        self.prefix = f"runs/test-{os.getpid()}-{next(_counter)}"
        self.url = server.url(self.prefix, part_size=1024 * 1024, concurrency=3)

    def open(self, **options: Any) -> Store:
        return ckptstore.open(self.url, **{**self.server.options, **options})

    def _names(self, **listing: Any) -> list[str]:
        with self.server.client() as client:
            container = client.get_container_client(self.server.container)
            return [b.name for b in container.list_blobs(name_starts_with=self.prefix + "/",
                                                         **listing)]  # fmt: skip

    def raw_names(self) -> list[str]:
        committed = self._names()
        staged = set(self._names(include=["uncommittedblobs"])) - set(committed)
        return sorted(committed) + sorted(staged)

    def _rewrite(self, key: str, edit: Callable[[bytes], bytes]) -> None:
        with self.server.client() as client:
            blob = client.get_blob_client(self.server.container, f"{self.prefix}/{key}")
            blob.upload_blob(edit(blob.download_blob().readall()), overwrite=True)

    def rewrite_shard(self, store: Store, step: int, name: str, edit: Callable[[bytes], bytes]):
        record = store.strategy.read_manifest(step).shard(name)
        assert record is not None
        self._rewrite(record.locator["key"], edit)

    def rewrite_manifest(self, store: Store, step: int, edit: Callable[[bytes], bytes]) -> None:
        self._rewrite(f"manifests/step-{step:020d}.json", edit)

    def remove_shard(self, store: Store, step: int, name: str) -> None:
        record = store.strategy.read_manifest(step).shard(name)
        assert record is not None
        with self.server.client() as client:
            client.get_blob_client(
                self.server.container, f"{self.prefix}/{record.locator['key']}"
            ).delete_blob()


def fsspec_s3_url(server: EmbeddedS3, prefix: str, **query: object) -> str:
    """An ``fsspec+s3://`` URL (s3fs) in this server's bucket; credentials go as options."""
    params = {"endpoint_url": server.endpoint_url, "min_part_size": server.min_part_size, **query}
    text = "&".join(f"{k}={v}" for k, v in params.items())
    return f"fsspec+s3://{server.bucket}/{prefix.strip('/')}?{text}"


def fsspec_s3_options(server: EmbeddedS3) -> dict[str, Any]:
    """s3fs's own names for the server's credentials."""
    return {"key": server.access_key, "secret": server.secret_key}


class FsspecS3Backend(S3Backend):
    """``fsspec+s3://``: the same bucket and layout as ``s3://``, through s3fs."""

    name = "fsspec+s3"

    def __init__(self, tmp_path: Any, server: EmbeddedS3) -> None:
        super().__init__(tmp_path, server)
        part = max(server.min_part_size, 65536)
        self.url = fsspec_s3_url(server, self.prefix, part_size=part, concurrency=3)

    def open(self, **options: Any) -> Store:
        return ckptstore.open(self.url, **{**fsspec_s3_options(self.server), **options})


class FsspecBackend(BackendUnderTest):
    """``fsspec+gcs://`` (gcsfs on fake-gcs-server) or ``fsspec+abfs://`` (adlfs on Azurite):
    damage and inspection through the implementation's own file system, raw."""

    def __init__(
        self, tmp_path: Any, name: str, location: str, query: str = "", **options: Any
    ) -> None:
        super().__init__(tmp_path)
        self.name = name
        self.prefix = f"runs/test-{os.getpid()}-{next(_counter)}"
        self.url = f"{location}/{self.prefix}?part_size=65536{query}"
        self.options = options
        driver = self.open().strategy.driver
        self.fs, self.root = driver.fs, driver.root  # type: ignore[attr-defined]

    def open(self, **options: Any) -> Store:
        return ckptstore.open(self.url, **{**self.options, **options})

    def raw_names(self) -> list[str]:
        return sorted(path[len(self.root) + 1 :] for path in self.fs.find(self.root))

    def _rewrite(self, key: str, edit: Callable[[bytes], bytes]) -> None:
        path = f"{self.root}/{key}"
        self.fs.pipe_file(path, edit(self.fs.cat_file(path)))

    def rewrite_shard(self, store: Store, step: int, name: str, edit: Callable[[bytes], bytes]):
        record = store.strategy.read_manifest(step).shard(name)
        assert record is not None
        self._rewrite(record.locator["key"], edit)

    def rewrite_manifest(self, store: Store, step: int, edit: Callable[[bytes], bytes]) -> None:
        self._rewrite(f"manifests/step-{step:020d}.json", edit)

    def remove_shard(self, store: Store, step: int, name: str) -> None:
        record = store.strategy.read_manifest(step).shard(name)
        assert record is not None
        self.fs.rm_file(f"{self.root}/{record.locator['key']}")


@pytest.fixture(
    params=[
        "file",
        "lustre",
        "memory",
        "memory+versioned",
        "s3",
        "s3+versioned",
        "gs",
        "gs+versioned",
        "az",
        "fsspec+s3",
        "fsspec+gcs",
        pytest.param(
            "fsspec+abfs",
            marks=extended(
                "the fsspec driver's behaviour on adlfs: the same driver runs on s3fs and gcsfs "
                "here, and tests/test_fsspec.py saves, streams and fails on adlfs"
            ),
        ),
    ]
)
def backend(request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[BackendUnderTest]:
    """One fresh store location per test, on each backend in turn (s3: the moto server)."""
    made: BackendUnderTest
    if request.param == "file":
        made = FileBackend(tmp_path)
    elif request.param == "lustre":
        made = LustreBackend(tmp_path)
    elif request.param == "memory":
        made = MemoryBackend(tmp_path)
    elif request.param == "memory+versioned":
        made = VersionedMemoryBackend(tmp_path)
    elif request.param == "s3":
        made = S3Backend(tmp_path, request.getfixturevalue("moto_s3"))
    elif request.param == "gs":
        made = GCSBackend(tmp_path, request.getfixturevalue("fake_gcs"))
    elif request.param == "gs+versioned":
        if request.node.originalname in VersionedGCSBackend.NEEDS_REAL_GCS:
            pytest.skip("frees old generations: fake-gcs-server cannot delete one")
        made = VersionedGCSBackend(tmp_path, request.getfixturevalue("fake_gcs"))
    elif request.param == "az":
        made = AzureBackend(tmp_path, request.getfixturevalue("azurite"))
    elif request.param == "fsspec+s3":
        made = FsspecS3Backend(tmp_path, request.getfixturevalue("moto_s3"))
    elif request.param == "fsspec+gcs":
        gcs: EmbeddedGCS = request.getfixturevalue("fake_gcs")
        query = f"&endpoint_url={gcs.endpoint_url}"
        made = FsspecBackend(tmp_path, "fsspec+gcs", f"fsspec+gcs://{gcs.bucket}", query,
                             token="anon")  # fmt: skip
    elif request.param == "fsspec+abfs":
        azure: EmbeddedAzure = request.getfixturevalue("azurite")
        made = FsspecBackend(tmp_path, "fsspec+abfs", f"fsspec+abfs://{azure.container}",
                             connection_string=azure.connection_string)  # fmt: skip
    else:
        made = VersionedS3Backend(tmp_path, request.getfixturevalue("moto_s3"))
    yield made
    if isinstance(made, MemoryBackend):
        made.close()


@pytest.fixture
def store(backend: BackendUnderTest) -> Store:
    """A fresh, empty store on each backend."""
    return backend.open()
