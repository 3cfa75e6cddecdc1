"""Deadlines that count only the time this process could run.

A whole host can stop for seconds (a VM that loses its CPUs, page
compaction, a debugger, SIGSTOP): every thread of every process on it stops,
and when they resume every ``time.monotonic()`` deadline has passed at once.
Peers that were stopped just as long would then be declared lost and their
transfers failed, although no message was ever late. So a channel's I/O
loop, which turns at least every ``tick_s``, measures its own gaps: a turn
that comes more than ``PAUSE_THRESHOLD_S`` late counts as a pause, and
:meth:`ActiveClock.now` leaves pauses out. Liveness and request deadlines
run on that clock. A peer that is really gone still fails after the deadline
of time we were able to listen.

A waiter can wake from its own timeout before the I/O thread has run since
the pause and counted it; :meth:`ActiveClock.settle` waits (briefly) for the
next turn, so a deadline is judged only after the pause is on the books.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from typing import NamedTuple

__all__ = ["PAUSE_THRESHOLD_S", "ActiveClock", "Turn"]

PAUSE_THRESHOLD_S = 1.0  # a loop turn later than this is a pause, not a slow turn
# Longest wait for the loop's next turn: it turns every tick_s <= 0.1 s when it gets a core; on a
# loaded host it may need seconds, and a deadline must not be judged before it did.
_SETTLE_S = 5.0


class Turn(NamedTuple):
    """What :meth:`ActiveClock.tick` saw: the clock at the turn, and the pause that turn ended."""

    now: float
    paused_s: float


class ActiveClock:
    """``monotonic()`` minus the pauses the owning loop observed; thread-safe.

    ``tick()`` is called by one loop thread once per turn; everything else by any thread.
    """

    def __init__(self, tick_s: float, threshold_s: float = PAUSE_THRESHOLD_S,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        if not (math.isfinite(tick_s) and math.isfinite(threshold_s) and 0 < tick_s < threshold_s):
            raise ValueError(f"need 0 < tick_s < threshold_s, got tick_s={tick_s}, threshold_s={threshold_s}")
        self._tick_s = tick_s
        self._threshold_s = threshold_s
        self._monotonic = monotonic
        self._turned = threading.Condition()
        self._turns = 0
        self._last_turn: float | None = None
        self._paused_s = 0.0
        self._pauses = 0

    @property
    def tick_s(self) -> float:
        """The longest the owning loop waits between turns."""
        return self._tick_s

    @property
    def paused_s(self) -> float:
        """Seconds of pauses observed so far."""
        with self._turned:
            return self._paused_s

    @property
    def pauses(self) -> int:
        """Pauses observed so far."""
        with self._turned:
            return self._pauses

    def now(self) -> float:
        """For deadlines, not durations: a pause is counted when the loop turns again, so a reading
        taken during one (before it was counted) can exceed a later reading."""
        with self._turned:
            return self._monotonic() - self._paused_s

    def tick(self) -> Turn:
        """One turn of the owning loop: the clock now, and the pause it ended (0.0 for an ordinary turn).

        The loop judges its peers by ``Turn.now``, not by a later :meth:`now`: this process may stop
        again before the check, and that pause is counted only at the next turn."""
        at = self._monotonic()
        with self._turned:
            gap = 0.0 if self._last_turn is None else at - self._last_turn
            pause = gap - self._tick_s if gap > self._threshold_s else 0.0
            if pause > 0:
                self._paused_s += pause
                self._pauses += 1
            self._last_turn = at
            self._turns += 1
            self._turned.notify_all()
            return Turn(at - self._paused_s, pause)

    def stop(self) -> None:
        """The loop stopped: waiters must not wait for its next turn."""
        with self._turned:
            self._last_turn = None
            self._turns = -1
            self._turned.notify_all()

    def settle(self, timeout_s: float = _SETTLE_S) -> None:
        """Wait until the loop turned once more (so a pause up to now is counted), at most ``timeout_s``."""
        with self._turned:
            start = self._turns
            if start < 0:
                return
            self._turned.wait_for(lambda: self._turns != start, timeout_s)

    def wait(self, attempt: Callable[[float], bool], timeout_s: float) -> bool:
        """Call ``attempt(seconds)`` (a blocking wait returning True on success) until it succeeds or
        ``timeout_s`` of active time passed; False on timeout.

        ``attempt`` is e.g. ``event.wait`` or ``lambda s: lock.acquire(timeout=s)``.
        """
        if not (math.isfinite(timeout_s) and timeout_s >= 0):  # nan never expires: this would spin forever
            raise ValueError(f"timeout_s must be a finite number >= 0, got {timeout_s!r}")
        deadline = self.now() + timeout_s
        while True:
            if attempt(max(0.0, deadline - self.now())):
                return True
            if deadline - self.now() <= 0:
                self.settle()  # a pause we slept through may not be counted yet
                if deadline - self.now() <= 0:
                    return False
