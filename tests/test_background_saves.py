"""What the asynchronous savers share (``ckptstore.background_saves``): a failed background
save is never silent, even when the saver is never closed, and a ``with`` block's own exception
is never replaced by one found while closing."""

from __future__ import annotations

import gc
import logging
import subprocess
import sys
import textwrap
from concurrent.futures import Future
from pathlib import Path

import pytest

import ckptstore
from ckptstore.background_saves import BackgroundSaver
from ckptstore.checkpoint import Checkpoint
from ckptstore.errors import CheckpointStateError, CkptStoreError

SAVER = '''
import functools

from ckptstore.background_saves import BackgroundSaver

class FileSaver(BackgroundSaver):
    """Publishes a dict of shards in the background (the snapshot is the dict itself)."""

    kind = "FileSaver"

    def __init__(self, store):
        super().__init__(store, max_in_flight=1, threads=1)

    def save(self, step, shards):
        self._check_open()
        self._raise_background_error()
        buffers = self._take_slot()
        return self._submit(step, buffers, functools.partial(self.store.save, step, dict(shards)))
'''
namespace: dict[str, object] = {}
exec(SAVER, namespace)  # the same saver in this process and in the child scripts below
FileSaver = namespace["FileSaver"]


def _child(tmp_path: Path, body: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "child.py"
    script.write_text(
        SAVER
        + "\nimport ckptstore\n"
        + f"store = ckptstore.open({str(tmp_path / 'store')!r})\n"
        + textwrap.dedent(body)
    )
    return subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, check=False
    )


def test_a_saver_never_closed_logs_its_failed_save_when_the_interpreter_exits(
    tmp_path: Path,
) -> None:
    done = _child(
        tmp_path,
        """
        store.save(1, {"a": b"first"})
        saver = FileSaver(store)
        saver.save(1, {"a": b"again"})  # fails in the background: step 1 exists
        """,
    )
    assert done.returncode == 0
    assert "the asynchronous save of step 1 failed" in done.stderr
    assert "CheckpointExistsError" in done.stderr
    assert "FileSaver was not closed" in done.stderr


def test_a_save_in_flight_at_exit_is_published_and_nothing_is_logged(tmp_path: Path) -> None:
    done = _child(tmp_path, 'FileSaver(store).save(3, {"a": b"x"})\n')
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    assert ckptstore.open(str(tmp_path / "store")).get(3).read("a") == b"x"


def test_an_error_already_raised_to_the_trainer_is_not_logged_again(tmp_path: Path) -> None:
    done = _child(
        tmp_path,
        """
        store.save(1, {"a": b"first"})
        saver = FileSaver(store)
        saver.save(1, {"a": b"again"}).exception()  # done, and failed
        try:
            saver.save(2, {"a": b"next"})
        except ckptstore.CkptStoreError as exc:
            print("raised:", exc)
        """,
    )
    assert "raised: an earlier asynchronous save failed" in done.stdout
    assert done.stderr == ""


def test_a_with_block_keeps_its_own_exception_and_the_failed_save_is_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = ckptstore.open(str(tmp_path / "store"))
    store.save(1, {"a": b"first"})
    with (
        caplog.at_level(logging.ERROR, logger="ckptstore.background_saves"),
        pytest.raises(KeyError, match="the trainer's own"),
        FileSaver(store) as saver,  # type: ignore[operator]
    ):
        future: Future[Checkpoint] = saver.save(1, {"a": b"again"})
        future.exception()
        raise KeyError("the trainer's own")
    assert "CheckpointExistsError" in caplog.text
    assert "KeyError" in caplog.text


def test_without_an_exception_the_with_block_raises_the_background_error(tmp_path: Path) -> None:
    store = ckptstore.open(str(tmp_path / "store"))
    store.save(1, {"a": b"first"})
    with (
        pytest.raises(CkptStoreError, match="an earlier asynchronous save failed"),
        FileSaver(store) as saver,  # type: ignore[operator]
    ):
        saver.save(1, {"a": b"again"})
    with pytest.raises(CheckpointStateError, match="this FileSaver is closed"):
        saver.save(2, {"a": b"after"})
    saver.close()  # closing again does nothing


def test_max_in_flight_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="max_in_flight must be at least 1"):
        BackgroundSaver(ckptstore.open(str(tmp_path / "s")), max_in_flight=0, threads=1)


def test_a_saver_dropped_without_closing_logs_its_failed_save(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = ckptstore.open(str(tmp_path / "store"))
    store.save(1, {"a": b"first"})
    saver = FileSaver(store)  # type: ignore[operator]
    saver.save(1, {"a": b"again"}).exception()
    with caplog.at_level(logging.ERROR, logger="ckptstore.background_saves"):
        del saver
        gc.collect()
    assert "the asynchronous save of step 1 failed" in caplog.text
