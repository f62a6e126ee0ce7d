"""Tiers: saves publish in the fast store, a replicator publishes copies in the durable one.

What is checked: the copy's manifest records its source and the first write's CRC32Cs (and a
copy whose bytes differ publishes nothing); latest() answers across tiers, from the durable
one when the fast tier is gone; a new replicator finds what the last one left owed; the fast
tier's retention keeps what is owed; each policy; the errors of bad options; a trainer
SIGKILLed in the middle of a durable multipart upload loses nothing.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from child_output import ChildOutput

import ckptstore
from ckptstore.backends.memory import drop_bucket
from ckptstore.errors import (
    InvalidOptionError,
    ReplicationError,
    ReplicationTimeoutError,
    StorageError,
)
from ckptstore.manifest import Manifest
from ckptstore.tiers.replication import ReplicateAll, ReplicateEvery, ReplicateNewest
from ckptstore.tiers.tiered import TieredStore
from ckptstore.tools.embedded import EmbeddedS3

_ids = iter(range(10**6))


def shards(step: int) -> dict[str, bytes]:
    return {
        "model/rank0.bin": bytes((step * 7 + i) % 251 for i in range(300_000)),
        "trainer.json": json.dumps({"step": step}).encode(),
        "empty.bin": b"",
    }


@pytest.fixture
def durable_url() -> Iterator[str]:
    bucket = f"tiers-{os.getpid()}-{next(_ids)}"
    yield f"memory://{bucket}/run?part_size=65536&min_part_size=4096"
    drop_bucket(bucket)


def tiered(tmp_path: Path, durable: str, **options: Any) -> TieredStore:
    return ckptstore.open(f"file://{tmp_path}/fast", replicate_to=durable, **options)


def test_a_save_is_published_in_both_tiers_with_its_source_and_first_crcs(
    tmp_path: Path, durable_url: str
) -> None:
    with tiered(tmp_path, durable_url) as store:
        first = store.save(10, shards(10), {"samples": 640})
        store.wait_replicated(timeout=60)
        copy = store.durable.get(10)
    assert copy.metadata == {"samples": 640}
    assert copy.manifest.source is not None
    assert copy.manifest.source.url == f"file://{tmp_path}/fast"
    assert (copy.manifest.source.step, copy.manifest.source.attempt) == (10, first.manifest.attempt)
    assert copy.manifest.timings == first.manifest.timings  # what the save cost the trainer
    for name, record in first.shards.items():
        replica = copy.shards[name]
        assert (replica.size, replica.crc32c, replica.block_crc32c) == (
            record.size,
            record.crc32c,
            record.block_crc32c,
        )
        assert copy.read(name) == shards(10)[name]
    # The source survives the manifest's encoding, and its checksum covers it.
    encoded = copy.manifest.encode()
    assert Manifest.decode(encoded, where="test").source == copy.manifest.source
    tampered = encoded.replace(b'"step": 10', b'"step": 11', 1)
    with pytest.raises(ckptstore.IntegrityError):
        Manifest.decode(tampered, where="test")


def test_latest_prefers_the_fast_copy_and_the_durable_tier_answers_on_a_new_node(
    tmp_path: Path, durable_url: str
) -> None:
    with tiered(tmp_path, durable_url) as store:
        for step in (1, 2):
            store.save(step, shards(step))
        store.wait_replicated(timeout=60)
        latest = store.latest()
        assert latest is not None and latest.step == 2 and latest.url == store.url
        assert store.steps() == [1, 2] and [c.step for c in store.checkpoints()] == [1, 2]
    shutil.rmtree(tmp_path / "fast")  # a new node: its local disk is empty
    with tiered(tmp_path, durable_url) as resumed:
        latest = resumed.latest()
        assert latest is not None and latest.step == 2 and latest.url == resumed.durable_url
        assert latest.read("model/rank0.bin") == shards(2)["model/rank0.bin"]
        assert resumed.get(1).read("trainer.json") == shards(1)["trainer.json"]


def test_a_damaged_fast_newest_is_answered_by_its_durable_copy(
    tmp_path: Path, durable_url: str
) -> None:
    with tiered(tmp_path, durable_url) as store:
        store.save(1, shards(1))
        store.wait_replicated(timeout=60)
        manifest = store.fast.strategy.read_manifest(1)
        os.unlink(tmp_path / "fast" / f"step-{1:020d}" / "data" / manifest.shards[0].name)
        latest = store.latest()
        assert latest is not None and latest.url == store.durable_url
        assert store.get(1).url == store.durable_url


def test_a_new_replicator_copies_what_the_last_one_left_owed(
    tmp_path: Path, durable_url: str
) -> None:
    store = tiered(tmp_path, durable_url, background=False)
    for step in (1, 2, 3):
        store.save(step, shards(step))
    store.close(wait=False)  # the process ends before anything was copied
    assert ckptstore.open(durable_url).steps() == []
    with tiered(tmp_path, durable_url, background=False) as restarted:
        restarted.wait_replicated()
        assert restarted.durable.steps() == [1, 2, 3]


def test_the_fast_tier_keeps_what_the_durable_tier_is_owed(
    tmp_path: Path, durable_url: str
) -> None:
    store = tiered(tmp_path, durable_url, background=False, retention=ckptstore.KeepLast(1))
    for step in (1, 2, 3):
        store.save(step, shards(step))
    assert store.fast.steps() == [1, 2, 3]  # none copied yet: all owed, none deleted
    store.wait_replicated()
    store.save(4, shards(4))  # retention after this publish: 4 is owed, 1 to 3 are durable
    assert store.fast.steps() == [4]
    assert store.durable.steps() == [1, 2, 3]
    store.close()
    assert ckptstore.open(durable_url).steps() == [1, 2, 3, 4]


def test_a_copy_whose_source_the_fast_tier_deleted_meanwhile_is_no_failure(
    tmp_path: Path, durable_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Retention of the fast tier judges by the owed steps it read just before it deletes: a
    step it deletes as its copy starts (an operator's delete, the same) was reported as a
    failed replication pass (wait_replicated and close raised). It is no longer owed: the copy
    is aborted, nothing is published, and the next saves replicate."""
    store = tiered(tmp_path, durable_url, background=False)
    store.save(1, shards(1))
    replicator = store.replicator
    real = replicator._copy_shard
    deleted: list[int] = []

    def copy_shard(manifest: Manifest, record: Any, pending: Any) -> None:
        if manifest.step == 1 and not deleted:
            store.fast.delete(1, force=True)  # mid-copy, after the source was read
            deleted.append(1)
        real(manifest, record, pending)

    monkeypatch.setattr(replicator, "_copy_shard", copy_shard)
    store.wait_replicated()  # no error: step 1 is gone, not owed
    assert deleted == [1] and store.durable.steps() == []
    store.save(2, shards(2))
    store.close()
    assert ckptstore.open(durable_url).steps() == [2]


