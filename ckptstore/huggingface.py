"""Hugging Face ``Trainer`` checkpoints through ckptstore: each ``checkpoint-N`` directory the
Trainer writes is published as checkpoint N (all its files, one commit), and a run resumes from
the newest published one (``pip install 'ckptstore[huggingface]'``)::

    from ckptstore.huggingface import CkptStoreCallback

    trainer = Trainer(model, args, train_dataset=data,
                      callbacks=[CkptStoreCallback("s3://bucket/runs/7")])
    trainer.train(resume_from_checkpoint=CkptStoreCallback.resume_path(args))  # or True

The Trainer writes a checkpoint directory in place, file after file; a run killed while it
writes leaves ``checkpoint-N`` half-written, and ``resume_from_checkpoint=True`` picks the
highest N it finds. When the Trainer is built, the callback therefore (on the main process of
each machine, the others wait) moves aside every ``checkpoint-N`` in ``output_dir`` newer than
the newest published checkpoint (renamed ``checkpoint-N.unpublished-<time>``, never deleted),
and materialises the newest published checkpoint there unless an identical copy is already
present (same files, sizes and CRC32C). A run on a new machine, with an empty ``output_dir``,
resumes the same way.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from ckptstore.checkpoint import Checkpoint
from ckptstore.checksum import Crc32c
from ckptstore.directory import directory_files, materialize, publish_directory
from ckptstore.errors import CkptStoreError
from ckptstore.store import Store, open_store

__all__ = ["CkptStoreCallback"]

_CHECKPOINT_DIR = re.compile(r"^checkpoint-([0-9]+)$", re.ASCII)


class CkptStoreCallback(TrainerCallback):
    """Publish every checkpoint the Trainer saves; materialise the newest on start."""

    def __init__(self, store: Store | str, *, parallel: int = 8, **options: Any) -> None:
        self.store = open_store(store, **options) if isinstance(store, str) else store
        self.parallel = parallel
        self.restored: Checkpoint | None = None
        """The checkpoint materialised when the Trainer was built (None: none published)."""

    @staticmethod
    def resume_path(args: Any) -> str | None:
        """The checkpoint directory to pass to ``trainer.train(resume_from_checkpoint=...)``:
        the newest one in ``args.output_dir`` (after the callback prepared it), or None."""
        newest = _local_checkpoints(Path(args.output_dir))
        return str(newest[max(newest)]) if newest else None

    # -- Trainer events ------------------------------------------------------------------

    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        with args.main_process_first(local=True, desc="ckptstore: materialise the newest"):
            if args.local_process_index == 0:
                self.restored = self.prepare_output_dir(Path(args.output_dir))
            else:
                latest = self.store.latest()
                self.restored = latest
        return control

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        directory = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        _every_process_done_writing(args)
        failure: BaseException | None = None
        if args.process_index == 0:
            try:
                publish_directory(
                    self.store,
                    state.global_step,
                    directory,
                    metadata={"trainer": "transformers", "directory": directory.name},
                    parallel=self.parallel,
                )
            except Exception as exc:  # every process must hear of it, or the others wait
                failure = exc
        outcome = _shared_outcome(args, None if failure is None else f"{failure}")
        if failure is not None:
            raise failure
        if outcome is not None:
            raise CkptStoreError(f"checkpoint-{state.global_step} was not published: {outcome}")
        return control

    # -- resuming --------------------------------------------------------------------------

    def prepare_output_dir(self, output_dir: Path) -> Checkpoint | None:
        """Make ``output_dir``'s newest ``checkpoint-N`` the newest published checkpoint."""
        latest = self.store.latest()
        newest_published = -1 if latest is None else latest.step
        for step, path in sorted(_local_checkpoints(output_dir).items()):
            if step > newest_published:
                aside = path.with_name(f"{path.name}.unpublished-{time.strftime('%Y%m%dT%H%M%S')}")
                with contextlib.suppress(FileNotFoundError):  # another machine's main was first
                    os.rename(path, aside)
        if latest is None:
            return None
        target = output_dir / f"checkpoint-{latest.step}"
        if not (target.is_dir() and _identical(target, latest)):
            materialize(latest, target, replace=True, parallel=self.parallel)
        return latest


def _local_checkpoints(output_dir: Path) -> dict[int, Path]:
    if not output_dir.is_dir():
        return {}
    found = {}
    for entry in output_dir.iterdir():
        match = _CHECKPOINT_DIR.match(entry.name)
        if match and entry.is_dir():
            found[int(match.group(1))] = entry
    return found


def _identical(directory: Path, checkpoint: Checkpoint) -> bool:
    """True if ``directory`` holds exactly the checkpoint's files, byte for byte (CRC32C)."""
    files = directory_files(directory)
    if sorted(f.name for f in files) != sorted(checkpoint.names):
        return False
    for file in files:
        record = checkpoint.shards[file.name]
        if file.size != record.size:
            return False
        crc = Crc32c()
        with open(file.path, "rb") as stream:
            while chunk := stream.read(8 * 1024 * 1024):
                crc.update(chunk)
        if crc.hexdigest() != record.crc32c:
            return False
    return True


def _shared_outcome(args: Any, failure: str | None) -> str | None:
    """The main process's failure (None: success), told to every process of the Trainer."""
    if args.world_size > 1:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            said: list[str | None] = [failure]
            dist.broadcast_object_list(said, src=0)
            return said[0]
    return failure


def _every_process_done_writing(args: Any) -> None:
    """A barrier across the Trainer's processes (a no-op in a single process)."""
    if args.world_size > 1:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.barrier()
