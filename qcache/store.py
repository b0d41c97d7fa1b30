"""PackedStore: the tensors of one cache layer, declared once, preallocated and written in place.

Every tensor a layer keeps is declared as a `Part`: a name, the axis it grows along, its trailing shape, its dtype
and the memory category it is counted under. Parts of one axis grow and shrink together:

    ============ ========================================= =================================================
    axis         one entry per                              examples (QuantLayer)
    ============ ========================================= =================================================
    "token"      quantized token                            key/value codes, value scales, value outliers
    "block"      key block (k_group_size quantized tokens)  key scales/zeros, key outliers
    "sink"       full-precision token at the start          sink keys and values
    "residual"   full-precision token at the end            the block being filled + the recent window
    "early"      token as given, before any block (8-bit    a short prompt's keys and values
                 residual windows)
    ============ ========================================= =================================================

Every part is a buffer [B, H, capacity, *shape] of which the entries [start, start + length) along dim 2 are in use
(`view(name)`, a view: no copy). `append` writes new entries in place after the used ones; when capacity runs out
the buffer is reallocated with room to spare (1/16 of what it holds, at least `min_grow` entries), so appending n
entries costs O(n) amortized however much is stored, never a copy of the whole store per append (the way
`torch.cat` grows a cache). `drop_front` (sliding eviction, the residual draining into the quantized region) only
moves `start`; the used entries are moved back to the front of the buffer when more than half of it lies unused
before them, a growing buffer more than three quarters empty is shrunk, and a bounded one (sinks, the residual)
goes back to its steady capacity (`bounded`: the most it holds between two flushes, e.g. the recent window plus one
key block) after a long chunk passed through it, so the capacity held stays close to what is used (`nbytes`
reports the difference as `reserved`). A growing axis grows by 1/64 of what it holds. Batch operations (beam search's
reorder, repeat-interleave, select) apply to every part at once.

Example:
    >>> store = PackedStore([Part("codes", "token", (16,), torch.uint8, "packed")], batch=1, heads=2)
    >>> store.append("token", codes=torch.zeros(1, 2, 5, 16, dtype=torch.uint8))
    >>> store.length("token"), store.view("codes").shape
    (5, torch.Size([1, 2, 5, 16]))
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

__all__ = ["Part", "PackedStore", "AXES", "CATEGORIES"]

AXES = ("token", "block", "sink", "residual", "early")
CATEGORIES = ("packed", "scales", "outliers", "full_precision")
_DIM = 2  # every part is [B, H, n, *shape]: entries run along dim 2


@dataclass(frozen=True)
class Part:
    """One tensor of a store.

    Args:
        name: key of the tensor in the store.
        axis: what one entry along dim 2 stands for (one of `AXES`).
        shape: trailing shape after [B, H, n].
        dtype: element type.
        category: what `PackedStore.nbytes` counts it as (one of `CATEGORIES`).
    """

    name: str
    axis: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    category: str

    @property
    def entry_bytes(self) -> int:
        """Bytes of one entry along the axis, per batch row and head."""
        return math.prod(self.shape) * self.dtype.itemsize

    def __post_init__(self) -> None:
        if self.axis not in AXES:
            raise ValueError(f"part {self.name!r}: axis={self.axis!r} is not supported; allowed values: {list(AXES)}")
        if self.category not in CATEGORIES:
            raise ValueError(f"part {self.name!r}: category={self.category!r} is not supported; allowed values: "
                             f"{list(CATEGORIES)}")


class PackedStore:
    """Preallocated tensors declared by `Part`s (see the module docstring).

    Args:
        parts: the declared tensors (names unique).
        batch: rows (B).
        heads: kv heads (H).
        device: where the buffers live.
        min_grow: smallest number of entries added when a buffer grows, per axis (default 16).
        bounded: {axis: steady capacity} of the axes whose length stays bounded (sinks, the residual; default:
            none): after a drop or crop a buffer larger than max(steady capacity, entries used) shrinks to that, so a
            long prefill chunk leaves no large buffer behind, and appends up to the steady capacity never reallocate
            (they move the used entries to the front when that makes room).
    """

    def __init__(self, parts: Iterable[Part], batch: int, heads: int, device: torch.device | str = "cpu",
                 min_grow: dict[str, int] | None = None, bounded: dict[str, int] | None = None):
        self.parts: dict[str, Part] = {}
        for part in parts:
            if part.name in self.parts:
                raise ValueError(f"part {part.name!r} is declared twice")
            self.parts[part.name] = part
        self.batch, self.heads, self.device = batch, heads, torch.device(device)
        self.min_grow = {axis: 16 for axis in AXES} | dict(min_grow or {})
        self.bounded = dict(bounded or {})
        unknown = sorted(set(self.bounded) - set(AXES))
        if unknown:
            raise ValueError(f"bounded axes {unknown} are not axes; allowed: {list(AXES)}")
        self._start = {axis: 0 for axis in AXES}
        self._length = {axis: 0 for axis in AXES}
        self._capacity = {axis: 0 for axis in AXES}
        self._buf: dict[str, torch.Tensor] = {
            p.name: torch.empty(batch, heads, 0, *p.shape, dtype=p.dtype, device=self.device) for p in self.parts.values()
        }

    # -- reading ---------------------------------------------------------------------------------------------
    def names(self, axis: str) -> list[str]:
        return [p.name for p in self.parts.values() if p.axis == axis]

    def length(self, axis: str) -> int:
        return self._length[axis]

    def view(self, name: str) -> torch.Tensor:
        """The used entries of part `name`, [B, H, length, *shape] (a view of the buffer)."""
        axis = self.parts[name].axis
        return self._buf[name].narrow(_DIM, self._start[axis], self._length[axis])

    def views(self, axis: str | None = None) -> dict[str, torch.Tensor]:
        """{name: view} of every part (of `axis` when given)."""
        return {name: self.view(name) for name, p in self.parts.items() if axis is None or p.axis == axis}

    # -- growing and shrinking -------------------------------------------------------------------------------
    def _reallocate(self, axis: str, capacity: int) -> None:
        """Move the used entries of `axis` to the front of new buffers holding `capacity` entries."""
        start, n = self._start[axis], self._length[axis]
        for name in self.names(axis):
            old = self._buf[name]
            new = old.new_empty(*old.shape[:_DIM], capacity, *old.shape[_DIM + 1:])
            new.narrow(_DIM, 0, n).copy_(old.narrow(_DIM, start, n))
            self._buf[name] = new
        self._start[axis], self._capacity[axis] = 0, capacity

    def append(self, axis: str, **tensors: torch.Tensor) -> None:
        """Write new entries of every part of `axis` (each [B, H, n, *shape], same n) after the used ones."""
        names = self.names(axis)
        if not names and not tensors:  # nothing is stored along this axis (e.g. no key blocks with static ranges)
            return
        if sorted(tensors) != sorted(names):
            raise ValueError(f"append to axis {axis!r} needs exactly the parts {sorted(names)}; got {sorted(tensors)}")
        counts = {t.shape[_DIM] for t in tensors.values()}
        if len(counts) != 1:
            raise ValueError(f"append to axis {axis!r}: parts disagree on the number of entries: "
                             f"{ {k: t.shape[_DIM] for k, t in tensors.items()} }")
        n = counts.pop()
        if n == 0:
            return
        start, used, cap = self._start[axis], self._length[axis], self._capacity[axis]
        if start + used + n > cap:
            if used + n <= cap and (start > cap // 2 or axis in self.bounded):
                self._reallocate(axis, cap)  # room at the front: compact instead of growing (a bounded axis keeps
                # its steady capacity: growing it would only be shrunk back at the next drop)
            else:
                need = used + n
                self._reallocate(axis, need + max(need // 64, self.min_grow[axis]))
        at = self._start[axis] + self._length[axis]
        for name, t in tensors.items():
            buf = self._buf[name]
            if t.shape[:_DIM] != buf.shape[:_DIM] or t.shape[_DIM + 1:] != buf.shape[_DIM + 1:]:
                raise ValueError(f"part {name!r} holds [B, H, n, *shape] = [{buf.shape[0]}, {buf.shape[1]}, n, "
                                 f"{', '.join(map(str, buf.shape[_DIM + 1:]))}]; got {tuple(t.shape)}")
            buf.narrow(_DIM, at, n).copy_(t)
        self._length[axis] += n

    def _maybe_shrink(self, axis: str) -> None:
        used, cap, grow = self._length[axis], self._capacity[axis], self.min_grow[axis]
        # a bounded axis (the residual: it drains back to a few blocks) goes back to its steady capacity; a growing
        # one shrinks only when three quarters of it are unused (no reallocation back and forth)
        if axis in self.bounded:  # (its entries move to the front when an append needs the room)
            if cap > max(self.bounded[axis], used):
                self._reallocate(axis, max(self.bounded[axis], used))
            return
        if cap > 4 * max(used, grow):
            self._reallocate(axis, used + max(used // 64, grow))
        elif self._start[axis] > cap // 2:
            self._reallocate(axis, cap)

    def drop_front(self, axis: str, n: int) -> None:
        """Forget the first `n` used entries of `axis`."""
        if not 0 <= n <= self._length[axis]:
            raise ValueError(f"drop_front({axis!r}, {n}): axis holds {self._length[axis]} entries")
        self._start[axis] += n
        self._length[axis] -= n
        self._maybe_shrink(axis)

    def crop(self, axis: str, keep: int) -> None:
        """Keep the first `keep` used entries of `axis` (forget the rest)."""
        if not 0 <= keep <= self._length[axis]:
            raise ValueError(f"crop({axis!r}, {keep}): axis holds {self._length[axis]} entries")
        self._length[axis] = keep
        self._maybe_shrink(axis)

    def clear(self, axis: str) -> None:
        self.crop(axis, 0)

    # -- batch -----------------------------------------------------------------------------------------------
    def map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Apply a batch-axis operation (index_select, repeat_interleave, ...) to the used entries of every part;
        capacities are kept."""
        for name, p in self.parts.items():
            result = fn(self.view(name))  # [B', H, n, *shape]
            buf = result.new_empty(result.shape[0], *result.shape[1:_DIM], self._capacity[p.axis],
                                   *result.shape[_DIM + 1:])
            buf.narrow(_DIM, 0, result.shape[_DIM]).copy_(result)
            self._buf[name] = buf
            self.batch = result.shape[0]
        self._start = {axis: 0 for axis in AXES}

    def clone(self) -> "PackedStore":
        """An independent copy: the same parts, lengths and capacities, every buffer copied."""
        new = copy.copy(self)
        new._buf = {name: buf.clone() for name, buf in self._buf.items()}
        new._start, new._length, new._capacity = dict(self._start), dict(self._length), dict(self._capacity)
        return new

    # -- bytes -----------------------------------------------------------------------------------------------
    def nbytes(self) -> dict[str, int]:
        """Bytes held per category (see `CATEGORIES`), plus "reserved": allocated capacity not in use."""
        out = {c: 0 for c in CATEGORIES} | {"reserved": 0}
        for name, p in self.parts.items():
            buf = self._buf[name]
            used = self.view(name).numel() * buf.element_size()
            out[p.category] += used
            out["reserved"] += buf.untyped_storage().nbytes() - used
        return out

    def __repr__(self) -> str:
        lengths = ", ".join(f"{a}={self._length[a]}" for a in AXES if self.names(a))
        return f"PackedStore(batch={self.batch}, heads={self.heads}, {lengths}, parts={list(self.parts)})"
