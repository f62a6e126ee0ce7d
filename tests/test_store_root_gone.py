"""A store's root removed under a running save is reported as what happened (issue 24, item
18): the root is gone; garbage collection, which never removes a root, is not blamed."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import ckptstore
from ckptstore.errors import ObjectNotFoundError


@pytest.mark.parametrize("when", ["write", "publish"])
def test_a_root_removed_under_a_save_is_named_not_blamed_on_gc(tmp_path: Path, when: str) -> None:
    root = tmp_path / "store"
    store = ckptstore.open(f"file://{root}")
    store.save(1, {"w": b"1"})
    pending = store.begin(2)
    pending.write("a", b"x" * 100)
    shutil.rmtree(root)
    with pytest.raises(ObjectNotFoundError) as caught:
        if when == "write":
            pending.write("b", b"y" * 100)
        pending.publish()
    message = str(caught.value)
    assert "the store's root directory is gone" in message, message
    assert "garbage collection" not in message
    assert "step 2" in message and "nothing was published" in message
