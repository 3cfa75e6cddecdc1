"""Which part of a request's KV each rank of a TP x PP engine holds."""

from __future__ import annotations

from ._geometry import KVGeometry, ParallelLayout
from ._roi import Roi
from ._span import Span, SpanSet

__all__ = ["head_blocks", "shard_heads", "shard_roi", "token_set"]


def token_set(tokens: SpanSet | Span | int) -> SpanSet:
    """Normalise a token argument: a count ``n`` means tokens ``[0, n)``."""
    if isinstance(tokens, SpanSet):
        return tokens
    if isinstance(tokens, Span):
        return SpanSet([tokens])
    if isinstance(tokens, int) and not isinstance(tokens, bool):
        if tokens < 0:
            raise ValueError(f"number of tokens must be >= 0, got {tokens}")
        return SpanSet.range(0, tokens)
    raise TypeError(f"tokens must be a SpanSet, Span or int, got {type(tokens).__name__}")


def shard_heads(geometry: KVGeometry, tp_size: int, tp_rank: int) -> Span:
    """The kv-head span TP rank ``tp_rank`` of ``tp_size`` holds.

    Heads split evenly when ``num_kv_heads >= tp_size``; otherwise each head is
    replicated on ``tp_size // num_kv_heads`` consecutive ranks, as vLLM does.
    An MLA latent (one "head") is on every TP rank. The caller checks the layout.
    """
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank={tp_rank} outside tp_size={tp_size}")
    heads = geometry.num_kv_heads
    if geometry.use_mla:
        return Span(0, 1)
    if heads >= tp_size:
        per_rank = heads // tp_size
        return Span(tp_rank * per_rank, (tp_rank + 1) * per_rank)
    head = tp_rank // (tp_size // heads)
    return Span(head, head + 1)


def head_blocks(geometry: KVGeometry, tp_size: int) -> list[tuple[Span, tuple[int, ...]]]:
    """The heads split into blocks that one set of TP ranks holds together.

    Returns ``(heads, tp_ranks)`` pairs in head order: one block per TP rank
    when heads are split, one block per head (with its replicas) when
    replicated, and ``[0, 1)`` on every rank for MLA.
    """
    holders: dict[Span, list[int]] = {}
    for tp_rank in range(tp_size):
        holders.setdefault(shard_heads(geometry, tp_size, tp_rank), []).append(tp_rank)
    return [(heads, tuple(ranks)) for heads, ranks in sorted(holders.items())]


def shard_roi(layout: ParallelLayout, geometry: KVGeometry, rank: int, tokens: SpanSet | int) -> Roi:
    """The part of the KV that global ``rank`` of ``layout`` holds, restricted to ``tokens``.

    Ranks are numbered ``pp_rank * tp_size + tp_rank``; layers follow the
    layout's pipeline split (vLLM's default or its explicit partition). Raises
    ValueError, naming the numbers, when the layout cannot hold the geometry.
    """
    layout.check(geometry)
    tp_rank, pp_rank = layout.coords(rank)
    return Roi(
        token_set(tokens),
        layout.layer_span(geometry, pp_rank),
        shard_heads(geometry, layout.tp_size, tp_rank),
    )
