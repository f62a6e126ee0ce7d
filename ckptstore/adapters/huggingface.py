"""Hugging Face ``Trainer`` checkpoints through ckptstore: each ``checkpoint-N`` directory the
Trainer writes is published as checkpoint N (all its files, one commit), and a run resumes from
the newest published one (``pip install 'ckptstore[huggingface]'``)::

    from ckptstore.adapters.huggingface import CkptStoreCallback

    trainer = Trainer(model, args, train_dataset=data,
                      callbacks=[CkptStoreCallback("s3://bucket/runs/7")])
    trainer.train(resume_from_checkpoint=CkptStoreCallback.resume_path(args))  # or True

The Trainer writes a checkpoint directory in place, file after file; a run killed while it
writes leaves ``checkpoint-N`` half-written, and ``resume_from_checkpoint=True`` picks the
highest N it finds. When the Trainer is built, the callback therefore (on the main process of
each machine, the others wait) moves aside every ``checkpoint-N`` in ``output_dir`` newer than
the newest published checkpoint (renamed ``checkpoint-N.unpublished-<time>``, never deleted),
and materialises the newest published checkpoint there unless an identical copy is already
present (same files, sizes and CRC32C). A ``checkpoint-N`` of the newest published step that
differs from it (another run's, a damaged copy, an ``output_dir`` reused with a store of
another run) is moved aside the same way first, and a warning says where: the callback never
deletes a file it did not write. A run on a new machine, with an empty ``output_dir``,
resumes the same way.

In a job of several machines without a shared file system, each machine's ``output_dir``
holds only the files its own processes wrote (``rng_state_<rank>.pth``, sharded optimizer
states): every machine then contributes its files to the one commit
(``publish_from_every_machine``), and every machine materialises the whole checkpoint.

Training does not wait for the publish (``background=True``, the default, in a run of one
process): ``on_save`` hard-links the checkpoint's files aside (``adapters.background``: one link
per file) and publishes them on a thread of its own, at most one checkpoint at a time; the next
save waits only if the previous publish is still going, and ``on_train_end`` waits for the
last. ``save_total_limit`` may then rotate the directory away at once: the links keep its
files. A publish that fails raises at the next save (or at the end of training): nothing of
that checkpoint was published. A run of several processes publishes on the training thread,
a collective of every process (``publish_from_every_machine``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import stat
import time
from pathlib import Path
from typing import Any, BinaryIO

from transformers import TrainerCallback

from ckptstore.adapters.background import BackgroundPublisher, remove_stale_snapshots
from ckptstore.adapters.directory import (
    directory_files,
    materialize,
    publish_directory,
    write_files,
)
from ckptstore.checkpoint import Checkpoint
from ckptstore.checksum import Crc32c
from ckptstore.errors import CheckpointNotFoundError, CkptStoreError, InvalidInputError
from ckptstore.interface import CheckpointStore
from ckptstore.manifest import ShardRecord
from ckptstore.tiers.tiered import open_checkpoints

__all__ = ["CkptStoreCallback"]

log = logging.getLogger(__name__)

_CHECKPOINT_DIR = re.compile(r"^checkpoint-([0-9]+)$", re.ASCII)


class CkptStoreCallback(TrainerCallback):
    """Publish every checkpoint the Trainer saves; materialise the newest on start."""

    def __init__(
        self,
        store: CheckpointStore | str,
        *,
        parallel: int = 8,
        background: bool = True,
        **options: Any,
    ) -> None:
        """``background``: publish each checkpoint on a thread of the callback's own, so that
        training does not wait for it (``adapters.background``); False publishes it on the
        training thread, in ``on_save``."""
        self.store: CheckpointStore = (
            open_checkpoints(store, **options) if isinstance(store, str) else store
        )
        self.parallel = parallel
        self.publisher = BackgroundPublisher(self.store, parallel=parallel) if background else None
        """Publishes in the background (None: on the training thread)."""
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
                remove_stale_snapshots(args.output_dir)  # a killed run's links, never files
                self.restored = self.prepare_output_dir(Path(args.output_dir))
            else:
                latest = self.store.latest()
                self.restored = latest
        return control

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        """Make the best checkpoint a resumed run remembers (``load_best_model_at_end``) exist
        here: on a new machine only the newest was materialised, and the best may be older."""
        best = getattr(state, "best_model_checkpoint", None)
        name = Path(best).name if isinstance(best, str) else ""
        match = _CHECKPOINT_DIR.match(name)
        if match is None:
            return control
        local = Path(args.output_dir) / name
        with args.main_process_first(local=True, desc="ckptstore: materialise the best"):
            if args.local_process_index == 0 and not local.is_dir():
                try:
                    checkpoint = self.store.get(int(match.group(1)))
                except CheckpointNotFoundError:
                    return control  # not published (or deleted since): the Trainer says so
                try:
                    materialize(checkpoint, local, parallel=self.parallel)
                except InvalidInputError:
                    if not local.is_dir():  # not "another machine's main made it first"
                        raise
        if local.is_dir():
            state.best_model_checkpoint = str(local)  # where this machine has it
        return control

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        directory = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        metadata = {"trainer": "transformers", "directory": directory.name}
        if _distributed(args):
            _every_process_done_writing(args)
            publish_from_every_machine(
                self.store, state.global_step, directory, args, metadata, self.parallel
            )
        elif args.process_index == 0:  # several processes without torch.distributed: one
            if self.publisher is not None and args.world_size <= 1:
                self.publisher.publish(state.global_step, directory, metadata)
            else:
                publish_directory(
                    self.store, state.global_step, directory, metadata=metadata,
                    parallel=self.parallel, clone=True,
                )  # fmt: skip
        return control

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        """Wait for the last checkpoint's publish (raising its failure)."""
        if self.publisher is not None:
            self.publisher.wait()
        return control

    def close(self) -> None:
        """Wait for the publish in flight (raising its failure) and stop the callback's
        publishing thread; then the store may be closed. (``trainer.train`` waits at its end:
        this is for code that calls ``on_save`` itself, or stops without ``on_train_end``.)"""
        if self.publisher is not None:
            self.publisher.close()

    # -- resuming --------------------------------------------------------------------------

    def prepare_output_dir(self, output_dir: Path) -> Checkpoint | None:
        """Make ``output_dir``'s newest ``checkpoint-N`` the newest published checkpoint."""
        latest = self.store.latest()
        newest_published = -1 if latest is None else latest.step
        moved = []
        for step, path in sorted(_local_checkpoints(output_dir).items()):
            if step > newest_published:
                aside = _move_aside(path)
                if aside is not None:
                    moved.append(aside.name)
        if moved:
            log.warning(
                "%s: moved aside %d checkpoint director%s that %s never published (%s): %s",
                output_dir, len(moved), "y" if len(moved) == 1 else "ies", self.store.url,
                "it holds no checkpoint: is this the run's store?" if latest is None
                else f"its newest is step {latest.step}",
                ", ".join(moved),
            )  # fmt: skip
        if latest is None:
            return None
        target = output_dir / f"checkpoint-{latest.step}"
        if _exists(target) and not (target.is_dir() and _identical(target, latest)):
            aside = _move_aside(target)  # never replaced in place: it may be the user's only copy
            if aside is not None:
                log.warning(
                    "%s differs from step %d of %s (another run's checkpoint, or a damaged "
                    "copy): moved aside to %s, and the published step %d put in its place; "
                    "delete it once you know it is not needed, or check the store's URL",
                    target, latest.step, self.store.url, aside, latest.step,
                )  # fmt: skip
        if not target.is_dir():
            try:
                materialize(latest, target, parallel=self.parallel)
            except InvalidInputError:
                if not target.is_dir():  # not "another machine's main made it first"
                    raise
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


