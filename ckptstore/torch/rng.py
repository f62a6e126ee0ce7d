"""Random number generator states (Python, NumPy, torch CPU and CUDA), captured and restored
exactly, as plain data and tensors (nothing pickled)."""

from __future__ import annotations

import random
from typing import Any

import torch

__all__ = ["capture_rng", "restore_rng"]


def capture_rng() -> dict[str, Any]:
    """Every generator's state, as a nested structure of lists, numbers and tensors."""
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {
        "python": {"version": version, "state": list(internal), "gauss": gauss},
        "torch_cpu": torch.get_rng_state(),
    }
    try:
        import numpy

        numpy_state: Any = numpy.random.get_state()
        name, keys, position, has_gauss, cached = numpy_state
        state["numpy"] = {
            "name": name,
            "keys": torch.from_numpy(keys.copy()),
            "position": int(position),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        }
    except ImportError:
        pass
    if torch.cuda.is_available():
        state["cuda"] = list(torch.cuda.get_rng_state_all())
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Put every generator back in the captured state."""
    python = state["python"]
    random.setstate((python["version"], tuple(python["state"]), python["gauss"]))
    torch.set_rng_state(state["torch_cpu"].to("cpu", torch.uint8))
    if "numpy" in state:
        import numpy

        saved = state["numpy"]
        numpy.random.set_state(
            (
                saved["name"],
                saved["keys"].cpu().numpy().astype(numpy.uint32),
                saved["position"],
                saved["has_gauss"],
                saved["cached_gaussian"],
            )
        )
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([t.to("cpu", torch.uint8) for t in state["cuda"]])
