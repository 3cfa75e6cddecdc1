"""What the channel tests share: the channel threads alive now, waiting for a condition with a deadline, and a
raw ZMQ DEALER playing a peer (or an intruder) by hand."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator

import zmq

from ncclkv.channel import THREAD_PREFIX

__all__ = ["channel_threads", "raw_dealer", "wait_until"]


def channel_threads() -> list[str]:
    """Names of the live threads any channel started (I/O, dispatcher, ZAP)."""
    return [t.name for t in threading.enumerate() if t.name.startswith(THREAD_PREFIX)]


def wait_until(predicate: Callable[[], bool], timeout_s: float, poll_s: float = 0.005) -> None:
    """Poll ``predicate`` until it holds; fail the test if it does not within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"condition not met within {timeout_s}s"
        time.sleep(poll_s)


@contextlib.contextmanager
def raw_dealer(address: str, routing_id: bytes) -> Iterator[zmq.Socket]:
    """A DEALER connected to ``address`` under ``routing_id``, in a context of its own, closed after."""
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTING_ID, routing_id)
        sock.connect(address)
        yield sock
    finally:
        sock.close(linger=0)
        context.term()
