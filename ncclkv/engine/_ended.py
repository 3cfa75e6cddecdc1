"""What one consumer rank remembers of transfers that ended here, for ``hold_s``: refusals and pulls.

A producer may still act on a transfer after it ended here: the tensors of a
pull that failed or was aborted may still be on the way, a push may fail at
its producer before this rank expects it, and a producer rank may answer a
pull of nothing long after (parked there until its ``deadline_s``). So the
consumer keeps, by request id, for ``hold_s`` and at most a fixed number each:

- refusals: a push refused, failed or expired here, or an expected request
  that failed or was aborted (and whether it was a pull). An expect() of its
  push fails at once instead of waiting ``hold_s`` for tensors that never
  come; a pull of it again is refused, since the ended one's tensors would
  land in it, unless both pulls name their holds (``hold``), which the
  producer's announcements, Done and errors for a pull carry.
- ended pulls: pulls that ended here (served, failed, aborted) and pulls
  declined. A producer's error for one is the pull's late answer, not a push
  failing before it was expected, and refuses nothing.

Not thread-safe: the consumer's lock guards it.
"""

from __future__ import annotations

from typing import NamedTuple

from ..errors import NcclKVError
from ._recent import RecentEnds

__all__ = ["MAX_ENDED_PULLS", "MAX_REFUSALS", "EndedTransfers", "Refusal"]

MAX_REFUSALS = 4096  # refusals remembered, each at most hold_s
MAX_ENDED_PULLS = 4096  # ended pulls (and pull declines) remembered, each at most hold_s


class Refusal(NamedTuple):
    """Why a request id from one producer is refused here, and since when (the channel clock)."""

    since: float
    error: NcclKVError
    pulled: bool  # a pull expected here ended unloaded (no push failed)
    hold: int  # that pull's hold number (0: not named, or a push)
    expected: bool = False  # a push expected here ended unloaded (failed or aborted after it was expected)


class EndedTransfers:
    """Refusals and ended pulls by request id, each kept ``hold_s`` (see the module's text)."""

    def __init__(self, hold_s: float) -> None:
        self._hold_s = hold_s
        self._refused: RecentEnds[tuple[str, NcclKVError, bool, int, bool]] = RecentEnds(hold_s, MAX_REFUSALS)
        self._pulled: RecentEnds[str] = RecentEnds(hold_s, MAX_ENDED_PULLS)

    def refuse(self, request_id: str, producer_engine_id: str, error: NcclKVError, now: float,
               pulled: bool = False, hold: int = 0, expected: bool = False) -> None:
        """``request_id`` from ``producer_engine_id`` ended here with ``error`` (``pulled``: it was a pull, of
        hold number ``hold``; ``expected``: a push expected here)."""
        # Its type and text, not the error itself: a traceback would keep its frames' buffers alive for hold_s.
        self._refused.note(request_id, now, (producer_engine_id, type(error)(str(error)), pulled, hold, expected))

    def refusal(self, request_id: str, producer_engine_id: str) -> Refusal | None:
        """Why ``request_id`` from ``producer_engine_id`` is refused here; None if it is not, or only from
        another producer."""
        entry = self._refused.get(request_id)
        if entry is None or entry[1][0] != producer_engine_id:
            return None
        since, (_, error, pulled, hold, expected) = entry
        return Refusal(since, error, pulled, hold, expected)

    def forget_refusal(self, request_id: str) -> None:
        """An expect() of the id's push took its refusal (it failed with it)."""
        self._refused.pop(request_id)

    def note_pull(self, request_id: str, producer_engine_id: str, now: float) -> None:
        """A pull of ``request_id`` from ``producer_engine_id`` ended here, or was declined."""
        self._pulled.note(request_id, now, producer_engine_id)

    def pulled_from(self, request_id: str, producer_engine_id: str) -> bool:
        """Whether a pull of ``request_id`` from ``producer_engine_id`` ended here (or was declined) lately."""
        entry = self._pulled.get(request_id)
        return entry is not None and entry[1] == producer_engine_id

    def pull_ended_text(self, request_id: str, producer_engine_id: str, since: float, now: float) -> str:
        """Why a push of ``request_id`` is refused when a pull of it ended here unloaded at ``since`` (no push
        failed): the pull's tensors, announced for that id, would land in it."""
        return (f"a pull of it from {producer_engine_id!r} failed or was aborted here "
                f"{max(0.0, now - since):.3g}s ago; its tensors may still arrive, so the id from that "
                f"producer is refused until hold_s={self._hold_s:g}s have passed; the pull's cause")

    def expire(self, now: float) -> None:
        self._refused.expire(now)
        self._pulled.expire(now)

    def clear(self) -> None:
        self._refused.clear()
        self._pulled.clear()

    @property
    def num_refused(self) -> int:
        return len(self._refused)

    @property
    def num_pulled(self) -> int:
        return len(self._pulled)