def test_each_tier_has_its_own_retention(tmp_path: Path, durable_url: str) -> None:
    with tiered(
        tmp_path,
        durable_url,
        background=False,
        retention=ckptstore.KeepLast(1),
        durable_retention=ckptstore.KeepLast(2),
    ) as store:
        for step in (1, 2, 3, 4):
            store.save(step, shards(step))
            store.wait_replicated()
        assert store.durable.steps() == [3, 4]
        store.save(5, shards(5))
        assert store.fast.steps() == [5]


def test_policies_choose_from_what_both_tiers_publish() -> None:
    assert ReplicateAll().select([1, 2, 3], None) == [1, 2, 3]
    assert ReplicateAll().select([1, 2, 3], 2) == [3]
    assert ReplicateNewest().select([1, 2, 3], None) == [3]
    assert ReplicateNewest().select([1, 2, 3], 3) == []
    every = ReplicateEvery(1000)
    assert every.select([500, 1000, 1500, 2000, 2500], None) == [500, 1500, 2500]
    assert every.select([500, 1000, 1500, 2000, 2500], 1000) == [2000]
    assert ckptstore.replication.replication_policy("every:500").select([0, 250, 500], None) == [
        0,
        500,
    ]


def test_newest_when_behind_skips_the_older_ones_and_close_copies_the_newest(
    tmp_path: Path, durable_url: str
) -> None:
    store = tiered(tmp_path, durable_url, background=False, replication="newest")
    for step in (1, 2, 3):
        store.save(step, shards(step))
    store.wait_replicated()
    assert store.durable.steps() == [3]
    store.close()
    every = tiered(tmp_path, durable_url, background=False, replication="every:10")
    for step in (4, 5, 13, 14):
        every.save(step, shards(step))
    every.wait_replicated()
    assert every.durable.steps() == [3, 13]  # 13 is the first at least 10 past 3
    every.close()  # the run ends: its newest is made durable whatever the policy
    assert ckptstore.open(durable_url).steps() == [3, 13, 14]


