"""A Hugging Face Trainer run on a tiny GPT-2 built here (no download), checkpointing through
CkptStoreCallback; run as a script, it can SIGKILL itself while checkpoint N is published."""

from __future__ import annotations

import argparse
import os
import signal
from typing import Any

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

import ckptstore.directory
from ckptstore.adapters.huggingface import CkptStoreCallback


def train(
    store: str, output_dir: str, **arguments: Any
) -> tuple[dict[str, Any], CkptStoreCallback]:
    """Train 9 steps, saving every 3, resuming from the store's newest checkpoint; return the
    final weights and the callback. ``arguments``: more TrainingArguments."""
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 64, (48, 12), generator=generator)
    data = [{"input_ids": row, "labels": row} for row in tokens]
    torch.manual_seed(0)
    config = GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=64, n_positions=16)
    model = GPT2LMHeadModel(config)  # dropout on: a resumed run needs the RNG states back
    training = TrainingArguments(
        output_dir=output_dir,
        max_steps=9,
        save_steps=3,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        seed=0,
        report_to="none",
        use_cpu=True,
        logging_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        **arguments,
    )
    callback = CkptStoreCallback(store)
    trainer = Trainer(model=model, args=training, train_dataset=data, callbacks=[callback])
    trainer.train(resume_from_checkpoint=CkptStoreCallback.resume_path(training))
    return {k: v.clone() for k, v in model.state_dict().items()}, callback


def die_while_publishing(step: int) -> None:
    """SIGKILL this process when checkpoint ``step`` has some of its files published."""
    publish_file = ckptstore.directory._publish_file

    def dying(pending: Any, file: Any, *rest: Any) -> None:
        if pending.step == step and file.name == "optimizer.pt":
            os.kill(os.getpid(), signal.SIGKILL)
        publish_file(pending, file, *rest)

    ckptstore.directory._publish_file = dying  # type: ignore[assignment]


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--store", required=True)
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--die-publishing", type=int, required=True)
    args = parser.parse_args()
    die_while_publishing(args.die_publishing)
    train(args.store, args.output_dir)
    raise SystemExit("the run was to die while publishing, and did not")
