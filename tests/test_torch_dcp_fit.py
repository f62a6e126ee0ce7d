"""DCP's StorageWriter and StorageReader as DCP users hold them: one of each for a whole run,
the step from DCP's ``checkpoint_id``; and which checkpoint a load without a step reads."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint.api import CheckpointException  # noqa: E402

import ckptstore  # noqa: E402
from ckptstore import CheckpointExistsError, CheckpointNotFoundError, InvalidInputError  # noqa: E402
from ckptstore.torch import load_state, save_state  # noqa: E402
from ckptstore.torch.agreement import agreed_checkpoint  # noqa: E402
from ckptstore.torch.dcp import (  # noqa: E402
    CkptStoreReader,
    CkptStoreWriter,
    checkpoint_id_of,
    step_from_checkpoint_id,
)

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _state(value: float) -> dict[str, object]:
    return {"w": torch.full((4, 2), value), "epoch": int(value)}


def test_one_writer_and_one_reader_serve_a_whole_run(tmp_path: Path) -> None:
    store = ckptstore.open(f"file://{tmp_path}/s")
    writer, reader = CkptStoreWriter(store), CkptStoreReader(store)
    dcp.save(_state(1), storage_writer=writer, checkpoint_id=1)
    dcp.save(_state(2), storage_writer=writer, checkpoint_id="2")
    dcp.async_save(
        _state(3), storage_writer=writer, checkpoint_id=checkpoint_id_of(store, 3)
    ).result()
    assert store.steps() == [1, 2, 3]
    for step in (2, 1, 3):
        target = _state(0)
        dcp.load(target, storage_reader=reader, checkpoint_id=step)
        assert reader.loaded is not None and reader.loaded.step == step
        assert torch.equal(target["w"], torch.full((4, 2), float(step)))
        assert target["epoch"] == step
    target = _state(0)
    dcp.load(target, storage_reader=CkptStoreReader(store))  # no step: the latest
    assert target["epoch"] == 3


def test_a_writer_step_is_the_default_and_checkpoint_id_overrides_it(tmp_path: Path) -> None:
    store = ckptstore.open(f"file://{tmp_path}/s")
    writer = CkptStoreWriter(store, 5)
    dcp.save(_state(5), storage_writer=writer)
    dcp.save(_state(6), storage_writer=writer, checkpoint_id=6)
    with pytest.raises(CheckpointException) as caught:  # the default again: already published
        dcp.save(_state(5), storage_writer=writer)
    assert CheckpointExistsError.__name__ in repr(caught.value.failures)
    assert store.steps() == [5, 6]


def test_a_writer_without_any_step_says_how_to_give_one(tmp_path: Path) -> None:
    store = ckptstore.open(f"file://{tmp_path}/s")
    with pytest.raises(CheckpointException) as caught:
        dcp.save(_state(1), storage_writer=CkptStoreWriter(store))
    assert "checkpoint_id=<step>" in repr(caught.value.failures)
    assert store.steps() == []


@pytest.mark.parametrize(
    ("checkpoint_id", "step"),
    [(7, 7), ("7", 7), (Path("7"), 7), ("file:///x/s#step=7", 7)],
)
def test_checkpoint_ids_that_name_a_step(tmp_path: Path, checkpoint_id: object, step: int) -> None:
    store = ckptstore.open("file:///x/s")
    assert step_from_checkpoint_id(store, checkpoint_id) == step


@pytest.mark.parametrize(
    "checkpoint_id",
    ["", "seven", "-1", "7.0", "file:///elsewhere#step=7", "file:///x/s#step=", True, 7.0, None,
     "\u0667"],
)  # fmt: skip
def test_checkpoint_ids_that_do_not(checkpoint_id: object) -> None:
    store = ckptstore.open("file:///x/s")
    with pytest.raises(InvalidInputError):
        step_from_checkpoint_id(store, checkpoint_id)


def test_a_load_without_any_checkpoint_is_not_found(tmp_path: Path) -> None:
    store = ckptstore.open(f"file://{tmp_path}/s")
    with pytest.raises(CheckpointNotFoundError):
        agreed_checkpoint(store)
    with pytest.raises(CheckpointNotFoundError):
        load_state(store, {"model": {}})
    with pytest.raises(CheckpointException) as caught:
        dcp.load(_state(0), storage_reader=CkptStoreReader(store))
    assert "no checkpoint to load" in repr(caught.value.failures)


def test_load_state_from_a_store_loads_the_latest_and_says_which(tmp_path: Path) -> None:
    store = ckptstore.open(f"file://{tmp_path}/s")
    for step in (1, 2):
        save_state(store, step, {"model": {"w": torch.full((2,), float(step))}}, rng=False)
    restored = load_state(store, {"model": {}}, rng=False)
    assert restored["step"] == 2
    assert torch.equal(restored["model"]["w"], torch.full((2,), 2.0))
    assert load_state(store.get(1), {"model": {}}, rng=False)["step"] == 1


def test_a_checkpoint_id_naming_a_missing_step_is_not_found_not_the_latest(
    tmp_path: Path,
) -> None:
    store = ckptstore.open(f"file://{tmp_path}/s")
    writer, reader = CkptStoreWriter(store), CkptStoreReader(store)
    for step in (5, 9):
        dcp.save(_state(step), storage_writer=writer, checkpoint_id=step)
    target = _state(0)
    with pytest.raises(CheckpointException) as caught:
        dcp.load(target, storage_reader=reader, checkpoint_id=7)
    assert "step 7" in repr(caught.value.failures)
    assert target["epoch"] == 0


def test_contiguous_spans() -> None:
    from ckptstore.torch.dcp import _contiguous_span

    assert _contiguous_span([6, 4], [2, 0], [3, 4]) == (8, 12)  # rows 2..4
    assert _contiguous_span([6, 4], [2, 1], [1, 2]) == (9, 2)  # one row, columns 1..2
    assert _contiguous_span([6, 4], [0, 1], [6, 2]) is None  # columns of every row: strided
    assert _contiguous_span([2, 3, 4], [1, 0, 0], [1, 3, 4]) == (12, 12)
    assert _contiguous_span([5], [0], [0]) == (0, 0)
    assert _contiguous_span([], [], []) == (0, 1)  # a scalar


def test_a_part_of_a_stored_chunk_reads_only_its_blocks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

    import ckptstore.checksum

    monkeypatch.setattr(ckptstore.checksum, "BLOCK_SIZE", 4096)
    store = ckptstore.open(f"file://{tmp_path}/s")
    weights = torch.arange(256 * 64, dtype=torch.float32).reshape(256, 64)  # 64 KiB, 16 blocks
    dcp.save({"w": weights}, storage_writer=CkptStoreWriter(store), checkpoint_id=1)
    reader = CkptStoreReader(store)
    reader.reset(1)
    metadata = reader.read_metadata()
    reader.set_up_storage_reader(metadata, True)
    index = next(i for i in metadata.storage_data if i.fqn == "w")
    target = torch.zeros(64, 64)  # rows 128..191: a quarter, 4 blocks
    item = ReadItem(LoadItemType.TENSOR, index, torch.Size([0, 0]), index, torch.Size([128, 0]),
                    torch.Size([64, 64]))  # fmt: skip
    reader._read_tensor(reader.loaded, metadata.storage_data[index], item, target)
    assert torch.equal(target, weights[128:192])
    assert reader.bytes_read == 4 * 4096
    strided = torch.zeros(256, 8)  # columns 8..15 of every row: the whole chunk is read
    item = ReadItem(LoadItemType.TENSOR, index, torch.Size([0, 0]), index, torch.Size([0, 8]),
                    torch.Size([256, 8]))  # fmt: skip
    reader._read_tensor(reader.loaded, metadata.storage_data[index], item, strided)
    assert torch.equal(strided, weights[:, 8:16])


def test_async_save_copies_once_and_records_what_the_copy_cost(tmp_path: Path) -> None:
    store = ckptstore.open(f"file://{tmp_path}/s")
    writer = CkptStoreWriter(store)
    from torch.distributed.checkpoint.staging import AsyncStager

    assert isinstance(writer, AsyncStager)  # DCP stages through the writer
    state = _state(1)
    future = dcp.async_save(state, storage_writer=writer, checkpoint_id=1)
    state["w"].fill_(99.0)  # training goes on at once: the save has its own copy
    future.result()
    timings = store.get(1).manifest.timings
    assert timings["snapshot_s"] > 0 and timings["blocked_s"] == timings["snapshot_s"]
    target = _state(0)
    dcp.load(target, storage_reader=CkptStoreReader(store, 1))
    assert torch.equal(target["w"], torch.full((4, 2), 1.0))
    dcp.save(_state(2), storage_writer=writer, checkpoint_id=2)  # not staged: no copy recorded
    assert "snapshot_s" not in store.get(2).manifest.timings
    writer.close()


def test_two_async_saves_in_flight_on_one_writer_keep_their_own_state(tmp_path: Path) -> None:
    import threading

    store = ckptstore.open(f"file://{tmp_path}/s")
    second_planned = threading.Event()

    class Writer(CkptStoreWriter):
        def prepare_global_plan(self, plans: list) -> list:  # type: ignore[type-arg]
            planned = super().prepare_global_plan(plans)
            if self.step == 2:
                second_planned.set()
            return planned

        def write_data(self, plan, planner):  # type: ignore[no-untyped-def]
            if plan.storage_data["step"] == 1:  # hold the first save until the second began
                assert second_planned.wait(60)
            return super().write_data(plan, planner)

    writer = Writer(store)
    state = _state(1)
    first = dcp.async_save(state, storage_writer=writer, checkpoint_id=1)
    state["w"].fill_(2.0)
    state["epoch"] = 2
    second = dcp.async_save(state, storage_writer=writer, checkpoint_id=2)
    first.result(timeout=120)
    second.result(timeout=120)
    assert store.steps() == [1, 2]
    for step in (1, 2):
        target = _state(0)
        dcp.load(target, storage_reader=CkptStoreReader(store, step))
        assert torch.equal(target["w"], torch.full((4, 2), float(step))), step
        assert target["epoch"] == step
    writer.close()


class _Holder:
    """A tensor inside a plain object: DCP saves it as bytes; pytree does not see into it."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