def _exists(path: Path) -> bool:
    return path.is_symlink() or path.exists()


def _move_aside(path: Path) -> Path | None:
    """Rename ``path`` to ``<name>.unpublished-<time>[-<n>]`` beside it, never over anything
    there; return the new path (None: ``path`` was gone, another machine's main was first)."""
    stamp = time.strftime("%Y%m%dT%H%M%S")
    for attempt in range(1000):
        aside = path.with_name(f"{path.name}.unpublished-{stamp}{f'-{attempt}' if attempt else ''}")
        try:
            if path.is_dir() and not path.is_symlink():
                os.mkdir(aside)  # the name, taken atomically: rename(2) then replaces only it
                try:
                    os.rename(path, aside)
                except BaseException:
                    os.rmdir(aside)
                    raise
            else:  # a file or a link named like a checkpoint: linked, never renamed over
                _link_then_unlink(path, aside)
        except FileExistsError:
            continue  # that name is taken: the next one
        except FileNotFoundError:
            return None
        return aside
    raise CkptStoreError(f"{path}: could not move it aside: 1000 names beside it are taken")


def _link_then_unlink(path: Path, aside: Path) -> None:
    """Move a file or link ``path`` to ``aside`` unless ``aside`` exists (FileExistsError)."""
    try:
        os.link(path, aside, follow_symlinks=False)
    except (FileExistsError, FileNotFoundError):
        raise
    except OSError:  # no hard links on this file system: checked, then renamed
        if _exists(aside):
            raise FileExistsError(aside) from None
        os.rename(path, aside)
        return
    os.unlink(path)


