"""The store buffer: tensors by string key, bounded in bytes, LRU eviction."""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from ._base import LockedLRU
from ._lru import held_nbytes, report_evicted, views_note

__all__ = ["KVStoreBuffer"]


class KVStoreBuffer(LockedLRU[str, torch.Tensor]):
    """A thread-safe key -> tensor store honouring the seed's ``KVStoreBufferBase``.

    ``put(key, tensor)`` stores (replacing any previous tensor of that key),
    ``put(key, None)`` deletes, ``get(key)`` returns the tensor or None and
    makes it the most recently used. The bytes the stored tensors hold (each
    storage whole: a view keeps its base alive) never exceed ``capacity_bytes``: beyond it the least recently used entries are
    evicted (``evict=True``) and reported to ``on_evict(key, tensor)`` after
    the lock is released, or the put is refused with CapacityError
    (``evict=False``). A tensor larger than the capacity is always refused, and
    a refused put leaves the store unchanged. Tensors are stored by reference,
    not copied.

    After ``close()`` every put/get raises ClosedError; ``len``, ``used_bytes``
    and ``stats`` still answer (0 entries).
    """

    def __init__(
        self,
        capacity_bytes: int,
        *,
        evict: bool = True,
        on_evict: Callable[[str, torch.Tensor], None] | None = None,
    ) -> None:
        super().__init__("KVStoreBuffer", capacity_bytes, evict)
        self._on_evict = on_evict
        # For callers that keep one object as several entries (ncclkv.blend's chunks: a layer each, then its
        # positions): held around the whole group, it keeps a reader from mixing two writes of the object.
        # Never taken by put/get themselves.
        self.group_lock = threading.RLock()

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._lru

    def put(self, key: str, value: torch.Tensor | None, *, nbytes: int | None = None) -> None:
        """Store ``value`` under ``key`` (None: delete). ``nbytes``: what to count it as, for a caller that
        accounts for its storage elsewhere (the engine's staging: a wire buffer's class slack belongs to the
        wire pool, and a push reserved its tensors' bytes); default, the storage it holds."""
        if not isinstance(key, str):
            raise TypeError(f"key must be a str, got {type(key).__name__} {key!r}")
        if value is not None and not isinstance(value, torch.Tensor):
            raise TypeError(f"value for key {key!r} must be a torch.Tensor or None, got {type(value).__name__}")
        if nbytes is None:
            nbytes = held_nbytes(value)  # a view counts its whole storage: the entry keeps it alive
        elif isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"nbytes for key {key!r} must be an int >= 0, got {nbytes!r}")
        with self._lock:
            self._check_open()
            if value is None:
                self._lru.pop(key)
                return
            # Check before removing the old value, so a refusal changes nothing.
            self._lru.check_fits(nbytes, freed=self._lru.nbytes_of(key), detail=views_note(nbytes, value))
            self._lru.pop(key)
            evicted = self._lru.add(key, value, nbytes)
        if self._on_evict is not None:
            callback = self._on_evict
            report_evicted(lambda item: callback(*item), evicted)

    def get(self, key: str) -> torch.Tensor | None:
        with self._lock:
            self._check_open()
            value = self._lru.get(key)
            if value is None:
                self._lru.misses += 1
                return None
            self._lru.hits += 1
            self._lru.touch(key)
            return value
