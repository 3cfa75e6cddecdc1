"""A byte-bounded LRU map: the bookkeeping both buffers share (no locking here)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch

from ..errors import CapacityError

__all__ = ["BufferStats", "ByteLRU", "held_nbytes", "report_evicted", "views_note"]

K = TypeVar("K")
V = TypeVar("V")
T = TypeVar("T")


def held_nbytes(*tensors: torch.Tensor | None) -> int:
    """The memory ``tensors`` keep alive: the bytes of each distinct storage they view, whole.

    A view of a large tensor pins all of it (its ``nbytes`` would count only the view), and an expanded
    tensor (stride 0) holds less than its ``nbytes``: capacity counts what is held."""
    storages: dict[tuple[str, int], int] = {}
    for tensor in tensors:
        if tensor is not None:
            storage = tensor.untyped_storage()
            storages[(str(tensor.device), storage.data_ptr())] = storage.nbytes()
    return sum(storages.values())


def views_note(nbytes: int, *tensors: torch.Tensor | None) -> str:
    """For a refusal: why an entry counts more than its tensors' own bytes (a view holds its base), or ""."""
    own = sum(t.nbytes for t in tensors if t is not None)
    if nbytes <= own:
        return ""
    return f" (its tensors hold {own} bytes but view storages of {nbytes}: clone them to store only their own)"


@dataclass(frozen=True, slots=True)
class BufferStats:
    """Counters of a buffer since construction (a snapshot)."""

    hits: int = 0
    misses: int = 0
    inserts: int = 0
    evictions: int = 0
    evicted_bytes: int = 0
    refusals: int = 0


class ByteLRU(Generic[K, V]):
    """Entries with a byte size, oldest first; never holds more than ``capacity_bytes``.

    Not thread-safe: the owning buffer holds its lock around every call. Every
    operation is O(1) except ``add``, which is O(number evicted).

    ``peak_used_bytes`` is the high-water mark of ``used_bytes``: the most held at
    any moment since construction or the last :meth:`reset_peak` (only ``add``
    raises ``used_bytes``, so it is kept there, after any eviction).
    """

    __slots__ = ("name", "capacity_bytes", "evict", "used_bytes", "peak_used_bytes", "_entries",
                 "hits", "misses", "inserts", "evictions", "evicted_bytes", "refusals")

    def __init__(self, name: str, capacity_bytes: int, evict: bool) -> None:
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int):
            raise TypeError(f"{name}: capacity_bytes must be an int, got {type(capacity_bytes).__name__}")
        if capacity_bytes < 1:
            raise ValueError(f"{name}: capacity_bytes must be >= 1, got {capacity_bytes}")
        self.name = name
        self.capacity_bytes = capacity_bytes
        self.evict = bool(evict)
        self.used_bytes = 0
        self.peak_used_bytes = 0
        self._entries: OrderedDict[K, tuple[V, int]] = OrderedDict()
        self.hits = self.misses = self.inserts = 0
        self.evictions = self.evicted_bytes = self.refusals = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def check_fits(self, nbytes: int, freed: int = 0, detail: str = "") -> None:
        """Raise CapacityError (and count a refusal) if an entry of ``nbytes`` cannot go in.

        ``freed`` is what a replaced entry gives back; ``detail`` ends the message. With eviction on only an
        entry larger than the capacity is refused.
        """
        if nbytes > self.capacity_bytes:
            self.refusals += 1
            raise CapacityError(
                f"{self.name}: entry of {nbytes} bytes is larger than the capacity of {self.capacity_bytes} bytes"
                f"{detail}"
            )
        if not self.evict and self.used_bytes - freed + nbytes > self.capacity_bytes:
            self.refusals += 1
            raise CapacityError(
                f"{self.name}: full with eviction off: entry of {nbytes} bytes, "
                f"{self.used_bytes - freed} of {self.capacity_bytes} bytes used{detail}"
            )

    def add(self, key: K, value: V, nbytes: int) -> list[tuple[K, V]]:
        """Insert as most recent after ``check_fits``; return what was evicted, oldest first."""
        assert key not in self._entries, "replace by pop() first"
        self.check_fits(nbytes)
        evicted: list[tuple[K, V]] = []
        while self.used_bytes + nbytes > self.capacity_bytes:
            old_key, (old_value, old_nbytes) = self._entries.popitem(last=False)
            self.used_bytes -= old_nbytes
            self.evictions += 1
            self.evicted_bytes += old_nbytes
            evicted.append((old_key, old_value))
        self._entries[key] = (value, nbytes)
        self.used_bytes += nbytes
        self.peak_used_bytes = max(self.peak_used_bytes, self.used_bytes)
        self.inserts += 1
        return evicted

    def get(self, key: K) -> V | None:
        item = self._entries.get(key)
        return None if item is None else item[0]

    def nbytes_of(self, key: K) -> int:
        item = self._entries.get(key)
        return 0 if item is None else item[1]

    def touch(self, key: K) -> None:
        self._entries.move_to_end(key)

    def pop(self, key: K) -> V | None:
        item = self._entries.pop(key, None)
        if item is None:
            return None
        self.used_bytes -= item[1]
        return item[0]

    def pop_lru(self) -> tuple[K, V] | None:
        if not self._entries:
            return None
        key, (value, nbytes) = self._entries.popitem(last=False)
        self.used_bytes -= nbytes
        return key, value

    def keys(self) -> Iterator[K]:
        """Keys from least to most recently used (do not mutate while iterating)."""
        return iter(self._entries)

    def clear(self) -> None:
        self._entries.clear()
        self.used_bytes = 0

    def reset_peak(self) -> int:
        """Start a new high-water mark from what is held now; return the mark it replaces."""
        peak, self.peak_used_bytes = self.peak_used_bytes, self.used_bytes
        return peak

    def stats(self) -> BufferStats:
        return BufferStats(self.hits, self.misses, self.inserts, self.evictions, self.evicted_bytes, self.refusals)


def report_evicted(callback: Callable[[T], None] | None, evicted: list[T]) -> None:
    """Call ``callback`` for each evicted item (outside the buffer's lock).

    Every item is reported even if a call raises; the first error is then
    re-raised to the inserting caller, whose insert has already succeeded.
    """
    if callback is None:
        return
    first_error: BaseException | None = None
    for item in evicted:
        try:
            callback(item)
        except Exception as exc:  # noqa: BLE001 - re-raised below, after the others are reported
            if first_error is None:
                first_error = exc
    if first_error is not None:
        raise first_error
