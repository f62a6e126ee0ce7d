"""The state a trainer actually has: NumPy values, random generators it holds, loaders; and
errors that name the component, the path inside it, and what to do."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
np = pytest.importorskip("numpy")

import ckptstore  # noqa: E402
from ckptstore import InvalidInputError  # noqa: E402
from ckptstore.errors import ManifestCorruptError  # noqa: E402
from ckptstore.torch import decode_state, encode_state, load_state, save_state  # noqa: E402


def _round_trip(state: object) -> object:
    return decode_state(*encode_state(state))


def test_numpy_scalars_and_arrays_come_back_as_numpy() -> None:
    state = {
        "seen": np.int64(2**40 + 3),
        "epoch": np.int32(-7),
        "ratio": np.float32(0.1),
        "loss": np.float64("nan"),
        "done": np.bool_(True),
        "order": np.arange(10, dtype=np.int64)[::-1],  # not contiguous
        "weights": np.linspace(0, 1, 6, dtype=np.float16).reshape(2, 3),
        "by_index": {np.int64(3): "three"},
    }
    got = _round_trip(state)
    assert isinstance(got, dict)
    for key in ("seen", "epoch", "ratio", "done"):
        assert type(got[key]) is type(state[key]) and got[key] == state[key], key
    assert type(got["loss"]) is np.float64 and np.isnan(got["loss"])
    for key in ("order", "weights"):
        assert isinstance(got[key], np.ndarray) and got[key].dtype == state[key].dtype
        assert np.array_equal(got[key], state[key])
    assert got["by_index"] == {3: "three"}


def test_a_zero_dimensional_array_keeps_its_shape() -> None:
    got = _round_trip({"x": np.array(3.5), "y": np.array(7, dtype=np.uint16)})
    assert isinstance(got, dict)
    assert got["x"].shape == () and got["x"] == 3.5
    assert got["y"].shape == () and got["y"].dtype == np.uint16


def test_two_generators_of_one_component_keep_their_own_states() -> None:
    """Their get_state() temporaries may share an address once freed: never one tensor."""
    from ckptstore.torch.codec import encode_state_chunks

    train, val = torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)
    torch.rand(3, generator=val)
    for _ in range(3):
        chunks, skeleton = encode_state_chunks({"train": train, "val": val}, copy=True)
        got = decode_state(b"".join(bytes(c) for c in chunks), skeleton)
        assert isinstance(got, dict)
        assert torch.equal(got["train"].get_state(), train.get_state())
        assert torch.equal(got["val"].get_state(), val.get_state())


@pytest.mark.parametrize(
    "value",
    [np.array(["a"]), np.array([object()]), np.str_("x"), np.array([1], dtype=">i4"),
     np.longdouble(1.1), np.array([1.0], dtype=np.longdouble), np.complex64(1j)],
)  # fmt: skip
def test_numpy_values_that_are_not_numbers_are_refused(value: object) -> None:
    with pytest.raises(InvalidInputError, match=r"at \.x"):
        encode_state({"x": value})


def _draws(generator: object) -> list[float]:
    if isinstance(generator, torch.Generator):
        return torch.rand(4, generator=generator).tolist()
    if isinstance(generator, random.Random):
        return [generator.random() for _ in range(4)]
    if isinstance(generator, np.random.RandomState):
        return list(generator.random_sample(4))
    return list(generator.random(4))  # type: ignore[attr-defined]


GENERATORS = {
    "torch": lambda: torch.Generator().manual_seed(11),
    "python": lambda: random.Random(12),
    "numpy-pcg64": lambda: np.random.default_rng(13),
    "numpy-philox": lambda: np.random.Generator(np.random.Philox(14)),
    "numpy-mt19937": lambda: np.random.Generator(np.random.MT19937(15)),
    "numpy-legacy": lambda: np.random.RandomState(16),
}


@pytest.mark.parametrize("kind", sorted(GENERATORS))
def test_a_generator_held_by_the_trainer_is_restored_in_place(kind: str, tmp_path: Path) -> None:
    store = ckptstore.open(f"file://{tmp_path}/s")
    held = GENERATORS[kind]()
    _draws(held)  # somewhere mid-stream
    save_state(store, 1, {"loader_rng": held}, rng=False)
    expected = _draws(held)
    again = GENERATORS[kind]()  # a resumed run makes a new one, then loads
    load_state(store, {"loader_rng": again}, rng=False)
    assert _draws(again) == expected


@pytest.mark.parametrize("kind", sorted(GENERATORS))
def test_a_generator_inside_a_state_comes_back_as_a_new_one(kind: str) -> None:
    held = GENERATORS[kind]()
    got = _round_trip({"sampler": {"generator": held, "position": 3}})
    expected = _draws(held)
    assert isinstance(got, dict)
    assert type(got["sampler"]["generator"]) is type(held)
    assert _draws(got["sampler"]["generator"]) == expected


def test_a_generator_component_of_another_kind_is_refused(tmp_path: Path) -> None:
    store = ckptstore.open(f"file://{tmp_path}/s")
    save_state(store, 1, {"loader_rng": random.Random(1)}, rng=False)
    with pytest.raises(InvalidInputError, match="'loader_rng' is a Generator"):
        load_state(store, {"loader_rng": torch.Generator()}, rng=False)


def test_an_unsupported_object_is_named_with_its_component_path_and_the_fix(
    tmp_path: Path,
) -> None:
    class Tokenizer:
        pass

    store = ckptstore.open(f"file://{tmp_path}/s")
    with pytest.raises(InvalidInputError) as caught:
        save_state(store, 1, {"data": {"epochs": [{"tok": Tokenizer()}]}}, rng=False)
    message = str(caught.value)
    assert "component 'data' at .epochs[0].tok" in message
    assert "Tokenizer" in message and "state_dict()" in message
    assert store.steps() == []


def test_a_dataloader_is_refused_with_what_to_save_instead(tmp_path: Path) -> None:
    from torch.utils.data import DataLoader

    store = ckptstore.open(f"file://{tmp_path}/s")
    loader = DataLoader(list(range(8)), batch_size=2, shuffle=True)
    with pytest.raises(InvalidInputError) as caught:
        save_state(store, 1, {"loader": loader}, rng=False)
    message = str(caught.value)
    assert "component 'loader'" in message and "DataLoader" in message
    assert "generator=" in message and "StatefulDataLoader" in message


def test_a_dict_that_looks_like_a_marker_is_refused() -> None:
    with pytest.raises(InvalidInputError, match="__tensor__"):
        encode_state({"x": {"__tensor__": "t0"}})


@pytest.mark.parametrize(
    "skeleton",
    [b'{"__numpy__": ["<i8"]}', b'{"__numpy_generator__": {"bit_generator": "Evil"}}',
     b'{"__torch_generator__": {"device": "cpu"}}', b'{"__numpy__": ["nonsense", 1]}'],
)  # fmt: skip
def test_a_damaged_skeleton_is_corruption_not_a_crash(skeleton: bytes) -> None:
    with pytest.raises(ManifestCorruptError):
        decode_state(b"", skeleton)


@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")  # torchdata 0.11 on torch 2.13
def test_a_stateful_data_loader_resumes_mid_epoch(tmp_path: Path) -> None:
    stateful = pytest.importorskip("torchdata.stateful_dataloader")
    store = ckptstore.open(f"file://{tmp_path}/s")

    def loader() -> object:
        generator = torch.Generator().manual_seed(5)
        return stateful.StatefulDataLoader(
            list(range(40)), batch_size=4, shuffle=True, generator=generator
        )

    first = loader()
    batches = iter(first)  # type: ignore[call-overload]
    for _ in range(3):
        next(batches)
    save_state(store, 1, {"loader": first}, rng=False)
    expected = [b.tolist() for b in batches]
    resumed = loader()
    load_state(store, {"loader": resumed}, rng=False)
    assert [b.tolist() for b in resumed] == expected  # type: ignore[attr-defined]
