"""How long a Hugging Face Trainer waits at each save: its own save alone, against its save
plus ckptstore's publish, on the training thread and in the background.

    python -m benchmarks.bench_hf_publish [--size 160M] [--repeats 5] [--busy 0] [--dir /xfs]

Baseline (issue 27 item 1): the Trainer's own ``_save_checkpoint`` (model, optimizer,
scheduler, RNG states, trainer state), which is what a run without ckptstore waits for. The
contenders add ``CkptStoreCallback.on_save``: publishing on the training thread
(``background=False``) and in the background (the default: the trainer waits for one hard
link per file, and for the previous publish only if it is still going; the benchmark lets it
finish between saves, untimed, as the training steps between two saves do). Stores: a
directory on the same disk (``file://``) and S3 on an embedded moto server. Each save writes a
new step; directories and steps are removed between repeats, untimed. ``--busy N`` starts N
spinning processes beside it (a training node is never idle). ``--dir`` puts the trainer's
output and the file:// store there: on XFS or btrfs the publish clones the files (reflinks)
instead of copying them.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

import ckptstore
from ckptstore.adapters.huggingface import CkptStoreCallback
from ckptstore.tools.embedded import embedded_moto
from ckptstore.tools.timing import busy as busy_processes
from ckptstore.tools.timing import measure, print_table, sizes


def _trainer(size: int, output_dir: str) -> Trainer:
    """A GPT-2 of about ``size`` bytes of fp32 weights, with an optimizer state to save."""
    width = 256
    layers = max(1, size // (12 * width * width * 4))
    config = GPT2Config(n_layer=layers, n_head=4, n_embd=width, vocab_size=512, n_positions=64)
    model = GPT2LMHeadModel(config)
    args = TrainingArguments(
        output_dir=output_dir, report_to="none", use_cpu=True,
        disable_tqdm=True, logging_strategy="no",
    )  # fmt: skip
    trainer = Trainer(model=model, args=args, train_dataset=[{"input_ids": torch.zeros(8)}])
    trainer.create_optimizer_and_scheduler(num_training_steps=10)
    for group in trainer.optimizer.param_groups:  # an optimizer state as after one step
        for p in group["params"]:
            trainer.optimizer.state[p] = {"exp_avg": torch.zeros_like(p), "step": torch.tensor(1.0)}
    return trainer


def _saver(trainer: Trainer, callback: CkptStoreCallback | None) -> Callable[[int], object]:
    def save(repeat: int) -> None:
        trainer.state.global_step = 1000 + repeat
        trainer._save_checkpoint(trainer.model, None)
        if callback is not None:
            callback.on_save(trainer.args, trainer.state, trainer.control)

    return save


def _tidy(
    root: str, url: str, options: dict[str, object], background: CkptStoreCallback
) -> Callable[[str, int], None]:
    """Untimed, after each save: the background publish finishes (as it does during the
    training steps between two saves), and the directories and steps go."""

    def tidy(name: str, repeat: int) -> None:
        if background.publisher is not None:
            background.publisher.wait()
        shutil.rmtree(Path(root) / "out", ignore_errors=True)
        store = ckptstore.open(url, **options)
        for step in store.steps():
            store.delete(step, force=True)

    return tidy


def run(size: int, repeats: int, busy: int, where: str | None = None) -> None:
    with tempfile.TemporaryDirectory(prefix="bench-hf-", dir=where) as root, embedded_moto() as s3:
        stores = {
            "file://": f"file://{root}/store",
            "s3:// (moto)": s3.url(f"bench-hf-{os.getpid()}"),
        }
        trainer = _trainer(size, f"{root}/out")
        weights = sum(p.numel() * 4 for p in trainer.model.parameters())
        for where, url in stores.items():
            options = s3.options if url.startswith("s3") else {}
            synchronous = CkptStoreCallback(url, background=False, **options)
            background = CkptStoreCallback(url, **options)
            contenders = {
                "HF save alone": _saver(trainer, None),
                "HF save + publish": _saver(trainer, synchronous),
                "HF save + background publish": _saver(trainer, background),
            }

            with busy_processes(busy):
                results = measure(contenders, repeats, after=_tidy(root, url, options, background))
            title = f"Trainer's wait at a save, {where}"
            shape = f"GPT-2, {weights / 2**20:.0f} MiB of fp32 weights (+ Adam state)"
            print_table(title, results, "HF save alone", layout=shape, busy=busy)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="160M", help="weights' size (fp32)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--busy", type=int, default=0, help="spinning processes beside it")
    parser.add_argument(
        "--dir", default=None, help="where the output and file:// store go (XFS: reflinks)"
    )
    args = parser.parse_args()
    (size,) = sizes([args.size])
    run(size, args.repeats, args.busy, args.dir)


if __name__ == "__main__":
    main()
