"""State dicts to bytes and back: tensors as safetensors, everything else as JSON.

A nested state (dicts, lists, tuples, numbers, strings, tensors, NumPy scalars and arrays,
random generators) becomes two blobs: a safetensors file holding every tensor and array, and a
JSON skeleton in which each tensor is replaced by ``{"__tensor__": key}``. Generators
(``torch.Generator``, ``numpy.random.Generator`` and ``RandomState``, ``random.Random``) are
stored by their state and come back as new generators in that state. Nothing is pickled, so
loading never runs code from a checkpoint. Tensors that share storage (tied weights) are
stored once and come back shared.
"""

from __future__ import annotations

import io
import json
import math
import random
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch

from ckptstore.driver import Buffer
from ckptstore.errors import InvalidInputError, ManifestCorruptError, ShardCorruptError
from ckptstore.jsonload import JSONDocumentError, load_json, nesting_exceeds

__all__ = [
    "decode_state",
    "encode_state",
    "encode_state_chunks",
    "encode_state_parts",
    "is_generator",
    "read_tensors",
    "restore_generator",
    "tensor_destinations",
]

_MAX_HEADER = 100 * 1024 * 1024
MAX_SKELETON_DEPTH = 128
"""Nesting of lists and dicts (markers included) in a state's JSON skeleton. A deeper state is
refused at save, and a deeper stored skeleton (damage, or planted) is refused at load before
it is parsed: both the parser and ``decode_state`` recurse."""
_MAX_SKELETON_BYTES = 1 << 30


class Readable(Protocol):
    """A binary stream that can fill a caller's buffer (a file, a ``ShardReader``)."""

    def readinto(self, buffer: Any, /) -> int | None: ...


_TENSOR, _TUPLE, _FLOAT, _INTKEYS = "__tensor__", "__tuple__", "__float__", "__intkeys__"
_NDARRAY, _NPSCALAR = "__ndarray__", "__numpy__"
_TORCH_GEN, _NP_GEN, _NP_LEGACY, _PY_RANDOM = (
    "__torch_generator__", "__numpy_generator__", "__numpy_randomstate__", "__python_random__"
)  # fmt: skip
_MARKERS = frozenset(
    {_TENSOR, _TUPLE, _FLOAT, _INTKEYS, _NDARRAY, _NPSCALAR, _TORCH_GEN, _NP_GEN, _NP_LEGACY,
     _PY_RANDOM}
)  # fmt: skip
_BIT_GENERATORS = frozenset({"MT19937", "PCG64", "PCG64DXSM", "Philox", "SFC64"})
_NUMPY_SCALAR_KINDS = frozenset("biuf")


def encode_state(state: Any, *, copy: bool = False) -> tuple[bytes, bytes]:
    """Return (safetensors bytes, JSON skeleton bytes) for a nested state.

    ``copy``: clone every tensor first (an asynchronous save snapshots this way, so training
    may change its tensors while the bytes are written).
    """
    chunks, skeleton = encode_state_chunks(state, copy=copy)
    return b"".join(chunks), skeleton


HostCopier = Callable[[str, torch.Tensor], torch.Tensor]
"""Copies a tensor (by its key in the state) into host memory that the caller owns."""


def encode_state_chunks(
    state: Any,
    *,
    copy: bool = False,
    copier: HostCopier | None = None,
    subject: str = "state",
) -> tuple[list[Buffer], bytes]:
    """Like ``encode_state``, but the safetensors file as a list of chunks: its header, then
    each tensor's own memory, uncopied (unless ``copy``), to be streamed into a shard.

    ``copier`` (with ``copy``) places the copies, e.g. into buffers reused from save to save.
    ``subject`` names the state in errors (e.g. "component 'model'").
    """
    parts, skeleton = encode_state_parts(state, copy=copy, copier=copier, subject=subject)
    return (parts[0] if parts else []), skeleton


