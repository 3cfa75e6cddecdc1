"""Bounded staging memory: the lookup buffer (by tokens + roi) and the store buffer (by key).

Both count tensor bytes against a capacity fixed at construction, evict the
least recently used entry in O(1) (or refuse with CapacityError when eviction
is off), are safe to use from several threads, and raise ClosedError after
``close()``. Nothing here knows about the network.
"""

from ._entry import LookupEntry, entry_matches
from ._lookup import KVLookupBuffer
from ._lru import BufferStats
from ._store import KVStoreBuffer

__all__ = ["BufferStats", "KVLookupBuffer", "KVStoreBuffer", "LookupEntry", "entry_matches"]
