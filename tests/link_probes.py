"""Test helpers for links: both ends of a link opened at once, and a link's threads held still, so who posts
what can be asserted, not raced."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ncclkv.transport import Link, LinkFactory

__all__ = ["OPEN_WAIT_S", "PARK_TIMEOUT_S", "open_both", "sleepy_poster"]

PARK_TIMEOUT_S = 10.0
OPEN_WAIT_S = 10.0


def open_both(plane0: LinkFactory, plane1: LinkFactory, link_id: str, store: str, timeout_s: float = OPEN_WAIT_S,
              **options: Any) -> tuple[Link, Link]:
    """Open ``link_id`` on CPU between two planes at once, link rank 0 on ``plane0``, each open with ``timeout_s``
    (and ``options``: ``op_timeout_s``, ``max_in_flight``, ...)."""
    with ThreadPoolExecutor(2) as pool:
        f0 = pool.submit(plane0.open_link, link_id, 0, store, "cpu", timeout_s, **options)
        f1 = pool.submit(plane1.open_link, link_id, 1, store, "cpu", timeout_s, **options)
        wait_s = max(timeout_s, OPEN_WAIT_S)
        return f0.result(wait_s), f1.result(wait_s)


class _Deaf(threading.Condition):
    """A condition nobody can wake until :meth:`hear` is called: until then ``notify`` does nothing.

    ``Condition.notify_all`` calls ``self.notify``, so both go deaf and both hear again together.
    """

    def __init__(self, lock: threading.Lock) -> None:
        super().__init__(lock)
        self._hearing = False
        self.asleep = threading.Event()  # set by the first wait; the waiter holds the lock until it sleeps

    def wait(self, timeout: float | None = None) -> bool:
        self.asleep.set()
        return super().wait(timeout)

    def notify(self, n: int = 1) -> None:
        if self._hearing:
            super().notify(n)

    def hear(self) -> None:
        """Wake every waiter and pass later notifications on; with the lock held."""
        self._hearing = True
        self.notify_all()


@contextlib.contextmanager
def sleepy_poster(link: Link) -> Iterator[None]:
    """While inside, ``link``'s send poster sleeps through every wake-up (it waits on a condition the pipe no
    longer notifies), as if it were never scheduled; on exit it is woken and works as before. Entering
    returns once the poster sleeps.

    Asleep means: asleep until its own timeout, if it has one. A framed link's poster waits with a
    timeout while a part-full header waits for its grace period, so a test makes sure none does (its
    earlier sends landed) before it relies on the poster's sleep.
    """
    pipe = link._pipes[0]  # noqa: SLF001 - what these tests observe is the poster's part
    awake = pipe._posting  # noqa: SLF001
    deaf = _Deaf(pipe._lock)  # noqa: SLF001
    with pipe._lock:  # noqa: SLF001
        pipe._posting = deaf  # noqa: SLF001
        awake.notify_all()  # a poster asleep on the old condition comes round and sleeps on the deaf one
    try:
        # A poster still in its loop (it just posted the last send) would take the next send without
        # being woken: wait until it sleeps. It calls wait() holding the pipe's lock, so any submit
        # after this returns finds it asleep.
        if not deaf.asleep.wait(PARK_TIMEOUT_S):
            raise TimeoutError(f"{link!r}: its poster did not go to sleep within {PARK_TIMEOUT_S} s")
        yield
    finally:
        with pipe._lock:  # noqa: SLF001
            pipe._posting = awake  # noqa: SLF001
            awake.notify_all()
            # The poster may have gone back to sleep on the deaf one meanwhile (it looks the condition up
            # each time it waits): wake it there too, or it would never see a later send, nor close().
            deaf.hear()
