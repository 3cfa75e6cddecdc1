"""The roi: a region of a request's KV cache, tokens x layers x kv-heads."""

from __future__ import annotations

from dataclasses import dataclass

from ._geometry import KVGeometry
from ._span import Span, SpanSet

__all__ = ["Roi"]


@dataclass(frozen=True, slots=True)
class Roi:
    """A box of KV cells: a token set (with holes allowed) x a layer span x a kv-head span.

    It generalises the seed lookup buffer's token mask to say which part of
    the KV a TP/PP rank holds. For MLA the head span is ``[0, 1)``.
    """

    tokens: SpanSet
    layers: Span
    heads: Span

    def __post_init__(self) -> None:
        if isinstance(self.tokens, Span):
            object.__setattr__(self, "tokens", SpanSet([self.tokens]))
        elif not isinstance(self.tokens, SpanSet):
            raise TypeError(f"Roi.tokens must be a SpanSet or Span, got {type(self.tokens).__name__}")
        for name in ("layers", "heads"):
            value = getattr(self, name)
            if not isinstance(value, Span):
                raise TypeError(f"Roi.{name} must be a Span, got {type(value).__name__} {value!r}")

    @classmethod
    def full(cls, geometry: KVGeometry, num_tokens: int) -> Roi:
        """Every cell of a ``num_tokens`` request."""
        return cls(SpanSet.range(0, num_tokens), Span(0, geometry.num_layers), Span(0, geometry.num_kv_heads))

    @property
    def empty(self) -> bool:
        return self.tokens.empty or self.layers.empty or self.heads.empty

    @property
    def num_cells(self) -> int:
        """(token, layer, kv-head) cells in the box."""
        return len(self.tokens) * len(self.layers) * len(self.heads)

    def nbytes(self, geometry: KVGeometry) -> int:
        return self.num_cells * geometry.cell_bytes

    def intersect(self, other: Roi) -> Roi:
        return Roi(self.tokens.intersect(other.tokens), self.layers.intersect(other.layers), self.heads.intersect(other.heads))

    def covers(self, other: Roi) -> bool:
        """True when every cell of ``other`` lies in this roi."""
        return other.empty or (
            self.tokens.covers(other.tokens) and self.layers.covers(other.layers) and self.heads.covers(other.heads)
        )

    def with_tokens(self, tokens: SpanSet) -> Roi:
        return Roi(tokens, self.layers, self.heads)

    def __repr__(self) -> str:
        return f"Roi(tokens={self.tokens!r}, layers={self.layers!r}, heads={self.heads!r})"
