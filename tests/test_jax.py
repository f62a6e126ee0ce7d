"""ckptstore.jax on CPU with 8 simulated devices: every leaf type round trip bitwise, loads
onto other meshes reading only what they need, async saves, bad input, damaged checkpoints."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
np = pytest.importorskip("numpy")
optax = pytest.importorskip("optax")

from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import ckptstore  # noqa: E402
from ckptstore.errors import (  # noqa: E402
    IntegrityError,
    InvalidInputError,
    ManifestCorruptError,
    ShardCorruptError,
    ShardNotFoundError,
)
from ckptstore.jax import AsyncPytreeSaver, ReadStats, load_pytree, save_pytree  # noqa: E402

pytestmark = pytest.mark.skipif(
    len(jax.devices()) < 8, reason="needs 8 devices: XLA_FLAGS was set before JAX started"
)


def _mesh(*shape: int, names: tuple[str, ...] = ("a", "b")) -> Any:
    count = int(np.prod(shape))
    return Mesh(np.array(jax.devices()[:count]).reshape(shape), names[: len(shape)])


def _put(value: Any, mesh: Any, spec: Any) -> Any:
    return jax.device_put(value, NamedSharding(mesh, spec))


def _leaves_equal(expected: Any, got: Any) -> None:
    """Same structure, same leaf types, bitwise the same values."""
    want, want_def = jax.tree_util.tree_flatten_with_path(expected)
    have, have_def = jax.tree_util.tree_flatten_with_path(got)
    assert want_def == have_def
    for (path, a), (_, b) in zip(want, have, strict=True):
        name = jax.tree_util.keystr(path)
        if isinstance(a, jax.Array):
            assert isinstance(b, jax.Array), name
            if a.committed:  # its own sharding; JAX's placement by itself: replicated
                assert b.sharding == a.sharding, name
            else:
                assert b.is_fully_replicated, name
        else:
            assert type(a) is type(b), (name, type(a), type(b))
        if isinstance(a, (int, float, complex, str)):  # Python scalars and strings
            assert repr(a) == repr(b) and (not isinstance(a, float) or a.hex() == b.hex()), name
            continue
        if jnp.issubdtype(getattr(a, "dtype", np.int8), jax.dtypes.prng_key):
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        left, right = np.asarray(a), np.asarray(b)
        assert left.dtype == right.dtype and left.shape == right.shape, name
        assert left.tobytes() == right.tobytes(), name


def _every_leaf_type() -> dict[str, Any]:
    mesh = _mesh(4, 2)
    weights = jnp.arange(64 * 16, dtype=jnp.float32).reshape(64, 16) / 7
    params = {
        "dense": {
            "kernel": _put(weights, mesh, P("a", "b")),  # sharded over both axes
            "bias": _put(jnp.arange(16, dtype=jnp.bfloat16), mesh, P("b")),  # replicated on a
        },
        "scale": _put(jnp.float32(1.5), mesh, P()),  # a replicated 0-d array
        "embed": jnp.arange(24, dtype=jnp.int8).reshape(4, 6),  # on one device
        "mask": _put(jnp.array([True, False] * 8), mesh, P("a")),
        "half": _put(jnp.full((8, 2), jnp.nan, jnp.float16), mesh, P("a", "b")),
    }
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
    return {
        "params": params,
        "opt_state": tx.init(params),
        "step": 123456789012345678901234567890,
        "lr": float.fromhex("0x1.999999999999ap-4"),
        "nan": float("nan"),
        "complex": 1.5 - 2.25j,
        "flag": True,
        "name": "run ☃ \u202e",
        "numpy": np.arange(12, dtype=np.uint16).reshape(3, 4),
        "numpy_scalar": np.float64(-0.0),
        "empty": np.zeros((0, 3), np.float32),
        "key": jax.random.key(7),
        "old_key": jax.random.PRNGKey(3),
        "float64": np.array([1e300, -1e-300]),
        "tuple": (1, "two", [3.0]),
    }


@pytest.fixture
def store(tmp_path: Path) -> Any:
    return ckptstore.open(str(tmp_path / "store"))


def test_every_leaf_type_round_trips_bitwise(store: Any) -> None:
    tree = _every_leaf_type()
    checkpoint = save_pytree(store, 5, tree, metadata={"run": "x"})
    assert checkpoint.metadata["run"] == "x"
    assert "snapshot_s" in checkpoint.manifest.timings
    _leaves_equal(tree, load_pytree(store, tree))
    _leaves_equal(tree, load_pytree(checkpoint, tree))


def test_a_flax_train_state_round_trips(store: Any) -> None:
    train_state = pytest.importorskip("flax.training.train_state")
    linen = pytest.importorskip("flax.linen")
    model = linen.Dense(8)
    params = model.init(jax.random.key(0), jnp.ones((2, 4)))
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-2))
    grads = jax.tree_util.tree_map(jnp.ones_like, state.params)
    state = state.apply_gradients(grads=grads)
    save_pytree(store, 1, state)
    fresh = train_state.TrainState.create(
        apply_fn=model.apply, params=model.init(jax.random.key(1), jnp.ones((2, 4))), tx=state.tx
    )
    _leaves_equal(state, load_pytree(store, fresh))


def test_without_a_target_the_tree_comes_back_as_dicts_and_lists(store: Any) -> None:
    tree = {"a": {"b": jnp.arange(4)}, "c": [np.int32(3), "x"], "d": (1.5, True)}
    save_pytree(store, 1, tree)
    got = load_pytree(store)
    assert list(got) == ["a", "c", "d"]
    assert np.array_equal(got["a"]["b"], np.arange(4)) and isinstance(got["a"]["b"], np.ndarray)
    assert got["c"] == [np.int32(3), "x"] and isinstance(got["c"][0], np.int32)
    assert got["d"] == [1.5, True]


@pytest.mark.parametrize(
    ("saved", "loaded"),
    [
        ((8,), (4,)),  # 8 -> 4 devices
        ((4,), (8,)),  # 4 -> 8
        ((8,), (2, 4)),  # onto a 2-D mesh, sharded along both axes
        ((2, 4), (8,)),
    ],
)
def test_a_load_reshards_reading_only_what_each_device_needs(
    store: Any, saved: tuple[int, ...], loaded: tuple[int, ...]
) -> None:
    rows, cols = 4096, 256  # 4 MiB of float32: more than one checked block
    value = jnp.arange(rows * cols, dtype=jnp.float32).reshape(rows, cols)
    source = _mesh(*saved)
    spec = P("a") if len(saved) == 1 else P("a", "b")
    save_pytree(store, 1, {"w": _put(value, source, spec)})
    mesh = _mesh(*loaded)
    target_spec = P("a") if len(loaded) == 1 else P("a", "b")
    sharding = NamedSharding(mesh, target_spec)
    target = {"w": jax.ShapeDtypeStruct((rows, cols), jnp.float32, sharding=sharding)}
    stats = ReadStats()
    got = load_pytree(store, target, stats=stats)["w"]
    assert got.sharding == sharding
    assert np.array_equal(np.asarray(got), np.asarray(value))
    for shard in got.addressable_shards:
        assert np.array_equal(np.asarray(shard.data), np.asarray(value)[shard.index])
    assert stats.needed == rows * cols * 4  # every box once
    if len(saved) == len(loaded) == 1:  # whole rows: each checked block read once
        assert stats.read == store.latest().shards["pytree.p00000.00000.safetensors"].size


def test_a_replicated_target_reads_each_box_once(store: Any) -> None:
    value = jnp.arange(1024 * 256, dtype=jnp.float32).reshape(1024, 256)
    save_pytree(store, 1, {"w": _put(value, _mesh(8), P("a"))})
    stats = ReadStats()
    target = {
        "w": jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=NamedSharding(_mesh(8), P()))
    }
    got = load_pytree(store, target, stats=stats)["w"]
    assert got.is_fully_replicated and np.array_equal(np.asarray(got), np.asarray(value))
    assert stats.needed == value.size * 4  # one box for eight devices, read once


def test_the_parts_are_safetensors_files(store: Any) -> None:
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    tree = {"w": _put(jnp.arange(32.0).reshape(8, 4), _mesh(8), P("a")), "n": np.arange(3)}
    checkpoint = save_pytree(store, 1, tree)
    tensors: dict[str, Any] = {}
    for name in checkpoint.names:
        if name.endswith(".safetensors"):
            path = Path(str(store.url).removeprefix("file://")) / f"step-{1:020d}" / "data" / name
            tensors.update(safetensors_numpy.load_file(str(path)))
    assert sorted(tensors) == ["['n']@0:3", *(f"['w']@{i}:{i + 1},0:4" for i in range(8))]
    assert np.array_equal(tensors["['w']@2:3,0:4"], np.arange(32.0).reshape(8, 4)[2:3])


def test_an_async_save_blocks_for_the_host_copy_only(store: Any) -> None:
    leaf = np.arange(1000, dtype=np.float32)
    tree = {"w": _put(jnp.ones((64, 64)), _mesh(8), P("a")), "n": leaf}
    with AsyncPytreeSaver(store) as saver:
        future = saver.save(3, tree)
        leaf[:] = -1  # after the snapshot: the save holds its own copy
        checkpoint = future.result(timeout=60)
    assert checkpoint.step == 3
    assert "blocked_s" in checkpoint.manifest.timings
    assert "to_commit_s" in checkpoint.manifest.timings
    assert np.array_equal(load_pytree(store)["n"], np.arange(1000, dtype=np.float32))


def test_an_async_failure_is_raised_again(store: Any) -> None:
    tree = {"w": jnp.ones(3)}
    save_pytree(store, 1, tree)
    with AsyncPytreeSaver(store) as saver:
        failed = saver.save(1, tree)  # step 1 exists
        with pytest.raises(ckptstore.CheckpointExistsError):
            failed.result(timeout=60)
        with pytest.raises(ckptstore.CkptStoreError, match="earlier asynchronous save failed"):
            saver.save(2, tree)
    assert store.steps() == [1]


class _Opaque:
    pass


@pytest.mark.parametrize(
    ("leaf", "match"),
    [
        (_Opaque(), "nothing is pickled"),
        (b"bytes", "nothing is pickled"),
        (jnp.zeros(3, dtype=jnp.complex64), "cannot be stored as safetensors"),
        (np.array(["a"], dtype=object), "cannot be stored as safetensors"),
    ],
)
def test_a_leaf_that_cannot_be_stored_is_refused_before_anything_is_written(
    store: Any, leaf: Any, match: str
) -> None:
    with pytest.raises(InvalidInputError, match=match):
        save_pytree(store, 1, {"ok": jnp.ones(2), "bad": leaf})
    assert store.steps() == []
    assert store.gc().removed == [] if hasattr(store.gc(), "removed") else True


def test_a_target_that_does_not_match_is_a_clear_error(store: Any) -> None:
    save_pytree(store, 1, {"w": jnp.ones((4, 2)), "n": 3})
    with pytest.raises(InvalidInputError, match=r"stored as float32\[4, 2\]; the target is"):
        load_pytree(store, {"w": jnp.ones((2, 4)), "n": 3})
    with pytest.raises(InvalidInputError, match="stored as float32"):
        load_pytree(store, {"w": jnp.ones((4, 2), jnp.bfloat16), "n": 3})
    with pytest.raises(InvalidInputError, match="the checkpoint does not: \\['x'\\]"):
        load_pytree(store, {"w": jnp.ones((4, 2)), "n": 3, "x": 1})
    with pytest.raises(InvalidInputError, match="partial=True"):
        load_pytree(store, {"w": jnp.ones((4, 2))})
    assert load_pytree(store, {"n": 0}, partial=True) == {"n": 3}
    with pytest.raises(InvalidInputError, match="not an array"):
        load_pytree(store, {"w": jnp.ones((4, 2)), "n": jnp.ones(())})
    with pytest.raises(InvalidInputError, match="is a stored array"):
        load_pytree(store, {"w": "a string", "n": 3})
    placeholder = load_pytree(store, {"w": 0, "n": 3})["w"]  # a fresh TrainState's step
    assert isinstance(placeholder, jax.Array) and placeholder.shape == (4, 2)


def _step_dir(store: Any, step: int) -> Path:
    return Path(str(store.url).removeprefix("file://")) / f"step-{step:020d}" / "data"


def test_damaged_array_bytes_are_found_by_a_ranged_read(store: Any) -> None:
    value = jnp.arange(2 * 1024 * 1024, dtype=jnp.float32).reshape(2048, 1024)
    save_pytree(store, 1, {"w": _put(value, _mesh(8), P("a"))})
    part = _step_dir(store, 1) / "pytree.p00000.00000.safetensors"
    with open(part, "r+b") as handle:
        handle.seek(part.stat().st_size - 10)
        damaged = bytes([handle.read(1)[0] ^ 0x01])
        handle.seek(-1, os.SEEK_CUR)
        handle.write(damaged)
    target = {
        "w": jax.ShapeDtypeStruct(
            value.shape, value.dtype, sharding=NamedSharding(_mesh(8), P("a"))
        )
    }
    with pytest.raises(ShardCorruptError):
        load_pytree(store, target)


@pytest.mark.parametrize(
    "edit",
    [
        lambda doc: doc["chunks"].pop(),  # a chunk missing: the leaf is not covered
        lambda doc: doc["chunks"].append(dict(doc["chunks"][0])),  # a chunk twice
        lambda doc: doc["chunks"][0].update(offset=10**12),  # outside its shard
        lambda doc: doc["chunks"][0].update(box=[[0, 9], [0, 4]]),  # more than it holds
        lambda doc: doc["chunks"][0].update(leaf="['nope']"),
        lambda doc: doc["chunks"][0].update(offset=0),  # into the safetensors header
        lambda doc: doc["chunks"][0].update(offset=doc["chunks"][1]["offset"]),  # another's
        lambda doc: doc["chunks"][0].update(offset=str(doc["chunks"][0]["offset"])),
        lambda doc: doc["chunks"][0].update(shard="pytree.json"),
        lambda doc: doc["chunks"][0].update(nbytes=True),
    ],
)
def test_a_damaged_index_is_refused(store: Any, edit: Any) -> None:
    """An index that lies is found before any array byte is believed (written here with the
    manifest's checksums updated, as a buggy writer would)."""
    tree = {"w": _put(jnp.arange(32.0).reshape(8, 4), _mesh(8), P("a"))}
    checkpoint = save_pytree(store, 1, tree)
    document = json.loads(checkpoint.read("pytree-index.p00000.json"))
    edit(document)
    with store.begin(2) as pending:
        for name in checkpoint.names:
            data = checkpoint.read(name)
            if name == "pytree-index.p00000.json":
                data = json.dumps(document).encode()
            pending.write(name, data)
    with pytest.raises(ManifestCorruptError):
        load_pytree(store, tree, step=2)


def test_a_checkpoint_that_is_not_a_pytree_is_a_clear_error(store: Any) -> None:
    """Not damage (an IntegrityError would send a trainer to an older checkpoint that verifies
    as well as this one): a checkpoint another adapter saved."""
    store.save(1, {"model.bin": b"x"})
    with pytest.raises(ShardNotFoundError, match=r"was not saved by ckptstore\.jax") as caught:
        load_pytree(store)
    assert not isinstance(caught.value, IntegrityError)


def test_a_pytree_on_an_object_store_loads_resharded(moto_s3: Any) -> None:
    store = ckptstore.open(moto_s3.url("jax"), **moto_s3.options)
    value = jnp.arange(512 * 64, dtype=jnp.float32).reshape(512, 64)
    tree = {"w": _put(value, _mesh(8), P("a")), "step": 4, "key": jax.random.key(1)}
    save_pytree(store, 4, tree)
    target = {
        "w": jax.ShapeDtypeStruct(
            value.shape, value.dtype, sharding=NamedSharding(_mesh(2, 2), P("a", "b"))
        ),
        "step": 0,
        "key": jax.random.key(0),
    }
    got = load_pytree(store, target)
    assert np.array_equal(np.asarray(got["w"]), np.asarray(value)) and got["step"] == 4
    assert np.array_equal(jax.random.key_data(got["key"]), jax.random.key_data(tree["key"]))


def test_ranged_reads_return_the_bytes_and_read_each_block_once(store: Any) -> None:
    """Reads of random ranges, small and large, in parallel: each returns the shard's bytes,
    and no checked block is read twice while the cache holds it."""
    from concurrent.futures import ThreadPoolExecutor

    from ckptstore.jax.reads import BlockReader

    rng = np.random.default_rng(5)
    data = rng.integers(0, 256, 5 * 4 * 1024 * 1024 + 12345, dtype=np.uint8).tobytes()
    checkpoint = store.save(1, {"blob": data})
    block = checkpoint.shards["blob"].block_size
    stats = ReadStats()
    reader = BlockReader(checkpoint, stats)
    ranges = [(0, 0), (0, 1), (len(data) - 1, 1), (0, len(data)), (block - 3, 2 * block + 7)]
    for _ in range(60):
        start = int(rng.integers(0, len(data)))
        ranges.append((start, int(rng.integers(0, min(len(data) - start, 3 * block) + 1))))
    into = bytearray(len(data))

    def check(where: tuple[int, int]) -> None:
        start, length = where
        assert bytes(reader.read("blob", start, length)) == data[start : start + length]
        view = memoryview(into)[start : start + length]
        reader.read("blob", start, length, view)
        assert bytes(view) == data[start : start + length]

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(check, ranges))
    blocks = -(-len(data) // block)
    # every block at least once; the whole-block middles of large reads are read in place
    # each time, the edges and small reads at most once each
    assert stats.read >= len(data)
    assert stats.requests <= blocks + 2 * len(ranges)
    # adjacent reads not aligned to blocks (a chunk after another): each block read once
    stats = ReadStats()
    reader = BlockReader(checkpoint, stats)
    piece = block + block // 3
    for start in range(0, len(data), piece):
        length = min(piece * 2, len(data) - start) if start % (2 * piece) == 0 else 0
        if length:
            assert bytes(reader.read("blob", start, length)) == data[start : start + length]
    assert stats.read == len(data)


def test_big_endian_and_x64_arrays_load_as_their_values(store: Any) -> None:
    tree = {"be": np.arange(4, dtype=">f4"), "wide": np.array([2**40, -3], np.int64)}
    save_pytree(store, 1, tree)
    got = load_pytree(store)
    assert got["be"].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert got["wide"].tolist() == [2**40, -3]
    assert load_pytree(store, tree)["wide"].tolist() == [2**40, -3]  # NumPy targets: exact
    if not jax.config.jax_enable_x64:  # JAX would truncate it: refused, not truncated
        target = {"be": tree["be"], "wide": jax.ShapeDtypeStruct((2,), np.int64)}
        with pytest.raises(InvalidInputError, match="64-bit"):
            load_pytree(store, target)


def test_scalar_leaves_are_stored_as_their_base_types(store: Any) -> None:
    class Loud(int):
        def __str__(self) -> str:
            return "loud"

        __repr__ = __str__

    save_pytree(store, 1, {"n": Loud(7), "s": "x"})
    assert load_pytree(store) == {"n": 7, "s": "x"}
    with pytest.raises(InvalidInputError, match="is a stored int; the target's is a str"):
        load_pytree(store, {"n": "7", "s": "x"})


def test_an_int_of_any_size_round_trips_whatever_the_interpreters_digit_limit(
    store: Any,
) -> None:
    """An int is stored in decimal up to 2000 bits (what any interpreter converts), past that
    in hexadecimal (no limit applies): what is saved always loads, even in a process whose
    ``sys.set_int_max_str_digits`` is the least there is."""
    values = [10**602, -(10**602), 10**4298, 10**4299, -(10**4298), 2**100_000 + 1]
    for step, value in enumerate(values, start=1):
        save_pytree(store, step, {"v": value})
    limit = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(640)
    try:
        for step, value in enumerate(values, start=1):
            assert load_pytree(store, {"v": 0}, step=step)["v"] == value
            assert load_pytree(store, step=step)["v"] == value
    finally:
        sys.set_int_max_str_digits(limit)
    stored = json.loads(store.get(4).read("pytree.json"))["leaves"][0]["value"]
    assert stored.startswith("0x")  # 4300 digits: past 2000 bits


def test_a_bad_int_in_a_tree_document_is_refused_without_echoing_it(store: Any) -> None:
    save_pytree(store, 1, {"v": 5})
    checkpoint = store.get(1)
    document = json.loads(checkpoint.read("pytree.json"))
    document["leaves"][0]["value"] = "9" * 5000  # more decimal digits than are ever stored
    with store.begin(2) as pending:
        pending.write("pytree.json", json.dumps(document).encode())
        for name in checkpoint.names:
            if name != "pytree.json":
                pending.write(name, checkpoint.read(name))
    with pytest.raises(ManifestCorruptError, match=r"holds '9{50}.*\(5002 characters\)") as caught:
        load_pytree(store, step=2)
    assert len(str(caught.value)) < 400


def test_a_key_of_another_implementation_is_a_clear_error(store: Any) -> None:
    save_pytree(store, 1, {"w": jnp.ones((8, 4)), "key": jax.random.key(1)})
    rbg = jax.random.key(0, impl="rbg")
    with pytest.raises(InvalidInputError, match="keys of shape"):
        load_pytree(store, {"w": jnp.ones((8, 4)), "key": rbg})
    structure = jax.ShapeDtypeStruct(rbg.shape, rbg.dtype)
    with pytest.raises(InvalidInputError, match="keys of shape"):
        load_pytree(store, {"w": jnp.ones((8, 4)), "key": structure})


def test_a_reshard_over_the_second_axis_reads_each_chunk_once(store: Any) -> None:
    value = jnp.arange(2048 * 1024, dtype=jnp.float32).reshape(2048, 1024)
    checkpoint = save_pytree(store, 1, {"w": _put(value, _mesh(8), P("a"))})
    columns = NamedSharding(_mesh(8), P(None, "a"))
    stats = ReadStats()
    target = {"w": jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=columns)}
    got = load_pytree(store, target, stats=stats)["w"]
    assert np.array_equal(np.asarray(got), np.asarray(value))
    assert stats.read <= checkpoint.shards["pytree.p00000.00000.safetensors"].size


