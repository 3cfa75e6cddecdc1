"""Test helpers that hold a link's threads still, so who posts what can be asserted, not raced."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from ncclkv.transport import Link

__all__ = ["PARK_TIMEOUT_S", "sleepy_poster"]

PARK_TIMEOUT_S = 10.0


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