def encode_state_parts(
    state: Any,
    *,
    copy: bool = False,
    copier: HostCopier | None = None,
    subject: str = "state",
    part_size: int | None = None,
    steady: Callable[[torch.Tensor], bool] | None = None,
) -> tuple[list[list[Buffer]], bytes]:
    """Like ``encode_state_chunks``, but the tensors split into several safetensors files
    (parts) of about ``part_size`` bytes each, in the state's order: a part is closed once it
    holds ``part_size`` bytes (a tensor is never split, so a part may be larger). Tensor keys
    are unique across parts; no tensors gives no parts, ``part_size=None`` at most one.

    ``steady`` (with ``part_size``): the tensors it is true of (frozen parameters) come first,
    in parts of their own, so that those parts hold the same bytes from save to save while
    the rest changes (an incremental save shares them, docs/protocol.md §12).
    """
    tensors: dict[str, torch.Tensor] = {}
    steady_keys: set[str] = set()
    seen: dict[tuple[int, int, tuple[int, ...], tuple[int, ...], torch.dtype], str] = {}
    alive: list[torch.Tensor] = []  # temporaries (a generator's state) held until the end

    def add_array(array: Any, path: str) -> str:
        """A NumPy array stored as a tensor of its own (never shared, always copied)."""
        dtype = array.dtype
        if dtype.kind not in _NUMPY_SCALAR_KINDS or not dtype.isnative:
            raise InvalidInputError(
                f"{subject} at {path or '<root>'}: a NumPy array of dtype {dtype.str} cannot "
                f"be stored (numbers and booleans in native byte order only: nothing is "
                f"pickled)"
            )
        try:
            tensor = torch.from_numpy(numpy().array(array, copy=True, order="C"))  # 0-d stays
        except TypeError as exc:
            raise InvalidInputError(
                f"{subject} at {path or '<root>'}: a NumPy array of dtype {dtype} has no torch "
                f"dtype to be stored as ({exc})"
            ) from exc
        key = f"t{len(tensors)}"
        tensors[key] = tensor
        return key

    def walk(value: Any, path: str) -> Any:
        np = numpy_if_loaded()
        if np is not None and isinstance(value, np.ndarray):
            return {_NDARRAY: add_array(value, path)}
        if np is not None and isinstance(value, np.generic):
            if value.dtype.kind not in _NUMPY_SCALAR_KINDS or value.dtype.itemsize > 8:
                raise InvalidInputError(
                    f"{subject} at {path or '<root>'}: a NumPy {value.dtype} scalar cannot be "
                    f"stored (numbers and booleans only)"
                )
            return {_NPSCALAR: [value.dtype.str, walk(value.item(), path)]}
        generator = _generator_state(value)
        if generator is not None:
            marker, generator_state = generator
            return {marker: walk(generator_state, f"{path}<{type(value).__name__}>")}
        if isinstance(value, torch.Tensor):
            alive.append(value)  # its address may not be reused while the walk runs
            tensor = value.detach()
            identity = (
                tensor.untyped_storage().data_ptr(),
                int(tensor.storage_offset()),
                tuple(tensor.shape),
                tuple(tensor.stride()),
                tensor.dtype,
            )
            key = seen.get(identity)
            if key is None:
                key = f"t{len(tensors)}"
                seen[identity] = key
                if steady is not None and steady(tensor):
                    steady_keys.add(key)
                if copy and copier is not None:
                    tensors[key] = copier(key, tensor)
                else:
                    tensors[key] = _to_host(tensor, copy=copy)
            return {_TENSOR: key}
        if isinstance(value, Mapping):
            if all(isinstance(k, str) for k in value):
                if len(value) == 1 and next(iter(value)) in _MARKERS:
                    raise InvalidInputError(
                        f"{subject} at {path or '<root>'}: a dict whose only key is "
                        f"{next(iter(value))!r} would read back as something else"
                    )
                return {k: walk(v, f"{path}.{k}") for k, v in value.items()}
            if all(_is_integer(k) for k in value):
                return {_INTKEYS: [[int(k), walk(v, f"{path}.{k}")] for k, v in value.items()]}
            raise InvalidInputError(
                f"{subject} at {path or '<root>'}: keys must be all str or all int"
            )
        if isinstance(value, tuple):
            return {_TUPLE: [walk(v, f"{path}[{i}]") for i, v in enumerate(value)]}
        if isinstance(value, list):
            return [walk(v, f"{path}[{i}]") for i, v in enumerate(value)]
        if isinstance(value, float) and not math.isfinite(value):
            return {_FLOAT: repr(value)}
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        raise InvalidInputError(_unstorable(value, subject, path))

    skeleton = walk(state, "")
    groups: list[dict[str, torch.Tensor]] = []
    filled = 0
    in_steady = False
    if part_size is None:
        steady_keys.clear()  # one part: nothing to set apart
    ordered = sorted(tensors, key=lambda k: k not in steady_keys)  # stable: the state's order
    for key in ordered:
        tensor = tensors[key]
        moved_on = in_steady and key not in steady_keys  # the first changing tensor after them
        if not groups or moved_on or (part_size is not None and filled >= part_size):
            groups.append({})
            filled = 0
        in_steady = key in steady_keys
        groups[-1][key] = tensor
        filled += tensor.numel() * tensor.element_size()
    parts = [_safetensors_chunks(group) for group in groups]
    text = json.dumps(skeleton, allow_nan=False)
    if len(text) > _MAX_SKELETON_BYTES or nesting_exceeds(text, MAX_SKELETON_DEPTH):
        raise InvalidInputError(
            f"{subject}: nests lists, tuples and dicts deeper than {MAX_SKELETON_DEPTH} levels "
            f"or holds more than {_MAX_SKELETON_BYTES} bytes besides its tensors: it could not "
            f"be loaded back"
        )
    return parts, text.encode("utf-8")


