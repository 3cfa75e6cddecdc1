"""Request ids remembered for a while after something ended for them here: a bounded, time-ordered memo.

The producer keeps the holds it reported (a late pull is answered at once with why), the consumer the
transfers that failed or were refused here (an expect() of one fails at once, a pull of it again is
refused). Both keep each id ``keep_s`` (their ``hold_s``) and at most a fixed number of ids, the oldest
forgotten first, so a stream of requests cannot grow them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from typing import Generic, TypeVar

__all__ = ["RecentEnds"]

V = TypeVar("V")


class RecentEnds(Generic[V]):
    """Ids noted with a value, each kept ``keep_s`` after it was noted, at most ``max_ids`` of them.

    Times come from the engine's channel clock, which steps back once a pause of this process is counted: a
    noted time is at least the newest one's, so the entries stay in time order (a note again moves its id to
    the end) and :meth:`expire` stops at the first entry still kept. Not thread-safe: the owner's lock guards it.
    """

    def __init__(self, keep_s: float, max_ids: int) -> None:
        self._keep_s, self._max_ids = keep_s, max_ids
        self._entries: OrderedDict[str, tuple[float, V]] = OrderedDict()

    def note(self, key: str, now: float, value: V) -> None:
        """Remember ``key`` with ``value`` from ``now`` on (again: from now, with this value)."""
        newest = next(reversed(self._entries.values()))[0] if self._entries else now
        if self._entries.pop(key, None) is None and len(self._entries) >= self._max_ids:
            self._entries.popitem(last=False)  # bounded: the oldest goes
        self._entries[key] = (max(now, newest), value)

    def get(self, key: str, now: float | None = None) -> tuple[float, V] | None:
        """(when it was noted, its value); None when never noted, forgotten, or (``now`` given) noted more than
        ``keep_s`` before ``now``, though not expired yet."""
        entry = self._entries.get(key)
        if entry is None or (now is not None and now - entry[0] > self._keep_s):
            return None
        return entry

    def pop(self, key: str) -> tuple[float, V] | None:
        return self._entries.pop(key, None)

    def expire(self, now: float) -> None:
        """Forget the ids noted more than ``keep_s`` before ``now``."""
        while self._entries:
            since, _ = next(iter(self._entries.values()))
            if now - since <= self._keep_s:  # and so is every later one
                break
            self._entries.popitem(last=False)

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[str]:
        """The ids remembered, oldest first."""
        return iter(self._entries)
