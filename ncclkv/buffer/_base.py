"""What both buffers share: a :class:`ByteLRU` behind one lock, its counters, and close."""

from __future__ import annotations

import threading
from typing import Generic, TypeVar

from ..errors import ClosedError
from ._lru import BufferStats, ByteLRU

__all__ = ["LockedLRU"]

K = TypeVar("K")
V = TypeVar("V")


class LockedLRU(Generic[K, V]):
    """A byte-bounded LRU guarded by one lock, with the size, stats and close both buffers expose.

    The lock is a Condition so that a subclass can wait on it (the lookup
    buffer's ``wait_select``); ``close`` wakes every waiter. Subclasses clear
    their own indexes in :meth:`_on_close`, which runs with the lock held.
    """

    def __init__(self, name: str, capacity_bytes: int, evict: bool) -> None:
        self._lru: ByteLRU[K, V] = ByteLRU(name, capacity_bytes, evict)
        self._lock = threading.Condition(threading.Lock())
        self._closed = False

    @property
    def capacity_bytes(self) -> int:
        return self._lru.capacity_bytes

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return self._lru.used_bytes

    @property
    def peak_used_bytes(self) -> int:
        """The most bytes held at once since construction or the last :meth:`reset_peak_used` (a snapshot)."""
        with self._lock:
            return self._lru.peak_used_bytes

    def reset_peak_used(self) -> int:
        """Start a new high-water mark from the bytes held now; return the mark it replaces (read and reset
        under one lock, so no insert between the two is lost)."""
        with self._lock:
            return self._lru.reset_peak()

    @property
    def stats(self) -> BufferStats:
        with self._lock:
            return self._lru.stats()

    @property
    def closed(self) -> bool:
        return self._closed

    def __len__(self) -> int:
        with self._lock:
            return len(self._lru)

    def close(self) -> None:
        """Drop every entry (without reporting them as evicted) and wake waiters; idempotent."""
        with self._lock:
            self._closed = True
            self._lru.clear()
            self._on_close()
            self._lock.notify_all()

    def _on_close(self) -> None:
        """Clear whatever the subclass keeps beside the LRU; called with the lock held."""

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"{self._lru.name} is closed")

    def __repr__(self) -> str:
        return (f"{self._lru.name}({len(self._lru)} entries, {self._lru.used_bytes}/"
                f"{self._lru.capacity_bytes} bytes, evict={self._lru.evict})")
