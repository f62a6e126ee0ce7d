"""The PyTorch integration: state codec, RNGs, sync and async saves, bitwise-exact resume."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import ckptstore  # noqa: E402
from ckptstore import CkptStoreError, InvalidInputError  # noqa: E402
from ckptstore.errors import ShardCorruptError  # noqa: E402
from ckptstore.torch import (  # noqa: E402
    AsyncSaver,
    capture_rng,
    decode_state,
    encode_state,
    load_state,
    read_tensors,
    restore_rng,
    save_state,
)

EXAMPLE = Path(__file__).parent.parent / "examples" / "train_resume.py"


def test_codec_round_trip_keeps_structure_dtypes_and_sharing() -> None:
    weight = torch.randn(4, 3)
    state = {
        "w": weight,
        "tied": weight,  # shares storage: stored once, comes back shared
        "half": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3),
        "ints": {0: torch.tensor([1, 2]), 7: "seven"},
        "tuple": (1, 2.5, None, True),
        "inf": float("inf"),
        "nested": [{"a": torch.zeros(0)}, "text"],
    }
    blob, skeleton = encode_state(state)
    back = decode_state(blob, skeleton)
    assert torch.equal(back["w"], weight)
    assert back["w"].data_ptr() == back["tied"].data_ptr()
    assert back["half"].dtype == torch.bfloat16
    assert torch.equal(back["half"], state["half"])
    assert torch.equal(back["ints"][0], torch.tensor([1, 2]))
    assert back["ints"][7] == "seven"
    assert back["tuple"] == (1, 2.5, None, True)
    assert back["inf"] == float("inf")
    assert back["nested"][0]["a"].shape == (0,)
    assert b"pickle" not in skeleton


def test_codec_refuses_what_it_would_have_to_pickle() -> None:
    with pytest.raises(InvalidInputError, match="nothing is pickled"):
        encode_state({"f": lambda: 1})


_ALL_DTYPES = [
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.float8_e4m3fn,
    torch.float8_e5m2, torch.uint16, torch.uint32, torch.uint64,
]  # fmt: skip


def _bitwise_equal(a: Any, b: Any) -> bool:
    return bool(
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    )


def test_safetensors_files_are_read_straight_into_tensors_both_ways() -> None:
    import io

    from safetensors.torch import load as safetensors_load
    from safetensors.torch import save as safetensors_save

    tensors = {f"d{i}": torch.arange(6).reshape(2, 3).to(d) for i, d in enumerate(_ALL_DTYPES)}
    tensors |= {"scalar": torch.tensor(2.5), "empty": torch.zeros(0, 4)}
    theirs = safetensors_save(tensors, metadata={"by": "safetensors"})
    back = read_tensors(io.BytesIO(theirs), len(theirs))
    assert back.keys() == tensors.keys()
    assert all(_bitwise_equal(back[key], tensor) for key, tensor in tensors.items())
    ours, _ = encode_state(tensors)
    by_safetensors = safetensors_load(ours)
    back = read_tensors(io.BytesIO(ours), len(ours))
    assert back.keys() == by_safetensors.keys()
    assert all(_bitwise_equal(back[key], tensor) for key, tensor in by_safetensors.items())


def _safetensors(header: dict[str, Any], data: bytes) -> bytes:
    text = json.dumps(header).encode()
    return len(text).to_bytes(8, "little") + text + data


@pytest.mark.parametrize(
    ("blob", "problem"),
    [
        (b"\x01\x00", "too short"),
        ((1 << 40).to_bytes(8, "little") + b"{}", "header length"),
        (_safetensors({"a": {"dtype": "F32", "shape": [1 << 30], "data_offsets": [0, 4]}},
                      b"abcd"), "do not hold"),
        (_safetensors({"a": {"dtype": "X9", "shape": [1], "data_offsets": [0, 4]}}, b"abcd"),
         "bad entry"),
        (_safetensors({"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
                       "b": {"dtype": "U8", "shape": [4], "data_offsets": [2, 6]}}, b"abcdef"),
         "starts at 2"),
        (_safetensors({"a": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}}, b"abcd"),
         "the file has 4"),
        (b"\x04\x00\x00\x00\x00\x00\x00\x00[1,]", "not JSON"),
    ],
)  # fmt: skip
def test_a_damaged_safetensors_header_is_refused_before_anything_is_allocated(
    blob: bytes, problem: str
) -> None:
    import io

    with pytest.raises(ShardCorruptError, match=problem):
        read_tensors(io.BytesIO(blob), len(blob))


def test_rng_states_round_trip() -> None:
    import numpy

    state = capture_rng()
    expected = (random.random(), numpy.random.rand(), torch.rand(3))
    random.random(), numpy.random.rand(), torch.rand(3)
    blob, skeleton = encode_state(state)
    restore_rng(decode_state(blob, skeleton))
    again = (random.random(), numpy.random.rand(), torch.rand(3))
    assert again[0] == expected[0]
    assert again[1] == expected[1]
    assert torch.equal(again[2], expected[2])


def _trainer() -> tuple[nn.Module, Any, Any]:
    model = nn.Linear(8, 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2)
    model(torch.randn(2, 8)).sum().backward()
    optimizer.step()
    scheduler.step()
    return model, optimizer, scheduler


def test_save_and_load_state(tmp_path: Path) -> None:
    store = ckptstore.open(str(tmp_path / "s"))
    model, optimizer, scheduler = _trainer()
    save_state(
        store, 10, {"model": model, "optimizer": optimizer, "scheduler": scheduler,
                    "loader": {"epoch": 3, "index": 17}},
        counters={"samples_read": 640, "skipped_updates": 1},
    )  # fmt: skip
    fresh_model, fresh_optimizer, fresh_scheduler = _trainer()
    restored = load_state(
        store.latest(),
        {"model": fresh_model, "optimizer": fresh_optimizer, "scheduler": fresh_scheduler,
         "loader": {}},
    )  # fmt: skip
    assert restored["loader"] == {"epoch": 3, "index": 17}
    assert restored["counters"] == {"samples_read": 640, "skipped_updates": 1}
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, fresh_model.state_dict()[name])
    saved_moments = optimizer.state_dict()["state"][0]["exp_avg"]
    assert torch.equal(saved_moments, fresh_optimizer.state_dict()["state"][0]["exp_avg"])
    assert fresh_scheduler.state_dict() == scheduler.state_dict()
    manifest = store.latest().manifest
    assert manifest.metadata["counters"]["samples_read"] == 640
    assert "blocked_s" in manifest.timings


def test_async_save_snapshots_then_training_runs_on(tmp_path: Path) -> None:
    store = ckptstore.open(str(tmp_path / "s"))
    weights = {"w": torch.ones(1000)}
    with AsyncSaver(store) as saver:
        future = saver.save(1, {"weights": weights})
        weights["w"].mul_(5)  # training goes on right after the snapshot
        checkpoint = future.result(timeout=60)
    assert checkpoint.step == 1
    restored = load_state(store.latest(), {"weights": {}})["weights"]
    assert torch.equal(restored["w"], torch.ones(1000))
    timings = checkpoint.manifest.timings
    assert 0 <= timings["blocked_s"] <= timings["to_commit_s"]


def test_async_backpressure_bounds_saves_in_flight(tmp_path: Path) -> None:
    store = ckptstore.open(str(tmp_path / "s"))
    release = threading.Event()
    publish = store.strategy.publish

    def slow_publish(manifest: Any) -> None:
        release.wait(30)
        publish(manifest)

    store.strategy.publish = slow_publish  # type: ignore[method-assign]
    saver = AsyncSaver(store, max_in_flight=2)
    first = saver.save(1, {"x": {"t": torch.zeros(10)}})
    second = saver.save(2, {"x": {"t": torch.zeros(10)}})
    third_started = time.monotonic()
    threading.Timer(0.5, release.set).start()
    third = saver.save(3, {"x": {"t": torch.zeros(10)}})  # waits for a slot
    assert time.monotonic() - third_started >= 0.4
    assert [f.result(30).step for f in (first, second, third)] == [1, 2, 3]
    assert saver.in_flight_peak == 2
    saver.close()


def test_async_errors_surface_at_the_future_and_the_next_save(tmp_path: Path) -> None:
    store = ckptstore.open(str(tmp_path / "s"))
    store.save(5, {"a": b"taken"})
    saver = AsyncSaver(store)
    future = saver.save(5, {"x": {"t": torch.zeros(1)}})
    with pytest.raises(ckptstore.CheckpointExistsError):
        future.result(30)
    with pytest.raises(CkptStoreError, match="earlier asynchronous save failed"):
        saver.save(6, {"x": {"t": torch.zeros(1)}})
    saver.close()


def _run_example(store: Path, result: Path, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(EXAMPLE), "--store", str(store), "--steps", "40",
         "--save-every", "5", "--result", str(result), *extra],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip


def _kill_once(store: Path, result: Path, extra: tuple[str, ...], mid_save: bool, rng: Any) -> bool:
    """Run the example and SIGKILL it mid-save or mid-training; False if it finished first."""
    with _run_example(store, result, *extra) as process:
        assert process.stdout is not None
        for line in process.stdout:
            if mid_save and line.startswith("saving"):
                time.sleep(rng.uniform(0, 0.005))  # somewhere inside the save
            elif not mid_save and line.startswith("saved"):
                time.sleep(rng.uniform(0, 0.05))  # somewhere in the training steps
            else:
                continue
            os.kill(process.pid, signal.SIGKILL)
            process.wait(60)
            return True
        process.wait(120)
        return False


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_sigkilled_training_resumes_bitwise_exact(tmp_path: Path, mode: str) -> None:
    extra = ("--async",) if mode == "async" else ()
    reference = tmp_path / "reference.json"
    with _run_example(tmp_path / "uninterrupted", reference, *extra) as process:
        assert process.wait(300) == 0
    rng = random.Random(1234 if mode == "sync" else 4321)
    result = tmp_path / "resumed.json"
    kinds = [True, False, True, False, True]  # three kills mid-save, two mid-training
    for mid_save in kinds:
        assert _kill_once(tmp_path / "interrupted", result, extra, mid_save, rng)
    with _run_example(tmp_path / "interrupted", result, *extra) as process:
        assert process.stdout is not None
        output = process.stdout.read()
        assert process.wait(300) == 0
    assert "resumed from step" in output
    expected, got = json.loads(reference.read_text()), json.loads(result.read_text())
    assert got["state_sha256"] == expected["state_sha256"]  # parameters and optimizer state
    assert got["losses"] == expected["losses"]  # the per-step loss log, bit for bit
    assert got["counters"] == expected["counters"]


SINGLE_PROCESS = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@SINGLE_PROCESS
def test_dcp_save_load_and_async_save_in_one_process(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    from ckptstore.torch.dcp import CkptStoreReader, CkptStoreWriter

    store = ckptstore.open(str(tmp_path / "s"))
    model, optimizer, _ = _trainer()
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
             "half": torch.ones(3, dtype=torch.bfloat16), "extra": {"epoch": 4}}  # fmt: skip
    dcp.save(state, storage_writer=CkptStoreWriter(store, 1, {"note": "dcp"}))
    dcp.async_save(state, storage_writer=CkptStoreWriter(store, 2)).result()
    assert store.steps() == [1, 2]
    assert store.get(1).metadata == {"note": "dcp"}
    fresh_model, fresh_optimizer, _ = _trainer()
    target = {"model": fresh_model.state_dict(), "optimizer": fresh_optimizer.state_dict(),
              "half": torch.zeros(3, dtype=torch.bfloat16), "extra": {"epoch": 0}}  # fmt: skip
    dcp.load(target, storage_reader=CkptStoreReader(store, 1))
    for name, tensor in model.state_dict().items():
        assert torch.equal(target["model"][name], tensor)
    assert torch.equal(
        target["optimizer"]["state"][0]["exp_avg"], optimizer.state_dict()["state"][0]["exp_avg"]
    )
    assert torch.equal(target["half"], torch.ones(3, dtype=torch.bfloat16))
    assert target["extra"] == {"epoch": 4}


@SINGLE_PROCESS
def test_dcp_reader_refuses_a_checkpoint_dcp_did_not_write(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    from ckptstore.torch.dcp import CkptStoreReader

    store = ckptstore.open(str(tmp_path / "s"))
    store.save(1, {"plain": b"x"})
    from torch.distributed.checkpoint.api import CheckpointException

    with pytest.raises(CheckpointException) as caught:
        dcp.load({"w": torch.zeros(1)}, storage_reader=CkptStoreReader(store))
    assert "not saved by torch.distributed.checkpoint" in repr(caught.value.failures)