def test_a_copy_that_does_not_hash_to_the_first_write_publishes_nothing(
    tmp_path: Path, durable_url: str
) -> None:
    store = tiered(tmp_path, durable_url, background=False)
    store.save(1, shards(1))
    manifest = store.fast.strategy.read_manifest(1)
    record = manifest.shard("model/rank0.bin")
    assert record is not None
    path = tmp_path / "fast" / f"step-{1:020d}" / "data" / "model/rank0.bin"
    data = bytearray(path.read_bytes())
    data[100_000] ^= 0x01  # rot after the first write: same size
    path.write_bytes(bytes(data))
    with pytest.raises(ReplicationError, match="does not match the first write"):
        store.wait_replicated()
    assert store.durable.steps() == []
    store.durable.gc(grace=0)
    assert store.durable.is_empty()  # the aborted copy left nothing behind
    assert 1 in store.replicator.skipped
    store.close(wait=False)


def test_wait_replicated_reports_a_failing_durable_store_and_times_out(
    tmp_path: Path, durable_url: str
) -> None:
    store = tiered(tmp_path, durable_url)
    writer = store.replicator.durable
    begin = writer.begin
    entered, release, seen = threading.Event(), threading.Event(), threading.Event()

    def blocking_begin(*args: Any, **kwargs: Any) -> Any:
        # Failing until the waiter has seen a failure: a pass that failed before the wait
        # began is not the wait's to report (and the wait would have run to its timeout).
        if not seen.is_set():
            raise StorageError("PutObject: SlowDown (injected)", http_status=503)
        entered.set()
        assert release.wait(60)
        return begin(*args, **kwargs)

    writer.begin = blocking_begin  # type: ignore[method-assign]
    store.save(1, shards(1))
    with pytest.raises(ReplicationError, match="SlowDown") as caught:
        store.wait_replicated(timeout=60)
    assert not isinstance(caught.value, ReplicationTimeoutError)  # a pass's error, at once
    seen.set()
    assert entered.wait(60)  # the retry is under way, held in begin
    with pytest.raises(ReplicationTimeoutError):
        store.wait_replicated(timeout=0.2)
    release.set()
    store.wait_replicated(timeout=60)
    assert store.durable.steps() == [1]
    store.close()


def test_bad_options_are_refused_clearly(tmp_path: Path, durable_url: str) -> None:
    fast = f"file://{tmp_path}/fast"
    with pytest.raises(InvalidOptionError, match="is the store being saved to"):
        ckptstore.open(fast, replicate_to=f"{tmp_path}/fast/")
    with pytest.raises(InvalidOptionError, match="inside the other"):
        ckptstore.open(fast, replicate_to=f"file://{tmp_path}/fast/durable")
    with pytest.raises(InvalidOptionError, match="unknown replication policy"):
        ckptstore.open(fast, replicate_to=durable_url, replication="sometimes")
    with pytest.raises(InvalidOptionError, match="needs an int"):
        ckptstore.open(fast, replicate_to=durable_url, replication="every:0")
    with pytest.raises(InvalidOptionError, match="need replicate_to"):
        ckptstore.open(fast, replication="all")
    with pytest.raises(InvalidOptionError, match="durable_retention"):
        ckptstore.open(fast, replicate_to=durable_url, durable_retention=3)  # type: ignore[arg-type]
    (tmp_path / "a-file").write_bytes(b"")
    with pytest.raises(ReplicationError, match="durable store cannot be opened") as unreachable:
        ckptstore.open(fast, replicate_to=f"file://{tmp_path}/a-file/durable")
    assert isinstance(unreachable.value.__cause__, ckptstore.CkptStoreError)


def test_an_unreachable_s3_durable_store_is_refused_at_open(
    tmp_path: Path, moto_s3: EmbeddedS3
) -> None:
    with pytest.raises(ReplicationError, match="durable store cannot be opened"):
        ckptstore.open(
            f"file://{tmp_path}/fast",
            replicate_to="s3://no-such-bucket-here/run",
            durable_options=moto_s3.options,
        )


def test_s3_durable_tier_round_trip(tmp_path: Path, moto_s3: EmbeddedS3) -> None:
    url = moto_s3.url(f"tiers/{os.getpid()}-{next(_ids)}", part_size=65536)
    with tiered(tmp_path, url, durable_options=moto_s3.options) as store:
        store.save(7, shards(7))
        store.wait_replicated(timeout=60)
    shutil.rmtree(tmp_path / "fast")
    durable = ckptstore.open(url, **moto_s3.options)
    latest = durable.latest()
    assert latest is not None and latest.step == 7 and latest.manifest.source is not None
    assert latest.read("model/rank0.bin") == shards(7)["model/rank0.bin"]


