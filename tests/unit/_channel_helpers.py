"""What the channel tests share: the channel threads alive now, and waiting for a condition with a deadline."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from ncclkv.channel import THREAD_PREFIX

__all__ = ["channel_threads", "wait_until"]


def channel_threads() -> list[str]:
    """Names of the live threads any channel started (I/O, dispatcher, ZAP)."""
    return [t.name for t in threading.enumerate() if t.name.startswith(THREAD_PREFIX)]


def wait_until(predicate: Callable[[], bool], timeout_s: float, poll_s: float = 0.005) -> None:
    """Poll ``predicate`` until it holds; fail the test if it does not within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"condition not met within {timeout_s}s"
        time.sleep(poll_s)
