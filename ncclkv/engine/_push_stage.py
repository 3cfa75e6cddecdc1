"""A consumer rank's staged pushes: tensors pushed before their request is expected here.

An accepted push offer reserves staging bytes (``staging_bytes`` in all);
its tensors land in a :class:`~ncclkv.buffer.KVStoreBuffer` until ``expect``
takes them, or the push fails or expires and gives everything back at once
(reservation, stored tensors, their wire buffers). A failed push stays as a
tombstone (``StagedPush.error``) until it expires, so its late tensors are
drained and its later offers refused. ``stored``/``removed`` staging events
(:mod:`._staging`) pair up for every push that named its blocks.

Not thread-safe on its own: the consumer calls every method under its lock
(which also guards the requests these pushes turn into), except
:meth:`PushStage.take_events` (the events log has a lock of its own) and
:meth:`PushStage.close`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from ..buffer import KVStoreBuffer
from ..layout import Route, Span, SpanSet
from ._staging import BlockTokens, RemovalReason, StagingEvent, StagingLog, StagingName

__all__ = ["PushStage", "SliceKey", "StagedPush", "StagedTensor"]

SliceKey = tuple[int, int, Route]  # (src rank, layer, route)
StagedTensor = tuple[SliceKey, Span, torch.Tensor]  # (slice, token piece, its wire buffer) taken from staging


@dataclass(slots=True)
class StagedPush:
    """A pushed request whose blocks do not exist yet: its tensors wait in the staging store."""

    producer_engine_id: str
    since: float
    keys: set[SliceKey] = field(default_factory=set)
    announced: dict[SliceKey, SpanSet] = field(default_factory=dict)
    landed: list[tuple[SliceKey, Span]] = field(default_factory=list)  # (slice, token piece) in the store
    landed_tokens: dict[SliceKey, int] = field(default_factory=dict)  # tokens of each slice in the store
    covered: dict[int, int] = field(default_factory=dict)  # producer rank -> its slices whose every token landed
    reserved: int = 0
    error: BaseException | None = None
    num_tokens: int = 0  # the tokens its offers say the push carries
    # Producer rank -> the slices this rank receives from it for the push (the plan's, known at the first offer):
    # a loss of a producer rank fails the push only while that rank still owes it some (see owes).
    wanted: dict[int, int] = field(default_factory=dict)
    blocks: BlockTokens | None = None  # what the staging events name (None: not reported)
    reported: StagingName | None = None  # set while a "stored" event stands for it
    # The request expect() made of it (the consumer's, opaque here): its tensors announced while staged and
    # still on the way land there, and in no other request under its id.
    taken_by: object | None = None

    @property
    def complete(self) -> bool:
        """Every slice this rank receives for the push landed: it needs nothing more from anyone."""
        return not any(self.owes(src) for src in self.wanted)

    def owes(self, src: int) -> bool:
        """Whether producer rank ``src`` has slices of the push still to land here."""
        return self.covered.get(src, 0) < self.wanted.get(src, 0)


def _store_key(request_id: str, key: SliceKey, piece: Span) -> str:
    src, layer, route = key
    return f"{request_id}|{src}|{layer}|{route}|{piece}"


class PushStage:
    """The staged pushes of one consumer rank, by request id (see the module docstring)."""

    def __init__(self, capacity_bytes: int, recycle: Callable[[torch.Tensor], None]) -> None:
        self._pushes: dict[str, StagedPush] = {}
        self._reserved = 0  # staging bytes promised to accepted push offers
        self.store = KVStoreBuffer(capacity_bytes, evict=False)  # read, never written, outside (stats, tests)
        self._recycle = recycle  # hands a wire buffer back to its pool
        self._log = StagingLog()

    def get(self, request_id: str) -> StagedPush | None:
        return self._pushes.get(request_id)

    def items(self) -> list[tuple[str, StagedPush]]:
        return list(self._pushes.items())

    @property
    def capacity_bytes(self) -> int:
        return self.store.capacity_bytes

    @property
    def reserved_bytes(self) -> int:
        return self._reserved

    def reserve(self, request_id: str, producer_engine_id: str, now: float, num_tokens: int, wanted: dict[int, int],
                blocks: BlockTokens | None, keys: set[SliceKey], nbytes: int) -> None:
        """Stage one producer rank's offer of ``request_id`` (the first one stages the push; ``wanted``: the slices
        this rank receives from each producer rank); the caller checked that ``nbytes`` fit."""
        staged = self._pushes.get(request_id)
        if staged is None:
            staged = self._pushes[request_id] = StagedPush(producer_engine_id, now, num_tokens=num_tokens,
                                                           wanted=wanted, blocks=blocks)
        elif staged.blocks != blocks:  # producer ranks disagree on what they push: report nothing
            staged.blocks = None
        staged.keys |= keys
        staged.reserved += nbytes
        self._reserved += nbytes

    def put(self, request_id: str, key: SliceKey, piece: Span, buf: torch.Tensor) -> None:
        """A landed tensor goes into the store, which holds ``buf`` once this returns (then call :meth:`landed`:
        apart, so the caller knows who holds ``buf`` should the bookkeeping fail)."""
        # Counted as the push reserved it, its bytes: the buffer's class slack is the wire pool's.
        self.store.put(_store_key(request_id, key, piece), buf, nbytes=buf.nbytes)

    def landed(self, request_id: str, staged: StagedPush, key: SliceKey, piece: Span) -> None:
        """Count a tensor :meth:`put` in the store for ``staged``; "stored" is reported once every one landed."""
        staged.landed.append((key, piece))
        # Announced pieces of a slice lie inside its route and never overlap: a count suffices.
        count = staged.landed_tokens[key] = staged.landed_tokens.get(key, 0) + len(piece)
        if count == len(key[2].tokens):
            staged.covered[key[0]] = staged.covered.get(key[0], 0) + 1
        if staged.reported is None and staged.blocks is not None and staged.error is None and staged.complete:
            staged.reported = self._log.stored(request_id, staged.blocks)  # once every tensor landed

    def take(self, request_id: str) -> tuple[StagedPush, list[StagedTensor]] | None:
        """Unstage ``request_id`` for its expect(): the push and its tensors, which the caller scatters or
        recycles (they are wire buffers); its reservation is given back. None if nothing is staged."""
        staged = self._pushes.pop(request_id, None)
        if staged is None:
            return None
        return staged, self._unstore(request_id, staged)

    def fail(self, request_id: str, staged: StagedPush, error: BaseException) -> None:
        """``staged`` can no longer be used: it gives back its staging at once and stays as a tombstone until
        it expires: its late tensors are drained, later offers refused, and an expect() fails with ``error``."""
        if staged.error is None:
            staged.error = error
        self.report_removed(staged, "failed")
        self._give_back(request_id, staged)

    def expire(self, now: float, hold_s: float) -> Iterator[tuple[str, StagedPush]]:
        """Drop the pushes staged more than ``hold_s`` ago (never expected here), giving back their staging;
        each is yielded once dropped, before the next is (the caller records each in turn)."""
        expired = [(request_id, staged) for request_id, staged in self._pushes.items() if now - staged.since > hold_s]
        for request_id, staged in expired:
            self._give_back(request_id, staged)
            del self._pushes[request_id]
            self.report_removed(staged, "expired")
            yield request_id, staged

    def report_removed(self, staged: StagedPush, reason: RemovalReason) -> None:
        """The staged KV left (or is no longer usable): pair its "stored" event."""
        if staged.reported is not None:
            self._log.removed(staged.reported, reason)
            staged.reported = None

    def take_events(self) -> list[StagingEvent]:
        return self._log.take()

    def clear(self) -> None:
        """Closing: forget every push (the store's tensors go with :meth:`close`)."""
        self._pushes.clear()
        self._reserved = 0

    def close(self) -> None:
        self.store.close()

    def _give_back(self, request_id: str, staged: StagedPush) -> None:
        """``staged``'s reservation, its tensors in the store and their wire buffers."""
        for _, _, tensor in self._unstore(request_id, staged):
            self._recycle(tensor)

    def _unstore(self, request_id: str, staged: StagedPush) -> list[StagedTensor]:
        """Give back ``staged``'s reservation and take its tensors out of the store."""
        self._reserved -= staged.reserved
        staged.reserved = 0
        taken: list[StagedTensor] = []
        for key, piece in staged.landed:
            store_key = _store_key(request_id, key, piece)
            tensor = self.store.get(store_key)
            self.store.put(store_key, None)
            if tensor is not None:
                taken.append((key, piece, tensor))
        staged.landed.clear()
        return taken