TRAINER = textwrap.dedent(
    """
    import json, sys, threading, ckptstore
    from ckptstore import replication
    fast, durable, options, part = sys.argv[1:3] + [json.loads(sys.argv[3]), int(sys.argv[4])]
    reads = {"n": 0}
    read_some = replication._read_some

    def read_then_hold(raw, view):  # hold the copy of step 3 in the middle of its upload
        got = read_some(raw, view)
        if holding.is_set():
            reads["n"] += 1
            if reads["n"] == 2:
                print("uploading", flush=True)
                threading.Event().wait()
        return got

    holding = threading.Event()
    replication._read_some = read_then_hold
    store = ckptstore.open(fast, replicate_to=durable, durable_options=options)
    store.replicator.chunk_size = part + 1  # a full part and more: the upload has begun
    for step in (1, 2):
        store.save(step, {"big.bin": bytes([step]) * (4 * part), "t.json": b"{}"})
    store.wait_replicated(timeout=60)
    print("replicated 2", flush=True)
    holding.set()
    store.save(3, {"big.bin": bytes([3]) * (4 * part), "t.json": b"{}"})
    print("published 3", flush=True)
    threading.Event().wait()
    """
)


def test_sigkill_during_replication_loses_nothing_and_resumes_from_the_right_tier(
    tmp_path: Path, moto_s3: EmbeddedS3
) -> None:
    part = 65536
    prefix = f"tiers/{os.getpid()}-{next(_ids)}"
    url = moto_s3.url(prefix, part_size=part)
    fast = f"file://{tmp_path}/fast"
    command = [sys.executable, "-c", TRAINER, fast, url, json.dumps(moto_s3.options), str(part)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    with subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=env) as child:
        assert child.stdout is not None
        output = ChildOutput(child.stdout)
        expected = {"replicated 2", "published 3", "uploading"}
        seen: set[str] = set()
        while seen != expected:
            line = output.next_line(120)
            assert line is not None, f"the trainer said nothing new in 120 s: {output.lines}"
            seen.add(line)
        client = moto_s3.client()
        uploads = client.list_multipart_uploads(Bucket=moto_s3.bucket, Prefix=prefix + "/")
        assert uploads.get("Uploads"), "the copy of step 3 should be a multipart upload under way"
        child.kill()
        child.wait()
    # Resume on the same node: the fast tier has step 3, the durable tier does not yet.
    with tiered(tmp_path, url, durable_options=moto_s3.options) as resumed:
        latest = resumed.latest()
        assert latest is not None and latest.step == 3 and latest.url == resumed.url
        resumed.wait_replicated(timeout=60)  # the new replicator finds step 3 owed
        assert resumed.durable.steps() == [1, 2, 3]
        later = ckptstore.open(url, clock=lambda: time.time() + 7200, **moto_s3.options)
        later.gc(grace=timedelta(hours=1))
    uploads = client.list_multipart_uploads(Bucket=moto_s3.bucket, Prefix=prefix + "/")
    assert not uploads.get("Uploads")  # the killed copy's upload was collected
    # Resume on a new node: only the durable tier is left.
    shutil.rmtree(tmp_path / "fast")
    with tiered(tmp_path, url, durable_options=moto_s3.options) as new_node:
        latest = new_node.latest()
        assert latest is not None and latest.step == 3 and latest.url == new_node.durable_url
        assert latest.read("big.bin") == bytes([3]) * (4 * part)


def test_a_tiered_run_takes_both_tiers_over(tmp_path: Path) -> None:
    """A restarted tiered run fences its zombie in both tiers: neither the zombie's saves nor
    its replicator's copies publish into either history (docs/protocol.md §8)."""
    durable_url = f"file://{tmp_path}/durable"
    zombie = ckptstore.open(f"file://{tmp_path}/fast-old", replicate_to=durable_url)
    for step in (1, 2):
        zombie.save(step, {"w": bytes([step]) * 64})
    zombie.wait_replicated(timeout=60)
    restarted = ckptstore.open(f"file://{tmp_path}/fast-new", replicate_to=durable_url)
    latest = restarted.latest()
    assert latest is not None and latest.step == 2  # from the durable tier: a new node
    fast_epoch, durable_epoch = restarted.take_over(resumed_from=latest.step)
    assert (fast_epoch.parent, durable_epoch.parent) == (2, 2)
    zombie.fast.save(3, {"w": b"old" * 20})  # its own fast tier is another directory...
    with pytest.raises(ReplicationError, match="superseded by epoch"):
        zombie.wait_replicated(timeout=60)  # ...but its copy into the durable tier is refused
    restarted.save(3, {"w": b"new" * 20})
    restarted.wait_replicated(timeout=60)
    durable = ckptstore.open(durable_url)
    assert durable.steps() == [1, 2, 3]
    assert durable.get(3).read("w") == b"new" * 20
    zombie.close(wait=False)
    restarted.close()