def _identical(directory: Path, checkpoint: Checkpoint) -> bool:
    """True if ``directory`` holds exactly the checkpoint's files, byte for byte (CRC32C);
    False if it holds anything else, or anything that cannot be read as a file (a FIFO)."""
    try:
        files = directory_files(directory)
    except InvalidInputError:
        return False  # something no checkpoint holds (a FIFO, a dangling link)
    if sorted(f.name for f in files) != sorted(checkpoint.names):
        return False
    for file in files:
        record = checkpoint.shards[file.name]
        if file.size != record.size:
            return False
        crc = Crc32c()
        try:
            with _open_regular(file.path) as stream:
                while chunk := stream.read(8 * 1024 * 1024):
                    crc.update(chunk)
        except (InvalidInputError, OSError):
            return False  # swapped for a FIFO, or unreadable: not the checkpoint
        if crc.hexdigest() != record.crc32c:
            return False
    return True


def _open_regular(path: Path) -> BinaryIO:
    """``path`` opened for reading if it is a regular file (a link to one included): never
    blocks on a FIFO or a device (``O_NONBLOCK`` and ``fstat``), else InvalidInputError."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise InvalidInputError(f"{path}: not a regular file")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _distributed(args: Any) -> bool:
    if args.world_size <= 1:
        return False
    import torch.distributed as dist

    return bool(dist.is_available() and dist.is_initialized())


def _every_process_done_writing(args: Any) -> None:
    """A barrier across the Trainer's processes."""
    import torch.distributed as dist

    dist.barrier()


def publish_from_every_machine(
    store: CheckpointStore,
    step: int,
    directory: Path,
    args: Any,
    metadata: dict[str, Any],
    parallel: int,
) -> None:
    """Publish ``directory`` as ``step`` in one commit, from every machine that holds part of
    it: a collective over the Trainer's processes.

    On machines without a shared file system each machine's ``output_dir`` holds only what its
    own processes wrote (``rng_state_<rank>.pth``, a sharded optimizer's files), so the main
    process of every machine lists its copy; each file is written by the first machine (by
    rank) that has it (on a shared file system: the global main process, for every file), into
    one attempt the global main process began; it publishes once every machine's files are
    sealed. Any failure anywhere publishes nothing, and every process raises it.
    """
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    listing: dict[str, int] | str | None = None
    if args.local_process_index == 0 and directory.exists():  # none: this machine wrote none
        try:
            listing = {f.name: f.size for f in directory_files(directory)}
        except Exception as exc:  # every process must hear of it, or the others wait
            listing = f"machine of rank {rank}: {exc}"
    listings: list[dict[str, int] | str | None] = [None] * world
    dist.all_gather_object(listings, listing)
    problems = [entry for entry in listings if isinstance(entry, str)]
    owners: dict[str, int] = {}
    for lister, entry in enumerate(listings):
        for name in sorted(entry) if isinstance(entry, dict) else ():
            owners.setdefault(name, lister)
    if not problems and not any(isinstance(entry, dict) for entry in listings):
        problems.append(f"no machine has {directory.name} in its output_dir")
    writers = sorted(set(owners.values()))
    pending = None
    begun: list[str | None] = [None]
    if rank == 0 and not problems:
        try:
            pending = store.begin(step, metadata, world_size=len(writers))
            begun = [pending.attempt]
        except Exception as exc:  # said to every process below, not raised past them
            problems.append(f"rank 0: {exc}")
    dist.broadcast_object_list(begun, src=0)
    attempt = begun[0]
    receipts: list[dict[str, Any]] = []
    failure: str | None = None
    if attempt is not None and rank in writers:
        try:
            mine = pending if pending is not None else store.join(step, attempt)
            files = [f for f in directory_files(directory) if owners.get(f.name) == rank]
            write_files(mine, files, parallel=parallel, clone=True)
            if mine is not pending:
                receipts = [dataclasses.asdict(record) for record in mine.seal()]
        except Exception as exc:  # every process must hear of it, or the others wait
            failure = f"rank {rank}: {exc}"
    outcomes: list[tuple[list[dict[str, Any]], str | None]] = [([], None)] * world
    dist.all_gather_object(outcomes, (receipts, failure))
    problems += [told for _, told in outcomes if told is not None]
    if rank == 0 and pending is not None:
        try:
            if problems:
                pending.abort()
            else:
                pending.add_receipts(ShardRecord(**r) for written, _ in outcomes for r in written)
                pending.publish()
        except Exception as exc:  # said to every process below, not raised past them
            problems.append(f"rank 0: {exc}")
    said: list[list[str]] = [problems]
    dist.broadcast_object_list(said, src=0)
    if said[0]:
        raise CkptStoreError(
            f"checkpoint-{step} was not published: {'; '.join(said[0])}", step=step
        )
