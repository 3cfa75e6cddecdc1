"""Declines: pulls of nothing that tell producer ranks this consumer rank will not take a request.

A producer rank holds a finished request's blocks until every consumer rank
pulled it or declined it, or ``hold_s`` passed; a decline lets it free them
now. Declines are best effort and wait on producers that may be gone, so they
run on threads of their own, never on the executor that pulls: a lane per
producer rank (one that does not answer delays only its own declines, and
those queued behind a lost one are dropped, see ``fail_fast``), and a bounded
queue (past it a decline is dropped: ``hold_s`` frees the blocks anyway).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

from .._affinity import pin_this_thread
from ._config import EngineRef
from ._tasks import PeerTasks, fail_fast, submit_task

__all__ = ["MAX_DECLINES_QUEUED", "Decliner"]

log = logging.getLogger("ncclkv.engine")

MAX_DECLINES_QUEUED = 256  # declines waiting to go out; past it a decline is dropped (hold_s frees the blocks)
_DECLINE_THREADS = 8  # declines to this many producer ranks at once; past it, their lanes take turns


class Decliner:
    """Sends declines in a lane per producer rank, at most ``MAX_DECLINES_QUEUED`` queued.

    ``send(request_id, producer, src, hold)`` sends producer rank ``src`` a pull of nothing (for the hold of
    the id numbered ``hold``, 0: not named) and returns once it is acknowledged; ``lost(peer_id, address,
    incarnation)``: the peer's life at that address (the life the reference names, 0: none) is gone, given up by
    the channel there or restarted elsewhere (its decline is skipped); ``alive(peer_id)``: the channel hears it
    (see ``fail_fast``).
    """

    def __init__(self, name: str, send: Callable[[str, EngineRef, int, int], object],
                 lost: Callable[[str, str, int], bool],
                 alive: Callable[[str], bool], cpus: frozenset[int] | None = None) -> None:
        self._send, self._lost, self._alive = send, lost, alive
        self._lanes = PeerTasks(_DECLINE_THREADS, name, initializer=pin_this_thread, initargs=(cpus,))
        self._lock = threading.Lock()
        self._queued = 0

    @property
    def queued(self) -> int:
        """Declines queued or being sent."""
        with self._lock:
            return self._queued

    def queue(self, request_id: str, producer: EngineRef, srcs: Sequence[int], hold: int = 0) -> None:
        """Queue a decline of ``request_id`` (its hold numbered ``hold``) to each of ``srcs`` (ranks of
        ``producer``), in that rank's lane; all of them, or none when the queue has no room for them."""
        with self._lock:
            if self._queued + len(srcs) > MAX_DECLINES_QUEUED:
                log.info("not declining %s: %d declines already queued (its producer frees it after hold_s)",
                         request_id, self._queued)
                return
            self._queued += len(srcs)
        for src in srcs:
            # on_error: a decline its lane fails before it runs (its producer found lost, or closing) is not queued
            submit_task(self._lanes, f"decline of {request_id} to {producer.peer_id(src)}", self._unqueue,
                        self._decline, request_id, producer, src, hold, peer=producer.peer_id(src),
                        at=producer.control_addrs[src])

    def close(self) -> None:
        """Drop the declines not started; wait for those running (they end with the channel's close)."""
        self._lanes.shutdown(wait=True, cancel_futures=True)

    def _unqueue(self, _: BaseException | None = None) -> None:
        """One queued decline went (sent, or failed by its lane before it ran)."""
        with self._lock:
            self._queued -= 1

    def _decline(self, request_id: str, producer: EngineRef, src: int, hold: int) -> None:
        """In producer rank ``src``'s lane: decline to it, best effort; a lost one is skipped."""
        peer_id = producer.peer_id(src)
        try:
            if self._lost(peer_id, producer.control_addrs[src], producer.incarnation(src)):
                log.info("not declining %s to %s: it was lost (it frees the blocks after hold_s)", request_id, peer_id)
                return
            self._send(request_id, producer, src, hold)
        except Exception as err:
            log.warning("empty pull (declined) of %s from %s failed: %s", request_id, peer_id, err)
            # The declines queued behind it for a producer that does not answer are dropped, not each waited on.
            fail_fast(self._lanes, peer_id, err, self._alive, at=producer.control_addrs[src])
        finally:
            self._unqueue()
