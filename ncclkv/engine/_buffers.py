"""Wire buffers of one engine rank, reused across tensors (CPU): what each slice is gathered into or lands in.

Why: a fresh multi-MiB CPU tensor per slice is fresh pages, and the kernel
faults and zeroes each of them on first touch, on the thread that writes it
(the gather, or the link's receive thread). Measured on the 2-core CPU
machine: copying 9.7 MiB into a fresh tensor on a non-main thread took a
median 6 ms, into a reused one 0.4 ms (glibc hands large blocks back to the
kernel on free). CUDA tensors come from torch's caching allocator, which
already reuses memory in stream order, so there :class:`WireBuffers` only
allocates.

A buffer goes back with :meth:`WireBuffers.give` once nothing reads or writes
it any more (its send completed, its scatter ran); one never given back is
freed as usual. Sizes are rounded up to classes at most 25% apart, so slices of
nearby lengths share buffers; at most ``max_cached_bytes`` wait for reuse (an
engine's ``wire_cache_bytes``, NCCLKV_WIRE_CACHE_BYTES), the least recently
given dropped first.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from collections.abc import Sequence

import torch

__all__ = ["WireBuffers", "capacity_class"]

_MIN_CLASS = 4096


def capacity_class(nbytes: int) -> int:
    """The smallest ``m * 2**k`` (m in 4..7, at least 4 KiB) that holds ``nbytes``: at most 25% over it."""
    if nbytes <= _MIN_CLASS:
        return _MIN_CLASS
    shift = max(0, nbytes.bit_length() - 3)  # nbytes / 2**shift lies in [4, 8)
    return math.ceil(nbytes / (1 << shift)) << shift


class WireBuffers:
    """A cache of free wire buffers for one device; thread-safe."""

    def __init__(self, device: torch.device | str, max_cached_bytes: int) -> None:
        if not (isinstance(max_cached_bytes, int) and max_cached_bytes >= 0):
            raise ValueError(f"max_cached_bytes must be an int >= 0, got {max_cached_bytes!r}")
        self.device = torch.device(device)
        self._reuse = self.device.type == "cpu"  # CUDA: the caching allocator reuses already
        self._max = max_cached_bytes
        self._lock = threading.Lock()
        self._free: dict[int, list[torch.UntypedStorage]] = {}  # capacity -> storages, last given last
        self._order: OrderedDict[int, int] = OrderedDict()  # data_ptr -> capacity, least recently given first
        self._cached = 0

    @property
    def cached_bytes(self) -> int:
        return self._cached

    def take(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """A contiguous tensor of ``shape`` and ``dtype`` on this device, contents undefined."""
        if not self._reuse:
            return torch.empty(tuple(shape), dtype=dtype, device=self.device)
        nbytes = math.prod(shape) * dtype.itemsize
        capacity = capacity_class(nbytes)
        storage = None
        with self._lock:
            stack = self._free.get(capacity)
            if stack:
                storage = stack.pop()
                del self._order[storage.data_ptr()]
                self._cached -= capacity
        # A normal tensor even under vLLM's inference mode: an inference tensor could not be written outside it.
        with torch.inference_mode(False):
            if storage is None:
                storage = torch.empty(capacity, dtype=torch.uint8, device=self.device).untyped_storage()
            return torch.empty(0, dtype=dtype, device=self.device).set_(storage, 0, tuple(shape))

    def give(self, tensor: torch.Tensor) -> None:
        """Take back a buffer from :meth:`take` that nothing uses any more (a no-op off the CPU)."""
        if not self._reuse or tensor.device != self.device:
            return
        storage = tensor.untyped_storage()
        capacity = storage.nbytes()
        if capacity != capacity_class(capacity) or capacity > self._max:
            return  # not one of ours (a foreign tensor is simply not kept)
        key = storage.data_ptr()  # storage objects are wrappers made per call; the memory is what counts
        with self._lock:
            if key in self._order:
                return  # given twice: keep it once
            self._free.setdefault(capacity, []).append(storage)
            self._order[key] = capacity
            self._cached += capacity
            while self._cached > self._max:  # drop the least recently given
                old_id, old_capacity = self._order.popitem(last=False)
                stack = self._free[old_capacity]
                stack.pop(next(i for i, s in enumerate(stack) if s.data_ptr() == old_id))
                self._cached -= old_capacity

    def clear(self) -> None:
        with self._lock:
            self._free.clear()
            self._order.clear()
            self._cached = 0
