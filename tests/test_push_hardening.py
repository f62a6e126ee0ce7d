"""``push`` and ``publish_directory`` at the seams (issue 24): a zombie's push after a takeover
is fenced (item 7), a symbolic link or a file swapped after the listing is never published
(items 14 and 16), a link loop says so and a store nested with the pushed directory is refused
(item 18). Through the CLI and the public API, on file:// and moto's S3."""

from __future__ import annotations

import io
import json
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import ckptstore
import ckptstore.directory
from ckptstore.adapters.directory import DirectoryFile, directory_files, publish_directory
from ckptstore.cli import main
from ckptstore.errors import (
    EpochNotFoundError,
    EpochRequiredError,
    InvalidInputError,
    InvalidOptionError,
    SupersededError,
)


@pytest.fixture(params=["file", "s3"])
def store(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[str, dict[str, object]]:
    """A store URL the CLI can open (S3 credentials from the environment) and the options
    for ``ckptstore.open``."""
    if request.param == "file":
        return f"file://{tmp_path}/store", {}
    server = request.getfixturevalue("moto_s3")
    for name, value in server.credentials_env().items():
        monkeypatch.setenv(name, value)
    return server.url(f"push-{os.getpid()}-{tmp_path.name}"), dict(server.options)


def run(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    return main(list(argv), out), out.getvalue()


def one_error_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    assert err.startswith("ckptstore: error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err and "[Errno" not in err, err
    return err


def checkpoint_dir(root: Path, tag: str) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "model.bin").write_bytes(tag.encode() * 1000)
    (root / "trainer_state.json").write_bytes(b'{"tag": "%s"}' % tag.encode())
    return root


def with_query(url: str, query: str) -> str:
    return f"{url}{'&' if '?' in url else '?'}{query}"


# -- item 7: push can be fenced -----------------------------------------------------------


def test_a_zombie_push_after_a_takeover_is_superseded(
    store: tuple[str, dict[str, object]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url, options = store
    for step in (10, 20, 30):  # the old run pushes a new process (a new handle) per save
        assert run("push", str(checkpoint_dir(tmp_path / f"z{step}", "zombie")), url,
                   "--step", str(step))[0] == 0  # fmt: skip
    new_run = ckptstore.open(url, **options)
    epoch = new_run.take_over(resumed_from=30).number
    assert epoch == 1
    capsys.readouterr()

    zombie_dir = checkpoint_dir(tmp_path / "z40", "zombie")
    status, text = run("push", str(zombie_dir), url, "--step", "40", "--json")
    assert status == 2
    assert json.loads(text)["type"] == "EpochRequiredError"  # a SupersededError
    err = one_error_line(capsys)
    assert "taken over (epoch 1" in err and "resumed from step 30" in err and "--epoch 1" in err
    status, text = run("push", str(zombie_dir), url, "--step", "40", "--epoch", "0", "--json")
    assert status == 2 and json.loads(text)["type"] == "SupersededError"
    assert "superseded by epoch 1" in one_error_line(capsys)
    with pytest.raises(SupersededError, match="taken over"):  # the API: the same refusal
        publish_directory(ckptstore.open(url, **options), 40, zombie_dir)

    new_run.save(40, {"model.bin": b"new" * 1000})  # not CheckpointExistsError
    latest = ckptstore.open(url, **options).latest()
    assert latest is not None and (latest.step, latest.manifest.epoch) == (40, 1)
    assert latest.read("model.bin") == b"new" * 1000  # the new run's bytes, not the zombie's

    # The new run pushes by naming its epoch: --epoch, or ?epoch= in the URL.
    mine = checkpoint_dir(tmp_path / "n50", "new")
    assert run("push", str(mine), url, "--step", "50", "--epoch", "1")[0] == 0
    assert run("push", str(mine), with_query(url, "epoch=1"), "--step", "60")[0] == 0
    reader = ckptstore.open(url, **options)
    assert reader.steps() == [10, 20, 30, 40, 50, 60]
    assert {reader.get(s).manifest.epoch for s in (40, 50, 60)} == {1}
    assert reader.get(60).read("model.bin") == b"new" * 1000


def test_a_handle_opened_before_the_takeover_that_had_not_saved_is_refused(
    tmp_path: Path,
) -> None:
    """A zombie whose handle had not saved yet when the store was taken over does not
    join the new run's epoch at its first save (it did before)."""
    url = f"file://{tmp_path}/store"
    ckptstore.open(url).save(1, {"m": b"old"})
    zombie = ckptstore.open(url)
    ckptstore.open(url).take_over(resumed_from=1)
    with pytest.raises(EpochRequiredError):
        publish_directory(zombie, 2, checkpoint_dir(tmp_path / "d", "zombie"))
    with pytest.raises(EpochRequiredError):
        zombie.save(2, {"m": b"zombie"})
    assert ckptstore.open(url).steps() == [1]


def test_an_epoch_in_the_url_is_parsed_by_every_opener(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/store"
    taker = ckptstore.open(url)
    taker.save(1, {"m": b"x"})
    taker.take_over(resumed_from=1)
    assert ckptstore.open(with_query(url, "epoch=1")).epoch == 1
    assert ckptstore.open(with_query(url, "epoch=1"), epoch=1).epoch == 1
    with pytest.raises(InvalidOptionError, match="give one"):
        ckptstore.open(with_query(url, "epoch=1"), epoch=0)
    with pytest.raises(InvalidOptionError, match="epoch must be an integer"):
        ckptstore.open(with_query(url, "epoch=one"))
    with pytest.raises(EpochNotFoundError, match="epoch 7 was never taken"):
        ckptstore.open(with_query(url, "epoch=7"))
    for command in (["ls"], ["show"], ["verify"], ["gc", "--dry-run"]):  # readers too
        assert run(command[0], with_query(url, "epoch=1"), *command[1:])[0] == 0, command
    store = ckptstore.open(with_query(url, "epoch=1"))
    publish_directory(store, 2, checkpoint_dir(tmp_path / "d", "new"), epoch=1)
    with pytest.raises(InvalidInputError, match="writes in epoch 1, not epoch 0"):
        publish_directory(store, 3, tmp_path / "d", epoch=0)


def test_the_adapters_take_the_epoch_from_the_url(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/store"
    ckptstore.open(url).take_over(resumed_from=None)
    lightning = pytest.importorskip("ckptstore.lightning")
    assert lightning.CkptStoreIO(with_query(url, "epoch=1")).store.epoch == 1
    huggingface = pytest.importorskip("ckptstore.huggingface")
    callback = huggingface.CkptStoreCallback(with_query(url, "epoch=1"))
    assert callback.store.epoch == 1


# -- items 14 and 16: links, and files swapped after the listing --------------------------


def test_push_refuses_a_symbolic_link_unless_told_to_follow(
    store: tuple[str, dict[str, object]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url, options = store
    outside = tmp_path / "secret.txt"
    outside.write_bytes(b"root:x:0:0\n")
    source = checkpoint_dir(tmp_path / "checkpoint-1", "one")
    os.symlink(outside, source / "passwd")
    assert run("push", str(source), url, "--step", "1")[0] == 2
    err = one_error_line(capsys)
    assert "passwd: a symbolic link" in err and "--follow-symlinks" in err
    assert ckptstore.open(url, **options).steps() == []
    assert run("push", str(source), url, "--step", "1", "--follow-symlinks")[0] == 0
    assert ckptstore.open(url, **options).get(1).read("passwd") == b"root:x:0:0\n"


@pytest.fixture
def swap_after_listing(monkeypatch: pytest.MonkeyPatch) -> Callable[..., None]:
    """Run ``change`` once ``publish_directory`` has listed the directory, before any read."""
    listing = ckptstore.directory.directory_files

    def arrange(change: Callable[[], None]) -> None:
        def listed_then_changed(directory: Any, **options: Any) -> list[DirectoryFile]:
            files = listing(directory, **options)
            change()
            return files

        monkeypatch.setattr(ckptstore.directory, "directory_files", listed_then_changed)

    return arrange


@pytest.mark.parametrize("follow", [False, True])
def test_a_file_swapped_for_a_link_after_the_listing_is_not_published(
    store: tuple[str, dict[str, object]],
    tmp_path: Path,
    swap_after_listing: Callable[..., None],
    follow: bool,
) -> None:
    url, options = store
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"S" * 4000)  # the same size as the file it replaces
    source = checkpoint_dir(tmp_path / "checkpoint-1", "abcd")
    target = source / "model.bin"

    def swap() -> None:
        target.unlink()
        os.symlink(outside, target)

    swap_after_listing(swap)
    writer = ckptstore.open(url, **options)
    with pytest.raises(InvalidInputError, match=r"model\.bin was replaced after it was listed"):
        publish_directory(writer, 1, source, follow_symlinks=follow, parallel=1)
    assert writer.steps() == []


def test_a_directory_swapped_for_a_link_after_the_listing_is_not_published(
    tmp_path: Path, swap_after_listing: Callable[..., None]
) -> None:
    outside = tmp_path / "elsewhere"
    (outside / "sub").mkdir(parents=True)
    (outside / "sub" / "w.bin").write_bytes(b"S" * 10)
    source = tmp_path / "checkpoint-1"
    (source / "sub").mkdir(parents=True)
    (source / "sub" / "w.bin").write_bytes(b"w" * 10)

    def swap() -> None:
        (source / "sub").rename(tmp_path / "gone")
        os.symlink(outside / "sub", source / "sub")

    swap_after_listing(swap)
    writer = ckptstore.open(f"file://{tmp_path}/store")
    with pytest.raises(InvalidInputError, match=r"replaced after it was listed \(now another"):
        publish_directory(writer, 1, source)
    assert writer.steps() == []


def test_a_followed_link_pointed_elsewhere_after_the_listing_is_not_published(
    tmp_path: Path, swap_after_listing: Callable[..., None]
) -> None:
    listed, other = tmp_path / "listed.bin", tmp_path / "other.bin"
    listed.write_bytes(b"L" * 10)
    other.write_bytes(b"O" * 10)
    source = tmp_path / "checkpoint-1"
    source.mkdir()
    os.symlink(listed, source / "w.bin")

    def repoint() -> None:
        (source / "w.bin").unlink()
        os.symlink(other, source / "w.bin")

    swap_after_listing(repoint)
    writer = ckptstore.open(f"file://{tmp_path}/store")
    with pytest.raises(InvalidInputError, match=r"replaced after it was listed \(now another"):
        publish_directory(writer, 1, source, follow_symlinks=True)
    assert writer.steps() == []


def test_a_file_swapped_for_a_fifo_after_the_listing_is_refused_at_once(
    store: tuple[str, dict[str, object]],
    tmp_path: Path,
    swap_after_listing: Callable[..., None],
    capsys: pytest.CaptureFixture[str],
) -> None:
    url, options = store
    source = checkpoint_dir(tmp_path / "checkpoint-1", "abcd")
    fifo = source / "model.bin"

    def swap() -> None:
        fifo.unlink()
        os.mkfifo(fifo)

    swap_after_listing(swap)
    outcome: list[tuple[int, str]] = []
    pusher = threading.Thread(
        target=lambda: outcome.append(run("push", str(source), url, "--step", "1")), daemon=True
    )
    pusher.start()
    pusher.join(timeout=60)
    if pusher.is_alive():  # blocked in open(): a writer lets it go, then the test fails
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        pusher.join(timeout=60)
        pytest.fail("push blocked on a FIFO swapped in after the listing")
    assert outcome[0][0] == 2
    assert "model.bin was replaced after it was listed (now a FIFO)" in one_error_line(capsys)
    assert ckptstore.open(url, **options).steps() == []


# -- item 18: a link loop says so; a store nested with the pushed directory ----------------


def test_a_symbolic_link_loop_is_one_line_that_says_loop(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = checkpoint_dir(tmp_path / "checkpoint-1", "x")
    os.symlink("a", source / "b")
    os.symlink("b", source / "a")
    for follow in ([], ["--follow-symlinks"]):
        assert run("push", str(source), f"file://{tmp_path}/store", "--step", "1", *follow)[0] == 2
        err = one_error_line(capsys)
        assert "a symbolic link loop" in err and "dangling" not in err, err
    for follow in (False, True):
        with pytest.raises(InvalidInputError, match="loop"):
            directory_files(source, follow_symlinks=follow)


def test_push_refuses_a_store_inside_the_pushed_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    project = checkpoint_dir(tmp_path / "project", "p")
    monkeypatch.chdir(project)
    assert run("push", ".", "./ckpts", "--step", "1")[0] == 2
    assert "is inside the directory being published" in one_error_line(capsys)
    assert not (project / "ckpts").exists()  # refused before the store was created
    os.symlink(project, tmp_path / "alias")  # real paths are compared
    assert run("push", str(tmp_path / "alias"), f"file://{project}/ckpts", "--step", "1")[0] == 2
    assert "inside the directory" in one_error_line(capsys)
    other = checkpoint_dir(tmp_path / "other", "o")
    with pytest.raises(InvalidInputError, match="inside the directory"):
        publish_directory(ckptstore.open(f"file://{other}/sub/ckpts"), 1, other)

    outside = f"file://{tmp_path}/store"  # the reverse: a directory inside the store
    assert run("push", ".", outside, "--step", "1")[0] == 0
    published = next(p for p in (tmp_path / "store").iterdir() if p.name.startswith("step-"))
    assert run("push", str(published), outside, "--step", "2")[0] == 2
    assert "inside the store" in one_error_line(capsys)
    assert ckptstore.open(outside).steps() == [1]
    assert sorted(ckptstore.open(outside).get(1).names) == ["model.bin", "trainer_state.json"]


def test_a_directory_named_through_a_link_is_listed_whole(tmp_path: Path) -> None:
    """The directory itself may be a link (the caller named it); the files under it are
    listed by directory descriptors, and published by their names under it."""
    source = checkpoint_dir(tmp_path / "real" / "checkpoint-1", "r")
    (source / "sub").mkdir()
    (source / "sub" / "deep.bin").write_bytes(b"d")
    os.symlink(source, tmp_path / "alias")
    listed = directory_files(tmp_path / "alias")
    assert [f.name for f in listed] == ["model.bin", "sub/deep.bin", "trainer_state.json"]
    assert listed[1].path == tmp_path / "alias" / "sub" / "deep.bin"
    store = ckptstore.open(f"file://{tmp_path}/store")
    assert publish_directory(store, 1, tmp_path / "alias").read("sub/deep.bin") == b"d"
