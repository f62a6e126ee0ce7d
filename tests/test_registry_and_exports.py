"""The scheme registry and the public surface of the package."""

from __future__ import annotations

import importlib.metadata
import pkgutil
import re
import subprocess
import sys

import pytest

import ckptstore
from ckptstore import registry
from ckptstore.backends.memory import open_memory
from ckptstore.errors import BackendUnavailableError, InvalidInputError


def test_all_is_complete_and_exact():
    # (pytest's assertion rewriting adds "@py_builtins" and "@pytest_ar" when it rewrote the
    # package, as it does for a plugin's distribution in some installs: not identifiers)
    public = {name for name in dir(ckptstore) if name.isidentifier() and not name.startswith("_")}
    submodules = {module.name for module in pkgutil.iter_modules(ckptstore.__path__)}
    assert set(ckptstore.__all__) == public - submodules
    for name in ckptstore.__all__:
        assert getattr(ckptstore, name) is not None


def test_the_public_surface_is_what_a_trainer_uses():
    assert len(ckptstore.__all__) <= 20
    assert {"open", "Store", "Checkpoint", "PendingCheckpoint", "KeepLast"} <= set(
        ckptstore.__all__
    )
    from ckptstore import driver, errors

    for name in ckptstore.__all__:  # every exported error is in the one hierarchy
        value = getattr(ckptstore, name)
        if isinstance(value, type) and issubclass(value, Exception):
            assert getattr(errors, name) is value
    for name in ("ObjectNotFoundError", "PreconditionFailedError", "TargetExistsError"):
        assert name not in ckptstore.__all__  # a driver's, for backend authors:
        assert getattr(driver, name) is getattr(errors, name)


def test_importing_the_package_imports_no_tooling_nor_optional_library():
    code = (
        "import sys, ckptstore; ckptstore.open('memory://surface/run').save(1, {'a': b'x'}); "
        "print(' '.join(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('torch', 'boto3', 'hypothesis', 'pytest', 'moto') or m.startswith('ckptstore.tools') "
        "or m.startswith('ckptstore.conformance'))))"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.split()
    assert loaded == []


def test_every_error_is_a_ckptstore_error():
    from ckptstore import errors

    for name in errors.__all__:
        assert issubclass(getattr(errors, name), errors.CkptStoreError)
    assert issubclass(errors.CheckpointNotFoundError, FileNotFoundError)
    assert issubclass(errors.CheckpointExistsError, FileExistsError)
    assert issubclass(errors.InvalidShardNameError, ValueError)
    for name in errors.__all__:
        assert name in errors.__doc__, f"{name} missing from the tree in errors.py"


def test_register_a_scheme_at_run_time():
    registry.register(
        "mytest",
        lambda url, options: open_memory(
            url.__class__(url.raw, "memory", "registered", url.path, {}), options
        ),
    )
    try:
        assert "mytest" in registry.known_schemes()
        store = ckptstore.open("mytest://anything/run")
        store.save(1, {"a": b"x"})
        assert ckptstore.open("memory://registered/run").latest().step == 1
        with pytest.raises(InvalidInputError):
            registry.register("mytest", lambda url, options: None)  # type: ignore[arg-type,return-value]
    finally:
        registry.unregister("mytest")


def test_third_party_entry_point(monkeypatch):
    class FakeEntryPoint:
        name = "thirdparty"

        def load(self):
            return lambda url, options: open_memory(
                url.__class__(url.raw, "memory", "thirdparty", url.path, {}), options
            )

    real = importlib.metadata.entry_points

    def entry_points(**kwargs):
        if kwargs.get("group") == registry.ENTRY_POINT_GROUP:
            return [FakeEntryPoint()]
        return real(**kwargs)

    monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)
    assert "thirdparty" in registry.known_schemes()
    ckptstore.open("thirdparty://x/run").save(3, {"a": b"x"})
    assert ckptstore.open("memory://thirdparty/run").latest().step == 3


def test_missing_dependency_gives_an_install_hint(monkeypatch):
    monkeypatch.setattr(
        registry,
        "_BUILTIN",
        {**registry._BUILTIN, "needy": ("ckptstore_missing_mod:f", "pip install needy")},
    )
    with pytest.raises(BackendUnavailableError, match="pip install needy"):
        ckptstore.open("needy://x")


def test_no_any_in_the_public_signatures_of_store_pending_and_checkpoint():
    from ckptstore.checkpoint import ShardReader
    from ckptstore.pending import ShardWriter

    found = []
    for cls in (ckptstore.Store, ckptstore.PendingCheckpoint, ckptstore.Checkpoint,
                ShardWriter, ShardReader):  # fmt: skip
        for name, member in vars(cls).items():
            if name.startswith("_") and name != "__init__":
                continue
            function = member.fget if isinstance(member, property) else member
            for part, annotation in getattr(function, "__annotations__", {}).items():
                if re.search(r"\bAny\b", str(annotation)):
                    found.append(f"{cls.__name__}.{name} {part}: {annotation}")
    assert found == []


MOVED = [
    ("ckptstore.directory", "ckptstore.adapters.directory", "publish_directory"),
    ("ckptstore.huggingface", "ckptstore.adapters.huggingface", "CkptStoreCallback"),
    ("ckptstore.lightning", "ckptstore.adapters.lightning", "CkptStoreIO"),
    ("ckptstore.tiered", "ckptstore.tiers.tiered", "TieredStore"),
    ("ckptstore.replication", "ckptstore.tiers.replication", "ReplicateAll"),
]
"""The import paths users know, the modules' homes since, and a name each exports."""


TRAINER_ADAPTERS = {"ckptstore.huggingface", "ckptstore.lightning"}
"""Import transformers or Lightning (ten seconds each on a busy CI machine): imported by the
path users know first only; the other order is the same five-line shim, tried on the rest."""


@pytest.mark.parametrize("old_first", [True, False])
def test_the_import_paths_users_know_are_the_modules_themselves(old_first: bool) -> None:
    # In a fresh interpreter: either path imported first; the same module object either way
    # (a monkeypatch, a private name or a logger through one is the other's).
    pytest.importorskip("torch")  # the trainer adapters need it
    lines = ["import importlib, sys"]
    moved = [entry for entry in MOVED if old_first or entry[0] not in TRAINER_ADAPTERS]
    for old, home, name in moved:
        first, second = (old, home) if old_first else (home, old)
        lines += [
            f"a = importlib.import_module({first!r}); b = importlib.import_module({second!r})",
            "assert a is b, (a, b)",
            f"from {old} import {name}",
            f"assert getattr(b, {name!r}) is {name}",
            f"assert sys.modules[{old!r}] is sys.modules[{home!r}]",
            "print(b.__name__)",
        ]
    done = subprocess.run(
        [sys.executable, "-c", "\n".join(lines)], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [home for _, home, _ in moved]
