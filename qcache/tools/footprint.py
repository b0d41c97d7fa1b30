"""What a cache object really holds: the bytes of every tensor reachable from it.

`reachable_bytes(obj)` walks an object graph (attributes, slots, dicts, lists, tuples, sets, dataclasses,
`nn.Module` parameters/buffers/submodules, and the inner tensors of tensor subclasses that declare them through
`__tensor_flatten__`, as quanto's and torchao's quantized tensors do) and adds up the storage of every tensor it
finds, once per storage: two views of one buffer count once, and a preallocated buffer counts with its unused
capacity, because that memory is held too. It knows nothing about any cache class, so it counts ours and
Transformers' quantized caches alike: it is the ruler behind "bits per value held".

Example:
    >>> import torch
    >>> reachable_bytes({"a": torch.zeros(4, dtype=torch.uint8), "b": [torch.zeros(2)]})
    12
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Iterator

import torch

__all__ = ["tensors_reachable", "reachable_tensors", "reachable_bytes", "bits_per_value"]

# objects never walked into: they hold no per-cache state (and some, like modules' classes, hold a lot of globals)
_LEAF_TYPES = (str, bytes, bytearray, int, float, complex, bool, type(None), type, types.ModuleType,
               types.FunctionType, types.BuiltinFunctionType, types.MethodType, torch.dtype, torch.device,
               torch.Size, torch.Generator)


def _children(obj) -> Iterator[object]:
    """The objects `obj` refers to that may hold tensors."""
    if isinstance(obj, dict):
        yield from obj.keys()
        yield from obj.values()
        return
    if isinstance(obj, (list, tuple, set, frozenset)):
        yield from obj
        return
    d = getattr(obj, "__dict__", None)
    if isinstance(d, dict):
        yield from d.values()
    for klass in type(obj).__mro__:
        for name in getattr(klass, "__slots__", ()):
            if isinstance(name, str) and hasattr(obj, name):
                yield getattr(obj, name)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type) and not isinstance(d, dict):
        for f in dataclasses.fields(obj):
            yield getattr(obj, f.name, None)


def _tensor_parts(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors holding `t`'s data: itself, or a subclass's inner tensors (recursively)."""
    flatten = getattr(t, "__tensor_flatten__", None)
    if flatten is None or type(t) is torch.Tensor or isinstance(t, torch.nn.Parameter) and type(t.data) is torch.Tensor:
        return [t]
    names, _ = flatten()
    out = []
    for name in names:
        out.extend(_tensor_parts(getattr(t, name)))
    return out


def tensors_reachable(obj) -> Iterator[torch.Tensor]:
    """Every tensor object reachable from `obj` (attributes, slots, dicts, sequences, dataclasses), each once."""
    seen_objects: set[int] = set()
    stack = [obj]
    while stack:
        item = stack.pop()
        if isinstance(item, _LEAF_TYPES) or id(item) in seen_objects:
            continue
        seen_objects.add(id(item))
        if isinstance(item, torch.Tensor):
            yield item
            continue
        stack.extend(_children(item))


def reachable_tensors(obj) -> dict[tuple, int]:
    """{storage key: bytes} for every distinct tensor storage reachable from `obj`."""
    storages: dict[tuple, int] = {}
    for tensor in tensors_reachable(obj):
        for part in _tensor_parts(tensor):
            if part.device.type == "meta":
                continue
            storage = part.untyped_storage()
            key = (part.device.type, part.device.index, storage.data_ptr(), id(storage) if storage.data_ptr() == 0
                   else 0)
            storages[key] = max(storages.get(key, 0), storage.nbytes())
    return storages


def reachable_bytes(obj) -> int:
    """Bytes of every distinct tensor storage reachable from `obj` (see the module docstring)."""
    return sum(reachable_tensors(obj).values())


def bits_per_value(held_bytes: int, layers: int, kv_heads: int, head_dim: int, tokens: int) -> float:
    """`held_bytes` x 8 over the values a cache of `tokens` tokens represents (K and V, every layer and head).

    A 16-bit cache that holds exactly its keys and values gives 16.0.

    Example:
        >>> bits_per_value(2 * 2 * 3 * 64 * 100 * 2, layers=2, kv_heads=3, head_dim=64, tokens=100)
        16.0
    """
    for name, value in (("layers", layers), ("kv_heads", kv_heads), ("head_dim", head_dim), ("tokens", tokens)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive integer")
    return held_bytes * 8 / (2 * layers * kv_heads * head_dim * tokens)
