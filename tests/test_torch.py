"""The PyTorch integration: state codec, RNGs, sync and async saves, bitwise-exact resume."""

from __future__ import annotations

import importlib.util
import io
import json
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from child_output import ChildOutput

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
    assert "snapshot_s" in manifest.timings  # synchronous: blocked for the whole save,
    assert "blocked_s" not in manifest.timings  # which only an asynchronous save records


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


RUN_WAIT_S = 240.0
"""How long one run of the example may take to reach what a test waits for (it imports torch,
on a machine that may be busy): a bound against hanging, not a timing assertion."""


def _run_example(store: Path, result: Path, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(EXAMPLE), "--store", str(store), "--steps", "80",
         "--save-every", "4", "--result", str(result), *extra],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip


def _finish(process: subprocess.Popen[str]) -> str:
    """Wait (bounded) for a run to end by itself; its output. A hung run fails the test."""
    try:
        output, _ = process.communicate(timeout=RUN_WAIT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        pytest.fail(f"the example did not finish within {RUN_WAIT_S:.0f} s")
    assert process.returncode == 0, output
    return output


def _step_of(line: str, event: str) -> int:
    """N in the example's line "<event> N" ("saving", "snapshot", "saved"); -1 otherwise."""
    word, _, number = line.partition(" ")
    return int(number) if word == event and number.isdigit() else -1


def _run_on(output: ChildOutput, seconds: float, until: str) -> None:
    """Let the example go on for ``seconds``, or until its next ``until`` line if sooner.

    Where in that window the kill lands is random; nothing the test asserts depends on it.
    Ending at the next line bounds how far one run gets, so that every kill finds work left.
    """
    deadline = time.monotonic() + seconds
    try:
        while (line := output.next_line(deadline - time.monotonic())) is not None:
            if _step_of(line, until) >= 0:
                return
    except EOFError:
        pytest.fail(f"the example finished before it could be killed:\n{output.lines[-5:]}")


def _kill_after_a_commit(
    store: Path, result: Path, extra: tuple[str, ...], mid_save: bool, rng: Any, committed: int
) -> int:
    """Run the example until it publishes a step after ``committed``, then SIGKILL it inside
    its next save or in its training steps; return the newest step it said it saved."""
    with _run_example(store, result, *extra) as process:
        assert process.stdout is not None
        output = ChildOutput(process.stdout)
        try:
            line = output.wait_for(
                lambda text: _step_of(text, "saved") > committed,
                RUN_WAIT_S,
                f'"saved N" for a step after {committed} (a new published checkpoint)',
            )
            if mid_save:
                saved = _step_of(line, "saved")
                output.wait_for(
                    lambda text: _step_of(text, "saving") > saved, RUN_WAIT_S, "the next save"
                )
                _run_on(output, rng.uniform(0, 0.03), until="saved")  # inside that save
            else:
                _run_on(output, rng.uniform(0, 0.05), until="saving")  # in the training steps
        finally:
            process.send_signal(signal.SIGKILL)  # also when a wait failed: never leave it running
            process.wait(60)
        lines = output.drain(60)
    return max(_step_of(line, "saved") for line in lines)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_sigkilled_training_resumes_bitwise_exact(tmp_path: Path, mode: str) -> None:
    extra = ("--async",) if mode == "async" else ()
    reference = tmp_path / "reference.json"
    with _run_example(tmp_path / "uninterrupted", reference, *extra) as process:
        _finish(process)
    rng = random.Random(1234 if mode == "sync" else 4321)
    result, interrupted = tmp_path / "resumed.json", tmp_path / "interrupted"
    committed = 0
    kinds = [True, False, True, False, True]  # three kills mid-save, two mid-training
    for mid_save in kinds:
        said = _kill_after_a_commit(interrupted, result, extra, mid_save, rng, committed)
        latest = ckptstore.open(str(interrupted)).latest()
        assert latest is not None, f"step {said} was published, then nothing survived the kill"
        assert latest.step >= said  # what was published survives the kill
        committed = latest.step
    with _run_example(interrupted, result, *extra) as process:
        output = _finish(process)
    assert f"resumed from step {committed}" in output
    expected, got = json.loads(reference.read_text()), json.loads(result.read_text())
    assert got["state_sha256"] == expected["state_sha256"]  # parameters and optimizer state
    assert got["losses"] == expected["losses"]  # the per-step loss log, bit for bit
    assert got["counters"] == expected["counters"]


class _PublishedAtEachLine(io.StringIO):
    """A stdout that notes, for each line written, the steps the store had published then."""

    def __init__(self, store: Path, open_store: Any) -> None:
        super().__init__()
        self.store, self.open_store = store, open_store
        self.lines: list[tuple[str, list[int]]] = []
        self.said_more_than_saving = threading.Event()
        self._partial = ""

    def write(self, text: str) -> int:
        self._partial += text
        while "\n" in self._partial:
            line, self._partial = self._partial.split("\n", 1)
            self.lines.append((line, self.open_store(str(self.store)).steps()))
            if _step_of(line, "saving") < 0:
                self.said_more_than_saving.set()
        return len(text)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_the_example_says_saved_only_once_the_checkpoint_is_published(
    tmp_path: Path, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The line "saved N" means N is published: a kill after it never loses N. With --async, the
    snapshot is its own line, and a publish held back until the example has said what it says
    at the snapshot shows that "saved N" waits for the publish."""
    spec = importlib.util.spec_from_file_location("train_resume_example", EXAMPLE)
    assert spec is not None
    assert spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    store, real_open = tmp_path / "store", ckptstore.open
    stdout = _PublishedAtEachLine(store, real_open)

    def open_with_a_held_publish(url: str, **options: Any) -> ckptstore.Store:
        opened = real_open(url, **options)
        publish = opened.strategy.publish

        def held_publish(manifest: Any) -> None:  # in the background: the trainer goes on
            stdout.said_more_than_saving.wait(RUN_WAIT_S)
            publish(manifest)

        opened.strategy.publish = held_publish  # type: ignore[method-assign]
        return opened

    if mode == "async":
        monkeypatch.setattr(ckptstore, "open", open_with_a_held_publish)
    monkeypatch.setattr(sys, "stdout", stdout)
    extra = ["--async"] if mode == "async" else []
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    rng_state = torch.random.get_rng_state()
    try:
        args = ["--store", str(store), "--steps", "8", "--save-every", "4", "--width", "16"]
        assert example.main([*args, *extra]) == 0
    finally:  # the example sets process-wide torch state: give the other tests theirs back
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)
        torch.random.set_rng_state(rng_state)
    said = [line for line, _ in stdout.lines]
    saved = [(_step_of(line, "saved"), published) for line, published in stdout.lines]
    assert [step for step, _ in saved if step >= 0] == [4, 8], said
    for step, published in saved:
        if step >= 0:
            assert published, f'"saved {step}" said while nothing was published: {said}'
            assert max(published) >= step, f'"saved {step}" said before it was published: {said}'
    if mode == "async":
        for step in (4, 8):
            assert said.index(f"snapshot {step}") < said.index(f"saved {step}"), said


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


def test_a_dcp_load_item_narrows_a_stored_chunk_to_its_slice() -> None:
    from ckptstore.torch.dcp import _narrow

    stored = torch.arange(6 * 4 * 5).reshape(6, 4, 5)
    assert torch.equal(_narrow(stored, [2, 0, 1], [3, 4, 2]), stored[2:5, :, 1:3])
    assert _narrow(stored, [0, 0, 0], [6, 4, 5]) is stored  # the whole chunk: no copy, no view
    with pytest.raises(ValueError, match="zip"):
        _narrow(stored, [0, 0], [6, 4, 5])  # a plan and a chunk that disagree on dimensions
