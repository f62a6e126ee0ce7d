"""The trainer adapters and the user's own files (issue 24, items 2 and 16): the Hugging Face
callback never deletes a file it did not write (a ``checkpoint-N`` that differs from the
store's step N is moved aside, and a warning says where), and no adapter blocks on a FIFO
where a checkpoint file is expected. Calls that could block run in a thread with a bound, and
the FIFO is released if they do: a regression fails, it does not hang the suite."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import BackendUnderTest, FileBackend, S3Backend

BOUND_S = 30.0
"""Long enough for a loaded 2-core machine; a call that blocks on a FIFO never returns."""


@pytest.fixture(params=["file", "s3"])
def where(request: pytest.FixtureRequest, tmp_path: Path) -> BackendUnderTest:
    if request.param == "file":
        return FileBackend(tmp_path)
    return S3Backend(tmp_path, request.getfixturevalue("moto_s3"))


def _options(backend: BackendUnderTest) -> dict[str, Any]:
    return dict(backend.server.options) if isinstance(backend, S3Backend) else {}


def _write(directory: Path, files: dict[str, bytes]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for name, content in files.items():
        (directory / name).write_bytes(content)
    return directory


def _files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in directory.iterdir()}


def _fifo(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(path)
    return path


def _bounded(call: Callable[[], Any], fifos: list[Path]) -> Any:
    """``call()``'s result (or its exception, raised), if it ends within BOUND_S; if it does
    not, the FIFOs are opened for writing (which releases a reader blocked opening one) and
    the test fails."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = call()
        except BaseException as exc:  # re-raised in the test's thread
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(BOUND_S)
    if thread.is_alive():
        for fifo in fifos:
            with contextlib.suppress(OSError):
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        thread.join(BOUND_S)
        pytest.fail(f"blocked for {BOUND_S:.0f} s on a FIFO: {fifos}")
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("value")


# -- Hugging Face: item 2 -----------------------------------------------------------------


@pytest.fixture
def transformers() -> types.ModuleType:
    pytest.importorskip("accelerate")
    return pytest.importorskip("transformers")


def _build_trainer(transformers: types.ModuleType, output_dir: Path, callback: Any) -> Any:
    """A real Trainer on a tiny GPT-2 built here: building it runs the callback's on_init_end."""
    config = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=64,
                                     n_positions=16)  # fmt: skip
    args = transformers.TrainingArguments(
        output_dir=str(output_dir), max_steps=1, report_to="none", use_cpu=True,
        disable_tqdm=True,
    )  # fmt: skip
    return transformers.Trainer(
        model=transformers.GPT2LMHeadModel(config), args=args, callbacks=[callback]
    )


