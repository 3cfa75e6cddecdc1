"""Bounded waits for CUDA events: ``Event.synchronize`` and ``Stream.synchronize`` have no timeout.

A device that stalls would hang whoever synchronizes with it (vLLM's step, a
blend prefetch thread). Events are polled instead, with a deadline; used by
the engine before it reports a load done and by the blend retriever before it
hands a layer over. Standard library and torch only.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Protocol

__all__ = ["wait_events"]

# The first pause between polls, then doubling up to the last: the latency added to a wait whose events are not
# done at once, against the CPU a wait costs; a scatter is nearly always done by the time anyone waits for it.
_POLL_FIRST_S = 20e-6
_POLL_MAX_S = 1e-3


class _Event(Protocol):
    def query(self) -> bool: ...


def wait_events(events: Iterable[_Event], timeout_s: float) -> int:
    """Wait until every one of ``events`` is done on the device, at most ``timeout_s`` in all; return how many were
    still pending at the deadline (0: all done), for the caller to report. Nothing sleeps when they are done."""
    pending = list(events)
    deadline = time.monotonic() + timeout_s
    pause = _POLL_FIRST_S
    while pending:
        pending = [event for event in pending if not event.query()]
        if not pending or time.monotonic() >= deadline:
            break
        time.sleep(pause)
        pause = min(2 * pause, _POLL_MAX_S)
    return len(pending)
