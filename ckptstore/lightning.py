"""Lightning checkpoints through ckptstore (``pip install 'ckptstore[lightning]'``)::

    from ckptstore.lightning import CkptStoreIO

    trainer = Trainer(plugins=[CkptStoreIO("s3://bucket/runs/7")], ...)
    trainer.fit(model, ckpt_path="last")

Every checkpoint Lightning saves is published in the store as the step ``global_step`` (one
commit: tensors as safetensors, everything else as JSON, nothing pickled), on any store, with
the store's retention. At the path Lightning asked for, the plugin leaves a small pointer file
(written atomically) naming the store and the step, so that everything Lightning does with
checkpoint files (``ModelCheckpoint``'s top-k, ``last.ckpt``, ``ckpt_path="last"``) works
unchanged. Loading a pointer named like ``last*.ckpt`` loads the newest *published*
checkpoint: a run killed after a publish and before its pointer was written resumes from
that publish. ``remove_checkpoint`` removes the pointer and unpublishes its step, unless
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
import threading
from pathlib import Path
from typing import Any

from lightning_fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning_fabric.plugins.io.torch_io import TorchCheckpointIO

from ckptstore.checkpoint import Checkpoint
from ckptstore.errors import CheckpointExistsError, CheckpointNotFoundError, RefusedError
from ckptstore.store import Store, open_store
from ckptstore.torch.state import load_state, save_state

__all__ = ["CkptStoreIO"]

log = logging.getLogger(__name__)

POINTER_FORMAT = "ckptstore.lightning-pointer"
COMPONENT = "lightning"
_LAST = re.compile(r"^last(-v?[0-9]+)?$")
_POINTER_LIMIT = 64 * 1024


class CkptStoreIO(CheckpointIO):
    """A Lightning ``CheckpointIO`` that saves, loads and removes checkpoints through a store."""

    def __init__(self, store: Store | str, **options: Any) -> None:
        super().__init__()
        self.store = open_store(store, **options) if isinstance(store, str) else store
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
                        f"{self.store.url} <step>) or use another store"
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
        if pointer is None:  # a checkpoint Lightning wrote itself
            loaded: dict[str, Any] = TorchCheckpointIO().load_checkpoint(
                path, map_location=map_location, weights_only=weights_only
            )
            return loaded
        checkpoint = self._pointed(Path(path), pointer)
        restored = load_state(
            checkpoint, {COMPONENT: {}}, map_location=map_location or "cpu", rng=False
        )
        state: dict[str, Any] = restored[COMPONENT]
        return state

    def remove_checkpoint(self, path: Any) -> None:
        """Remove the pointer at ``path`` and unpublish its step if nothing else points there."""
        target = Path(path)
        pointer = _read_pointer(target)
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
    """The pointer at ``path``, or None if ``path`` is some other file (a torch.save one)."""
    try:
        with open(path, "rb") as stream:
            head = stream.read(_POINTER_LIMIT + 1)
    except FileNotFoundError as exc:
        raise CheckpointNotFoundError(f"{path}: no such checkpoint file") from exc
    if len(head) > _POINTER_LIMIT or not head.startswith(b"{"):
        return None
    try:
        pointer = json.loads(head)
    except ValueError:
        return None
    if not isinstance(pointer, dict) or pointer.get("format") != POINTER_FORMAT:
        return None
    if not isinstance(pointer.get("url"), str) or type(pointer.get("step")) is not int:
        return None
    return pointer


def _steps_named_in(directory: Path) -> set[int]:
    """Steps that the (not ``last``) pointers in ``directory`` name."""
    steps = set()
    for path in directory.glob("*.ckpt"):
        if not _LAST.match(path.stem) and path.is_file():
            with contextlib.suppress(CheckpointNotFoundError):  # removed meanwhile
                pointer = _read_pointer(path)
                if pointer is not None:
                    steps.add(pointer["step"])
    return steps
