"""A LoRA-style trainer state for ``bench_incremental --api state``: frozen linear layers
(the base) under trainable low-rank adapters, with their AdamW state, saved through
``ckptstore.torch.save_state``."""

from __future__ import annotations

import math
from typing import Any

import torch

import ckptstore
from benchmarks.bench_incremental import MiB, Workload
from ckptstore.torch import load_state, save_state

LAYERS = 8
ADAPTER_BYTES = 16 * MiB


class LoraLayer(torch.nn.Module):
    """A frozen square weight plus a low-rank update ``up @ down``."""

    def __init__(self, width: int, rank: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(width, width), requires_grad=False)
        self.down = torch.nn.Parameter(torch.randn(rank, width) * 0.01)
        self.up = torch.nn.Parameter(torch.zeros(width, rank))


class LoraWorkload(Workload):
    """``base`` bytes of frozen float32 weights in ``LAYERS`` layers, 16 MiB of adapters and
    32 MiB of AdamW state; each change is one optimizer step on random gradients (and, with
    ``everything``, a change to every frozen weight as well)."""

    def __init__(self, base: int, *, everything: bool) -> None:
        width = math.isqrt(base // LAYERS // 4)
        rank = max(1, ADAPTER_BYTES // (LAYERS * 2 * width * 4))
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(*(LoraLayer(width, rank) for _ in range(LAYERS)))
        trained = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(trained, lr=1e-3)
        self.everything = everything
        self._step(0)  # the optimizer's state exists from the first save on
        frozen = sum(p.numel() * 4 for p in self.model.parameters() if not p.requires_grad)
        adapters = sum(p.numel() * 4 for p in trained)
        changed = 3 * adapters + (frozen if everything else 0)
        layout = f"{LAYERS} x {width}x{width} frozen, adapters of rank {rank}, AdamW"
        super().__init__(frozen + 3 * adapters, changed, layout)

    def _step(self, repeat: int) -> None:
        for p in self.model.parameters():
            if p.requires_grad:
                p.grad = torch.randn_like(p)
        self.optimizer.step()
        if self.everything:
            with torch.no_grad():
                for layer in self.model:
                    layer.weight[0, :2] = float(repeat)  # every frozen weight's bytes change

    def change(self, repeat: int, plain: bool) -> None:
        self._step(repeat * 2 + plain)

    def components(self) -> dict[str, Any]:
        return {"model": self.model, "optimizer": self.optimizer}

    def save(self, store: ckptstore.Store, step: int) -> None:
        save_state(store, step, self.components(), rng=False)

    def load(self, store: ckptstore.Store, step: int) -> None:
        load_state(store.get(step), self.components(), rng=False)
