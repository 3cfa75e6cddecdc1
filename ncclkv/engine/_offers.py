"""A producer rank's push offer, checked against this consumer rank's plan before anything is reserved for it.

What the offer says (its routes, its bytes, the blocks it names) must be what
this rank's own plan of the push gives the offering rank; whatever differs is
a ProtocolError naming both, so a skewed producer is refused before its
tensors are announced. Pure: no lock, no state (the consumer, ``_consumer``,
decides what to do with a checked offer).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import NcclKVError, PeerLostError, PeerResetError, ProtocolError
from ..layout import KVGeometry, ParallelLayout, Route, SpanSet, cached_plan
from ..protocol import Handshake, PushOffer
from ._expected import as_ncclkv
from ._push_stage import SliceKey
from ._staging import BlockTokens

__all__ = ["CheckedOffer", "check_offer", "refused_offer", "routes_text"]

# Routes an error names of a list it compares with another: a pull or offer carries up to MAX_ROUTES (4096), and the
# whole of both lists was half a megabyte of text a refusal, logged at ERROR with no rate limit.
_SHOWN_ROUTES = 8


@dataclass(frozen=True, slots=True)
class CheckedOffer:
    """An offer that matches this rank's plan of the push."""

    routes: list[Route]  # what the offering rank sends here, sorted
    keys: set[SliceKey]  # its (src rank, layer, route) slices
    nbytes: int  # their bytes: what staging must hold for them
    wanted: dict[int, int]  # producer rank -> (layer, route) slices the whole push sends here (every rank's)
    blocks: BlockTokens | None  # the prompt's full blocks it names (KV events), if it named them


def check_offer(offer: PushOffer, sender: str, producer: Handshake, layout: ParallelLayout, geometry: KVGeometry,
                rank: int) -> CheckedOffer:
    """Check ``offer`` from ``sender`` (producer rank ``producer``, as it shook hands) against the plan of its
    push to rank ``rank`` of ``layout``; ProtocolError naming both when they differ."""
    src = producer.rank
    if offer.producer_engine_id != producer.engine_id or offer.src_rank != src:
        raise ProtocolError(f"push offer for {offer.request_id!r} from {sender!r} names engine "
                            f"{offer.producer_engine_id!r} rank {offer.src_rank}, but it shook hands as engine "
                            f"{producer.engine_id!r} rank {src}")
    routes = sorted(Route(m.src, m.dst, *m.spans()) for m in offer.routes)
    want = cached_plan(producer.layout.to_layout(), layout, geometry,
                       SpanSet.range(0, offer.num_tokens)).routes_to(rank)
    mine = sorted(r for r in want if r.src == src)
    if routes != mine:
        raise ProtocolError(f"push of {offer.request_id!r} from {sender!r} offers {routes_text(routes, mine)}, "
                            f"our plan gives {routes_text(mine, routes)}")
    nbytes = sum(r.nbytes(geometry) for r in routes)
    if offer.nbytes != nbytes:
        raise ProtocolError(f"push of {offer.request_id!r} from {sender!r} says {offer.nbytes} B, routes hold {nbytes} B")
    wanted: dict[int, int] = {}
    for route in want:
        wanted[route.src] = wanted.get(route.src, 0) + len(route.layers)
    keys = {(src, layer, r) for r in routes for layer in r.layers}
    return CheckedOffer(routes, keys, nbytes, wanted, _offered_blocks(offer, sender))


def refused_offer(offer: PushOffer, sender: str, failed: BaseException,
                  why: str = "it already failed here") -> NcclKVError:
    """What an offer for a push that already failed here (or, ``why`` says, whose id is refused here for
    another reason) is refused with: ``failed``'s type, naming it. Not a :class:`PeerResetError`: that answer
    (``peer_reset``) tells the offering rank that we hold no handshake with it, and it would drop its link to
    us and offer once more, for another rank's reset; a :class:`PeerLostError` says the same words."""
    kind = type(as_ncclkv(failed))
    if issubclass(kind, PeerResetError):
        kind = PeerLostError
    return kind(f"push of {offer.request_id!r} from {sender!r} refused: {why}: {failed}")


def _offered_blocks(offer: PushOffer, sender: str) -> BlockTokens | None:
    """The offer's named blocks, checked against its token count (ProtocolError if they disagree)."""
    if offer.blocks is None:
        return None
    msg = offer.blocks
    full = offer.num_tokens // msg.block_size * msg.block_size
    if len(msg.token_ids) != full:
        raise ProtocolError(f"push of {offer.request_id!r} from {sender!r} names {len(msg.token_ids)} tokens of "
                            f"blocks of {msg.block_size}; its {offer.num_tokens} tokens hold {full} in full blocks")
    try:
        return BlockTokens(msg.token_ids, msg.block_size, msg.extra_keys)
    except (TypeError, ValueError) as err:
        raise ProtocolError(f"push of {offer.request_id!r} from {sender!r}: bad blocks: {err}") from None


def routes_text(routes: Sequence[Route], other: Sequence[Route]) -> str:
    """``routes`` as an error that compares them with ``other`` names them: the list itself when it holds at most
    ``_SHOWN_ROUTES``, else its count and the first of them that ``other`` lacks (counted with repeats)."""
    if len(routes) <= _SHOWN_ROUTES:
        return str(list(routes))
    left = Counter(other)
    lacking = []
    for route in routes:
        if left[route]:
            left[route] -= 1
        else:
            lacking.append(route)
    first = f", the first {min(len(lacking), _SHOWN_ROUTES)}: " + ", ".join(map(repr, lacking[:_SHOWN_ROUTES]))
    return f"[{len(routes)} routes, {len(lacking)} of them not in the other list{first if lacking else ''}]"