def test_a_staging_whose_tensors_cannot_be_watched_is_never_reused() -> None:
    from ckptstore.torch.dcp_staging import ReusingStager

    stager = ReusingStager()
    training = torch.zeros(4)
    first = stager.stage({"held": _Holder(training)})
    training.fill_(7.0)  # training goes on while the first save still has to write its copy
    second = stager.stage({"held": _Holder(training)})
    assert torch.equal(first["held"].tensor, torch.zeros(4))  # not overwritten by the second
    assert torch.equal(second["held"].tensor, torch.full((4,), 7.0))
    stager.close()


def test_a_release_inside_a_locked_section_does_not_deadlock() -> None:
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    from ckptstore.torch.dcp_staging import ReusingStager

    stager = ReusingStager()
    with stager._lock:  # a garbage collection here may finalise an earlier staging
        stager._release(DefaultStager(StagingOptions(False, False, False, False)), {1})
    assert stager.seconds_for(torch.empty(0)) is None  # empty tensors have no memory to key on
    stager.close()


def test_user_metadata_cannot_take_the_adapters_own_keys(tmp_path: Path) -> None:
    store = ckptstore.open(f"file://{tmp_path}/s")
    for key in ("tensor_parts", "components", "counters"):
        with pytest.raises(InvalidInputError, match=key):
            save_state(store, 1, {"model": {"w": torch.zeros(2)}}, metadata={key: 1})
    assert store.latest() is None