def test_the_coverage_check_takes_a_grid_of_many_chunks(store: Any) -> None:
    from ckptstore.jax.layout import StoredChunk, check_coverage

    columns = 20000
    chunks = [StoredChunk("x", ((0, 4), (i, i + 1)), "p", 0, 16) for i in range(columns)]
    check_coverage("x", (4, columns), chunks, "here")
    with pytest.raises(ManifestCorruptError, match="do not tile"):
        check_coverage("x", (4, columns), chunks[:5] + chunks[6:], "here")
    with pytest.raises(ManifestCorruptError, match="twice"):
        check_coverage("x", (4, columns), [*chunks, chunks[3]], "here")
    overlapping = [StoredChunk("x", ((0, 2), (0, 2)), "p", 0, 16),
                   StoredChunk("x", ((1, 2), (0, 2)), "p", 0, 8)]  # fmt: skip
    with pytest.raises(ManifestCorruptError):
        check_coverage("x", (2, 2), overlapping, "here")


@pytest.mark.parametrize(
    "leaves",
    [
        [{"name": "a", "keys": [["key", "a"]], "kind": "int", "value": "1"},
         {"name": "b", "keys": [["key", "a"], ["key", "b"]], "kind": "int", "value": "2"}],
        [{"name": "a", "keys": [["index", 0]], "kind": "int", "value": "1"},
         {"name": "b", "keys": [["key", "x"]], "kind": "int", "value": "2"}],
        [{"name": "a", "keys": [["attr", "s"]], "kind": "int", "value": "1"},
         {"name": "b", "keys": [["key", "s"]], "kind": "int", "value": "2"}],
        [{"name": "a", "keys": [], "kind": "int", "value": "1"},
         {"name": "b", "keys": [["key", "s"]], "kind": "int", "value": "2"}],
        [{"name": "a", "keys": [["key", True]], "kind": "int", "value": "1"}],
        [{"name": "a", "keys": [["index", 1]], "kind": "int", "value": "1"}],
    ],
)  # fmt: skip
def test_an_untargeted_load_refuses_a_tree_whose_paths_clash(store: Any, leaves: Any) -> None:
    document = {"format": "ckptstore.jax/1", "processes": 1, "leaves": leaves}
    index = {"format": "ckptstore.jax/1", "process": 0, "chunks": []}
    store.save(1, {"pytree.json": json.dumps(document).encode(),
                   "pytree-index.p00000.json": json.dumps(index).encode()})  # fmt: skip
    with pytest.raises(ManifestCorruptError):
        load_pytree(store)


