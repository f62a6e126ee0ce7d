"""Lightning checkpoints through ckptstore (``pip install 'ckptstore[lightning]'``)::

    from ckptstore.adapters.lightning import CkptStoreIO

    io = CkptStoreIO("s3://bucket/runs/7")
    trainer = Trainer(plugins=[io], callbacks=[ModelCheckpoint(dirpath=ckpts)], ...)
    trainer.fit(model, ckpt_path=io.resume_path(ckpts))  # or "last" where pointers exist

Every checkpoint Lightning saves is published in the store as the step ``global_step`` (one
commit: tensors as safetensors, everything else as JSON, nothing pickled), on any store, with
the store's retention. At the path Lightning asked for, the plugin leaves a small pointer file
(written atomically) naming the store and the step, so that everything Lightning does with
checkpoint files (``ModelCheckpoint``'s top-k, ``last.ckpt``, ``ckpt_path="last"``) works
unchanged. Loading a pointer named like ``last*.ckpt`` loads the newest *published*
checkpoint: a run killed after a publish and before its pointer was written resumes from
that publish; ``resume_path`` writes such a pointer where there is none (a new machine).
``remove_checkpoint`` removes the pointer and unpublishes its step, unless
another pointer still names that step, in its directory or in any other this plugin has
written pointers to (several ``ModelCheckpoint`` callbacks), or it is the newest (that stays). A
checkpoint file Lightning wrote itself (``torch.save``) still loads, through Lightning's own
``TorchCheckpointIO``. Async saves: wrap it, ``AsyncCheckpointIO(CkptStoreIO(url))``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import secrets
import stat
import threading
from pathlib import Path
from typing import Any, BinaryIO

from lightning_fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning_fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning_fabric.utilities.cloud_io import _load as pl_load

from ckptstore.checkpoint import Checkpoint
from ckptstore.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    InvalidInputError,
    NotACheckpointError,
    RefusedError,
)
from ckptstore.interface import CheckpointStore
from ckptstore.jsonload import load_json
from ckptstore.tiers.tiered import open_checkpoints
from ckptstore.torch.state import load_state, save_state

__all__ = ["CkptStoreIO"]

log = logging.getLogger(__name__)

POINTER_FORMAT = "ckptstore.lightning-pointer"
COMPONENT = "lightning"
_LAST = re.compile(r"^last(-v?[0-9]+)?$")
_POINTER_LIMIT = 64 * 1024


class CkptStoreIO(CheckpointIO):
    """A Lightning ``CheckpointIO`` that saves, loads and removes checkpoints through a store."""

    def __init__(self, store: CheckpointStore | str, **options: Any) -> None:
        super().__init__()
        self.store: CheckpointStore = (
            open_checkpoints(store, **options) if isinstance(store, str) else store
        )
        self._saved: dict[int, str] = {}  # step -> attempt, published by this plugin
        self._directories: set[Path] = set()  # where this plugin has written pointers
        self._lock = threading.Lock()

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        """Publish ``checkpoint`` as step ``global_step``, then point ``path`` at it."""
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options: the store has them")
        step = int(checkpoint["global_step"])
        with self._lock:
            if step not in self._saved:
                try:
                    published = save_state(self.store, step, {COMPONENT: checkpoint}, rng=False)
                except CheckpointExistsError as exc:
                    raise CheckpointExistsError(
                        f"{exc}: this run is saving global step {step} again (resumed from an "
                        f"older checkpoint?). Roll the store back first (ckptstore rollback "
                        f"{self.store.url} <step>) or use another store",
                        step=step,
                    ) from exc
                self._saved[step] = published.manifest.attempt
        _write_pointer(Path(path), {"format": POINTER_FORMAT, "url": self.store.url, "step": step})
        with self._lock:
            self._directories.add(Path(path).absolute().parent)

    def load_checkpoint(
        self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """The checkpoint a pointer file names (``last*.ckpt``: the newest published one)."""
        pointer = _read_pointer(Path(path))
        if pointer is None:  # a checkpoint Lightning wrote itself: loaded as Lightning does,
            with _open_regular(Path(path)) as stream:  # from a file checked to be one
                loaded: dict[str, Any] = pl_load(
                    stream, map_location=map_location, weights_only=weights_only
                )
            return loaded
        checkpoint = self._pointed(Path(path), pointer)
        restored = load_state(
            checkpoint, {COMPONENT: {}}, map_location=map_location or "cpu", rng=False
        )
        state: dict[str, Any] = restored[COMPONENT]
        return state

    def resume_path(self, directory: str | os.PathLike[str]) -> str | None:
        """Where ``trainer.fit(..., ckpt_path=...)`` resumes from the newest published
        checkpoint, on any machine: ``<directory>/last.ckpt``, a pointer written there if
        there is none (a new machine, a local directory lost with the old one). None if the
        store has no checkpoint yet: a fresh start.

        Pass the ``ModelCheckpoint`` directory, and every later ``ckpt_path="last"`` finds the
        pointer too. A ``last.ckpt`` there that is not this store's pointer is left alone and
        refused (InvalidInputError), not overwritten.
        """
        latest = self.store.latest()
        if latest is None:
            return None
        path = Path(directory) / "last.ckpt"
        if not (path.exists() or path.is_symlink()):  # a dangling link is not replaced either
            _write_pointer(path, {"format": POINTER_FORMAT, "url": self.store.url,
                                  "step": latest.step})  # fmt: skip
            with self._lock:
                self._directories.add(path.absolute().parent)
            return str(path)
        pointer = _read_pointer(path)  # a damaged one: NotACheckpointError, saying so
        if pointer is None or pointer["url"] != self.store.url:
            raise InvalidInputError(
                f"{path} exists and is not a pointer into {self.store.url}; move it away to "
                f"resume from the store, or pass it to ckpt_path yourself"
            )
        return str(path)

    def remove_checkpoint(self, path: Any) -> None:
        """Remove the pointer at ``path`` and unpublish its step if nothing else points there.

        A damaged pointer (NotACheckpointError on load) is removed, and unpublishes nothing."""
        target = Path(path)
        try:
            pointer = _read_pointer(target)
        except NotACheckpointError:
            target.unlink(missing_ok=True)
            return
        except InvalidInputError as exc:  # not a file (a FIFO): nothing this plugin wrote
            log.warning("left %s alone: %s", target, exc)
            return
        if pointer is None:
            TorchCheckpointIO().remove_checkpoint(path)
            return
        target.unlink(missing_ok=True)
        step = pointer["step"]
        with self._lock:
            directories = {target.absolute().parent, *self._directories}
        if _LAST.match(target.stem) or any(step in _steps_named_in(d) for d in directories):
            return
        try:
            self.store.delete(step)
        except CheckpointNotFoundError:
            pass
        except RefusedError as exc:  # the newest stays
            log.info("kept step %d of %s: %s", step, self.store.url, exc)
        with self._lock:
            self._saved.pop(step, None)

    def teardown(self) -> None:
        self.store.close()

    def _pointed(self, path: Path, pointer: dict[str, Any]) -> Checkpoint:
        if pointer["url"] != self.store.url:
            raise CheckpointNotFoundError(
                f"{path} names a checkpoint of {pointer['url']}, not of this plugin's store "
                f"({self.store.url})"
            )
        if _LAST.match(path.stem):
            latest = self.store.latest()
            if latest is None:
                raise CheckpointNotFoundError(f"{path}: {self.store.url} has no checkpoint")
            return latest
        return self.store.get(pointer["step"])


def _write_pointer(path: Path, pointer: dict[str, Any]) -> None:
    """Write the pointer file atomically: a temporary sibling, fsynced, renamed over ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    try:
        with open(temporary, "x", encoding="utf-8") as stream:
            json.dump(pointer, stream)
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    directory = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def _read_pointer(path: Path) -> dict[str, Any] | None:
    """The pointer at ``path``, or None if ``path`` is some other file (a torch.save one: a
    zip archive, or an old pickle, never text starting with ``{``).

    A file that starts like a pointer but is not a whole one (a pointer cut short, edited, or
    some other JSON file) raises NotACheckpointError saying so: handed to ``torch.load`` it
    would fail with a message about pickles."""
    try:
        with _open_regular(path) as stream:
            head = stream.read(_POINTER_LIMIT + 1)
    except FileNotFoundError as exc:
        raise CheckpointNotFoundError(f"{path}: no such checkpoint file") from exc
    if not head.lstrip().startswith(b"{"):
        return None
    try:
        pointer = load_json(head, max_bytes=_POINTER_LIMIT, max_depth=8)
        if not isinstance(pointer, dict) or pointer.get("format") != POINTER_FORMAT:
            raise ValueError(f'no "format": "{POINTER_FORMAT}"')
        if not isinstance(pointer.get("url"), str) or type(pointer.get("step")) is not int:
            raise ValueError("no store url and step")
    except ValueError as exc:  # JSONDocumentError included
        raise NotACheckpointError(
            f"{path}: a JSON file, but not a ckptstore pointer ({exc}); it names no "
            f"checkpoint. Delete it, or resume from another checkpoint file "
            f"(CkptStoreIO.resume_path finds the newest published one)"
        ) from exc
    return pointer


def _open_regular(path: Path) -> BinaryIO:
    """``path`` opened for reading if it is a regular file (a link to one included, as
    ``save_last="link"`` makes): a FIFO or a device never blocks the open (``O_NONBLOCK``) and
    is refused (InvalidInputError), left as it is."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = "a FIFO" if stat.S_ISFIFO(mode) else "a device or socket"
            if stat.S_ISDIR(mode):
                kind = "a directory"
            raise InvalidInputError(
                f"{path}: {kind}, not a checkpoint file; left as it is: move it away, or "
                f"pass another checkpoint"
            )
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _steps_named_in(directory: Path) -> set[int]:
    """Steps that the (not ``last``) pointers in ``directory`` name."""
    steps = set()
    for path in directory.glob("*.ckpt"):
        if not _LAST.match(path.stem) and path.is_file():
            with contextlib.suppress(CheckpointNotFoundError, InvalidInputError):  # removed
                # meanwhile, damaged, swapped for a FIFO
                pointer = _read_pointer(path)
                if pointer is not None:
                    steps.add(pointer["step"])
    return steps