def _where(where: str) -> str:
    return f"{where}: " if where else ""


def _load_skeleton(skeleton: bytes, where: str) -> Any:
    """The stored JSON skeleton, bounded before it is parsed (ManifestCorruptError if not)."""
    try:
        return load_json(skeleton, max_bytes=_MAX_SKELETON_BYTES, max_depth=MAX_SKELETON_DEPTH)
    except JSONDocumentError as exc:
        raise ManifestCorruptError(f"{where}state skeleton {exc}") from exc


def _is_integer(key: object) -> bool:
    if isinstance(key, bool):
        return False
    np = numpy_if_loaded()
    return isinstance(key, int) or (np is not None and isinstance(key, np.integer))


def numpy() -> Any:
    """The NumPy module (torch's ``Tensor.numpy`` needs it too)."""
    import numpy as np

    return np


def numpy_if_loaded() -> Any:
    """NumPy if something has imported it (a state cannot hold NumPy values otherwise)."""
    import sys

    return sys.modules.get("numpy")


def _generator_state(value: Any) -> tuple[str, Any] | None:
    """(marker, state) for a random generator, stored by its state; None for anything else."""
    if isinstance(value, torch.Generator):
        return _TORCH_GEN, {"device": str(value.device), "state": value.get_state()}
    if isinstance(value, random.Random):
        version, internal, gauss = value.getstate()
        return _PY_RANDOM, {"version": version, "state": list(internal), "gauss": gauss}
    np = numpy_if_loaded()
    if np is None:
        return None
    if isinstance(value, np.random.Generator):
        return _NP_GEN, value.bit_generator.state
    if isinstance(value, np.random.RandomState):
        return _NP_LEGACY, value.get_state(legacy=False)
    return None


