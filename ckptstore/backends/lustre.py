"""Lustre: ``lustre:///abs/path``, the POSIX rename protocol plus striping.

See docs/backends/lustre.md.

Shard files are created with a striping layout through liblustreapi (``lustreapi.py``): large
files (above ``wide_threshold`` bytes, or of unknown size) are striped over every OST, or over
``stripe_count`` OSTs, in ``stripe_size`` stripes, optionally in an OST ``pool``; small files
get the file system's default layout. Striping is a performance hint, never a correctness
matter: without the library the backend works with default striping and says so once.

The staging directory is a sibling of the final one, so the publishing rename stays in one
directory, on one MDT. A rename that fails with EXDEV (the parent directory is striped across
MDTs and remote renames are disabled) is a clear error, never a copy-and-delete.
"""

from __future__ import annotations

import errno
import os
import threading
import warnings
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

from ckptstore.backends.lustreapi import (
    LAYOUT_DEFAULT,
    LAYOUT_WIDE,
    Layout,
    LustreApi,
    is_lustre,
    load_lustreapi,
)
from ckptstore.backends.posix import PosixDriver
from ckptstore.commit.rename import RenameCommit
from ckptstore.driver import FileSystemDriver
from ckptstore.errors import InvalidOptionError, InvalidURLError, StorageError, TargetExistsError
from ckptstore.urls import StoreURL, file_url, option_int

__all__ = [
    "LayoutFileSystemDriver",
    "LustreCommit",
    "LustreDriver",
    "LustreStripingWarning",
    "open_lustre",
]

DEFAULT_WIDE_THRESHOLD = 64 * 1024 * 1024
DEFAULT_STRIPE_SIZE = 16 * 1024 * 1024
_NOT_LUSTRE = (errno.ENOTTY, errno.EOPNOTSUPP, errno.ENOSYS)


class LustreStripingWarning(UserWarning):
    """Striping is not applied (no liblustreapi, or not a Lustre file system)."""


_warned: set[str] = set()
_warned_lock = threading.Lock()


def _warn_once(key: str, message: str) -> None:
    with _warned_lock:
        if key in _warned:
            return
        _warned.add(key)
    warnings.warn(message, LustreStripingWarning, stacklevel=3)


@runtime_checkable
class LayoutFileSystemDriver(FileSystemDriver, Protocol):
    """A file system that can create a file with a striping layout chosen up front."""

    def create_with_layout(self, path: str, layout: Layout) -> int:
        """Create a new, empty file exclusively, striped as ``layout``; return a handle."""


class LustreDriver(PosixDriver, LayoutFileSystemDriver):
    """The POSIX driver, plus exclusive creation of files with a striping layout."""

    def __init__(self, root: str, api: LustreApi | None) -> None:
        super().__init__(root)
        self.url = file_url(self.root, "lustre")
        self.api = api

    def create_with_layout(self, path: str, layout: Layout) -> int:
        """Create a file exclusively with ``layout``; default striping where it cannot."""
        if self.api is None:
            return self.create(path)
        try:
            return self._opened(self.api.create(self._abs(path), layout), path)
        except StorageError as exc:
            if exc.errno == errno.EEXIST:
                raise TargetExistsError(errno.EEXIST, f"create {self._abs(path)}: exists") from exc
            if exc.errno in _NOT_LUSTRE:
                _warn_once(
                    f"not-lustre:{self.root}",
                    f"{self.url} is not on Lustre ({exc}); files get the default layout",
                )
                return self.create(path)
            raise

    def rename_noreplace(self, src: str, dst: str) -> None:
        try:
            super().rename_noreplace(src, dst)
        except StorageError as exc:
            if exc.errno != errno.EXDEV:
                raise
            raise StorageError(
                errno.EXDEV,
                f"{self.url}: renaming {src} to {dst} crosses Lustre metadata servers (EXDEV): "
                f"the store's directory is striped over several MDTs and remote renames are "
                f"disabled. Put the store under a directory that is not striped (lfs mkdir "
                f"-c 1, or lfs setdirstripe -c 1). Nothing was published.",
            ) from exc


