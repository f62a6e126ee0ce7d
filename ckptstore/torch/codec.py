"""State dicts to bytes and back: tensors as safetensors, everything else as JSON.

A nested state (dicts, lists, tuples, numbers, strings, tensors) becomes two blobs: a
safetensors file holding every tensor, and a JSON skeleton in which each tensor is replaced by
``{"__tensor__": key}``. Nothing is pickled, so loading never runs code from a checkpoint.
Tensors that share storage (tied weights) are stored once and come back shared.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
from safetensors.torch import load as load_safetensors

from ckptstore.driver import Buffer
from ckptstore.errors import InvalidInputError, ManifestCorruptError

__all__ = ["decode_state", "encode_state", "encode_state_chunks"]

_TENSOR, _TUPLE, _FLOAT, _INTKEYS = "__tensor__", "__tuple__", "__float__", "__intkeys__"


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
    state: Any, *, copy: bool = False, copier: HostCopier | None = None
) -> tuple[list[Buffer], bytes]:
    """Like ``encode_state``, but the safetensors file as a list of chunks: its header, then
    each tensor's own memory, uncopied (unless ``copy``), to be streamed into a shard.

    ``copier`` (with ``copy``) places the copies, e.g. into buffers reused from save to save.
    """
    tensors: dict[str, torch.Tensor] = {}
    seen: dict[tuple[int, int, tuple[int, ...], tuple[int, ...], torch.dtype], str] = {}

    def walk(value: Any, path: str) -> Any:
        if isinstance(value, torch.Tensor):
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
                if copy and copier is not None:
                    tensors[key] = copier(key, tensor)
                else:
                    tensors[key] = _to_host(tensor, copy=copy)
            return {_TENSOR: key}
        if isinstance(value, Mapping):
            if all(isinstance(k, str) for k in value):
                return {k: walk(v, f"{path}.{k}") for k, v in value.items()}
            if all(isinstance(k, int) and not isinstance(k, bool) for k in value):
                return {_INTKEYS: [[k, walk(v, f"{path}.{k}")] for k, v in value.items()]}
            raise InvalidInputError(f"state at {path or '<root>'}: keys must be all str or all int")
        if isinstance(value, tuple):
            return {_TUPLE: [walk(v, f"{path}[{i}]") for i, v in enumerate(value)]}
        if isinstance(value, list):
            return [walk(v, f"{path}[{i}]") for i, v in enumerate(value)]
        if isinstance(value, float) and not math.isfinite(value):
            return {_FLOAT: repr(value)}
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        raise InvalidInputError(
            f"state at {path or '<root>'} holds a {type(value).__name__}, which ckptstore does not "
            f"store (tensors, numbers, strings, lists, tuples and dicts only: nothing is pickled)"
        )

    skeleton = walk(state, "")
    chunks = _safetensors_chunks(tensors) if tensors else []
    return chunks, json.dumps(skeleton, allow_nan=False).encode("utf-8")


_SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL", torch.complex64: "C64",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
    torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64",
}  # fmt: skip


def _safetensors_chunks(tensors: dict[str, torch.Tensor]) -> list[Buffer]:
    """The safetensors format, streamed: 8-byte header length, JSON header padded with spaces
    to 8 bytes, then every tensor's bytes in header order (the layout safetensors reads)."""
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
    text += b" " * (-len(text) % 8)
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


def decode_state(blob: bytes, skeleton: bytes, *, map_location: Any = "cpu") -> Any:
    """Rebuild the nested state written by ``encode_state``."""
    tensors = load_safetensors(blob) if blob else {}
    if map_location is not None:
        tensors = {k: v.to(map_location) for k, v in tensors.items()}
    try:
        document = json.loads(skeleton.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise ManifestCorruptError(f"state skeleton is not JSON: {exc}") from exc

    def build(value: Any) -> Any:
        if isinstance(value, dict):
            if set(value) == {_TENSOR}:
                return tensors[value[_TENSOR]]
            if set(value) == {_TUPLE}:
                return tuple(build(v) for v in value[_TUPLE])
            if set(value) == {_FLOAT}:
                return float(value[_FLOAT])
            if set(value) == {_INTKEYS}:
                return {int(k): build(v) for k, v in value[_INTKEYS]}
            return {k: build(v) for k, v in value.items()}
        if isinstance(value, list):
            return [build(v) for v in value]
        return value

    return build(document)