def _unstorable(value: Any, subject: str, path: str) -> str:
    """Why ``value`` cannot be stored, and what to do instead."""
    kind = type(value)
    where = f"{subject} at {path or '<root>'}"
    if any(c.__name__ == "DataLoader" and c.__module__.startswith("torch.") for c in kind.__mro__):
        return (
            f"{where} is a torch DataLoader, which has no state of its own to save: save the "
            f"parts that decide what comes next instead, its sampler (if it has state_dict()) "
            f"and a torch.Generator you gave it (DataLoader(..., generator=g)) as components, "
            f"or use torchdata's StatefulDataLoader, which has state_dict()"
        )
    return (
        f"{where} holds a {kind.__module__}.{kind.__qualname__}, which ckptstore does not store "
        f"(tensors, numbers, strings, lists, tuples, dicts, NumPy values and random generators "
        f"only: nothing is pickled). Give its class state_dict() and load_state_dict() that "
        f"return and take those, or store what it needs to resume instead"
    )


_SAFETENSORS_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL", torch.complex64: "C64",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
    torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64",
}  # fmt: skip


_PAGE = 4096
_ALIGN_FROM = 1024 * 1024
"""Tensor data of at least this many bytes starts on a page boundary of the file: writing it
from (page-aligned) tensor memory then copies page onto page (measured: 1.6x faster into the
page cache than at some unaligned offsets), and a memory map of the file aligns every tensor."""


def _safetensors_chunks(tensors: dict[str, torch.Tensor]) -> list[Buffer]:
    """The safetensors format, streamed: 8-byte header length, JSON header padded with spaces
    (so the data starts at a multiple of 8 bytes, of a page for large data), then every
    tensor's bytes in header order (the layout safetensors reads)."""
    header: dict[str, Any] = {}
    views: list[Buffer] = []
    offset = 0
    for name, tensor in tensors.items():
        dtype = _SAFETENSORS_DTYPES.get(tensor.dtype)
        if dtype is None:
            raise InvalidInputError(f"tensor dtype {tensor.dtype} cannot be stored as safetensors")
        flat = tensor.reshape(-1)
        size = flat.numel() * flat.element_size()
        header[name] = {
            "dtype": dtype,
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + size],
        }
        if size:
            array: Any = flat.view(torch.uint8).numpy()
            views.append(memoryview(array))
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    align = _PAGE if offset >= _ALIGN_FROM else 8
    text += b" " * (-(8 + len(text)) % align)  # 8 + len(text) is a multiple of 8 (or a page)
    return [len(text).to_bytes(8, "little") + text, *views]


def _to_host(tensor: torch.Tensor, *, copy: bool) -> torch.Tensor:
    """A contiguous CPU tensor with the same values; a copy that ckptstore owns if ``copy``.

    A CUDA tensor is copied into pinned host memory (the device-to-host copy is then a DMA,
    and the training stream is not held by pageable memory).
    """
    if tensor.device.type == "cuda":
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        host.copy_(tensor, non_blocking=True)
        torch.cuda.current_stream(tensor.device).synchronize()
        return host
    if copy:
        return tensor.to("cpu", copy=True).contiguous()
    return tensor.to("cpu").contiguous()


_DTYPES_BY_NAME = {name: dtype for dtype, name in _SAFETENSORS_DTYPES.items()}


