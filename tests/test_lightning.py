"""Lightning through CkptStoreIO: every checkpoint Lightning saves is published in one commit,
and a fit killed mid-save resumes with ckpt_path="last", bit-exact."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("pytorch_lightning")
import torch

import ckptstore
from ckptstore import CheckpointExistsError, CheckpointNotFoundError
from ckptstore.adapters.lightning import CkptStoreIO

HERE = Path(__file__).parent
CHECKOUT = HERE.parent
STEP = 4  # global steps per epoch (lightning_training.BATCHES_PER_EPOCH)
LIGHTNING_WARNINGS = pytest.mark.filterwarnings(
    "ignore::UserWarning", "ignore::DeprecationWarning", "ignore::FutureWarning"
)


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name, tensor in a.items():
        assert torch.equal(tensor, b[name]), name


@pytest.mark.slow
@LIGHTNING_WARNINGS
def test_a_fit_killed_mid_save_resumes_from_the_newest_published_bit_exact(
    tmp_path: Path,
) -> None:
    from lightning_training import fit

    expected, trained = fit(f"file://{tmp_path}/reference", str(tmp_path / "reference"))
    assert trained == 4 * STEP
    store = f"file://{tmp_path}/store"
    killed = subprocess.run(
        [sys.executable, str(HERE / "lightning_training.py"), "--store", store,
         "--root", str(tmp_path / "run"), "--die-publishing", str(2 * STEP)],
        capture_output=True, text=True, timeout=300, check=False,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(CHECKOUT), str(HERE)])},
    )  # fmt: skip
    assert killed.returncode == -9, killed.stderr[-3000:]
    assert ckptstore.open(store).steps() == [STEP]  # the second epoch's save never published
    weights, trained = fit(store, str(tmp_path / "run"))  # ckpt_path="last"
    assert trained == 3 * STEP  # resumed after the first epoch, not from scratch
    _same(weights, expected)
    assert ckptstore.open(store).steps() == [STEP, 2 * STEP, 3 * STEP, 4 * STEP]
    pointers = {p.name for p in (tmp_path / "run" / "ckpts").iterdir()}
    assert {"last.ckpt", *(f"epoch={e}-step={STEP * (e + 1)}.ckpt" for e in range(4))} <= pointers


@pytest.mark.slow
@LIGHTNING_WARNINGS
def test_async_saves_through_lightnings_async_checkpoint_io(tmp_path: Path) -> None:
    from lightning_training import fit

    weights, _ = fit(f"file://{tmp_path}/store", str(tmp_path / "run"), epochs=2, use_async=True)
    store = ckptstore.open(f"file://{tmp_path}/store")
    assert store.steps() == [STEP, 2 * STEP]
    saved = store.latest().metadata
    assert saved == {"components": ["lightning"]}
    assert not (tmp_path / "new-machine").exists()  # no pointer file there: only the store
    resumed, trained = fit(f"file://{tmp_path}/store", str(tmp_path / "new-machine"), epochs=2,
                           new_machine=True)  # fmt: skip
    assert trained == 0  # resumed at the end: nothing left to train
    _same(resumed, weights)


def _checkpoint(step: int) -> dict[str, object]:
    return {"global_step": step, "epoch": 0, "state_dict": {"w": torch.full((2,), float(step))}}


def test_pointers_removal_and_last(tmp_path: Path) -> None:
    store = ckptstore.open(f"file://{tmp_path}/store")
    io = CkptStoreIO(store)
    ckpts = tmp_path / "ckpts"
    for step in (1, 2, 3):
        io.save_checkpoint(_checkpoint(step), ckpts / f"step={step}.ckpt")
        io.save_checkpoint(_checkpoint(step), ckpts / "last.ckpt")  # the same step: reused
    assert store.steps() == [1, 2, 3]
    pointer = json.loads((ckpts / "step=2.ckpt").read_text())
    assert pointer == {"format": "ckptstore.lightning-pointer", "url": store.url, "step": 2}
    assert torch.equal(io.load_checkpoint(ckpts / "step=2.ckpt")["state_dict"]["w"],
                       torch.full((2,), 2.0))  # fmt: skip
    io.save_checkpoint(_checkpoint(1), ckpts / "copy-of-1.ckpt")  # two pointers at step 1
    io.remove_checkpoint(ckpts / "step=1.ckpt")
    assert store.steps() == [1, 2, 3]  # copy-of-1 still names it
    io.remove_checkpoint(ckpts / "copy-of-1.ckpt")
    assert store.steps() == [2, 3]
    io.remove_checkpoint(ckpts / "step=3.ckpt")  # the newest stays published
    assert store.steps() == [2, 3]
    assert io.load_checkpoint(ckpts / "last.ckpt")["global_step"] == 3
    with pytest.raises(CheckpointNotFoundError):
        io.load_checkpoint(ckpts / "nowhere.ckpt")
    with pytest.raises(CheckpointExistsError, match="rollback"):
        CkptStoreIO(store).save_checkpoint(_checkpoint(2), ckpts / "again.ckpt")
    other = CkptStoreIO(f"file://{tmp_path}/other")
    with pytest.raises(CheckpointNotFoundError, match="not of this plugin's store"):
        other.load_checkpoint(ckpts / "step=2.ckpt")


def test_a_step_another_callbacks_pointer_names_is_kept(tmp_path: Path) -> None:
    store = ckptstore.open(f"file://{tmp_path}/store")
    io = CkptStoreIO(store)
    for step in (1, 2, 3):  # two ModelCheckpoint callbacks, each with a directory of its own
        io.save_checkpoint(_checkpoint(step), tmp_path / "best" / f"step={step}.ckpt")
        io.save_checkpoint(_checkpoint(step), tmp_path / "every" / f"step={step}.ckpt")
    io.remove_checkpoint(tmp_path / "best" / "step=1.ckpt")
    io.remove_checkpoint(tmp_path / "best" / "step=2.ckpt")
    assert store.steps() == [1, 2, 3]
    assert io.load_checkpoint(tmp_path / "every" / "step=1.ckpt")["global_step"] == 1
    io.remove_checkpoint(tmp_path / "every" / "step=1.ckpt")
    assert store.steps() == [2, 3]


def test_a_checkpoint_lightning_wrote_itself_still_loads(tmp_path: Path) -> None:
    path = tmp_path / "plain.ckpt"
    torch.save(_checkpoint(7), path)
    io = CkptStoreIO(f"file://{tmp_path}/store")
    assert io.load_checkpoint(path)["global_step"] == 7
    io.remove_checkpoint(path)
    assert not path.exists()


def test_a_new_machine_resumes_from_the_store_without_any_local_file(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/store"
    assert CkptStoreIO(url).resume_path(tmp_path / "fresh") is None  # nothing yet: from scratch
    assert not (tmp_path / "fresh").exists()
    io = CkptStoreIO(url)
    for step in (1, 2):
        io.save_checkpoint(_checkpoint(step), tmp_path / "old-machine" / f"step={step}.ckpt")
    elsewhere = CkptStoreIO(url)  # another machine: its checkpoint directory is empty
    path = elsewhere.resume_path(tmp_path / "new-machine" / "ckpts")
    assert path == str(tmp_path / "new-machine" / "ckpts" / "last.ckpt")
    assert elsewhere.load_checkpoint(path)["global_step"] == 2
    io.save_checkpoint(_checkpoint(3), tmp_path / "old-machine" / "step=3.ckpt")
    assert elsewhere.resume_path(tmp_path / "new-machine" / "ckpts") == path  # kept, reused
    assert elsewhere.load_checkpoint(path)["global_step"] == 3  # last: the newest published
    foreign = tmp_path / "mine" / "last.ckpt"
    foreign.parent.mkdir()
    torch.save(_checkpoint(9), foreign)
    with pytest.raises(ckptstore.InvalidInputError, match="not a pointer"):
        elsewhere.resume_path(foreign.parent)
    assert torch.load(foreign)["global_step"] == 9  # left alone


@pytest.mark.parametrize(
    "content",
    ['{"format": "ckptstore.lightning-pointer", "url": "file:///x", "st',  # cut short
     '{"format": "ckptstore.lightning-pointer", "url": "file:///x"}',  # no step
     '{"some": "other json"}'],
    ids=["truncated", "incomplete", "other-json"],
)  # fmt: skip
def test_a_damaged_pointer_says_so(tmp_path: Path, content: str) -> None:
    from ckptstore.errors import NotACheckpointError

    io = CkptStoreIO(f"file://{tmp_path}/store")
    io.save_checkpoint(_checkpoint(1), tmp_path / "ckpts" / "step=1.ckpt")
    damaged = tmp_path / "ckpts" / "step=2.ckpt"
    damaged.write_text(content)
    with pytest.raises(NotACheckpointError, match="not a ckptstore pointer"):
        io.load_checkpoint(damaged)
    io.remove_checkpoint(damaged)  # removed; unpublishes nothing
    assert not damaged.exists() and io.store.steps() == [1]
