"""Loads in place: each stored tensor is read straight into the tensor that holds it now (a
model's parameters and buffers, an optimizer's state), new memory only where none fits."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import ckptstore  # noqa: E402
from ckptstore.errors import ShardCorruptError  # noqa: E402
from ckptstore.torch import encode_state, load_state, read_tensors, save_state  # noqa: E402
from ckptstore.torch.codec import tensor_destinations  # noqa: E402


def _trained(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        optimizer.zero_grad()
        model(torch.randn(4, 8)).pow(2).sum().backward()
        optimizer.step()
    return model, optimizer


def _addresses(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[int]:
    tensors = [*model.state_dict().values()]
    for state in optimizer.state.values():
        tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
    return [t.data_ptr() for t in tensors]


def test_a_model_and_its_optimizer_are_filled_in_place(tmp_path: Path) -> None:
    store = ckptstore.open(f"file://{tmp_path}/s")
    saved_model, saved_optimizer = _trained(1)
    save_state(store, 1, {"model": saved_model, "optimizer": saved_optimizer}, rng=False)
    model, optimizer = _trained(2)  # a resumed run: built, one step taken, then loaded
    before = _addresses(model, optimizer)
    load_state(store, {"model": model, "optimizer": optimizer}, rng=False)
    assert _addresses(model, optimizer) == before  # same memory: nothing new, nothing copied
    for name, tensor in saved_model.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name
    for param, saved in zip(model.parameters(), saved_model.parameters(), strict=True):
        state, expected = optimizer.state[param], saved_optimizer.state[saved]
        assert torch.equal(state["exp_avg"], expected["exp_avg"])
        assert torch.equal(state["exp_avg_sq"], expected["exp_avg_sq"])
        assert torch.equal(state["step"], expected["step"])


def test_an_optimizer_without_state_yet_gets_new_memory(tmp_path: Path) -> None:
    store = ckptstore.open(f"file://{tmp_path}/s")
    saved_model, saved_optimizer = _trained(1)
    save_state(store, 1, {"model": saved_model, "optimizer": saved_optimizer}, rng=False)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)  # state not materialised
    load_state(store, {"model": model, "optimizer": optimizer}, rng=False)
    first = next(iter(model.parameters()))
    assert torch.equal(
        optimizer.state[first]["exp_avg"],
        saved_optimizer.state[next(iter(saved_model.parameters()))]["exp_avg"],
    )


def test_a_tensor_that_does_not_fit_is_not_overwritten() -> None:
    stored = {"a": torch.arange(6.0), "b": torch.ones(2, 3), "c": torch.zeros(3)}
    blob, skeleton = encode_state(stored)
    wrong_shape, wrong_dtype = torch.full((3, 2), 7.0), torch.full((2, 3), 7, dtype=torch.int64)
    strided = torch.full((6, 2), 7.0)[:, 0]  # the right shape, not contiguous: filled in place
    present = {"a": strided, "b": wrong_dtype, "c": wrong_shape}
    into = tensor_destinations(skeleton, present)
    got = read_tensors(io.BytesIO(blob), len(blob), into=into)
    assert got["t0"].data_ptr() == strided.data_ptr()
    assert torch.equal(strided, torch.arange(6.0))
    assert torch.equal(wrong_dtype, torch.full((2, 3), 7, dtype=torch.int64))
    assert torch.equal(wrong_shape, torch.full((3, 2), 7.0))


def test_destinations_follow_the_stored_structure() -> None:
    present = {
        "layers": [torch.zeros(2), (torch.zeros(3), {"w": torch.zeros(4), "b": torch.zeros(7)})],
        "state": {0: {"m": torch.zeros(5)}, 1: {"m": torch.zeros(6)}},
        "step": 3,
    }
    stored = {
        "layers": [torch.ones(2), (torch.ones(3), {"w": torch.ones(4)})],
        "state": {1: {"m": torch.ones(6)}},
        "step": torch.ones(9),
    }
    _, skeleton = encode_state(stored)
    into = tensor_destinations(skeleton, present)
    assert sorted(t.numel() for t in into.values()) == [2, 3, 4, 6]
    present["extra"] = torch.zeros(1)  # keys that differ at the top: load_state_dict refuses
    assert tensor_destinations(skeleton, present) == {}


def test_a_damaged_shard_is_still_refused(tmp_path: Path) -> None:
    store = ckptstore.open(f"file://{tmp_path}/s")
    saved_model, _ = _trained(1)
    checkpoint = save_state(store, 1, {"model": saved_model}, rng=False)
    shard = tmp_path / "s" / f"step-{1:020d}" / "data" / "model.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0x01
    shard.write_bytes(bytes(data))
    model, _ = _trained(2)
    with pytest.raises(ShardCorruptError):
        load_state(checkpoint, {"model": model}, rng=False)


def test_a_large_component_is_split_into_parts_and_loads_in_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import ckptstore.torch.state as state_module

    monkeypatch.setattr(state_module, "PART_SIZE", 600)  # bytes: a part per 150 float32 or so
    store = ckptstore.open(f"file://{tmp_path}/s")
    saved_model, saved_optimizer = _trained(1)
    checkpoint = save_state(store, 1, {"model": saved_model, "optimizer": saved_optimizer})
    parts = checkpoint.metadata["tensor_parts"]
    assert parts["model"] >= 2 and parts["optimizer"] >= 2
    for name, count in parts.items():
        stored = {f"{name}.safetensors"} | {f"{name}.{i}.safetensors" for i in range(1, count)}
        assert stored <= set(checkpoint.shards)
        assert f"{name}.{count}.safetensors" not in checkpoint.shards
    model, optimizer = _trained(2)
    before = _addresses(model, optimizer)
    load_state(store, {"model": model, "optimizer": optimizer})
    assert _addresses(model, optimizer) == before
    for name, tensor in saved_model.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name
    assert "rng.1.safetensors" not in checkpoint.shards  # small states stay one shard


def test_a_checkpoint_whose_part_count_is_wrong_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import ckptstore.torch.state as state_module
    from ckptstore.errors import ManifestCorruptError, ShardNotFoundError

    monkeypatch.setattr(state_module, "PART_SIZE", 600)
    store = ckptstore.open(f"file://{tmp_path}/s")
    saved_model, _ = _trained(1)
    parts = save_state(store, 1, {"model": saved_model}, rng=False).metadata["tensor_parts"]
    with store.begin(
        2, {"components": ["model"], "tensor_parts": {"model": parts["model"] + 1}}
    ) as pending:
        for name, blob in ((n, store.get(1).read(n)) for n in store.get(1).shards):
            pending.write(name, blob)
    model, _ = _trained(2)
    with pytest.raises(ShardNotFoundError, match=r"model\.\d+\.safetensors"):
        load_state(store.get(2), {"model": model}, rng=False)
    with store.begin(3, {"components": ["model"], "tensor_parts": {"model": "two"}}) as pending:
        for name in store.get(1).shards:
            pending.write(name, store.get(1).read(name))
    with pytest.raises(ManifestCorruptError, match="tensor_parts"):
        load_state(store.get(3), {"model": model}, rng=False)


def test_a_component_named_like_another_ones_part_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import ckptstore.torch.state as state_module
    from ckptstore.errors import InvalidInputError

    monkeypatch.setattr(state_module, "PART_SIZE", 8)
    store = ckptstore.open(f"file://{tmp_path}/s")
    components = {"a.1": {"x": torch.zeros(4)}, "a": {"x": torch.zeros(4), "y": torch.ones(4)}}
    with pytest.raises(InvalidInputError, match="rename one of the components"):
        save_state(store, 1, components, rng=False)
    assert store.latest() is None


def test_a_tensor_that_cannot_take_the_bytes_directly_is_filled_through_a_bounded_buffer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import ckptstore.torch.codec as codec

    monkeypatch.setattr(codec, "STAGING_BYTES", 64)  # 2 rows of 8 float32 at a time
    stored = {"w": torch.arange(6 * 8, dtype=torch.float32).reshape(6, 8),
              "s": torch.tensor(3.5), "wide": torch.ones(2, 32)}  # fmt: skip
    blob, _ = encode_state(stored)
    present = {
        "w": torch.zeros(8, 6).t(),  # the stored shape, but not contiguous (a transposed weight)
        "s": torch.zeros(()).expand(()),  # 0-d
        "wide": torch.zeros(32, 2).t(),  # a row (128 bytes) larger than the buffer
    }
    keys = {"w": "t0", "s": "t1", "wide": "t2"}
    into = {keys[name]: tensor for name, tensor in present.items()}
    tensors = read_tensors(io.BytesIO(blob), len(blob), into=into)
    assert tensors["t0"].data_ptr() == into["t0"].data_ptr()
    assert torch.equal(present["w"], stored["w"])
    assert tensors["t1"].data_ptr() == into["t1"].data_ptr() and present["s"].item() == 3.5
    assert tensors["t2"].data_ptr() != into["t2"].data_ptr()
    assert torch.equal(tensors["t2"], stored["wide"])
    assert torch.equal(present["wide"], torch.zeros(2, 32))  # not filled: new memory instead
    short = blob[:-40]  # a truncated stream is reported, not filled with garbage
    with pytest.raises(ShardCorruptError):
        read_tensors(io.BytesIO(short), len(blob), into=into)
