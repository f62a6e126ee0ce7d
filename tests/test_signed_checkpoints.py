"""Signed checkpoints (issue 29): a shard replaced and every CRC32C and checksum recomputed
passes ``verify()`` without trust; with ``trust`` it is refused through ``load_state``, the DCP
reader and ``pull``, on file:// and S3 (moto), whichever way the forger rewrote the manifest."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path
from typing import Any

import pytest
from conftest import BackendUnderTest, FileBackend, S3Backend

import ckptstore
from ckptstore.checksum import crc32c_hex
from ckptstore.cli import main as cli
from ckptstore.digest import BlockDigests
from ckptstore.errors import (
    CheckpointNotFoundError,
    InvalidInputError,
    InvalidOptionError,
    ShardCorruptError,
    UntrustedCheckpointError,
)
from ckptstore.manifest import Manifest
from ckptstore.signing import SIGNING_KEY_ENV, TRUST_ENV, generate_key, write_key_pair
from ckptstore.store import Store

torch = pytest.importorskip("torch")
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint.api import CheckpointException  # noqa: E402

from ckptstore.torch.dcp import CkptStoreReader, CkptStoreWriter  # noqa: E402
from ckptstore.torch.state import load_state, save_state  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture(autouse=True)
def _no_keys_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SIGNING_KEY_ENV, raising=False)
    monkeypatch.delenv(TRUST_ENV, raising=False)


@pytest.fixture
def keys(tmp_path: Path) -> tuple[Path, Path]:
    """A key pair in files: the private key (0600) and its ``.pub``."""
    (tmp_path / "keys").mkdir(exist_ok=True)
    return write_key_pair(generate_key(), tmp_path / "keys" / "writer")


@pytest.fixture(params=["file", "s3"])
def where(request: pytest.FixtureRequest, tmp_path: Path) -> BackendUnderTest:
    (tmp_path / "keys").mkdir(exist_ok=True)
    if request.param == "file":
        return FileBackend(tmp_path)
    return S3Backend(tmp_path, request.getfixturevalue("moto_s3"))


# -- the forger ------------------------------------------------------------------------------


def _forge(
    where: BackendUnderTest, store: Store, step: int, name: str, data: bytes, *, how: str
) -> None:
    """Replace shard ``name`` of ``step`` with ``data`` and rewrite the manifest to match, as
    an attacker with write access to the storage (and no key) would.

    ``how``: ``bytes`` leaves the manifest as it is; ``crc`` recomputes sizes, CRC32Cs and the
    checksum (the attack of the issue); ``digests`` recomputes the digests too; ``strip`` also
    removes the signature. Each of the last three leaves a signature that cannot match.
    """
    manifest = store.strategy.read_manifest(step)
    record = manifest.shard(name)
    assert record is not None
    where.rewrite_shard(store, step, name, lambda _old: data)
    if how == "bytes":
        return
    size = record.block_size
    blocks = "".join(crc32c_hex(data[i : i + size]) for i in range(0, len(data), size))
    forged = dataclasses.replace(
        record, size=len(data), crc32c=crc32c_hex(data), block_crc32c=blocks
    )
    if how in ("digests", "strip"):
        digests = BlockDigests(record.digest_algorithm, size)
        digests.update(data)
        digests.finish()
        forged = dataclasses.replace(
            forged,
            digest=f"{digests.algorithm}:{digests.hexdigest()}",
            block_digests=digests.block_hexdigests(),
        )
    shards = tuple(forged if r.name == name else r for r in manifest.shards)
    rewritten = dataclasses.replace(manifest, shards=shards)
    if how == "strip":
        rewritten = dataclasses.replace(rewritten, signature=None)
    where.rewrite_manifest(store, step, lambda _old: rewritten.encode())


FORGERIES = ["bytes", "crc", "digests", "strip"]
WHY: dict[str, type[Exception]] = {
    "bytes": ShardCorruptError,  # the signed manifest is intact: the bytes miss its digests
    "crc": UntrustedCheckpointError,  # "bad-signature"
    "digests": UntrustedCheckpointError,  # "bad-signature"
    "strip": UntrustedCheckpointError,  # "unsigned"
}


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Linear(64, 64)


# -- the attack, through every reader ---------------------------------------------------------


@pytest.mark.parametrize("how", FORGERIES)
def test_the_forged_shard_passes_verify_without_trust_and_is_refused_by_load_state(
    where: BackendUnderTest, keys: tuple[Path, Path], how: str
) -> None:
    private, public = keys
    writer = where.open(signing_key=private)
    save_state(writer, 1, {"model": _model(1)}, rng=False)
    save_state(writer, 2, {"model": _model(2)}, rng=False)
    victim = writer.get(2)
    (name,) = [n for n in victim.names if n.startswith("model")][:1]
    planted = bytearray(victim.read(name))
    planted[-8:] = b"\x00" * 8  # a tensor's last values, changed
    _forge(where, writer, 2, name, bytes(planted), how=how)

    # Without trust: the recorded digests catch bytes that differ from them; a forger who
    # recomputed the digests too is not caught (the attack of the issue, one step further).
    assert where.open().get(2).verify().ok == (how in ("digests", "strip"))

    reader = where.open(trust=[public])
    target = _model(0)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(WHY[how]) as caught:
        load_state(reader.get(2), {"model": target}, rng=False)
    if how == "bytes":
        assert "digest mismatch" in str(caught.value)
    else:  # refused before a byte of the checkpoint was read
        assert caught.value.reason == {"strip": "unsigned"}.get(how, "bad-signature")
        assert all(torch.equal(before[k], v) for k, v in target.state_dict().items())
    target = _model(0)
    if how == "bytes":  # the newest trusted manifest is step 2's: its load is refused
        with pytest.raises(ShardCorruptError):
            load_state(reader, {"model": target}, rng=False)
        return
    loaded = load_state(reader, {"model": target}, rng=False)  # latest(): trusted step 1
    assert loaded["step"] == 1
    reference = _model(1).state_dict()
    assert all(torch.equal(reference[k], v) for k, v in target.state_dict().items())


def test_latest_under_trust_passes_over_a_forged_shard_only_when_verified(
    where: BackendUnderTest, keys: tuple[Path, Path]
) -> None:
    """A forgery that left the signed manifest alone is found by reading the shard: a plain
    ``load_state`` of the latest refuses it (never loads it); ``latest(verified=True)`` passes
    over it to the newest intact trusted checkpoint."""
    private, public = keys
    writer = where.open(signing_key=private)
    save_state(writer, 1, {"model": _model(1)}, rng=False)
    save_state(writer, 2, {"model": _model(2)}, rng=False)
    name = next(n for n in writer.get(2).names if n.startswith("model"))
    data = bytearray(writer.get(2).read(name))
    data[-4:] = b"\x01\x02\x03\x04"
    _forge(where, writer, 2, name, bytes(data), how="bytes")
    reader = where.open(trust=[public])
    with pytest.raises(ShardCorruptError, match="digest mismatch"):
        load_state(reader, {"model": _model(0)}, rng=False)
    checkpoint = reader.latest(verified=True)
    assert checkpoint is not None and checkpoint.step == 1


@pytest.mark.parametrize("how", FORGERIES)
def test_the_dcp_reader_refuses_the_forgery(
    where: BackendUnderTest, keys: tuple[Path, Path], how: str
) -> None:
    private, public = keys
    writer = where.open(signing_key=private)
    state = {"w": torch.arange(4096.0), "b": torch.ones(3)}
    dcp.save(state, storage_writer=CkptStoreWriter(writer), checkpoint_id=5)
    checkpoint = writer.get(5)
    name = next(n for n in checkpoint.names if n.endswith(".distcp"))
    data = bytearray(checkpoint.read(name))
    data[:16] = b"\xff" * 16
    _forge(where, writer, 5, name, bytes(data), how=how)

    target = {"w": torch.zeros(4096), "b": torch.zeros(3)}
    with pytest.raises(CheckpointException) as caught:
        dcp.load(target, storage_reader=CkptStoreReader(where.open(trust=[public]), step=5))
    (failure,) = caught.value.failures.values()
    error = failure[0] if isinstance(failure, tuple) else failure
    if how == "bytes":
        assert isinstance(error, ShardCorruptError) and "digest mismatch" in str(error)
    else:  # DCP reports a failed metadata read as an AssertionError holding our message
        expected = "is not signed" if how == "strip" else "does not match its contents"
        assert expected in str(error), error
    assert torch.equal(target["w"], torch.zeros(4096)) or how == "bytes"


@pytest.mark.parametrize("how", FORGERIES)
def test_pull_refuses_the_forgery(
    where: BackendUnderTest,
    keys: tuple[Path, Path],
    how: str,
    tmp_path: Path,
    capsys: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    private, public = keys
    if isinstance(where, S3Backend):  # the command's credentials
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", where.server.access_key)
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", where.server.secret_key)
    writer = where.open(signing_key=private)
    for step in (1, 2):
        with writer.begin(step) as pending:
            pending.write("config.json", b'{"step": %d}' % step)
            pending.write("model.bin", os.urandom(300_000))
    _forge(where, writer, 2, "model.bin", os.urandom(300_000), how=how)
    url = where.url
    assert cli(["pull", url, "2", str(tmp_path / "out"), "--trust", str(public)]) != 0
    err = capsys.readouterr().err
    assert ("digest mismatch" if how == "bytes" else "sign") in err
    assert not (tmp_path / "out").exists()
    # The latest trusted checkpoint: step 1 where the forger's manifest is untrusted; for a
    # forgery that kept the signed manifest, latest is step 2, refused when its bytes are read.
    code = cli(["pull", url, str(tmp_path / "latest"), "--trust", str(public)])
    if how == "bytes":
        assert code != 0 and not (tmp_path / "latest").exists()
    else:
        assert code == 0
        assert (tmp_path / "latest" / "config.json").read_bytes() == b'{"step": 1}'


# -- what is signed, and what trust refuses ----------------------------------------------------


def test_a_signed_manifest_records_digests_and_the_signer(
    tmp_path: Path, keys: tuple[Path, Path]
) -> None:
    private, public = keys
    store = ckptstore.open(f"file://{tmp_path}/s", signing_key=private)
    with store.begin(1) as pending:
        pending.write("a", os.urandom(9 * 1024 * 1024))
        pending.write("empty", b"")
    manifest = store.manifest(1)
    assert manifest.signature is not None and manifest.signature.key_id.startswith("ed25519:")
    for shard in manifest.shards:
        assert shard.digest.startswith(("blake3:", "sha256:")) and shard.block_size
    trusted = ckptstore.open(f"file://{tmp_path}/s", trust=[public])
    assert trusted.manifest(1).check_trust(trusted.trust, where="x") == manifest.signature.key_id
    assert trusted.get(1).verify().ok


def test_unsigned_other_key_and_edited_manifests_are_refused_and_latest_skips_them(
    tmp_path: Path, keys: tuple[Path, Path], caplog: pytest.LogCaptureFixture
) -> None:
    private, public = keys
    url = f"file://{tmp_path}/s"
    ckptstore.open(url, signing_key=private).begin(1).__enter__().publish()
    ckptstore.open(url).begin(2).__enter__().publish()  # unsigned
    stranger = generate_key()
    ckptstore.open(url, signing_key=stranger).begin(3).__enter__().publish()
    signed4 = ckptstore.open(url, signing_key=private)
    with signed4.begin(4, metadata={"lr": 0.1}):
        pass
    path = Path(tmp_path / "s" / f"step-{4:020d}" / "manifest.json")
    manifest = Manifest.decode(path.read_bytes(), where="t")
    edited = dataclasses.replace(manifest, metadata={"lr": 10.0})
    path.write_bytes(edited.encode())  # checksum recomputed, signature now stale

    reader = ckptstore.open(url, trust=[public])
    reasons = {}
    for step in (2, 3, 4):
        with pytest.raises(UntrustedCheckpointError) as caught:
            reader.get(step)
        reasons[step] = caught.value.reason
    assert reasons == {2: "unsigned", 3: "untrusted-key", 4: "bad-signature"}
    with caplog.at_level(logging.WARNING):
        latest = reader.latest()
    assert latest is not None and latest.step == 1
    assert sum("not trusted" in r.getMessage() for r in caplog.records) == 3
    assert reader.steps() == [1]
    # Key rotation: trust both keys, and the stranger's step is read too.
    both = ckptstore.open(url, trust=[public, stranger])
    assert both.steps() == [1, 3]


def test_a_manifest_replayed_from_another_step_is_refused(
    tmp_path: Path, keys: tuple[Path, Path]
) -> None:
    private, public = keys
    url = f"file://{tmp_path}/s"
    store = ckptstore.open(url, signing_key=private)
    for step in (1, 2):
        with store.begin(step) as pending:
            pending.write("a", b"%d" % step)
    one = tmp_path / "s" / f"step-{1:020d}" / "manifest.json"
    two = tmp_path / "s" / f"step-{2:020d}" / "manifest.json"
    two.write_bytes(one.read_bytes())  # validly signed, for step 1
    reader = ckptstore.open(url, trust=[public])
    assert reader.steps() == [1]
    with pytest.raises(Exception, match="step 1, stored as step 2"):
        reader.get(2)


def test_an_unsigned_takeover_stops_a_trusting_reader(
    tmp_path: Path, keys: tuple[Path, Path]
) -> None:
    private, public = keys
    url = f"file://{tmp_path}/s"
    store = ckptstore.open(url, signing_key=private)
    with store.begin(1) as pending:
        pending.write("a", b"1")
    store.take_over(1)  # signed
    reader = ckptstore.open(url, trust=[public])
    assert reader.latest() is not None and reader.lineage().newest == 1
    ckptstore.open(url).take_over(None, discard_history=True)  # unsigned: hides every step
    with pytest.raises(UntrustedCheckpointError, match="epoch 2 is not signed"):
        ckptstore.open(url, trust=[public]).latest()
    record = tmp_path / "s" / "epochs"
    assert record.exists()


def test_multi_rank_receipts_without_digests_cannot_be_signed(
    tmp_path: Path, keys: tuple[Path, Path]
) -> None:
    private, _ = keys
    url = f"file://{tmp_path}/s"
    coordinator = ckptstore.open(url, signing_key=private)
    pending = coordinator.begin(1)
    rank1 = ckptstore.open(url).join(1, pending.attempt)  # opened without the key
    rank1.write("rank1", b"x")
    pending.add_receipts(rank1.seal())
    pending.write("rank0", b"y")
    with pytest.raises(InvalidInputError, match=r"rank1.*no digest"):
        pending.publish()
    assert ckptstore.open(url).steps() == []


# -- keys and options --------------------------------------------------------------------------


def test_keys_are_files_written_once_and_never_shown(tmp_path: Path) -> None:
    key = generate_key()
    private, public = write_key_pair(key, tmp_path / "k")
    assert private.stat().st_mode & 0o777 == 0o600
    assert public.read_bytes().startswith(b"-----BEGIN PUBLIC KEY-----")
    with pytest.raises(InvalidOptionError, match="never overwrites"):
        write_key_pair(generate_key(), tmp_path / "k")
    secret = private.read_bytes()
    with pytest.raises(InvalidOptionError, match="holds a private key") as caught:
        ckptstore.open(f"file://{tmp_path}/s", trust=[private])
    assert secret.decode() not in str(caught.value)
    mangled = tmp_path / "mangled"
    mangled.write_bytes(secret[:70] + b"\n-----END PRIVATE KEY-----\n")  # cut short
    with pytest.raises(InvalidOptionError) as caught:
        ckptstore.open(f"file://{tmp_path}/s", signing_key=mangled)
    assert "PRIVATE" not in str(caught.value) and secret[30:50].decode() not in str(caught.value)
    with pytest.raises(InvalidOptionError, match="no key"):
        ckptstore.open(f"file://{tmp_path}/s", trust=[])
    link = tmp_path / "link.pub"  # a secret mounted as a link (Kubernetes): followed
    link.symlink_to(public)
    assert ckptstore.open(f"file://{tmp_path}/s", trust=[link]).trust is not None
    assert ckptstore.open(f"file://{tmp_path}/s", trust=key).trust is not None  # one key
    for given in ('"' + secret.decode() + '"', "\ufeff" + secret.decode()):  # key text: taken
        assert ckptstore.open(f"file://{tmp_path}/s", signing_key=given).signing_key is not None
    broken = secret.decode().replace("MC4", "XX4")
    with pytest.raises(InvalidOptionError) as caught:
        ckptstore.open(f"file://{tmp_path}/s", signing_key=broken[:-30])
    assert secret.decode()[40:60] not in str(caught.value)
    with pytest.raises(InvalidOptionError, match="not shown") as caught:
        ckptstore.open(f"file://{tmp_path}/s", signing_key=f"/no/such/{secret.decode()}")
    assert secret.decode()[40:60] not in str(caught.value)
    with pytest.raises(InvalidOptionError, match="digests=False"):
        ckptstore.open(f"file://{tmp_path}/s", signing_key=private, digests=False)


def test_the_environment_names_the_keys(
    tmp_path: Path, keys: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    private, public = keys
    url = f"file://{tmp_path}/s"
    monkeypatch.setenv(SIGNING_KEY_ENV, str(private))
    with ckptstore.open(url).begin(1) as pending:
        pending.write("a", b"1")
    monkeypatch.setenv(SIGNING_KEY_ENV, private.read_text())  # the key itself
    with ckptstore.open(url).begin(2) as pending:
        pending.write("a", b"2")
    monkeypatch.delenv(SIGNING_KEY_ENV)
    with ckptstore.open(url).begin(3) as pending:
        pending.write("a", b"3")
    monkeypatch.setenv(TRUST_ENV, f"{public}{os.pathsep}")
    assert ckptstore.open(url).steps() == [1, 2]
    monkeypatch.setenv(TRUST_ENV, "")
    with pytest.raises(InvalidOptionError, match="names no public key"):
        ckptstore.open(url)
    monkeypatch.setenv(SIGNING_KEY_ENV, "-----BEGIN PRIVATE KEY-----\nnot a key\n")
    monkeypatch.delenv(TRUST_ENV)
    with pytest.raises(InvalidOptionError) as caught:
        ckptstore.open(url)
    assert "not a key" not in str(caught.value)


def test_digests_alone_catch_damage_on_every_read_path(tmp_path: Path) -> None:
    """An unsigned store opened with ``digests`` records them; every reader checks them."""
    url = f"file://{tmp_path}/s"
    store = ckptstore.open(url, digests="sha256")
    size = 40 * 1024 * 1024  # large enough for the parallel read paths
    data = os.urandom(size)
    with store.begin(1) as pending:
        pending.write("big", data)
    record = store.manifest(1).shard("big")
    assert record is not None and record.digest.startswith("sha256:")
    path = tmp_path / "s" / f"step-{1:020d}" / "data" / "big"
    damaged = bytearray(data)
    damaged[size - 100] ^= 1  # in the last block
    path.write_bytes(bytes(damaged))
    checkpoint = ckptstore.open(url).get(1)
    with pytest.raises(ShardCorruptError, match="digest mismatch in block 9"):
        checkpoint.read("big")
    with pytest.raises(ShardCorruptError, match="digest mismatch in block 9"):
        checkpoint.read_into("big", bytearray(size))
    with pytest.raises(ShardCorruptError, match="digest mismatch in block 9"):
        checkpoint.read_range("big", size - 200, 150)
    assert checkpoint.read_range("big", 0, 1000).tobytes() == data[:1000]
    assert not checkpoint.verify().ok
    assert ckptstore.open(url).latest(verified=True) is None
    with pytest.raises(CheckpointNotFoundError):
        ckptstore.open(url).get(2)
    assert json.loads((tmp_path / "s" / f"step-{1:020d}" / "manifest.json").read_text())


# -- tiers: a copy keeps the first signature, and is checked as a copy -----------------------


def test_a_durable_copy_keeps_the_first_signature_and_the_replicator_signs_nothing(
    tmp_path: Path, keys: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    private, public = keys
    fast, durable = f"file://{tmp_path}/fast", f"file://{tmp_path}/durable"
    ckptstore.open(fast)  # the fast store exists; an unsigned step is saved in it below
    with ckptstore.open(fast, replicate_to=durable, signing_key=private) as pair:
        with pair.begin(1, metadata={"lr": 0.5}) as pending:
            pending.write("w", os.urandom(5 * 1024 * 1024))
        pair.wait_replicated(timeout=60)
    copy = ckptstore.open(durable).manifest(1)
    assert copy.signature is None and copy.source is not None
    assert copy.source.signature is not None and copy.shards[0].digest
    trusted = ckptstore.open(durable, trust=[public])
    assert trusted.get(1).verify().ok and trusted.steps() == [1]

    # A key in the environment: the trainer's store signs, the replicator still does not.
    monkeypatch.setenv(SIGNING_KEY_ENV, str(private))
    with ckptstore.open(fast, replicate_to=durable, signing_key=False) as pair:
        with pair.begin(2) as pending:  # unsigned: signing_key=False beats the environment
            pending.write("w", b"2")
        pair.wait_replicated(timeout=60)
    monkeypatch.delenv(SIGNING_KEY_ENV)
    assert ckptstore.open(durable).manifest(2).source is not None
    with pytest.raises(UntrustedCheckpointError, match="is not signed"):
        trusted.get(2)

    # A copy edited in the durable tier (its metadata; or its epoch) is refused.
    path = tmp_path / "durable" / f"step-{1:020d}" / "manifest.json"
    original = path.read_bytes()
    edited = dataclasses.replace(Manifest.decode(original, where="t"), metadata={"lr": 5.0})
    path.write_bytes(edited.encode())
    with pytest.raises(UntrustedCheckpointError, match="metadata is not that signed"):
        ckptstore.open(durable, trust=[public]).get(1)
    moved = dataclasses.replace(Manifest.decode(original, where="t"), epoch=3)
    path.write_bytes(moved.encode())
    with pytest.raises(Exception, match="epoch"):
        ckptstore.open(durable, trust=[public]).get(1)
    path.write_bytes(original)
    assert ckptstore.open(durable, trust=[public]).get(1).verify().ok


def test_a_trusting_pair_reads_what_a_signing_pair_wrote(
    tmp_path: Path, keys: tuple[Path, Path]
) -> None:
    private, public = keys
    fast, durable = f"file://{tmp_path}/fast", f"file://{tmp_path}/durable"
    with ckptstore.open(fast, replicate_to=durable, signing_key=private) as pair:
        for step in (1, 2):
            with pair.begin(step) as pending:
                pending.write("w", b"%d" % step)
        pair.wait_replicated(timeout=60)
    (tmp_path / "fast" / f"step-{2:020d}" / "manifest.json").unlink()  # the node was lost
    with ckptstore.open(fast, replicate_to=durable, trust=[public]) as reader:
        latest = reader.latest()
        assert latest is not None and latest.step == 2 and latest.read("w") == b"2"


# -- the command line ---------------------------------------------------------------------------


def test_keygen_ls_show_verify_under_trust(tmp_path: Path, capsys: Any) -> None:
    import io

    out = io.StringIO()
    assert cli(["keygen", str(tmp_path / "run.key")], out) == 0
    assert "run.key.pub" in out.getvalue() and "PRIVATE" not in out.getvalue()
    assert cli(["keygen", str(tmp_path / "run.key")], io.StringIO()) == 2  # never overwrites
    url, public = f"file://{tmp_path}/s", str(tmp_path / "run.key.pub")
    source = tmp_path / "dir"
    source.mkdir()
    (source / "weights.bin").write_bytes(b"w" * 1000)
    push = ["push", str(source), url, "--step", "1", "--signing-key", str(tmp_path / "run.key")]
    assert cli(push, io.StringIO()) == 0
    assert cli(["push", str(source), url, "--step", "2"], io.StringIO()) == 0  # unsigned
    out = io.StringIO()
    assert cli(["ls", url, "--trust", public], out) == 0
    assert "UNTRUSTED" in out.getvalue() and "manifest of step 2 is not signed" in out.getvalue()
    out = io.StringIO()
    assert cli(["verify", url, "--all", "--trust", public], out) == 1
    assert "1 ok, 0 broken, 1 untrusted" in out.getvalue()
    out = io.StringIO()
    assert cli(["show", url, "1", "--trust", public], out) == 0
    assert "signed      by ed25519:" in out.getvalue() and "trusted" in out.getvalue()
    out = io.StringIO()
    assert cli(["show", url, "2"], out) == 0
    assert "signed      no (unsigned)" in out.getvalue()
    capsys.readouterr()


# -- what a hostile review found (each fixed) -------------------------------------------------


def test_a_store_that_signs_trusts_its_own_key_and_never_resumes_from_a_forgery(
    tmp_path: Path, keys: tuple[Path, Path]
) -> None:
    private, _ = keys
    url = f"file://{tmp_path}/s"
    with ckptstore.open(url, signing_key=private, retention=ckptstore.KeepLast(2)) as trainer:
        for step in (1, 2):
            with trainer.begin(step) as pending:
                pending.write("w", b"genuine %d" % step)
    with ckptstore.open(url) as forger:  # write access, no key
        for step in (3, 4):
            with forger.begin(step) as pending:
                pending.write("w", b"FORGED %d" % step)
    with ckptstore.open(url, signing_key=private, retention=ckptstore.KeepLast(2)) as trainer:
        resumed = trainer.latest()
        assert resumed is not None and resumed.read("w") == b"genuine 2"
        with trainer.begin(5) as pending:
            pending.write("w", resumed.read("w") + b" -> trained")
        assert trainer.steps() == [2, 5]  # retention counted the signed steps only
    assert ckptstore.open(url).steps() == [2, 3, 4, 5]  # the forgeries are left alone
    assert ckptstore.open(url, signing_key=private, trust=False).latest().step == 5


def test_a_signed_checkpoint_wrapped_as_a_copy_is_not_planted_in_another_epoch(
    tmp_path: Path, keys: tuple[Path, Path]
) -> None:
    from ckptstore.manifest import ReplicaSource

    private, public = keys
    url = f"file://{tmp_path}/s"
    writer = ckptstore.open(url, signing_key=private)
    with writer.begin(1) as pending:
        pending.write("w", b"GOOD")
    fresh = ckptstore.open(url, signing_key=private)
    fresh.take_over(None, discard_history=True)
    with fresh.begin(1) as pending:
        pending.write("w", b"BAD")
    ckptstore.open(url, signing_key=private).take_over(1, from_epoch=0)  # the undo
    bad = fresh.strategy.read_manifest(1, 1)
    copy = dataclasses.replace(
        bad,
        epoch=0,
        signature=None,
        signed=b"",
        source=ReplicaSource(
            url="file:///elsewhere",
            step=1,
            attempt=bad.attempt,
            committed_at=bad.committed_at,
            signature=bad.signature,
            signed=bad.signed,
        ),
    )
    root = tmp_path / "s"
    (root / f"step-{1:020d}" / "data" / "w").write_bytes(b"BAD")
    (root / f"step-{1:020d}" / "manifest.json").write_bytes(copy.encode())
    with pytest.raises(UntrustedCheckpointError, match="no tier record"):
        ckptstore.open(url, trust=[public]).get(1)


def test_a_pair_signs_its_durable_takeovers_and_binds_a_copy_to_its_signed_fields(
    tmp_path: Path, keys: tuple[Path, Path]
) -> None:
    private, public = keys
    fast, durable = f"file://{tmp_path}/fast", f"file://{tmp_path}/durable"
    with ckptstore.open(fast, replicate_to=durable, signing_key=private) as pair:
        for step in (1, 2):
            with pair.begin(step) as pending:
                pending.write("w", b"%d" % step)
        pair.wait_replicated(timeout=60)
        fast_epoch, durable_epoch = pair.take_over(2, note="restart")
        assert fast_epoch.signature is not None and durable_epoch.signature is not None
        pair.rollback(1)
    reader = ckptstore.open(durable, trust=[public])
    assert reader.latest() is not None and reader.latest().step == 1
    path = tmp_path / "durable" / f"step-{1:020d}" / "manifest.json"
    copy = Manifest.decode(path.read_bytes(), where="t")
    for edit, problem in (
        ({"timings": {"write_s": 1e9}}, "timings"),
        ({"source": dataclasses.replace(copy.source, step=2)}, "was signed"),
    ):
        path.write_bytes(dataclasses.replace(copy, **edit).encode())
        with pytest.raises(UntrustedCheckpointError, match=problem):
            ckptstore.open(durable, trust=[public]).get(1)
    # The copy read through another store's URL is not that store's copy.
    elsewhere = tmp_path / "elsewhere"
    (tmp_path / "durable").rename(elsewhere)
    path = elsewhere / f"step-{1:020d}" / "manifest.json"
    path.write_bytes(copy.encode())
    with pytest.raises(UntrustedCheckpointError, match="signed for the durable store"):
        ckptstore.open(f"file://{elsewhere}", trust=[public]).get(1)


def test_bytes_that_fail_their_digest_are_not_left_in_the_callers_buffer(
    tmp_path: Path, keys: tuple[Path, Path]
) -> None:
    private, public = keys
    url = f"file://{tmp_path}/s"
    size = 40 * 1024 * 1024
    with ckptstore.open(url, signing_key=private).begin(1) as pending:
        pending.write("big", bytes(size))
    path = tmp_path / "s" / f"step-{1:020d}" / "data" / "big"
    forged = bytearray(size)
    forged[5 * 1024 * 1024 : 6 * 1024 * 1024] = b"\x7f" * (1024 * 1024)  # in block 1
    path.write_bytes(bytes(forged))
    checkpoint = ckptstore.open(url, trust=[public]).get(1)

    def stream(out: bytearray) -> None:
        with checkpoint.open("big") as reader:
            reader.readinto(out)

    for read in (
        lambda out: checkpoint.read_into("big", out),
        lambda out: checkpoint.read_range("big", 0, size, into=out),
        stream,
    ):
        out = bytearray(size)
        with pytest.raises(ShardCorruptError, match="digest mismatch in block 1"):
            read(out)
        assert b"\x7f" not in out


def test_the_key_holder_signs_an_unsigned_takeover_it_checked(
    tmp_path: Path, keys: tuple[Path, Path]
) -> None:
    import io

    private, public = keys
    url = f"file://{tmp_path}/s"
    with ckptstore.open(url, signing_key=private).begin(1) as pending:
        pending.write("w", b"1")
    ckptstore.open(url).take_over(1, note="an unsigned restart")
    with pytest.raises(UntrustedCheckpointError, match="epoch 1 is not signed"):
        ckptstore.open(url, trust=[public]).latest()
    assert cli(["repair-epoch", url, "1", "--resign"], io.StringIO()) == 2  # no key: refused
    out = io.StringIO()
    assert cli(["repair-epoch", url, "1", "--resign", "--signing-key", str(private)], out) == 0
    assert "signed the record of epoch 1" in out.getvalue()
    reader = ckptstore.open(url, trust=[public])
    assert reader.latest() is not None and reader.lineage().epoch(1).note == "an unsigned restart"
    assert cli(["repair-epoch", url, "1", "--resign", "--signing-key", str(private)], out) == 2
