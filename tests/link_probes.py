"""Test helpers that hold a link's threads still, so who posts what can be asserted, not raced."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from ncclkv.transport import Link

__all__ = ["sleepy_poster"]


class _Deaf(threading.Condition):
    """A condition nobody can wake: ``notify`` does nothing."""

    def notify(self, n: int = 1) -> None:
        return None

    def notify_all(self) -> None:
        return None


@contextlib.contextmanager
def sleepy_poster(link: Link) -> Iterator[None]:
    """While inside, ``link``'s send poster sleeps through every wake-up (it waits on a condition the pipe no
    longer notifies), as if it were never scheduled; on exit it is woken and works as before.

    Asleep means: asleep until its own timeout, if it has one. A framed link's poster waits with a
    timeout while a part-full header waits for its grace period, so a test makes sure none does (its
    earlier sends landed) before it relies on the poster's sleep.
    """
    pipe = link._pipes[0]  # noqa: SLF001 - what these tests observe is the poster's part
    awake = pipe._posting  # noqa: SLF001
    deaf = _Deaf(pipe._lock)  # noqa: SLF001
    pipe._posting = deaf  # noqa: SLF001
    try:
        yield
    finally:
        pipe._posting = awake  # noqa: SLF001
        with pipe._lock:  # noqa: SLF001
            awake.notify_all()
            # The poster may have gone back to sleep on the deaf one meanwhile (it looks the condition up
            # each time it waits): wake it there too, or it would never see a later send, nor close().
            threading.Condition.notify_all(deaf)
