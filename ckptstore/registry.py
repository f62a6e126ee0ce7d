"""Which backend opens which URL scheme: built-ins loaded lazily, third parties by entry point.

Built-in backends are named by "module:function" and imported only when their scheme is used,
so a missing optional dependency (boto3 for s3://) is an error with an install hint for that
scheme alone. Third-party packages add schemes through the ``ckptstore.backends`` entry-point
group (``myscheme = "mypkg.ckpt:open_store"``), or at run time with ``register``. A factory
takes ``(StoreURL, options)`` and returns a ``CommitStrategy`` bound to its driver.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import threading
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

from ckptstore.commit.base import CommitStrategy
from ckptstore.errors import BackendUnavailableError, InvalidInputError, UnknownSchemeError
from ckptstore.urls import StoreURL

__all__ = [
    "BackendFactory",
    "backend_modules",
    "builtin_schemes",
    "import_backend",
    "known_schemes",
    "register",
    "resolve",
]

BackendFactory = Callable[[StoreURL, Mapping[str, object]], CommitStrategy[Any]]
ENTRY_POINT_GROUP = "ckptstore.backends"

_BUILTIN: Mapping[str, tuple[str, str]] = MappingProxyType(
    {
        "file": ("ckptstore.backends.posix:open_posix", ""),
        "memory": ("ckptstore.backends.memory:open_memory", ""),
        "memory+versioned": ("ckptstore.backends.memory:open_memory", ""),
        "s3": ("ckptstore.backends.s3_open:open_s3", "pip install 'ckptstore[s3]'"),
        "s3+versioned": (
            "ckptstore.backends.s3_open:open_s3_versioned",
            "pip install 'ckptstore[s3]'",
        ),
        "gs": ("ckptstore.backends.gcs_open:open_gcs", "pip install 'ckptstore[gcs]'"),
        "gs+versioned": (
            "ckptstore.backends.gcs_open:open_gcs_versioned",
            "pip install 'ckptstore[gcs]'",
        ),
        "lustre": ("ckptstore.backends.lustre:open_lustre", ""),
        "az": ("ckptstore.backends.azure_open:open_azure", "pip install 'ckptstore[azure]'"),
        "abfs": ("ckptstore.backends.azure_open:open_azure", "pip install 'ckptstore[azure]'"),
        "abfss": ("ckptstore.backends.azure_open:open_azure", "pip install 'ckptstore[azure]'"),
    }
)
_FAMILIES: Mapping[str, tuple[str, str]] = MappingProxyType(
    {"fsspec+": ("ckptstore.backends.fsspec_open:open_fsspec", "pip install 'ckptstore[fsspec]'")}
)
"""Scheme prefixes a built-in backend opens whatever follows: ``fsspec+<protocol>``."""
_registered: dict[str, BackendFactory] = {}
_origins: dict[str, str] = {}
"""The module whose import (``import_backend``) registered a scheme."""
_importing = threading.local()
"""``modules``: what ``import_backend`` is importing on this thread now (innermost last)."""
_lock = threading.Lock()


def builtin_schemes() -> tuple[str, ...]:
    """The schemes ckptstore itself provides."""
    return tuple(_BUILTIN)


def known_schemes() -> tuple[str, ...]:
    """Every scheme that can be opened: built-in, registered, and from entry points."""
    names = set(_BUILTIN) | set(_registered) | {f"{family}<protocol>" for family in _FAMILIES}
    names.update(ep.name for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP))
    return tuple(sorted(names))


def register(scheme: str, factory: BackendFactory, *, replace: bool = False) -> None:
    """Make ``scheme://`` URLs open through ``factory``."""
    scheme = scheme.lower()
    with _lock:
        if not replace and (scheme in _registered or scheme in _BUILTIN):
            raise InvalidInputError(f"scheme {scheme!r} is already registered")
        _registered[scheme] = factory
        importing: list[str] = getattr(_importing, "modules", [])
        if importing:
            _origins[scheme] = importing[-1]
        else:
            _origins.pop(scheme, None)


def unregister(scheme: str) -> None:
    """Remove a scheme added with ``register``."""
    with _lock:
        _registered.pop(scheme.lower(), None)
        _origins.pop(scheme.lower(), None)


def import_backend(name: str) -> None:
    """Import the module ``name`` (which registers schemes when imported), remembering which
    schemes it registered: a process started later to open their URLs imports it too
    (``backend_modules``). Raises what the import raises."""
    importing: list[str] = getattr(_importing, "modules", [])
    _importing.modules = [*importing, name]
    try:
        importlib.import_module(name)
    finally:
        _importing.modules = importing


def backend_modules(scheme: str) -> tuple[str, ...]:
    """The modules a fresh process must import for ``scheme://`` URLs to open there as here:
    the module whose import (``import_backend``) registered ``scheme``, and the module of the
    factory registered for it at run time (unless it is ``__main__``, which no other process
    can import). Built-in and entry-point schemes need none."""
    with _lock:
        origin = _origins.get(scheme.lower())
        factory = _registered.get(scheme.lower())
    modules = [origin] if origin else []
    home = getattr(factory, "__module__", None) if factory is not None else None
    if isinstance(home, str) and home != "__main__" and home not in modules:
        modules.append(home)
    return tuple(modules)


def resolve(scheme: str) -> BackendFactory:
    """Return the factory for ``scheme``; raise UnknownSchemeError listing the known ones."""
    with _lock:
        factory = _registered.get(scheme)
    if factory is not None:
        return factory
    if scheme in _BUILTIN:
        target, hint = _BUILTIN[scheme]
        return _load(target, scheme, hint)
    for family, (target, hint) in _FAMILIES.items():
        if scheme.startswith(family) and len(scheme) > len(family):
            return _load(target, scheme, hint)  # the factory checks the rest (the protocol)
    for entry in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        if entry.name == scheme:
            loaded: BackendFactory = entry.load()
            return loaded
    raise UnknownSchemeError(
        f"no ckptstore backend for {scheme}:// URLs; known schemes: "
        f"{', '.join(f'{s}://' for s in known_schemes())}"
    )


def _load(target: str, scheme: str, hint: str) -> BackendFactory:
    module_name, _, attribute = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise BackendUnavailableError(
            f"{scheme}:// needs a package that is not installed ({exc.name}); {hint}"
        ) from exc
    factory: BackendFactory = getattr(module, attribute)
    return factory