def test_a_reused_output_dir_keeps_the_users_checkpoint_when_the_store_differs(
    where: BackendUnderTest,
    tmp_path: Path,
    transformers: types.ModuleType,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The callback pointed at a shared (or the wrong) store whose step 5 is another run's:
    the user's own checkpoint-5 (their model bytes, a notes.txt) survives, moved aside."""
    from ckptstore.adapters.directory import publish_directory
    from ckptstore.adapters.huggingface import CkptStoreCallback

    theirs = {"model.safetensors": b"another run's weights", "trainer_state.json": b"{}"}
    publish_directory(where.open(), 5, _write(tmp_path / "other-run" / "checkpoint-5", theirs))
    out = tmp_path / "out"
    mine = {"model.safetensors": b"my own weights, kept nowhere else", "notes.txt": b"lr 3e-4"}
    _write(out / "checkpoint-5", mine)
    newer = {"model.safetensors": b"my step 7"}
    _write(out / "checkpoint-7", newer)  # newer, never published there: moved aside as before
    callback = CkptStoreCallback(where.url, **_options(where))
    with caplog.at_level(logging.WARNING, logger="ckptstore.adapters.huggingface"):
        trainer = _build_trainer(transformers, out, callback)
    assert callback.restored is not None and callback.restored.step == 5
    assert _files(out / "checkpoint-5") == theirs  # what the store has, to resume from
    aside = {p.name: _files(p) for p in out.iterdir() if ".unpublished-" in p.name}
    assert sorted(aside.values(), key=len) == [newer, mine]  # every byte of the user's kept
    (kept,) = [out / name for name, files in aside.items() if files == mine]
    assert kept.name.startswith("checkpoint-5.unpublished-")
    assert str(kept) in caplog.text  # the warning says where they went
    assert "differs from step 5" in caplog.text
    assert CkptStoreCallback.resume_path(trainer.args) == str(out / "checkpoint-5")


def test_an_identical_copy_is_kept_and_a_differing_one_moved_aside_every_time(
    tmp_path: Path,
) -> None:
    import ckptstore
    from ckptstore.adapters.directory import publish_directory
    from ckptstore.adapters.huggingface import CkptStoreCallback

    pytest.importorskip("transformers")
    store = ckptstore.open(f"file://{tmp_path}/store")
    out = tmp_path / "out"
    published = {"model.safetensors": b"weights\x05"}
    good = _write(out / "checkpoint-5", published)
    publish_directory(store, 5, good)
    callback = CkptStoreCallback(store)
    inode = (good / "model.safetensors").stat().st_ino
    callback.prepare_output_dir(out)
    assert (good / "model.safetensors").stat().st_ino == inode  # identical: left as it was
    for round_ in range(3):  # the same second: each is moved aside under a name of its own
        edited = {"model.safetensors": b"weightZ\x05", "notes.txt": b"round %d" % round_}
        _write(good, edited)
        callback.prepare_output_dir(out)
        assert _files(good) == published
    kept = sorted(_files(p)["notes.txt"] for p in out.iterdir() if ".unpublished-" in p.name)
    assert kept == [b"round 0", b"round 1", b"round 2"]


@pytest.mark.parametrize("kind", ["file", "symlink", "dangling-symlink"])
def test_a_checkpoint_name_that_is_no_directory_is_moved_aside_not_deleted(
    tmp_path: Path, kind: str
) -> None:
    import ckptstore
    from ckptstore.adapters.directory import publish_directory
    from ckptstore.adapters.huggingface import CkptStoreCallback

    pytest.importorskip("transformers")
    store = ckptstore.open(f"file://{tmp_path}/store")
    publish_directory(store, 5, _write(tmp_path / "run" / "checkpoint-5", {"m": b"w"}))
    out = tmp_path / "out"
    out.mkdir()
    elsewhere = _write(tmp_path / "elsewhere", {"m": b"the user's"})
    if kind == "file":
        (out / "checkpoint-5").write_bytes(b"a file of the user's")
    else:
        (out / "checkpoint-5").symlink_to(elsewhere if kind == "symlink" else tmp_path / "none")
    CkptStoreCallback(store).prepare_output_dir(out)
    assert _files(out / "checkpoint-5") == {"m": b"w"}
    (aside,) = [p for p in out.iterdir() if ".unpublished-" in p.name]
    if kind == "file":
        assert aside.read_bytes() == b"a file of the user's"
    else:
        assert aside.is_symlink()
    assert _files(elsewhere) == {"m": b"the user's"}  # a link's target is never touched


def test_a_fifo_in_a_local_checkpoint_neither_blocks_nor_is_lost(tmp_path: Path) -> None:
    import ckptstore
    from ckptstore.adapters.directory import publish_directory
    from ckptstore.adapters.huggingface import CkptStoreCallback, _identical

    pytest.importorskip("transformers")
    store = ckptstore.open(f"file://{tmp_path}/store")
    out = tmp_path / "out"
    good = _write(out / "checkpoint-5", {"model.safetensors": b"w"})
    publish_directory(store, 5, good)
    checkpoint = store.get(5)
    (good / "model.safetensors").unlink()
    fifo = _fifo(good / "model.safetensors")  # the listed file swapped for a FIFO
    assert _bounded(lambda: _identical(good, checkpoint), [fifo]) is False
    _bounded(lambda: CkptStoreCallback(store).prepare_output_dir(out), [fifo])
    assert _files(good) == {"model.safetensors": b"w"}
    (aside,) = [p for p in out.iterdir() if ".unpublished-" in p.name]
    assert (aside / "model.safetensors").is_fifo()  # moved aside with the rest, not removed


# -- Lightning: item 16 ---------------------------------------------------------------------


@pytest.fixture
def lightning_io(tmp_path: Path) -> Iterator[Any]:
    pytest.importorskip("pytorch_lightning")
    import torch

    from ckptstore.adapters.lightning import CkptStoreIO

    io = CkptStoreIO(f"file://{tmp_path}/store")
    io.save_checkpoint({"global_step": 3, "state_dict": {"w": torch.ones(2)}},
                       tmp_path / "elsewhere" / "step=3.ckpt")  # fmt: skip
    yield io
    io.teardown()


def test_lightning_resume_path_refuses_a_fifo_last_ckpt_without_blocking(
    tmp_path: Path, lightning_io: Any
) -> None:
    from ckptstore import InvalidInputError

    fifo = _fifo(tmp_path / "ckpts" / "last.ckpt")
    with pytest.raises(InvalidInputError, match="a FIFO, not a checkpoint file"):
        _bounded(lambda: lightning_io.resume_path(tmp_path / "ckpts"), [fifo])
    assert fifo.is_fifo()  # left as it is


def test_lightning_load_checkpoint_refuses_a_fifo_without_blocking(
    tmp_path: Path, lightning_io: Any
) -> None:
    from ckptstore import InvalidInputError

    for name in ("last.ckpt", "epoch=0-step=3.ckpt"):
        fifo = _fifo(tmp_path / "ckpts" / name)
        with pytest.raises(InvalidInputError, match="a FIFO"):
            _bounded(lambda fifo=fifo: lightning_io.load_checkpoint(fifo), [fifo])


def test_lightning_remove_checkpoint_leaves_a_fifo_and_never_blocks(
    tmp_path: Path, lightning_io: Any
) -> None:
    import torch

    ckpts = tmp_path / "ckpts"
    lightning_io.save_checkpoint({"global_step": 4, "state_dict": {"w": torch.ones(2)}},
                                 ckpts / "step=4.ckpt")  # fmt: skip
    fifo = _fifo(ckpts / "step=9.ckpt")  # beside the pointers: every removal reads them
    _bounded(lambda: lightning_io.remove_checkpoint(fifo), [fifo])
    assert fifo.is_fifo()
    _bounded(lambda: lightning_io.remove_checkpoint(ckpts / "step=4.ckpt"), [fifo])
    assert not (ckpts / "step=4.ckpt").exists()


def test_lightning_still_loads_its_own_torch_save_files_and_links_to_them(
    tmp_path: Path, lightning_io: Any
) -> None:
    import torch

    path = tmp_path / "plain.ckpt"
    torch.save({"global_step": 1, "state_dict": {"w": torch.zeros(3)}}, path)
    link = tmp_path / "link.ckpt"
    link.symlink_to(path)  # as ModelCheckpoint(save_last="link") makes last.ckpt
    for each in (path, link):
        loaded = lightning_io.load_checkpoint(each, weights_only=True)
        assert torch.equal(loaded["state_dict"]["w"], torch.zeros(3))