class LustreCommit(RenameCommit):
    """The rename protocol, with shard files created in a striping layout chosen by size."""

    name = "lustre-rename"

    def __init__(
        self,
        driver: LustreDriver,
        *,
        stripe_count: int = LAYOUT_WIDE,
        stripe_size: int = DEFAULT_STRIPE_SIZE,
        pool: str | None = None,
        wide_threshold: int = DEFAULT_WIDE_THRESHOLD,
    ) -> None:
        super().__init__(driver)
        self.large_layout = Layout(stripe_count, stripe_size, pool)
        self.small_layout = Layout(LAYOUT_DEFAULT, LAYOUT_DEFAULT, pool)
        self.wide_threshold = wide_threshold

    def settings(self) -> dict[str, Any]:
        large = self.large_layout
        return {
            "stripe_count": large.stripe_count,
            "stripe_size": large.stripe_size,
            "pool": large.pool,
            "wide_threshold": self.wide_threshold,
        }

    def layout_for(self, size_hint: int | None) -> Layout:
        """The layout of a new shard file: wide above the threshold or when the size is
        unknown (streamed shards are the large ones), the default below it."""
        if size_hint is not None and size_hint < self.wide_threshold:
            return self.small_layout
        return self.large_layout

    def create_shard_file(self, path: str, size_hint: int | None) -> int:
        if not isinstance(self.driver, LayoutFileSystemDriver):
            return self.driver.create(path)  # the conformance suite's simulated file system
        return self.driver.create_with_layout(path, self.layout_for(size_hint))


def open_lustre(url: StoreURL, options: Mapping[str, object]) -> LustreCommit:
    """Open a ``lustre:///abs/path`` store.

    Options: ``stripe_count`` (-1: all OSTs, the default for large files), ``stripe_size``
    (bytes, default 16 MiB), ``pool`` (an OST pool), ``wide_threshold`` (bytes; smaller files
    keep the default layout, default 64 MiB), ``lustreapi`` (path of liblustreapi.so).
    """
    url.reject_unknown(
        options, allowed=("stripe_count", "stripe_size", "pool", "wide_threshold", "lustreapi")
    )
    if url.netloc not in ("", "localhost"):
        raise InvalidURLError(f"{url.shown}: lustre:// URLs take an absolute path (lustre:///path)")
    count = option_int(options, "stripe_count", -1, minimum=-1)
    if count == 0:
        raise InvalidOptionError("stripe_count must be -1 (all OSTs) or a positive count")
    size = option_int(options, "stripe_size", DEFAULT_STRIPE_SIZE, minimum=65536)
    if size % 65536:
        raise InvalidOptionError(f"stripe_size must be a multiple of 64 KiB, got {size}")
    explicit = str(options["lustreapi"]) if options.get("lustreapi") else None
    api = load_lustreapi(explicit)
    driver = LustreDriver(url.path, api)
    if api is None:
        _warn_once(
            "no-library",
            "liblustreapi was not found (set CKPTSTORE_LUSTREAPI or the lustreapi option): "
            "lustre:// stores work, with the file system's default striping",
        )
    probe = url.path
    while not os.path.exists(probe) and probe != os.path.dirname(probe):
        probe = os.path.dirname(probe)
    if is_lustre(probe) is False:
        _warn_once(
            f"not-lustre-root:{url.path}",
            f"{url.shown} is not on a Lustre file system; the protocol is still correct",
        )
    return LustreCommit(
        driver,
        stripe_count=LAYOUT_WIDE if count == -1 else count,
        stripe_size=size,
        pool=str(options["pool"]) if options.get("pool") else None,
        wide_threshold=option_int(options, "wide_threshold", DEFAULT_WIDE_THRESHOLD, minimum=0),
    )
