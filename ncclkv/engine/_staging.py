"""Staging events: the KV a consumer rank holds in its staging store for pushes, as a stream of events.

A push that lands before its decode request exists waits in the consumer's
staging store, outside the engine's paged blocks. Each consumer rank reports
``stored`` once every tensor it is to receive for that push has landed there,
and ``removed`` when that KV leaves staging again (taken by :meth:`expect`,
dropped after ``hold_s``, or failed). The events name the KV by the prompt's
full blocks (:class:`BlockTokens`, sent by the producer in its offer) and
their :mod:`ncclkv.hashing` hashes, so an index outside this process can tell
which prefixes are staged where. Pushes whose producer did not name the
blocks, and KV that goes straight into expected blocks, are not reported.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from ..hashing import BlockHash, as_token_ids, hash_request_tokens
from ._config import is_int

__all__ = ["MAX_PENDING_EVENTS", "BlockTokens", "RemovalReason", "StagingEvent", "StagingLog", "StagingName"]

log = logging.getLogger("ncclkv.engine")

MAX_PENDING_EVENTS = 4096  # events not yet taken; beyond it the oldest are dropped (and counted)

EventKey = str | int | None
StagingKind = Literal["stored", "removed"]
RemovalReason = Literal["taken", "expired", "failed"]


@dataclass(frozen=True, slots=True)
class BlockTokens:
    """The full blocks of a pushed prompt: their ``token_ids`` (a multiple of ``block_size``, the
    producer's block size) and the ``extra_keys`` hashed with every block (e.g. LoRA name, cache salt)."""

    token_ids: tuple[int, ...]
    block_size: int
    extra_keys: tuple[EventKey, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "token_ids", as_token_ids(self.token_ids))
        object.__setattr__(self, "extra_keys", tuple(self.extra_keys))
        if not is_int(self.block_size) or self.block_size < 1:
            raise ValueError(f"block_size must be an int >= 1, got {self.block_size!r}")
        if len(self.token_ids) % self.block_size:
            raise ValueError(f"{len(self.token_ids)} token ids are not whole blocks of {self.block_size}")
        for index, key in enumerate(self.extra_keys):
            if not (key is None or isinstance(key, str) or is_int(key)):
                raise ValueError(f"extra_keys[{index}] must be str, int or None, got {type(key).__name__} {key!r}")

    @classmethod
    def of_prompt(cls, token_ids: Sequence[int], block_size: int,
                  extra_keys: Sequence[EventKey] = ()) -> BlockTokens:
        """The full blocks of ``token_ids``; a partial last block is left out (it has no hash)."""
        if not is_int(block_size) or block_size < 1:
            raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
        num_full = len(token_ids) // block_size * block_size
        return cls(tuple(token_ids[:num_full]), block_size, tuple(extra_keys))

    @property
    def num_blocks(self) -> int:
        return len(self.token_ids) // self.block_size

    def hashes(self) -> tuple[BlockHash, ...]:
        """The chained :mod:`ncclkv.hashing` hash of each block (the same in every process)."""
        return tuple(hash_request_tokens(self.block_size, self.token_ids, self.extra_keys))


@dataclass(frozen=True, slots=True)
class StagingEvent:
    """One change of a consumer rank's staging store. ``reason`` says why a ``removed`` KV left
    (``taken`` by its request, ``expired`` after ``hold_s``, ``failed``); None for ``stored``."""

    kind: StagingKind
    transfer_id: str
    block_hashes: tuple[BlockHash, ...]
    token_ids: tuple[int, ...]
    block_size: int
    extra_keys: tuple[EventKey, ...]
    reason: RemovalReason | None = None


class StagingName:
    """One staged push's blocks, shared by its stored and removed events; hashed once, when first taken."""

    __slots__ = ("_hashes", "blocks", "transfer_id")

    def __init__(self, transfer_id: str, blocks: BlockTokens) -> None:
        self.transfer_id, self.blocks = transfer_id, blocks
        self._hashes: tuple[BlockHash, ...] | None = None

    def event(self, kind: StagingKind, reason: RemovalReason | None) -> StagingEvent:
        if self._hashes is None:  # off the receive thread: the taker pays for the hashing
            self._hashes = self.blocks.hashes()
        b = self.blocks
        return StagingEvent(kind, self.transfer_id, self._hashes, b.token_ids, b.block_size, b.extra_keys, reason)


class StagingLog:
    """Events recorded by the consumer (under its lock, cheap) and taken by the engine's user."""

    def __init__(self, max_pending: int = MAX_PENDING_EVENTS) -> None:
        self._lock = threading.Lock()
        self._pending: deque[tuple[StagingName, StagingKind, RemovalReason | None]] = deque()
        self._max_pending = max_pending
        self.num_dropped = 0

    def stored(self, transfer_id: str, blocks: BlockTokens) -> StagingName:
        """Record that ``blocks`` of ``transfer_id`` are all in staging; pass the result to :meth:`removed`."""
        name = StagingName(transfer_id, blocks)
        self._add(name, "stored", None)
        return name

    def removed(self, name: StagingName, reason: RemovalReason) -> None:
        self._add(name, "removed", reason)

    def take(self) -> list[StagingEvent]:
        """Every event recorded since the last call, in order."""
        with self._lock:
            pending, self._pending = self._pending, deque()
        return [name.event(kind, reason) for name, kind, reason in pending]

    def _add(self, name: StagingName, kind: StagingKind, reason: RemovalReason | None) -> None:
        with self._lock:
            if len(self._pending) >= self._max_pending:  # nobody takes them: keep memory bounded
                self._pending.popleft()
                self.num_dropped += 1
                if self.num_dropped == 1:
                    log.warning("staging events are not being taken; dropping the oldest beyond %d",
                                self._max_pending)
            self._pending.append((name, kind, reason))
