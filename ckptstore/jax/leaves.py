"""A pytree's leaves as stored: arrays as tensors, scalars and strings as JSON, never a pickle.

Every leaf is named by its path in the tree (``jax.tree_util.keystr``: ``['params']['w']``),
which is how a load matches a stored leaf to the target's. A leaf is a ``jax.Array`` (sharded
or not), a NumPy array or scalar, or a Python ``bool``, ``int``, ``float``, ``complex`` or
``str``; anything else is refused at save time, before anything is written. Floats are stored
as their hex form, so that a round trip is bitwise exact (NaN payloads aside), and ints whole
(in hexadecimal past 2000 bits, which any interpreter converts back at any size).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from ckptstore.errors import InvalidInputError, ManifestCorruptError

__all__ = [
    "Leaf",
    "decode_value",
    "dtype_code",
    "encode_value",
    "flatten",
    "numpy_dtype",
    "path_keys",
    "scalar_kind",
]

_CODES = {
    "bool": "BOOL",
    "uint8": "U8",
    "int8": "I8",
    "uint16": "U16",
    "int16": "I16",
    "uint32": "U32",
    "int32": "I32",
    "uint64": "U64",
    "int64": "I64",
    "float16": "F16",
    "bfloat16": "BF16",
    "float32": "F32",
    "float64": "F64",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
}
"""NumPy (and ml_dtypes) dtype names and their safetensors codes."""
_NAMES = {code: name for name, code in _CODES.items()}


@dataclass(frozen=True)
class Leaf:
    """One leaf of a tree: its name (path), its path's keys as JSON, and its value."""

    name: str
    keys: list[list[Any]]
    value: Any


def flatten(tree: Any) -> tuple[list[Leaf], Any]:
    """The leaves of ``tree`` in order, and its tree definition; leaf names are unique."""
    pairs, treedef = jax.tree_util.tree_flatten_with_path(tree)
    leaves = [Leaf(jax.tree_util.keystr(path), path_keys(path), value) for path, value in pairs]
    seen: set[str] = set()
    for leaf in leaves:
        if leaf.name in seen:
            raise InvalidInputError(f"two leaves of the tree are both named {leaf.name}")
        seen.add(leaf.name)
    return leaves, treedef


def path_keys(path: tuple[Any, ...]) -> list[list[Any]]:
    """A leaf's path as JSON: ``["key", k]`` (a mapping's), ``["index", i]`` (a sequence's),
    ``["attr", name]`` (a dataclass's, a named tuple's) or ``["flat", i]`` (any other node's)."""
    keys: list[list[Any]] = []
    for entry in path:
        if isinstance(entry, jax.tree_util.DictKey):
            key = entry.key
            if isinstance(key, bool) or not isinstance(key, (str, int)):
                raise InvalidInputError(
                    f"a mapping key {key!r} of the tree is a {type(key).__name__}: only str and "
                    f"int keys can be stored"
                )
            keys.append(["key", key])
        elif isinstance(entry, jax.tree_util.SequenceKey):
            keys.append(["index", entry.idx])
        elif isinstance(entry, jax.tree_util.GetAttrKey):
            keys.append(["attr", entry.name])
        elif isinstance(entry, jax.tree_util.FlattenedIndexKey):
            keys.append(["flat", entry.key])
        else:
            raise InvalidInputError(f"a tree path entry {entry!r} is of an unknown kind")
    return keys


def dtype_code(dtype: Any, name: str) -> str:
    """The safetensors code of an array's dtype, or InvalidInputError naming the leaf."""
    code = _CODES.get(np.dtype(dtype).name)
    if code is None:
        raise InvalidInputError(
            f"leaf {name}: dtype {np.dtype(dtype).name} cannot be stored as safetensors "
            f"(stored: {', '.join(sorted(_CODES))})"
        )
    return code


def numpy_dtype(code: str, where: str) -> np.dtype[Any]:
    """The NumPy dtype of a safetensors code read from a checkpoint."""
    name = _NAMES.get(code)
    if name is None:
        raise ManifestCorruptError(f"{where}: unknown dtype code {code!r}")
    return np.dtype(jax.numpy.dtype(name))


def encode_value(value: Any, name: str) -> dict[str, Any] | None:
    """A scalar or string leaf as JSON (``{"kind": ..., "value": ...}``); None for an array
    leaf; InvalidInputError for anything else."""
    if isinstance(value, (jax.Array, np.ndarray, np.generic)):
        return None
    # The base types' own methods: a subclass's __str__ or __repr__ must not change what is
    # stored (it is loaded back as the base type).
    if isinstance(value, bool):
        return {"kind": "bool", "value": bool(value)}
    if isinstance(value, int):
        return {"kind": "int", "value": _int_text(value)}
    if isinstance(value, float):
        return {"kind": "float", "value": float.hex(value)}
    if isinstance(value, complex):
        return {"kind": "complex", "value": [float.hex(value.real), float.hex(value.imag)]}
    if isinstance(value, str):
        return {"kind": "str", "value": str.__str__(value)}
    raise InvalidInputError(
        f"leaf {name} is a {type(value).__module__}.{type(value).__qualname__}: a tree's leaves "
        f"are stored as arrays (jax.Array, NumPy), Python scalars or strings, and nothing is "
        f"pickled"
    )


def scalar_kind(value: Any) -> str | None:
    """The stored kind a Python scalar or string target leaf asks for (None: not one)."""
    if isinstance(value, np.generic):
        return None
    for kind, types in (("bool", bool), ("int", int), ("float", float), ("complex", complex),
                        ("str", str)):  # fmt: skip
        if isinstance(value, types):
            return kind
    return None


def decode_value(entry: Mapping[str, Any], where: str) -> Any:
    """A scalar or string leaf from its JSON entry, checked."""
    kind, value = entry.get("kind"), entry.get("value")
    try:
        if kind == "bool" and isinstance(value, bool):
            return value
        if kind == "int" and isinstance(value, str) and _INT_TEXT.fullmatch(value):
            return int(value, 16 if "x" in value else 10)
        if kind == "float" and isinstance(value, str):
            return float.fromhex(value)
        if kind == "complex" and isinstance(value, list) and len(value) == 2:
            return complex(float.fromhex(value[0]), float.fromhex(value[1]))
        if kind == "str" and isinstance(value, str):
            return value
    except (TypeError, ValueError, OverflowError):
        pass
    shown = repr(value)
    shown = shown if len(shown) <= 80 else f"{shown[:60]}... ({len(shown)} characters)"
    raise ManifestCorruptError(f"{where}: a {kind!r} leaf holds {shown}")


_DECIMAL_BITS = 2000
"""An int of at most this many bits is stored in decimal (at most 603 digits: under 640, the
least that any interpreter converts, whatever ``sys.set_int_max_str_digits`` says); a larger
one in hexadecimal, which Python converts whole, at any size, in linear time."""
_INT_TEXT = re.compile(r"-?(0|[1-9][0-9]{0,639}|0x[0-9a-f]+)")


def _int_text(value: int) -> str:
    """An int as its stored text: decimal, or hexadecimal if it is large (the base type's
    methods: a subclass must not change what is stored)."""
    if int.bit_length(value) <= _DECIMAL_BITS:
        return int.__repr__(value)
    return int.__format__(value, "#x")
