"""Half-open integer ranges and normalised sets of them (pure, no torch)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

__all__ = ["Span", "SpanSet"]


@dataclass(frozen=True, slots=True, order=True)
class Span:
    """The half-open range ``[start, stop)`` of non-negative integers."""

    start: int
    stop: int

    def __post_init__(self) -> None:
        if not (isinstance(self.start, int) and isinstance(self.stop, int)):
            raise TypeError(f"Span bounds must be int, got start={self.start!r}, stop={self.stop!r}")
        if self.start < 0 or self.stop < self.start:
            raise ValueError(f"Span needs 0 <= start <= stop, got start={self.start}, stop={self.stop}")

    def __len__(self) -> int:
        return self.stop - self.start

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.start, self.stop))

    def __contains__(self, index: object) -> bool:
        return isinstance(index, int) and self.start <= index < self.stop

    @property
    def empty(self) -> bool:
        return self.stop == self.start

    def intersect(self, other: Span) -> Span:
        start = max(self.start, other.start)
        return Span(start, max(start, min(self.stop, other.stop)))

    def covers(self, other: Span) -> bool:
        return other.empty or (self.start <= other.start and other.stop <= self.stop)

    def as_list(self) -> list[int]:
        return [self.start, self.stop]

    def split(self, size: int) -> tuple[Span, ...]:
        """Consecutive spans of ``size`` (the last may be shorter) that cover this one; empty: none."""
        if not (isinstance(size, int) and size >= 1):
            raise ValueError(f"Span.split needs a size >= 1, got {size!r}")
        return tuple(Span(start, min(start + size, self.stop)) for start in range(self.start, self.stop, size))

    def split_even(self, count: int) -> tuple[Span, ...]:
        """``count`` consecutive non-empty spans covering this one whose lengths differ by at most one (the
        first ``len % count`` are the longer): no short tail."""
        if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= len(self):
            raise ValueError(f"Span.split_even needs 1 <= count <= {len(self)} (the span's length), got {count!r}")
        base, longer = divmod(len(self), count)
        starts = [self.start + i * base + min(i, longer) for i in range(count + 1)]
        return tuple(Span(a, b) for a, b in zip(starts, starts[1:]))

    def __repr__(self) -> str:
        return f"[{self.start},{self.stop})"


@dataclass(frozen=True, slots=True)
class SpanSet:
    """A set of integers stored as sorted, disjoint, non-adjacent, non-empty spans.

    Token masks with holes (a decode side that already holds some blocks) are
    SpanSets; the constructor normalises any iterable of spans.
    """

    spans: tuple[Span, ...] = ()

    def __init__(self, spans: Iterable[Span | tuple[int, int]] = ()) -> None:
        items = sorted(s if isinstance(s, Span) else Span(*s) for s in spans)
        merged: list[Span] = []
        for span in items:
            if span.empty:
                continue
            if merged and span.start <= merged[-1].stop:
                last = merged[-1]
                merged[-1] = Span(last.start, max(last.stop, span.stop))
            else:
                merged.append(span)
        object.__setattr__(self, "spans", tuple(merged))

    @classmethod
    def range(cls, start: int, stop: int) -> SpanSet:
        return cls([Span(start, stop)])

    @classmethod
    def from_mask(cls, mask: Iterable[bool]) -> SpanSet:
        """Build from a boolean mask over positions 0..n-1 (the seed's roi mask)."""
        spans: list[Span] = []
        start: int | None = None
        index = -1
        for index, flag in enumerate(mask):
            if flag and start is None:
                start = index
            elif not flag and start is not None:
                spans.append(Span(start, index))
                start = None
        if start is not None:
            spans.append(Span(start, index + 1))
        return cls(spans)

    def __len__(self) -> int:
        return sum(len(s) for s in self.spans)

    def __iter__(self) -> Iterator[Span]:
        return iter(self.spans)

    def __contains__(self, index: object) -> bool:
        return any(index in s for s in self.spans)

    @property
    def empty(self) -> bool:
        return not self.spans

    @property
    def bounds(self) -> Span:
        """The smallest single span holding every member (empty set: [0,0))."""
        if not self.spans:
            return Span(0, 0)
        return Span(self.spans[0].start, self.spans[-1].stop)

    def intersect(self, other: SpanSet | Span) -> SpanSet:
        others = other.spans if isinstance(other, SpanSet) else (other,)
        out: list[Span] = []
        i = j = 0
        while i < len(self.spans) and j < len(others):
            a, b = self.spans[i], others[j]
            cut = a.intersect(b)
            if not cut.empty:
                out.append(cut)
            if a.stop <= b.stop:
                i += 1
            else:
                j += 1
        return SpanSet(out)

    def union(self, other: SpanSet) -> SpanSet:
        return SpanSet(self.spans + other.spans)

    def difference(self, other: SpanSet) -> SpanSet:
        out: list[Span] = []
        for span in self.spans:
            start = span.start
            for cut in other.intersect(span).spans:
                if cut.start > start:
                    out.append(Span(start, cut.start))
                start = cut.stop
            if start < span.stop:
                out.append(Span(start, span.stop))
        return SpanSet(out)

    def covers(self, other: SpanSet) -> bool:
        return other.difference(self).empty

    def as_lists(self) -> list[list[int]]:
        return [s.as_list() for s in self.spans]

    def __repr__(self) -> str:
        return "{" + ",".join(repr(s) for s in self.spans) + "}"
