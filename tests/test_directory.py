"""A trainer's checkpoint directory published as one checkpoint, and materialised back."""

from __future__ import annotations

import errno
import os
import socket
from pathlib import Path

import pytest

import ckptstore
import ckptstore.directory
from ckptstore import CheckpointExistsError, IntegrityError, InvalidInputError
from ckptstore.adapters.directory import directory_files, materialize, publish_directory
from ckptstore.cli import main as cli
from ckptstore.errors import StorageError
from ckptstore.sharing import storage_use


def _trainer_directory(root: Path, seed: int = 0) -> dict[str, bytes]:
    """What a Hugging Face Trainer's checkpoint-N directory holds, roughly."""
    files = {
        "config.json": b'{"hidden": 8}',
        "model.safetensors": bytes((seed + i) % 256 for i in range(300_000)),
        "optimizer.pt": os.urandom(70_000),
        "trainer_state.json": b'{"global_step": %d}' % seed,
        "rng_state.pth": b"\x00" * 5,
        "empty.bin": b"",
        "sub/dir/deep.txt": b"deep",
    }
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return files


def _read_tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


@pytest.fixture(params=["file", "s3"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, dict[str, object]]:
    if request.param == "file":
        return f"file://{tmp_path}/store", {}
    server = request.getfixturevalue("moto_s3")
    return server.url(f"dir-{os.getpid()}-{tmp_path.name}"), dict(server.options)


def test_a_directory_round_trips_through_any_store(
    store_url: tuple[str, dict[str, object]], tmp_path: Path
) -> None:
    url, options = store_url
    store = ckptstore.open(url, **options)
    source = tmp_path / "checkpoint-20"
    files = _trainer_directory(source, seed=20)
    checkpoint = publish_directory(store, 20, source, metadata={"trainer": "hf"}, parallel=3)
    assert sorted(checkpoint.names) == sorted(files)
    assert checkpoint.metadata == {"trainer": "hf"}
    target = materialize(store.get(20), tmp_path / "restored" / "checkpoint-20")
    assert _read_tree(target) == files
    left = sorted(p.name for p in target.parent.iterdir())
    assert left == [".checkpoint-20.ckptstore-pulled", "checkpoint-20"]  # no staging, no lock


def test_a_failed_publish_publishes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = ckptstore.open(f"file://{tmp_path}/store")
    source = tmp_path / "checkpoint-1"
    _trainer_directory(source)
    listed = directory_files(source)
    (source / "optimizer.pt").unlink()  # removed between the listing and its read
    monkeypatch.setattr(ckptstore.directory, "directory_files", lambda directory, **_: listed)
    with pytest.raises(StorageError, match=r"optimizer\.pt") as caught:
        publish_directory(store, 1, source, parallel=2)
    assert caught.value.errno == errno.ENOENT
    assert store.steps() == []
    assert store.gc(grace=0).removed == []  # nothing left behind either


@pytest.mark.parametrize("incremental", [False, True])
@pytest.mark.parametrize("change", ["shorter", "longer", "same size"])
def test_a_file_that_changes_under_the_publish_is_refused(
    tmp_path: Path, incremental: bool, change: str
) -> None:
    store = ckptstore.open(f"file://{tmp_path}/store", incremental=incremental)
    source = tmp_path / "checkpoint-1"
    _trainer_directory(source)
    listed = directory_files(source)
    optimizer = source / "optimizer.pt"
    if change == "shorter":
        optimizer.write_bytes(b"shorter")
    elif change == "longer":  # appended to: the first bytes are as listed
        with optimizer.open("ab") as appending:
            appending.write(b"more")
    else:  # rewritten in place, same size: its modification time tells
        optimizer.write_bytes(os.urandom(70_000))
        os.utime(optimizer, ns=(0, optimizer.stat().st_mtime_ns + 1_000_000))
    from ckptstore.adapters.directory import _publish_file

    with pytest.raises(InvalidInputError, match="changed while"), store.begin(1) as pending:
        try:
            _publish_file(pending, next(f for f in listed if f.name == "optimizer.pt"))
        finally:
            with pytest.raises(Exception, match="optimizer"):
                pending.publish()  # even a caller that goes on cannot publish it
    assert store.steps() == []


def test_an_incremental_push_shares_the_files_that_did_not_change(
    store_url: tuple[str, dict[str, object]], tmp_path: Path
) -> None:
    url, options = store_url
    store = ckptstore.open(url, incremental=True, **options)
    pushed = {}
    for step in (1, 2, 3):
        source = tmp_path / f"checkpoint-{step}"
        pushed[step] = _trainer_directory(source, seed=0)  # model.safetensors unchanged
        (source / "optimizer.pt").write_bytes(os.urandom(2 * 2**20))  # the rest changes
        pushed[step]["optimizer.pt"] = (source / "optimizer.pt").read_bytes()
        publish_directory(store, step, source, parallel=2)
    manifests = [store.get(step).manifest for step in (1, 2, 3)]
    use = storage_use(store.strategy, manifests)
    assert use.shared[(3, manifests[2].epoch)] >= 300_000  # the model, stored once
    assert use.listed - use.stored >= 2 * 300_000
    for step in (1, 2, 3):
        assert store.get(step).verify().ok
        target = materialize(store.get(step), tmp_path / "restored" / f"checkpoint-{step}")
        assert _read_tree(target) == pushed[step]


def test_entries_that_are_not_files(tmp_path: Path) -> None:
    source = tmp_path / "d"
    source.mkdir()
    (source / "real.bin").write_bytes(b"x")
    os.symlink("real.bin", source / "link.bin")
    # A link is refused unless the caller opts in (it was published as its target unasked).
    with pytest.raises(InvalidInputError, match=r"link\.bin: a symbolic link \(-> real\.bin\)"):
        directory_files(source)
    listed = directory_files(source, follow_symlinks=True)
    assert [(f.name, f.size) for f in listed] == [("link.bin", 1), ("real.bin", 1)]
    (source / "link.bin").unlink()
    os.symlink("missing", source / "dangling")
    for follow in (False, True):
        with pytest.raises(InvalidInputError, match="dangling"):
            directory_files(source, follow_symlinks=follow)
    (source / "dangling").unlink()
    os.symlink(str(tmp_path), source / "loop")
    for follow in (False, True):
        with pytest.raises(InvalidInputError, match="other than a file"):
            directory_files(source, follow_symlinks=follow)
    (source / "loop").unlink()
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(str(source / "sock"))
        with pytest.raises(InvalidInputError, match="not a regular file"):
            directory_files(source)
    with pytest.raises(InvalidInputError, match="not a directory"):
        directory_files(tmp_path / "nowhere")


def test_materialize_refuses_an_existing_directory_unless_told_to_replace(tmp_path: Path) -> None:
    store = ckptstore.open(f"file://{tmp_path}/store")
    source = tmp_path / "src"
    files = _trainer_directory(source, seed=3)
    publish_directory(store, 3, source)
    publish_directory(store, 4, source)
    target = tmp_path / "out"
    target.mkdir()
    (target / "partial.bin").write_bytes(b"what a crashed trainer left")
    with pytest.raises(InvalidInputError, match="already exists"):
        materialize(store.get(3), target)
    assert (target / "partial.bin").exists()
    # not made by a pull: replace refuses it too (issue 24, item 1: it used to be swapped out)
    with pytest.raises(InvalidInputError, match="not made by ckptstore pull"):
        materialize(store.get(3), target, replace=True)
    assert _read_tree(target) == {"partial.bin": b"what a crashed trainer left"}
    (target / "partial.bin").unlink()
    target.rmdir()
    materialize(store.get(3), target)
    materialize(store.get(4), target, replace=True)  # a pull's own directory: replaced
    assert _read_tree(target) == files
    assert sorted(p.name for p in tmp_path.iterdir()) == [MARKER, "out", "src", "store"]


def test_a_damaged_shard_leaves_the_target_untouched(tmp_path: Path) -> None:
    store = ckptstore.open(f"file://{tmp_path}/store")
    source = tmp_path / "src"
    _trainer_directory(source)
    publish_directory(store, 1, source)
    stored = tmp_path / "store" / f"step-{1:020d}" / "data" / "optimizer.pt"
    data = bytearray(stored.read_bytes())
    data[100] ^= 0xFF
    stored.write_bytes(bytes(data))
    target = tmp_path / "out"
    with pytest.raises(IntegrityError):
        materialize(store.get(1), target)
    assert not target.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src", "store"]  # no lock left


def test_leftovers_of_an_interrupted_materialize_are_removed(tmp_path: Path) -> None:
    store = ckptstore.open(f"file://{tmp_path}/store")
    source = tmp_path / "src"
    _trainer_directory(source)
    publish_directory(store, 1, source)
    (tmp_path / ".out.ckptstore-0123456789ab").mkdir()
    (tmp_path / ".out.ckptstore-0123456789ab" / "half").write_bytes(b"x")
    materialize(store.get(1), tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == [MARKER, "out", "src", "store"]


def test_a_crash_between_the_renames_of_a_swap_puts_the_old_directory_back(
    tmp_path: Path,
) -> None:
    store = ckptstore.open(f"file://{tmp_path}/store")
    source = tmp_path / "src"
    _trainer_directory(source)
    publish_directory(store, 1, source)
    materialize(store.get(1), tmp_path / "out")  # a pull's directory, named by the marker
    (tmp_path / "out" / "config.json").write_bytes(b"what the pull wrote, edited in place")
    aside = tmp_path / ".out.ckptstore-old-0123456789ab"  # renamed aside, then the crash
    os.rename(tmp_path / "out", aside)
    with pytest.raises(InvalidInputError, match="already exists"):
        materialize(store.get(1), tmp_path / "out")  # put back first: then it exists
    edited = b"what the pull wrote, edited in place"
    assert (tmp_path / "out" / "config.json").read_bytes() == edited
    assert not aside.exists()


def test_a_dangling_symlink_is_not_replaced_unasked(tmp_path: Path) -> None:
    store = ckptstore.open(f"file://{tmp_path}/store")
    source = tmp_path / "src"
    _trainer_directory(source)
    publish_directory(store, 1, source)
    os.symlink(tmp_path / "nowhere", tmp_path / "out")
    with pytest.raises(InvalidInputError, match="already exists"):
        materialize(store.get(1), tmp_path / "out")
    assert (tmp_path / "out").is_symlink()


MARKER = ".out.ckptstore-pulled"


def test_bad_arguments(tmp_path: Path) -> None:
    store = ckptstore.open(f"file://{tmp_path}/store")
    source = tmp_path / "src"
    _trainer_directory(source)
    with pytest.raises(InvalidInputError, match="parallel"):
        publish_directory(store, 1, source, parallel=0)
    publish_directory(store, 1, source)
    with pytest.raises(CheckpointExistsError):
        publish_directory(store, 1, source)
    with pytest.raises(InvalidInputError, match="parallel"):
        materialize(store.get(1), tmp_path / "out", parallel=0)


def test_cli_push_and_pull(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = f"file://{tmp_path}/store"
    source = tmp_path / "checkpoint-7"
    files = _trainer_directory(source, seed=7)
    assert cli(["push", str(source), url, "--step", "7"]) == 0
    assert "published step 7" in capsys.readouterr().out
    assert cli(["pull", url, str(tmp_path / "latest")]) == 0  # no step: the latest
    assert _read_tree(tmp_path / "latest") == files
    assert cli(["pull", url, "7", str(tmp_path / "seven")]) == 0
    assert _read_tree(tmp_path / "seven") == files
    capsys.readouterr()
    assert cli(["pull", url, "7", str(tmp_path / "seven")]) != 0  # exists: refused
    assert "already exists" in capsys.readouterr().err
    assert cli(["pull", url, "7", str(tmp_path / "seven"), "--replace"]) == 0
    assert cli(["pull", url, "8", str(tmp_path / "eight")]) != 0
    assert not (tmp_path / "eight").exists()
    capsys.readouterr()
    assert cli(["pull", url, str(tmp_path / ("x" * 300))]) == 2  # a name too long: one line
    err = capsys.readouterr().err
    assert err.startswith("ckptstore: error: cannot") and "Traceback" not in err
    assert "[Errno" not in err


def test_cli_pull_with_a_step_and_no_directory_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"file://{tmp_path}/store"
    source = tmp_path / "checkpoint-1"
    files = _trainer_directory(source, seed=1)
    assert cli(["push", str(source), url, "--step", "1"]) == 0
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    assert cli(["pull", url, "1"]) == 2  # a step without a directory: not a directory named 1
    assert "looks like a step" in capsys.readouterr().err
    assert not (tmp_path / "1").exists()
    assert cli(["pull", url, "./1"]) == 0  # a directory of that name, said so
    assert _read_tree(tmp_path / "1") == files


@pytest.mark.parametrize("stored", ["hashed then written", "hashed then shared"])
def test_a_file_rewritten_between_its_hash_and_its_write_is_not_stored_under_that_hash(
    store_url: tuple[str, dict[str, object]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    stored: str,
) -> None:
    """An incremental push reads a file once to hash it, and again to write (or upload, or
    compare) it: a file rewritten in between, at the same size and within the same
    modification-time tick, must not be stored under the first bytes' checksums (on an
    object store, as the blob those bytes name: every later push of them would share the
    wrong bytes). It is refused, or shared as the bytes it hashed, whole."""
    import ckptstore.pending as pending_module

    url, options = store_url
    store = ckptstore.open(url, incremental=True, **options)
    source = tmp_path / "src"
    source.mkdir()
    good = os.urandom(100_000)
    weights = source / "w.bin"
    weights.write_bytes(good)
    if stored == "hashed then shared":
        publish_directory(store, 1, source)
    real = pending_module.shard_checksums

    def rewritten_after_hashing(data: object, algorithm: str | None) -> object:
        sums = real(data, algorithm)  # type: ignore[arg-type]
        before = weights.stat()
        with weights.open("r+b") as rewriting:  # in place, same size
            rewriting.write(b"\0" * 100_000)
        os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))  # the same tick
        return sums

    monkeypatch.setattr(pending_module, "shard_checksums", rewritten_after_hashing)
    refusal = ""
    try:
        publish_directory(store, 2, source)
    except InvalidInputError as exc:
        refusal = str(exc)
    if refusal or stored == "hashed then written":
        assert "changed while" in refusal
        assert 2 not in store.steps()
    else:  # shared by the digest of step 1's bytes (an object store): those bytes, whole
        assert store.get(2).read("w.bin") == good
    monkeypatch.setattr(pending_module, "shard_checksums", real)
    weights.write_bytes(good)
    publish_directory(store, 3, source)
    assert store.get(3).read("w.bin") == good
    assert store.get(3).verify().ok
