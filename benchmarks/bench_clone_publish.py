"""Publishing a directory into a file:// store by copy-on-write clones (reflinks) against
copying its bytes, on a file system that makes clones.

    python -m benchmarks.bench_clone_publish --dir /mnt/xfs [--layout 4x128M] [--repeats 5]
        [--busy 0]

``--dir`` must be on XFS (``mkfs.xfs -m reflink=1``), btrfs or another file system with
``FICLONE``; elsewhere both contenders copy. The directory's files are written and synced to
disk first (the state a trainer's files reach a little after its save), then
``publish_directory`` publishes them, interleaved: ``clone=False`` (copied, as on ext4) and
``clone=True``. Each published step is deleted between repeats, untimed.
"""

from __future__ import annotations

import argparse
import itertools
import os
import shutil
import tempfile

import ckptstore
from ckptstore.directory import publish_directory
from ckptstore.tools.timing import busy, layout, measure, print_table, sizes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", required=True, help="a directory on XFS, btrfs...")
    parser.add_argument("--layout", default="4x128M", help="files x size")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--busy", type=int, default=0, help="spinning processes beside it")
    args = parser.parse_args()
    count, each = args.layout.lower().split("x")
    files, size = int(count), sizes([each])[0]
    root = tempfile.mkdtemp(prefix="bench-clone-", dir=args.dir)
    try:
        directory = os.path.join(root, "checkpoint")
        os.makedirs(directory)
        for index in range(files):
            with open(os.path.join(directory, f"shard{index}.bin"), "wb") as out:
                out.write(os.urandom(size))
        os.sync()
        store = ckptstore.open(f"file://{root}/store")
        steps = itertools.count(1)

        def publisher(clone: bool) -> object:
            return lambda repeat: publish_directory(store, next(steps), directory, clone=clone)

        def tidy(name: str, repeat: int) -> None:
            for step in store.steps():
                store.delete(step, force=True)
            os.sync()

        with busy(args.busy):
            results = measure(
                {"copy": publisher(False), "clone": publisher(True)},  # type: ignore[dict-item]
                args.repeats,
                after=tidy,
            )
        print_table(
            f"publish_directory of {files * size / 2**20:.0f} MiB into file:// on {args.dir}",
            results,
            "copy",
            files * size,
            layout=layout(files, size),
            busy=args.busy,
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
