"""Scratch ext4, xfs and btrfs file systems: sparse images mounted on loop devices.

The file-system layers of the ``thorough`` profile run again on each, because journaling and
rename atomicity differ between them (btrfs and xfs have no ``data=ordered`` mode as ext4
has). It takes root, ``mount -o loop`` (which finds a free loop device itself) and the
type's ``mkfs``; where the machine lacks one, ``ImageUnavailable`` says which. Nothing is
installed here: a missing ``mkfs.xfs`` is a reason to skip, not to fetch it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator

__all__ = ["IMAGE_TYPES", "ImageUnavailable", "image_url", "mounted_image"]

IMAGE_TYPES = ("ext4", "xfs", "btrfs")
_SIZE_MIB = {"ext4": 64, "xfs": 320, "btrfs": 128}
"""Sparse, so only what is written takes room; xfs refuses less than 300 MiB, btrfs 114."""
_MKFS_FLAGS = {"ext4": ["-q", "-F"], "xfs": ["-q", "-f"], "btrfs": ["-q", "-f"]}
_COMMAND_TIMEOUT_S = 60.0


class ImageUnavailable(Exception):
    """An image of this type cannot be made or mounted here; the message says why."""


def image_url(base_url: str, mount_point: str) -> str:
    """``base_url``'s scheme and options, at a directory of the mounted image."""
    scheme, sep, _ = base_url.partition("://")
    _, qmark, query = base_url.partition("?")
    return f"{scheme if sep else 'file'}://{mount_point}/store{qmark}{query}"


@contextlib.contextmanager
def mounted_image(fs_type: str) -> Iterator[str]:
    """A fresh ``fs_type`` file system mounted on a loop device; unmounted and removed after."""
    if hasattr(os, "geteuid") and os.geteuid() != 0:
        raise ImageUnavailable("loop devices need root")
    for tool in ("mount", "umount", "losetup", f"mkfs.{fs_type}"):
        if shutil.which(tool) is None:
            raise ImageUnavailable(f"{tool} is not installed")
    scratch = tempfile.mkdtemp(prefix=f"ckptstore-{fs_type}-")
    image, mount_point = os.path.join(scratch, "image"), os.path.join(scratch, "mnt")
    try:
        os.mkdir(mount_point)
        with open(image, "wb") as stream:
            stream.truncate(_SIZE_MIB[fs_type] * 1024 * 1024)
        _run(f"mkfs.{fs_type}", *_MKFS_FLAGS[fs_type], image)
        _run("mount", "-o", "loop", "-t", fs_type, image, mount_point)
        try:
            yield mount_point
        finally:
            _unmount(mount_point)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _run(*argv: str) -> None:
    try:
        completed = subprocess.run(
            argv, capture_output=True, text=True, timeout=_COMMAND_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ImageUnavailable(f"{argv[0]} failed: {exc}") from exc
    if completed.returncode != 0:
        why = (completed.stderr.strip() or completed.stdout.strip() or "no message").splitlines()
        raise ImageUnavailable(f"{argv[0]} failed: {why[-1]}")


def _unmount(mount_point: str) -> None:
    try:
        _run("umount", mount_point)
    except ImageUnavailable:  # still busy: detach it now, the kernel frees it when it can
        subprocess.run(["umount", "-l", mount_point], capture_output=True, check=False)
