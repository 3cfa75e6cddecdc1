"""KV events of the connector: pushed KV waiting in a decode engine's staging store, as vLLM events.

vLLM reports the blocks of its own KV cache itself (loaded ones included,
once they are in its prefix cache). What it cannot see is KV that a prefill
engine pushed and that waits in ncclkv's staging store, outside vLLM's block
pool, until its decode request comes (or ``hold_s`` passes). Each worker
turns its engine's staging events (:meth:`TransferEngine.take_staging_events`)
into ``BlockStored`` / ``BlockRemoved`` with ``medium="ncclkv_staging"`` and
ncclkv's stable block hashes; vLLM merges the workers' containers each step
and hands them to the scheduler role, which yields an event once every worker
reported it (workers may land the same push in different steps).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence

from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent, KVConnectorKVEvents

from ..engine import StagingEvent

__all__ = ["LOCALITY", "MEDIUM", "EventGatherer", "NcclKVEvents", "to_vllm_events"]

log = logging.getLogger("ncclkv.connector")

MEDIUM = "ncclkv_staging"
LOCALITY = "LOCAL"  # held in this engine's own memory


def to_vllm_events(events: Sequence[StagingEvent]) -> list[KVCacheEvent]:
    """vLLM's events for a worker's staging events. The connector hashes ``(lora_name, cache_salt)``
    with every block (``_scheduler.extra_keys``): the first extra key is the LoRA name."""
    out: list[KVCacheEvent] = []
    for event in events:
        hashes = [h.digest for h in event.block_hashes]
        if event.kind == "stored":
            lora = event.extra_keys[0] if event.extra_keys and isinstance(event.extra_keys[0], str) else None
            out.append(BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=list(event.token_ids),
                                   block_size=event.block_size, lora_id=None, medium=MEDIUM, lora_name=lora,
                                   locality=LOCALITY))
        else:
            out.append(BlockRemoved(block_hashes=hashes, medium=MEDIUM, locality=LOCALITY))
    return out


class NcclKVEvents(KVConnectorKVEvents):
    """The events of one step of one or more workers, each worker's in its order.

    vLLM's output aggregator merges the workers' containers into the first
    (``add_events`` + ``increment_workers``); a plain list keeps every
    worker's stored-before-removed order, which a counter would not.
    """

    def __init__(self, events: Iterable[KVCacheEvent] = (), num_workers: int = 1) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        self._events: list[KVCacheEvent] = list(events)
        self._num_workers = num_workers

    def add_events(self, events: list[KVCacheEvent]) -> None:
        self._events.extend(events)

    def aggregate(self) -> NcclKVEvents:
        """Keep the events every worker reported (once each, first-seen order), as one worker's."""
        counts: dict[KVCacheEvent, int] = {}
        for event in self._events:
            counts[event] = counts.get(event, 0) + 1
        self._events = [event for event, count in counts.items() if count >= self._num_workers]
        self._num_workers = 1
        return self

    def increment_workers(self, count: int = 1) -> None:
        if count < 1:
            raise ValueError(f"count must be >= 1, got {count}")
        self._num_workers += count

    def get_all_events(self) -> list[KVCacheEvent]:
        return list(self._events)

    def get_number_of_workers(self) -> int:
        return self._num_workers

    def clear_events(self) -> None:
        self._events = []
        self._num_workers = 1

    def __len__(self) -> int:
        return len(self._events)

    def __repr__(self) -> str:
        return f"NcclKVEvents(workers={self._num_workers}, events={self._events!r})"


class EventGatherer:
    """Scheduler side: yield an event once ``num_workers`` reports of it came, over any number of steps.

    Equal events count together (vLLM's events carry no transfer id), so two
    pushes of the same prompt may be yielded one early; each is yielded once.
    Reports that never reach every worker (a rank that received the push
    straight into its blocks reports nothing) are forgotten after
    ``horizon_s``, so memory stays bounded.
    """

    def __init__(self, horizon_s: float) -> None:
        self._horizon_s = horizon_s
        self._seen: dict[KVCacheEvent, tuple[int, float]] = {}  # event -> (reports, first seen)
        self._ready: list[KVCacheEvent] = []

    def add(self, events: Iterable[KVCacheEvent], num_workers: int) -> None:
        now = time.monotonic()
        # Dropped before these are counted: an old report is not counted with a new push's.
        stale = [event for event, (_, since) in self._seen.items() if now - since > self._horizon_s]
        for event in stale:
            del self._seen[event]
        if stale:
            log.debug("ncclkv: %d staging events not reported by every worker within %ss: dropped",
                      len(stale), self._horizon_s)
        for event in events:
            count, since = self._seen.get(event, (0, now))
            if count + 1 >= num_workers:
                self._seen.pop(event, None)
                self._ready.append(event)
            else:
                self._seen[event] = (count + 1, since)

    def take(self) -> list[KVCacheEvent]:
        ready, self._ready = self._ready, []
        return ready

    @property
    def num_pending(self) -> int:
        return len(self._seen)
