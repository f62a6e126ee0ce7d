"""Hugging Face Trainer checkpoints through CkptStoreCallback: every checkpoint-N published in
one commit, a killed run resumed bit-exact from the store, on a machine that has nothing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
import torch

import ckptstore
from ckptstore.adapters.directory import publish_directory
from ckptstore.adapters.huggingface import CkptStoreCallback

HERE = Path(__file__).parent
CHECKOUT = HERE.parent


@pytest.mark.slow
def test_a_run_killed_while_publishing_resumes_bit_exact_on_a_new_machine(tmp_path: Path) -> None:
    from hf_training import train

    expected, _ = train(f"file://{tmp_path}/reference", str(tmp_path / "reference-out"))
    store = f"file://{tmp_path}/store"
    killed = subprocess.run(
        [sys.executable, str(HERE / "hf_training.py"), "--store", store,
         "--output-dir", str(tmp_path / "node-1"), "--die-publishing", "6"],
        capture_output=True, text=True, timeout=300, check=False,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(CHECKOUT), str(HERE)])},
    )  # fmt: skip
    assert killed.returncode == -9, killed.stderr[-3000:]
    assert ckptstore.open(store).steps() == [3]  # step 6 died half-published: not there
    weights, callback = train(store, str(tmp_path / "node-2"))  # a new machine: nothing local
    assert callback.restored is not None and callback.restored.step == 3
    assert weights.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(weights[name], tensor), name
    assert ckptstore.open(store).steps() == [3, 6, 9]
    assert ckptstore.open(store).get(9).metadata == {
        "trainer": "transformers",
        "directory": "checkpoint-9",
    }


def _checkpoint_dir(root: Path, step: int, content: bytes = b"weights") -> Path:
    directory = root / f"checkpoint-{step}"
    directory.mkdir(parents=True)
    (directory / "model.safetensors").write_bytes(content + bytes([step]))
    (directory / "trainer_state.json").write_bytes(b'{"global_step": %d}' % step)
    return directory


def test_unpublished_local_checkpoints_are_moved_aside_not_deleted(tmp_path: Path) -> None:
    store = ckptstore.open(f"file://{tmp_path}/store")
    out = tmp_path / "out"
    publish_directory(store, 2, _checkpoint_dir(out, 2))
    _checkpoint_dir(out, 4)  # written by the Trainer, killed before it was published
    restored = CkptStoreCallback(store).prepare_output_dir(out)
    assert restored is not None and restored.step == 2
    names = sorted(p.name for p in out.iterdir())
    assert names[0] == "checkpoint-2" and names[1].startswith("checkpoint-4.unpublished-")
    assert len(names) == 2
    assert CkptStoreCallback.resume_path(type("Args", (), {"output_dir": str(out)})) == str(
        out / "checkpoint-2"
    )


def test_a_damaged_local_copy_is_moved_aside_and_a_good_one_kept(tmp_path: Path) -> None:
    store = ckptstore.open(f"file://{tmp_path}/store")
    out = tmp_path / "out"
    good = _checkpoint_dir(out, 5)
    publish_directory(store, 5, good)
    callback = CkptStoreCallback(store)
    inode = (good / "model.safetensors").stat().st_ino
    callback.prepare_output_dir(out)
    assert (good / "model.safetensors").stat().st_ino == inode  # identical: left as it was
    (good / "model.safetensors").write_bytes(b"weightZ\x05")  # same size, other bytes
    (good / "stray.tmp").write_bytes(b"")
    callback.prepare_output_dir(out)
    assert (good / "model.safetensors").read_bytes() == b"weights\x05"
    assert not (good / "stray.tmp").exists()
    # issue 24: the differing copy was the user's to delete, not the callback's: moved aside
    (aside,) = [p for p in out.iterdir() if p.name.startswith("checkpoint-5.unpublished-")]
    assert (aside / "model.safetensors").read_bytes() == b"weightZ\x05"
    assert (aside / "stray.tmp").exists()


def test_nothing_published_leaves_the_output_dir_alone_but_unpublished_saves(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    out = tmp_path / "out"
    _checkpoint_dir(out, 1)
    with caplog.at_level("WARNING", logger="ckptstore.adapters.huggingface"):
        assert CkptStoreCallback(f"file://{tmp_path}/store").prepare_output_dir(out) is None
    assert [p.name.split(".")[0] for p in out.iterdir()] == ["checkpoint-1"]
    assert "is this the run's store?" in caplog.text  # a wrong URL is not silent
    assert "checkpoint-1.unpublished-" in caplog.text
    assert CkptStoreCallback.resume_path(type("Args", (), {"output_dir": str(out)})) is None
    assert (
        CkptStoreCallback.resume_path(type("Args", (), {"output_dir": str(tmp_path / "no")}))
        is None
    )


def _machine(rank: int, rendezvous: str, store_url: str, dirs: list[str], local: list[int],
             bad_rank: int, outcome: object) -> None:  # fmt: skip
    """One process of a 2-process job: ``dirs[rank]`` is its machine's output_dir. The ranks
    meet through a file of the job's own (no TCP port to pick ahead and lose to another
    process: a port found free and bound seconds later by rank 0 could meanwhile be taken, or
    handed to a concurrent job too, whose rank 1 then joined this one and left: "Connection
    reset by peer" at rank 0's first barrier); gloo listens on loopback ports the kernel hands
    it."""
    import types

    import torch.distributed as dist

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=2)
    try:
        args = types.SimpleNamespace(
            output_dir=dirs[rank], process_index=rank, local_process_index=local[rank],
            world_size=2,
        )  # fmt: skip
        if rank == bad_rank:
            (Path(dirs[rank]) / "checkpoint-5" / "broken").symlink_to("nowhere")
        callback = CkptStoreCallback(store_url)
        try:
            callback.on_save(args, types.SimpleNamespace(global_step=5), None)
            outcome[rank] = "published"  # type: ignore[index]
        except ckptstore.CkptStoreError as exc:
            outcome[rank] = f"error: {exc}"  # type: ignore[index]
    finally:
        dist.destroy_process_group()


def _run_machines(tmp_path: Path, dirs: list[Path], local: list[int], bad_rank: int = -1):  # type: ignore[no-untyped-def]
    import torch.multiprocessing as mp

    tmp_path.mkdir(parents=True, exist_ok=True)
    rendezvous = str(tmp_path / "rendezvous")  # new for each job: a FileStore's file
    # The manager's server is spawned: a fork here would copy whatever threads this test
    # process runs (JAX's, when a JAX test ran in it first) and may deadlock.
    outcome = mp.get_context("spawn").Manager().dict()
    url = f"file://{tmp_path}/store"
    mp.spawn(_machine, args=(rendezvous, url, [str(d) for d in dirs], local, bad_rank, outcome),
             nprocs=2)  # fmt: skip
    return ckptstore.open(url), dict(outcome)


def _write(directory: Path, files: dict[str, bytes]) -> None:
    for name, content in files.items():
        (directory / name).parent.mkdir(parents=True, exist_ok=True)
        (directory / name).write_bytes(content)


def test_a_machine_that_wrote_nothing_contributes_nothing(tmp_path: Path) -> None:
    dirs = [tmp_path / "machine-a", tmp_path / "machine-b"]  # save_only_model: b wrote nothing
    _write(dirs[0] / "checkpoint-5", {"model.safetensors": b"w"})
    store, outcome = _run_machines(tmp_path, dirs, local=[0, 0])
    assert outcome == {0: "published", 1: "published"}
    assert store.latest().names == ["model.safetensors"]
    _run_machines(tmp_path / "none", [tmp_path / "x", tmp_path / "y"], local=[0, 0])
    assert ckptstore.open(f"file://{tmp_path}/none/store").latest() is None


@pytest.mark.parametrize("shared", [False, True], ids=["own-disks", "shared-fs"])
def test_every_machine_contributes_its_files_to_one_commit(tmp_path: Path, shared: bool) -> None:
    common = {"model.safetensors": b"weights" * 100, "trainer_state.json": b"{}"}
    if shared:  # one directory both machines see, with every file
        dirs = [tmp_path / "shared", tmp_path / "shared"]
        _write(
            dirs[0] / "checkpoint-5", {**common, "rng_state_0.pth": b"r0", "rng_state_1.pth": b"r1"}
        )
    else:  # each machine holds what its own process wrote; both wrote trainer_state.json
        dirs = [tmp_path / "machine-a", tmp_path / "machine-b"]
        _write(dirs[0] / "checkpoint-5", {**common, "rng_state_0.pth": b"r0"})
        _write(dirs[1] / "checkpoint-5", {"trainer_state.json": b"{}", "rng_state_1.pth": b"r1"})
    store, outcome = _run_machines(tmp_path, dirs, local=[0, 0])
    assert outcome == {0: "published", 1: "published"}
    checkpoint = store.latest()
    assert checkpoint.step == 5
    assert sorted(checkpoint.names) == sorted([*common, "rng_state_0.pth", "rng_state_1.pth"])
    assert checkpoint.read("rng_state_1.pth") == b"r1"  # from the second machine's disk
    fresh = tmp_path / "new-machine"
    assert CkptStoreCallback(store).prepare_output_dir(fresh).step == 5
    assert (fresh / "checkpoint-5" / "rng_state_1.pth").read_bytes() == b"r1"


def test_a_machine_that_cannot_publish_its_files_publishes_nothing_anywhere(
    tmp_path: Path,
) -> None:
    dirs = [tmp_path / "machine-a", tmp_path / "machine-b"]
    _write(dirs[0] / "checkpoint-5", {"model.safetensors": b"w", "rng_state_0.pth": b"r0"})
    _write(dirs[1] / "checkpoint-5", {"rng_state_1.pth": b"r1"})
    store, outcome = _run_machines(tmp_path, dirs, local=[0, 0], bad_rank=1)
    assert store.latest() is None
    for rank in (0, 1):  # both processes raise, naming the machine and the file
        assert outcome[rank].startswith("error: checkpoint-5 was not published"), outcome
        assert "rank 1" in outcome[rank] and "broken" in outcome[rank]


def test_the_best_checkpoint_a_resumed_run_remembers_exists_on_a_new_machine(
    tmp_path: Path,
) -> None:
    import contextlib
    import types

    store = ckptstore.open(f"file://{tmp_path}/store")
    old = tmp_path / "old-machine"
    for step in (2, 4):
        publish_directory(store, step, _checkpoint_dir(old, step))
    out = tmp_path / "new-machine"
    callback = CkptStoreCallback(store)
    assert callback.prepare_output_dir(out).step == 4  # only the newest is materialised
    args = types.SimpleNamespace(
        output_dir=str(out), local_process_index=0,
        main_process_first=lambda **kwargs: contextlib.nullcontext(),
    )  # fmt: skip
    state = types.SimpleNamespace(best_model_checkpoint=str(old / "checkpoint-2"))
    callback.on_train_begin(args, state, None)
    assert state.best_model_checkpoint == str(out / "checkpoint-2")  # here, not on the old one
    assert (out / "checkpoint-2" / "trainer_state.json").read_bytes() == b'{"global_step": 2}'
    state = types.SimpleNamespace(best_model_checkpoint=str(old / "checkpoint-3"))  # unpublished
    callback.on_train_begin(args, state, None)
    assert state.best_model_checkpoint == str(old / "checkpoint-3")  # left for the Trainer to say


def test_two_machines_materialising_the_best_at_once_on_a_shared_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import contextlib
    import types

    import ckptstore.huggingface as hf

    store = ckptstore.open(f"file://{tmp_path}/store")
    publish_directory(store, 2, _checkpoint_dir(tmp_path / "old", 2))
    out = tmp_path / "shared"
    real = hf.materialize

    def other_machine_first(checkpoint, target, **kwargs):  # type: ignore[no-untyped-def]
        real(checkpoint, target, **kwargs)  # the other machine's main process won the race
        return real(checkpoint, target, **kwargs)  # ours: "already exists"

    monkeypatch.setattr(hf, "materialize", other_machine_first)
    args = types.SimpleNamespace(
        output_dir=str(out), local_process_index=0,
        main_process_first=lambda **kwargs: contextlib.nullcontext(),
    )  # fmt: skip
    state = types.SimpleNamespace(best_model_checkpoint=str(tmp_path / "old" / "checkpoint-2"))
    CkptStoreCallback(store).on_train_begin(args, state, None)
    assert state.best_model_checkpoint == str(out / "checkpoint-2")
