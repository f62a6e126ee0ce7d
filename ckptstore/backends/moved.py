"""Names a backend module still serves after they moved to a module of their own (PEP 562).

``s3``, ``gcs`` and ``azure`` hold their drivers; opening a store (the URL, the client, the
``open_*`` functions) lives in ``s3_open``, ``gcs_open`` and ``azure_open``, which import the
drivers. The old import paths (``ckptstore.backends.s3.open_s3``) keep working through a module
``__getattr__`` that imports the opening module only when one of its names is asked for.

What is served is the name, not the module: reading ``ckptstore.backends.s3.open_s3`` gives the
function, but a monkeypatch must set it where it lives (``ckptstore.backends.s3_open``), and
private names are only there.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

__all__ = ["served_from"]


def served_from(serving: str, home: str) -> Callable[[str], Any]:
    """A ``__getattr__`` for module ``serving`` that serves the public names (``__all__``) of
    module ``home``, importing ``home`` on first use (``home`` imports ``serving``, so neither
    imports the other at its top)."""

    def __getattr__(name: str) -> Any:
        if not name.startswith("__"):
            module = importlib.import_module(home)
            if name in getattr(module, "__all__", ()):
                return getattr(module, name)
        raise AttributeError(f"module {serving!r} has no attribute {name!r}")

    return __getattr__
