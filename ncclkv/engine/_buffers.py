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
freed as usual. Sizes are rounded up to classes at most 25% apart, and a take
reuses the smallest free buffer up to twice its class, so slices of nearby
lengths share buffers. What waits for reuse is bounded twice, the least
recently given dropped first: by ``max_cached_bytes`` (an engine's
``wire_cache_bytes``, NCCLKV_WIRE_CACHE_BYTES), and by ``KEEP_PEAKS`` times the
most bytes out at once in the last few seconds, so varied lengths do not pile
up buffers of every class (see :meth:`WireBuffers.give`).
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence

import torch

__all__ = ["WireBuffers", "capacity_class"]

_MIN_CLASS = 4096
# The free buffers kept are at most this many times the most bytes out at once recently (within
# one to two windows): what the next requests can reuse, with room for the mix of sizes to change.
KEEP_PEAKS = 2
PEAK_WINDOW_S = 5.0


def capacity_class(nbytes: int) -> int:
    """The smallest ``m * 2**k`` (m in 4..7, at least 4 KiB) that holds ``nbytes``: at most 25% over it."""
    if nbytes <= _MIN_CLASS:
        return _MIN_CLASS
    shift = max(0, nbytes.bit_length() - 3)  # nbytes / 2**shift lies in [4, 8)
    return math.ceil(nbytes / (1 << shift)) << shift


def _classes_up_to_twice(capacity: int) -> Iterator[int]:
    """The class ``capacity`` and each larger one up to twice it, smallest first (a best fit wastes at most half)."""
    fit = capacity
    while fit <= 2 * capacity:
        yield fit
        fit = capacity_class(fit + 1)


