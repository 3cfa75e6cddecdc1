"""The lookup buffer: KV slices keyed by (input tokens, roi), bounded in bytes, LRU eviction."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .._timeout import check_timeout
from ..errors import TransferTimeout
from ..hashing import BlockHash
from ..layout import KVGeometry, Roi
from ._base import LockedLRU
from ._entry import LookupEntry, PrefixIndex, entry_matches, to_roi, to_token_ids
from ._lru import report_evicted, views_note

__all__ = ["KVLookupBuffer"]

RoiArg = Roi | torch.Tensor | Sequence[bool]


class _Record:
    """An entry plus its index keys and last-use tick (smaller = less recently used)."""

    __slots__ = ("entry", "keys", "tick")

    def __init__(self, entry: LookupEntry, keys: tuple[BlockHash, ...], tick: int) -> None:
        self.entry = entry
        self.keys = keys
        self.tick = tick


@dataclass(frozen=True, slots=True)
class _Query:
    token_ids: tuple[int, ...]
    roi: Roi
    bucket: BlockHash | None
    checked: int  # leading tokens the bucket guarantees equal


class KVLookupBuffer(LockedLRU[int, _Record]):
    """A thread-safe buffer honouring the seed's ``KVLookupBufferBase`` with an roi of tokens x layers x kv-heads.

    ``insert(input_tokens, roi, key, value, hidden)`` stages a slice;
    ``drop_select(input_tokens, roi)`` removes and returns ``[input_tokens,
    roi, key, value, hidden]`` of a matching entry (vLLM's order; the roi it
    holds, which may be more than was asked), or five Nones when none
    matches; ``drop_select(None, None)`` removes and returns the least
    recently used entry (for offloading). ``drop_select_entry`` / ``select`` / ``wait_select``
    return a typed :class:`LookupEntry` instead.

    Match rule: a stored entry matches the asked ``(input_tokens, roi)`` when
    its roi covers the asked roi (every asked token, layer and kv-head) and
    its token ids equal the asked ones on the whole prefix ``[0, stop)``, where
    ``stop`` is one past the asked roi's last token (KV of token i depends on
    tokens 0..i). Tokens after ``stop`` may differ, so a longer stored request
    serves a shorter asked prefix. Among several matches the least recently
    used one is returned. The roi is the entry's label: the buffer returns the
    stored tensors as inserted, and the caller slices the asked part.

    Lookup goes through a :class:`PrefixIndex` of chained block hashes of
    ``index_block_size`` tokens, so a query compares tokens only with entries
    sharing its whole-block prefix (a query shorter than one block scans all).

    Capacity: the bytes the entries' ``key``, ``value`` and ``hidden`` hold
    (each storage whole: a view keeps its base alive) never exceed
    ``capacity_bytes``. Beyond it the least recently used entries are
    evicted and passed to ``on_evict`` after the lock is released
    (``evict=True``), or the insert raises CapacityError (``evict=False``); an
    entry larger than the capacity is always refused. Tensors are stored by
    reference. ``roi`` may also be a boolean token mask (the seed's roi) when
    ``geometry`` is given: it then means all layers and kv-heads.
    """

    def __init__(
        self,
        capacity_bytes: int,
        *,
        evict: bool = True,
        on_evict: Callable[[LookupEntry], None] | None = None,
        geometry: KVGeometry | None = None,
        index_block_size: int = 16,
    ) -> None:
        super().__init__("KVLookupBuffer", capacity_bytes, evict)
        self._index = PrefixIndex(index_block_size)
        self._on_evict = on_evict
        self._geometry = geometry
        self._ids = itertools.count()
        self._ticks = itertools.count()

    def insert(
        self,
        input_tokens: torch.Tensor | Sequence[int],
        roi: RoiArg,
        key: torch.Tensor,
        value: torch.Tensor,
        hidden: torch.Tensor | None = None,
    ) -> None:
        """Stage ``[key, value, hidden]`` for ``(input_tokens, roi)``; wakes ``wait_select`` callers."""
        for name, tensor in (("key", key), ("value", value)):
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"insert: {name} must be a torch.Tensor, got {type(tensor).__name__}")
        if hidden is not None and not isinstance(hidden, torch.Tensor):
            raise TypeError(f"insert: hidden must be a torch.Tensor or None, got {type(hidden).__name__}")
        token_ids = to_token_ids(input_tokens, "insert")
        # drop_select returns the ids as an int64 tensor: one it could not hold would be lost with its entry there
        if token_ids and max(token_ids) >= 2**63:
            too_large = next(i for i, token in enumerate(token_ids) if token >= 2**63)
            raise ValueError(f"insert: input_tokens[{too_large}]={token_ids[too_large]} does not fit in int64, "
                             "which drop_select returns the token ids as")
        roi = to_roi(roi, len(token_ids), self._geometry, "insert")
        entry = LookupEntry(token_ids, roi, key, value, hidden)
        nbytes = entry.nbytes
        with self._lock:  # refuse an oversized entry before hashing anything
            self._check_open()
            self._lru.check_fits(nbytes, detail=views_note(nbytes, key, value, hidden))
        keys = self._index.entry_keys(token_ids, roi)  # hashing outside the lock
        with self._lock:
            self._check_open()
            entry_id = next(self._ids)
            evicted = self._lru.add(entry_id, _Record(entry, keys, next(self._ticks)), nbytes)
            self._index.add(entry_id, keys)
            for old_id, old in evicted:
                self._index.remove(old_id, old.keys)
            self._lock.notify_all()
        report_evicted(self._on_evict, [old.entry for _, old in evicted])

    def drop_select(
        self, input_tokens: torch.Tensor | Sequence[int] | None, roi: RoiArg | None
    ) -> list[torch.Tensor | Roi | None]:
        """The seed's contract, in the order vLLM's lookup buffers return it: ``[input_tokens, roi, key, value,
        hidden]`` of the removed match (see :meth:`LookupEntry.as_list`), else five Nones. The match may cover
        more than was asked: the returned roi says what the tensors hold."""
        entry = self.drop_select_entry(input_tokens, roi)
        return [None] * 5 if entry is None else entry.as_list(self._geometry)

    def drop_select_entry(
        self, input_tokens: torch.Tensor | Sequence[int] | None, roi: RoiArg | None
    ) -> LookupEntry | None:
        """Remove and return a matching entry (any, least recently used, for ``None, None``), or None."""
        if input_tokens is None or roi is None:
            if input_tokens is not None or roi is not None:
                raise ValueError("drop_select: input_tokens and roi must both be None or both be given")
            with self._lock:
                self._check_open()
                item = self._lru.pop_lru()
                if item is None:
                    self._lru.misses += 1
                    return None
                self._index.remove(item[0], item[1].keys)
                self._lru.hits += 1
                return item[1].entry
        query = self._query(input_tokens, roi, "drop_select")
        with self._lock:
            self._check_open()
            return self._take(query, drop=True)

    def select(self, input_tokens: torch.Tensor | Sequence[int], roi: RoiArg) -> LookupEntry | None:
        """Return a matching entry without removing it (it becomes the most recently used), or None."""
        query = self._query(input_tokens, roi, "select")
        with self._lock:
            self._check_open()
            return self._take(query, drop=False)

    def wait_select(self, input_tokens: torch.Tensor | Sequence[int], roi: RoiArg, timeout: float) -> LookupEntry:
        """Like ``drop_select_entry`` but wait up to ``timeout`` seconds for a match to be inserted.

        Raises TransferTimeout past the deadline and ClosedError if the buffer is (or gets) closed.
        """
        check_timeout("wait_select: timeout", timeout)
        query = self._query(input_tokens, roi, "wait_select")
        deadline = time.monotonic() + timeout
        with self._lock:
            self._check_open()
            found = self._take(query, drop=True, count_miss=False)
            while found is None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    self._lru.misses += 1
                    raise TransferTimeout(
                        f"wait_select: no entry for {len(query.token_ids)} tokens, roi {query.roi!r} "
                        f"arrived within {timeout} s"
                    )
                self._lock.wait(remaining)
                self._check_open()
                found = self._take(query, drop=True, count_miss=False)
            return found

    def _on_close(self) -> None:
        self._index.clear()

    def _query(self, input_tokens: torch.Tensor | Sequence[int], roi: RoiArg, what: str) -> _Query:
        token_ids = to_token_ids(input_tokens, what)
        roi = to_roi(roi, len(token_ids), self._geometry, what)
        bucket, checked = self._index.query_key(token_ids, roi)
        return _Query(token_ids, roi, bucket, checked)

    def _take(self, query: _Query, *, drop: bool, count_miss: bool = True) -> LookupEntry | None:
        """Find the least recently used match; drop it or refresh it. Caller holds the lock."""
        # A query shorter than one index block has no bucket: scan everything, oldest first.
        ids = self._lru.keys() if query.bucket is None else self._index.candidates(query.bucket)
        best: tuple[int, _Record] | None = None
        for entry_id in ids:
            record = self._lru.get(entry_id)
            assert record is not None, "index and LRU disagree"
            if (best is None or record.tick < best[1].tick) and entry_matches(
                record.entry, query.token_ids, query.roi, query.checked
            ):
                best = (entry_id, record)
                if query.bucket is None:
                    break  # the full scan runs oldest first: the first match is the LRU one
        if best is None:
            if count_miss:
                self._lru.misses += 1
            return None
        self._lru.hits += 1
        entry_id, record = best
        if drop:
            self._lru.pop(entry_id)
            self._index.remove(entry_id, record.keys)
        else:
            record.tick = next(self._ticks)
            self._lru.touch(entry_id)
        return record.entry