def read_tensors(
    stream: Readable,
    size: int,
    *,
    where: str = "tensors",
    into: Mapping[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """Read a safetensors file of ``size`` bytes from ``stream`` straight into tensors.

    Each tensor's bytes are read into its own memory: no intermediate copy of the file. A
    tensor of ``into`` (by name) with the stored shape and dtype is filled in place and
    returned: straight from the stream if it is contiguous in CPU memory, else (on a GPU,
    non-contiguous) through one bounded host buffer (``STAGING_BYTES``, pinned for a GPU);
    every other tensor gets new CPU memory. The header is
    checked before anything is allocated or overwritten (known dtypes, sizes that match the
    shapes, data that covers the file exactly), so a damaged header cannot ask for more memory
    than the file holds. The stream is read to its end (a ``ShardReader`` verifies its CRC32C
    there): tensors filled in place before a mismatch is found hold the damaged bytes.
    """

    def corrupt(problem: str) -> ShardCorruptError:
        return ShardCorruptError(f"{where}: not a valid safetensors file: {problem}")

    if size == 0:  # a state without tensors is stored as an empty shard
        if _fill(stream, memoryview(bytearray(1))):
            raise corrupt("longer than 0 bytes")
        return {}
    prefix = bytearray(8)
    if size < 8 or _fill(stream, memoryview(prefix)) != 8:
        raise corrupt(f"{size} bytes is too short")
    header_size = int.from_bytes(prefix, "little")
    if not 2 <= header_size <= min(_MAX_HEADER, size - 8):
        raise corrupt(f"header length {header_size} does not fit a {size}-byte file")
    header_bytes = bytearray(header_size)
    if _fill(stream, memoryview(header_bytes)) != header_size:
        raise corrupt("truncated header")
    try:  # a header nests a tensor's shape in its entry in the header: 3 levels
        header = load_json(header_bytes, max_bytes=_MAX_HEADER, max_depth=8)
    except JSONDocumentError as exc:
        raise corrupt(f"header is not JSON: it {exc}") from exc
    if not isinstance(header, dict):
        raise corrupt("header is not a JSON object")
    layout: list[tuple[int, str, torch.dtype, list[int], int]] = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = _DTYPES_BY_NAME[entry["dtype"]]
            shape = [int(d) for d in entry["shape"]]
            begin, end = (int(o) for o in entry["data_offsets"])
        except (KeyError, TypeError, ValueError) as exc:
            raise corrupt(f"tensor {name!r} has a bad entry {entry!r}") from exc
        nbytes = math.prod(shape) * dtype.itemsize
        if min(shape, default=0) < 0 or end - begin != nbytes:
            raise corrupt(f"tensor {name!r}: offsets {begin}..{end} do not hold shape {shape}")
        layout.append((begin, name, dtype, shape, nbytes))
    layout.sort(key=lambda item: item[0])
    position = 0
    for begin, name, _dtype, _shape, nbytes in layout:
        if begin != position:
            raise corrupt(f"tensor {name!r} starts at {begin}, expected {position}")
        position = begin + nbytes
    if position != size - 8 - header_size:
        raise corrupt(f"tensors hold {position} bytes, the file has {size - 8 - header_size}")
    tensors: dict[str, torch.Tensor] = {}
    staging = _Staging()
    for _begin, name, dtype, shape, nbytes in layout:
        target = (into or {}).get(name)
        tensor = _fillable(target, dtype, shape)
        staged = None if tensor is not None else _stageable(target, dtype, shape, nbytes)
        if staged is not None:
            if not staging.fill(stream, staged, nbytes):
                raise corrupt(f"truncated in tensor {name!r}")
            tensors[name] = staged
            continue
        if tensor is None:
            tensor = torch.empty(shape, dtype=dtype)
        if nbytes:
            array: Any = tensor.reshape(-1).view(torch.uint8).numpy()
            if _fill(stream, memoryview(array)) != nbytes:
                raise corrupt(f"truncated in tensor {name!r}")
        tensors[name] = tensor
    if _fill(stream, memoryview(bytearray(1))):
        raise corrupt(f"longer than {size} bytes")
    return tensors


def _fillable(target: object, dtype: torch.dtype, shape: list[int]) -> torch.Tensor | None:
    """``target`` (detached) if the stored bytes can be read straight into it, else None."""
    if not isinstance(target, torch.Tensor):
        return None
    tensor = target.detach()
    fits = tensor.dtype == dtype and list(tensor.shape) == shape and tensor.is_contiguous()
    return tensor if fits and tensor.device.type == "cpu" and not tensor.is_neg() else None


STAGING_BYTES = 16 * 1024 * 1024
"""The host buffer through which a load fills tensors it cannot read into directly (on a GPU:
pinned memory; non-contiguous), a whole number of rows at a time."""


def _stageable(
    target: object, dtype: torch.dtype, shape: list[int], nbytes: int
) -> torch.Tensor | None:
    """``target`` (detached) if a staging buffer can fill it: the stored shape and dtype, on a
    device that can copy from host memory, rows no larger than the buffer."""
    if not isinstance(target, torch.Tensor) or not nbytes:
        return None
    tensor = target.detach()
    if tensor.dtype != dtype or list(tensor.shape) != shape or tensor.device.type == "meta":
        return None
    rows = shape[0] if shape else 1
    return tensor if nbytes // rows <= STAGING_BYTES else None


class _Staging:
    """One bounded host buffer (pinned for GPU targets) that fills tensors rows at a time."""

    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None

    def _host(self, device: torch.device) -> torch.Tensor:
        pinned = device.type == "cuda" and torch.cuda.is_available()
        if self._buffer is None or (pinned and not self._buffer.is_pinned()):
            self._buffer = torch.empty(STAGING_BYTES, dtype=torch.uint8, pin_memory=pinned)
        return self._buffer

    def fill(self, stream: Readable, target: torch.Tensor, nbytes: int) -> bool:
        """Read ``nbytes`` from ``stream`` into ``target``; False if the stream ends first."""
        rows = target.reshape(-1) if target.dim() == 0 else target  # 0-d: one row of one
        count = rows.shape[0]
        row_bytes = nbytes // count
        step = max(1, STAGING_BYTES // row_bytes)
        host = self._host(target.device)
        for start in range(0, count, step):
            taken = min(step, count - start)
            piece = host[: taken * row_bytes]
            array: Any = piece.numpy()
            if _fill(stream, memoryview(array)) != piece.numel():
                return False
            values = piece.view(target.dtype).view(taken, *rows.shape[1:])
            rows[start : start + taken].copy_(values)  # waits: the buffer is reused next
        return True


def tensor_destinations(
    skeleton: bytes, current: Any, *, where: str = ""
) -> dict[str, torch.Tensor]:
    """The tensors of ``current`` (a component's present state) that stand where the stored
    ``skeleton`` has a tensor, by stored tensor name: where a load may read in place.
    ``where``: the skeleton's shard, named in errors."""
    document = _load_skeleton(skeleton, _where(where))
    found: dict[str, torch.Tensor] = {}

    def pair(stored: Any, present: Any) -> None:
        if isinstance(stored, list):
            if isinstance(present, (list, tuple)):
                for inner, now in zip(stored, present, strict=False):
                    pair(inner, now)
            return
        if not isinstance(stored, dict):
            return
        if len(stored) == 1:
            marker, inner = next(iter(stored.items()))
            if marker == _TENSOR:
                if isinstance(inner, str) and isinstance(present, torch.Tensor):
                    found.setdefault(inner, present)
                return
            if marker == _TUPLE:
                pair(inner, present)
                return
            if marker == _INTKEYS:
                if isinstance(inner, list) and isinstance(present, Mapping):
                    for entry in inner:
                        if isinstance(entry, list) and len(entry) == 2 and entry[0] in present:
                            pair(entry[1], present[entry[0]])
                return
            if marker in _MARKERS:
                return
        if isinstance(present, Mapping):
            for key, inner in stored.items():
                if key in present:
                    pair(inner, present[key])

    if isinstance(document, dict) and isinstance(current, Mapping):
        stored_keys = set(document)
        if len(document) == 1 and next(iter(document)) == _INTKEYS:
            stored_keys = {entry[0] for entry in document[_INTKEYS] if isinstance(entry, list)}
        if stored_keys != set(current):
            return {}  # a state that does not fit: load_state_dict refuses it, untouched
    pair(document, current)
    return found


def _fill(stream: Readable, view: memoryview) -> int:
    """Read until ``view`` is full or the stream ends; return the bytes read."""
    got = 0
    while got < view.nbytes:
        count = stream.readinto(view[got:])
        if not count:
            break
        got += count
    return got


def decode_state(
    tensors: bytes | Mapping[str, torch.Tensor],
    skeleton: bytes,
    *,
    map_location: Any = "cpu",
    where: str = "",
) -> Any:
    """Rebuild the nested state written by ``encode_state``.

    ``tensors``: the safetensors bytes, or the tensors already read (``read_tensors``).
    ``where``: the skeleton's shard, named in errors.
    """
    if isinstance(tensors, (bytes, bytearray, memoryview)):
        blob = bytes(tensors)
        tensors = read_tensors(io.BytesIO(blob), len(blob)) if blob else {}
    host = dict(tensors)  # NumPy arrays and generator states come from these
    if map_location is not None:  # new memory is on the CPU; a tensor filled on a GPU stays
        tensors = {k: v.to(map_location) if v.is_cpu else v for k, v in tensors.items()}
    document = _load_skeleton(skeleton, _where(where))

    def tensor(key: object, source: Mapping[str, torch.Tensor]) -> torch.Tensor:
        if not isinstance(key, str) or key not in source:
            raise ManifestCorruptError(f"state skeleton names a missing tensor {key!r}")
        return source[key]

    def build(value: Any, *, on_host: bool = False) -> Any:
        if isinstance(value, dict):
            if len(value) == 1:
                marker, inner = next(iter(value.items()))
                if marker == _TENSOR:
                    return tensor(inner, host if on_host else tensors)
                if marker in _MARKERS:
                    return special(marker, inner)
            return {k: build(v, on_host=on_host) for k, v in value.items()}
        if isinstance(value, list):
            return [build(v, on_host=on_host) for v in value]
        return value

    def special(marker: str, inner: Any) -> Any:
        try:
            if marker == _TUPLE:
                return tuple(build(v) for v in inner)
            if marker == _FLOAT:
                return float(inner)
            if marker == _INTKEYS:
                return {int(k): build(v) for k, v in inner}
            if marker == _NDARRAY:
                return tensor(inner, host).cpu().numpy()
            if marker == _NPSCALAR:
                dtype, number = inner
                return numpy().dtype(dtype).type(build(number))
            return _new_generator(marker, build(inner, on_host=True))
        except ManifestCorruptError:
            raise
        except (TypeError, ValueError, KeyError, AttributeError, RuntimeError) as exc:
            raise ManifestCorruptError(f"state skeleton has a bad {marker} entry: {exc}") from exc

    return build(document)


def _new_generator(marker: str, state: Any) -> Any:
    """A new random generator in the stored ``state``."""
    if marker == _TORCH_GEN:
        generator = torch.Generator(device=state["device"])
        generator.set_state(state["state"].to("cpu", torch.uint8))
        return generator
    if marker == _PY_RANDOM:
        python = random.Random()
        python.setstate((state["version"], tuple(state["state"]), state["gauss"]))
        return python
    np = numpy()
    name = state["bit_generator"]
    if name not in _BIT_GENERATORS:
        raise ValueError(f"unknown NumPy bit generator {name!r}")
    if marker == _NP_GEN:
        bits = getattr(np.random, name)()
        bits.state = state
        return np.random.Generator(bits)
    legacy = np.random.RandomState()
    legacy.set_state(state)
    return legacy


def restore_generator(target: Any, restored: Any) -> bool:
    """Put generator ``target`` in the state of ``restored`` (a generator this codec decoded);
    False if ``target`` is not a generator of the same kind."""
    if isinstance(target, torch.Generator) and isinstance(restored, torch.Generator):
        target.set_state(restored.get_state())
        return True
    if isinstance(target, random.Random) and isinstance(restored, random.Random):
        target.setstate(restored.getstate())
        return True
    np = numpy_if_loaded()
    if np is None:
        return False
    if isinstance(target, np.random.Generator) and isinstance(restored, np.random.Generator):
        if type(target.bit_generator) is not type(restored.bit_generator):
            return False
        target.bit_generator.state = restored.bit_generator.state
        return True
    if isinstance(target, np.random.RandomState) and isinstance(restored, np.random.RandomState):
        target.set_state(restored.get_state(legacy=False))
        return True
    return False


def is_generator(value: Any) -> bool:
    """True for a random generator this codec stores by its state."""
    return _generator_state(value) is not None