class WireBuffers:
    """A cache of free wire buffers for one device; thread-safe."""

    def __init__(self, device: torch.device | str, max_cached_bytes: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not (isinstance(max_cached_bytes, int) and max_cached_bytes >= 0):
            raise ValueError(f"max_cached_bytes must be an int >= 0, got {max_cached_bytes!r}")
        self.device = torch.device(device)
        self._reuse = self.device.type == "cpu"  # CUDA: the caching allocator reuses already
        self._max = max_cached_bytes
        self._lock = threading.Lock()
        # capacity -> (storage, the tensor it came back as), last given last: a take of that same shape and
        # dtype returns the tensor itself, without the two torch calls (each a GIL hand-off) of a new view.
        self._free: dict[int, list[tuple[torch.UntypedStorage, torch.Tensor | None]]] = {}
        self._order: OrderedDict[int, int] = OrderedDict()  # data_ptr -> capacity, least recently given first
        self._cached = 0
        self._lent: dict[int, int] = {}  # data_ptr -> capacity of each buffer taken and not given back
        self._lent_bytes = 0
        self._clock = clock
        self._peaks = [0, 0]  # most bytes out at once in the window before and in this one
        self._window_ends = clock() + PEAK_WINDOW_S

    @property
    def cached_bytes(self) -> int:
        """Bytes of free buffers kept for reuse."""
        return self._cached

    @property
    def recent_peak_bytes(self) -> int:
        """The most bytes of buffers out at once in the last one to two ``PEAK_WINDOW_S`` (see :meth:`give`)."""
        with self._lock:
            self._roll()
            return max(self._peaks)

    @property
    def keep_bytes(self) -> int:
        """The most bytes of free buffers the pool keeps now (see :meth:`give`): ``KEEP_PEAKS`` times
        :attr:`recent_peak_bytes`, at most ``max_cached_bytes``."""
        with self._lock:
            return self._keep_locked()

    def _keep_locked(self) -> int:
        self._roll()
        return min(self._max, KEEP_PEAKS * max(self._peaks))

    def _roll(self) -> None:
        now = self._clock()
        if now >= self._window_ends:
            idle = now >= self._window_ends + PEAK_WINDOW_S  # a whole window passed without a take or give
            self._peaks = [0 if idle else self._peaks[1], self._lent_bytes]
            self._window_ends = now + PEAK_WINDOW_S

    def take(self, shape: Sequence[int], dtype: torch.dtype, exact: bool = False) -> torch.Tensor:
        """A contiguous tensor of ``shape`` and ``dtype`` on this device, contents undefined.

        A free buffer of the smallest class that holds it, up to twice its class, is reused; ``exact``: only
        one of its own class (a buffer held for long, as staged KV is, then holds at most 25% over its bytes,
        not twice them: staging counts the tensor's bytes)."""
        if not self._reuse:
            return torch.empty(tuple(shape), dtype=dtype, device=self.device)
        shape = tuple(shape)
        capacity = capacity_class(math.prod(shape) * dtype.itemsize)
        storage = None
        with self._lock:
            for fit in (capacity,) if exact else _classes_up_to_twice(capacity):
                stack = self._free.get(fit)
                if stack:
                    storage, last = stack.pop()
                    del self._order[storage.data_ptr()]
                    self._cached -= fit
                    self._lend(storage)
                    if last is not None and last.shape == shape and last.dtype == dtype:
                        return last
                    break
        # A normal tensor even under vLLM's inference mode: an inference tensor could not be written outside it.
        with torch.inference_mode(False):
            if storage is None:
                storage = torch.empty(capacity, dtype=torch.uint8, device=self.device).untyped_storage()
                with self._lock:
                    self._lend(storage)
            return torch.empty(0, dtype=dtype, device=self.device).set_(storage, 0, shape)

    def _lend(self, storage: torch.UntypedStorage) -> None:
        # A buffer dropped without give() counts as out until its memory comes back from an allocation here.
        self._lent_bytes += storage.nbytes() - self._lent.get(storage.data_ptr(), 0)
        self._lent[storage.data_ptr()] = storage.nbytes()
        self._roll()
        self._peaks[1] = max(self._peaks[1], self._lent_bytes)

    def give(self, tensor: torch.Tensor) -> None:
        """Take back a buffer from :meth:`take` that nothing uses any more (a no-op off the CPU).

        At most ``max_cached_bytes``, and at most ``KEEP_PEAKS`` times :attr:`recent_peak_bytes`, stay
        cached, the least recently given dropped first. Free buffers beyond what is out at once could never
        all be reused at once: with requests of varied lengths they would pile up class by class, each
        class keeping the most it ever needed (measured: the wire cache of a 2P2D soak grew 33 -> 47 MiB
        between requests 200 and 1000). The window lets the bound follow the load down as well as up.
        """
        if not self._reuse or tensor.device != self.device:
            return
        storage = tensor.untyped_storage()
        key = storage.data_ptr()  # storage objects are wrappers made per call; the memory is what counts
        # Kept as it is only if it is as taken: the whole buffer from its start, and not an inference tensor.
        view = tensor if tensor.data_ptr() == key and tensor.is_contiguous() and not tensor.is_inference() else None
        with self._lock:
            capacity = self._lent.pop(key, None)
            if capacity is None:
                return  # not one of ours, or given twice: keep it once
            self._lent_bytes -= capacity
            keep = self._keep_locked()
            if capacity > keep:
                return
            self._free.setdefault(capacity, []).append((storage, view))
            self._order[key] = capacity
            self._cached += capacity
            while self._cached > keep:  # drop the least recently given
                old_id, old_capacity = self._order.popitem(last=False)
                stack = self._free[old_capacity]
                stack.pop(next(i for i, (s, _) in enumerate(stack) if s.data_ptr() == old_id))
                self._cached -= old_capacity

    def forget(self, tensor: torch.Tensor) -> None:
        """Stop counting ``tensor``'s buffer as out, without reusing it: a failed send or receive may leave it
        with the backend, which could still read or write it. Counted as out, it would hold the cache's bound
        (twice the recent peak) up for good; its memory goes with the last reference to it."""
        if not self._reuse or tensor.device != self.device:
            return
        with self._lock:
            capacity = self._lent.pop(tensor.untyped_storage().data_ptr(), None)
            if capacity is not None:
                self._lent_bytes -= capacity

    def clear(self) -> None:
        with self._lock:
            self._free.clear()
            self._order.clear()
            self._cached = 0
