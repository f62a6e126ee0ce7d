"""A Lightning Trainer.fit on CPU (a tiny model built here), checkpointing through CkptStoreIO;
run as a script, it SIGKILLs itself while the checkpoint of a given global step is published."""

from __future__ import annotations

import argparse
import os
import signal
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.plugins.io import AsyncCheckpointIO
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ckptstore.lightning
from ckptstore.adapters.lightning import CkptStoreIO

BATCHES_PER_EPOCH = 4


class Regressor(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
        self.batches_trained = 0
        """Batches this process trained (a resumed fit trains only what was left)."""

    def training_step(self, batch: Any, index: int) -> torch.Tensor:
        self.batches_trained += 1
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
        return [optimizer], [scheduler]


def fit(
    store: str, root: str, *, epochs: int = 4, use_async: bool = False, new_machine: bool = False
) -> tuple[dict[str, Any], int]:
    """Fit, resuming from the newest published checkpoint (ckpt_path="last"; ``new_machine``:
    from ``CkptStoreIO.resume_path``, with no local file); return the weights and the number
    of batches this call trained."""
    pl.seed_everything(0, verbose=False)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(8 * BATCHES_PER_EPOCH, 8, generator=generator)
    data = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8, shuffle=False)
    model = Regressor()
    io: Any = CkptStoreIO(store)
    trainer = pl.Trainer(
        max_epochs=epochs,
        accelerator="cpu",
        devices=1,
        plugins=[AsyncCheckpointIO(io) if use_async else io],
        callbacks=[ModelCheckpoint(dirpath=Path(root) / "ckpts", save_last=True, save_top_k=-1)],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
    )
    resume = io.resume_path(Path(root) / "ckpts") if new_machine else "last"
    trainer.fit(model, data, ckpt_path=resume)
    return {k: v.clone() for k, v in model.state_dict().items()}, model.batches_trained


def die_while_publishing(step: int) -> None:
    """SIGKILL this process once checkpoint ``step`` has a shard written, before its commit."""
    save_state = ckptstore.lightning.save_state

    def dying(store: Any, at: int, components: Any, **kwargs: Any) -> Any:
        if at == step:
            with store.begin(at) as pending:
                pending.write("lightning.json", b"{}")
                os.kill(os.getpid(), signal.SIGKILL)
        return save_state(store, at, components, **kwargs)

    ckptstore.lightning.save_state = dying  # type: ignore[assignment]


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--store", required=True)
    parser.add_argument("--root", required=True)
    parser.add_argument("--die-publishing", type=int, required=True)
    args = parser.parse_args()
    die_while_publishing(args.die_publishing)
    fit(args.store, args.root)
    raise SystemExit("the run was to die while publishing, and did not")