def test_an_async_failure_is_raised_by_the_very_next_save(store: Any) -> None:
    save_pytree(store, 1, {"w": jnp.ones(3)})
    with AsyncPytreeSaver(store) as saver:
        saver.save(1, {"w": jnp.ones(3)})  # step 1 exists: fails in the background
        with pytest.raises(ckptstore.CkptStoreError, match="earlier asynchronous save failed"):
            saver.save(2, {"w": jnp.ones(3)})  # waits for the slot, then raises it


def test_a_pytree_on_a_tiered_incremental_store(tmp_path: Path) -> None:
    """A pytree saved to a fast tier is replicated to the durable one and loads from either;
    saved again unchanged on an incremental store, its parts are shared, not written again."""
    store = ckptstore.open(
        f"file://{tmp_path}/fast", replicate_to=f"file://{tmp_path}/durable",
        incremental=True, background=False,
    )  # fmt: skip
    value = jnp.arange(256 * 1024, dtype=jnp.float32).reshape(256, 1024)
    tree = {"w": _put(value, _mesh(8), P("a")), "step": 1}
    for step in (1, 2):
        save_pytree(store, step, tree)
        store.wait_replicated(timeout=120)
    durable = store.replicator.durable
    four = NamedSharding(_mesh(4), P("a"))
    target = {"w": jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=four), "step": 0}
    for source in (store, durable):
        got = load_pytree(source, target)
        assert np.array_equal(np.asarray(got["w"]), np.asarray(value)) and got["step"] == 1
    part = "pytree.p00000.00000.safetensors"
    first, second = (tmp_path / "durable" / f"step-{s:020d}" / "data" / part for s in (1, 2))
    assert first.stat().st_ino == second.stat().st_ino  # one blob, linked: no second copy
    assert durable.get(2).verify().ok
