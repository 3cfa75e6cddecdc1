"""Transfer plans: which source rank sends which KV box to which destination rank.

A plan is a value. :func:`plan` builds one from two layouts, a geometry and a
token set; :meth:`TransferPlan.validate` checks it, by counting coverage of
boxes and independently of how the planner chose its routes, before anything
is sent.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import lru_cache
from itertools import accumulate
from typing import NamedTuple

from ._geometry import KVGeometry, ParallelLayout, pp_layer_spans
from ._roi import Roi
from ._shard import head_blocks, shard_heads, shard_roi, token_set
from ._span import Span, SpanSet

__all__ = ["PlanError", "Route", "TransferPlan", "cached_plan", "plan", "routes_between", "routes_from_rank"]


class PlanError(ValueError):
    """A transfer plan that misses, doubles or misplaces a KV cell; the message names the first such cell."""


def _check_max_bytes(max_bytes: object) -> None:
    if not (isinstance(max_bytes, int) and max_bytes >= 0):
        raise ValueError(f"max_bytes must be an int >= 0, got {max_bytes!r}")


def _even_cut(span: Span, unit_bytes: int, max_bytes: int) -> tuple[Span, ...]:
    """``span`` cut into the fewest runs of at most ``max_bytes`` (``unit_bytes`` an element, at least one element
    each), their lengths differing by at most one: evening out never lengthens a run (each is at most
    ceil(n / count) <= the most that fit)."""
    most = max(1, max_bytes // unit_bytes)
    return span.split_even(-(-len(span) // most))


@dataclass(frozen=True, slots=True, order=True)
class Route:
    """Source rank ``src`` sends destination rank ``dst`` the box ``tokens x layers x heads``.

    Ranks are global ranks of their own side; spans are half-open, non-empty
    and in model coordinates (global layer and kv-head indices).
    """

    src: int
    dst: int
    layers: Span
    heads: Span
    tokens: Span
    # A consumer looks each landed tensor's route up in several sets and dicts: hash it once.
    _hash: int = field(init=False, repr=False, compare=False, default=0)

    def __post_init__(self) -> None:
        for name in ("src", "dst"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"Route.{name} must be a rank >= 0, got {value!r}")
        for name in ("layers", "heads", "tokens"):
            span = getattr(self, name)
            if not isinstance(span, Span) or span.empty:
                raise ValueError(f"Route.{name} must be a non-empty Span, got {span!r}")
        object.__setattr__(self, "_hash", hash((self.src, self.dst, self.layers, self.heads, self.tokens)))

    def __hash__(self) -> int:
        return self._hash

    @property
    def roi(self) -> Roi:
        return Roi(SpanSet([self.tokens]), self.layers, self.heads)

    @property
    def num_cells(self) -> int:
        return len(self.tokens) * len(self.layers) * len(self.heads)

    def nbytes(self, geometry: KVGeometry) -> int:
        return self.num_cells * geometry.cell_bytes

    def pieces(self, geometry: KVGeometry, max_bytes: int) -> tuple[Span, ...]:
        """This route's tokens cut into the fewest pieces of which one layer holds at most ``max_bytes`` (at
        least one token each), their lengths differing by at most one token (a pipeline's fill and drain
        are its largest piece); ``max_bytes`` 0: one piece, all the tokens."""
        _check_max_bytes(max_bytes)
        if max_bytes == 0:
            return (self.tokens,)
        return _even_cut(self.tokens, len(self.heads) * geometry.cell_bytes, max_bytes)

    def layer_runs(self, geometry: KVGeometry, max_bytes: int) -> tuple[Span, ...]:
        """This route's layers cut into the fewest runs of consecutive layers whose slices (all the route's
        tokens) hold at most ``max_bytes`` together (at least one layer each), their lengths differing by at most
        one layer; ``max_bytes`` 0: one run per layer."""
        _check_max_bytes(max_bytes)
        return _even_cut(self.layers, len(self.tokens) * len(self.heads) * geometry.cell_bytes, max_bytes)

    def to_json(self) -> dict[str, int | list[int]]:
        return {
            "src": self.src,
            "dst": self.dst,
            "layers": self.layers.as_list(),
            "heads": self.heads.as_list(),
            "tokens": self.tokens.as_list(),
        }

    def __repr__(self) -> str:
        return f"Route(src {self.src} -> dst {self.dst}: layers {self.layers!r} heads {self.heads!r} tokens {self.tokens!r})"


@dataclass(frozen=True, slots=True)
class TransferPlan:
    """Routes from every rank of ``src_layout`` to every rank of ``dst_layout``.

    ``routes`` are sorted by (src, dst, layers, heads, tokens), so the routes
    of one (src, dst) link come in the same order from :meth:`routes_from` on
    the sending side and :meth:`routes_to` on the receiving side (point-to-point
    sends have no tags: order is what matches them). Sorted on construction,
    whoever built the plan.
    """

    src_layout: ParallelLayout
    dst_layout: ParallelLayout
    geometry: KVGeometry
    tokens: SpanSet
    routes: tuple[Route, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "tokens", token_set(self.tokens))
        routes = tuple(self.routes)
        for route in routes:
            if not isinstance(route, Route):
                raise TypeError(f"TransferPlan.routes must hold Route values, got {type(route).__name__}")
        # Sorted, not checked: plans are also built by hand (tests break plan()'s, then validate() them). On
        # plan()'s routes, sorted already, this costs one comparison per route.
        object.__setattr__(self, "routes", tuple(sorted(routes)))

    def routes_from(self, src: int) -> tuple[Route, ...]:
        return tuple(r for r in self.routes if r.src == src)

    def routes_to(self, dst: int) -> tuple[Route, ...]:
        return tuple(r for r in self.routes if r.dst == dst)

    def send_bytes(self) -> dict[int, int]:
        """Bytes each source rank sends (every rank present, 0 if it sends nothing)."""
        out = dict.fromkeys(range(self.src_layout.world_size), 0)
        for route in self.routes:
            out[route.src] = out.get(route.src, 0) + route.nbytes(self.geometry)
        return out

    def recv_bytes(self) -> dict[int, int]:
        """Bytes each destination rank receives (every rank present, 0 if none)."""
        out = dict.fromkeys(range(self.dst_layout.world_size), 0)
        for route in self.routes:
            out[route.dst] = out.get(route.dst, 0) + route.nbytes(self.geometry)
        return out

    def to_json(self) -> dict[str, object]:
        """``{"routes": [...], "send_bytes": {rank: int}, "recv_bytes": {rank: int}}``, half-open ranges."""
        return {
            "routes": [route.to_json() for route in self.routes],
            "send_bytes": self.send_bytes(),
            "recv_bytes": self.recv_bytes(),
        }

    def grid(self) -> str:
        """A table: one row per dst rank, one column per src rank, each cell the boxes sent."""
        src, dst, geo = self.src_layout, self.dst_layout, self.geometry
        boxes: dict[tuple[int, int], list[str]] = defaultdict(list)
        for route in self.routes:
            text = f"L{route.layers.start}:{route.layers.stop} H{route.heads.start}:{route.heads.stop}"
            if text not in boxes[route.dst, route.src]:
                boxes[route.dst, route.src].append(text)
        header = ["dst\\src"] + [_rank_label("s", src, r) for r in range(src.world_size)]
        rows = [header]
        for d in range(dst.world_size):
            cells = [", ".join(boxes.get((d, s), [])) or "." for s in range(src.world_size)]
            rows.append([_rank_label("d", dst, d)] + cells)
        widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
        kind = "MLA latent" if geo.use_mla else f"{geo.num_kv_heads} kv-heads"
        lines = [
            f"plan {src.spec()} -> {dst.spec()}: {geo.num_layers} layers x {kind}, "
            f"tokens {self.tokens!r} ({len(self.tokens)} tokens in {_count(len(self.tokens.spans), 'span')}), "
            f"{_count(len(self.routes), 'route')}; cells: layers L start:stop, heads H start:stop (half-open)"
        ]
        lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
        return "\n".join(lines)

    def validate(self) -> None:
        """Raise :class:`PlanError` naming the first cell missing, doubled or outside a shard.

        Independent of the planner: each route must lie inside its source's
        shard and its destination's need (the destination shard restricted to
        ``tokens``); then each destination's need is cut into elementary boxes
        at every route boundary and each box must be delivered exactly once.
        """
        src, dst, geo = self.src_layout, self.dst_layout, self.geometry
        by_dst: dict[int, list[Route]] = defaultdict(list)
        for route in self.routes:
            for side, rank, layout in (("src", route.src, src), ("dst", route.dst, dst)):
                if rank >= layout.world_size:
                    raise PlanError(
                        f"dst rank {route.dst} layer {route.layers.start} head {route.heads.start} token {route.tokens.start}: "
                        f"{side} rank {rank} outside {layout.spec()} ({layout.world_size} ranks; {route!r})"
                    )
            have = shard_roi(src, geo, route.src, self.tokens)
            need = shard_roi(dst, geo, route.dst, self.tokens)
            for shard, what in ((have, f"outside src rank {route.src}'s shard"), (need, f"outside dst rank {route.dst}'s need")):
                if not shard.covers(route.roi):
                    layer, head, token = _first_outside(route.roi, shard)
                    raise PlanError(
                        f"dst rank {route.dst} layer {layer} head {head} token {token}: {what} "
                        f"(shard layers {shard.layers!r} heads {shard.heads!r} tokens {shard.tokens!r}; {route!r})"
                    )
            by_dst[route.dst].append(route)
        for rank in range(dst.world_size):
            _check_cover(rank, shard_roi(dst, geo, rank, self.tokens), by_dst.get(rank, []))


class _Piece(NamedTuple):
    src: int
    dst: int
    layers: Span
    heads: Span


def plan(src_layout: ParallelLayout, dst_layout: ParallelLayout, geometry: KVGeometry, tokens: SpanSet | int) -> TransferPlan:
    """Route every cell each destination rank holds, restricted to ``tokens``, from exactly one source rank.

    Assignment unit: the cells one destination rank needs from one source
    pipeline stage and one source *head block* (a set of heads that the same
    source TP ranks hold: one TP rank's ``h/tp`` heads when heads are split, one
    head when heads are replicated, the MLA latent), over all ``tokens``. The
    holders of one block in one stage (a *holder set*; a source rank belongs to
    exactly one) share its units: the units, in destination order, are laid end
    to end, one layer-row (a layer of the unit's heads) after another, and cut
    at layer boundaries into ``min(holders, rows)`` runs as even as rows allow
    (the longer runs placed so that runs end on a unit's end where they can),
    dealt to the holders in rank order (McNaughton's wrap-around rule). So each
    holder of a set sends within one layer-row (one layer x the unit's heads x
    ``tokens``) of each other, every holder sends when the set's units have at
    least as many layers as it has holders, a unit is split along layers only
    where it must be, and each holder sends each destination one box at most.

    The source of each (dst, layer, head) cell depends on the layouts and the
    geometry only, never on ``tokens`` (beyond its being empty): a producer and
    a consumer that re-plan a pull or push with only some of the tokens get the
    same routes for those tokens. Same inputs give the same plan. Routes are
    split per token span.
    """
    src_layout.check(geometry)
    dst_layout.check(geometry)
    tokens = token_set(tokens)
    routes: list[Route] = []
    if not tokens.empty:
        routes = sorted(Route(p.src, p.dst, p.layers, p.heads, span) for p in _pieces(src_layout, dst_layout, geometry)
                        for span in tokens)
    return TransferPlan(src_layout, dst_layout, geometry, tokens, tuple(routes))


def routes_between(src_layout: ParallelLayout, dst_layout: ParallelLayout, geometry: KVGeometry,
                   tokens: SpanSet | int, src: int, dst: int) -> tuple[Route, ...]:
    """The routes :func:`plan` gives the one link from source rank ``src`` to destination rank ``dst``, in its
    order: ``[r for r in plan(...).routes_from(src) if r.dst == dst]``, without planning the other links. Its
    work is that link's boxes times the spans of ``tokens``, where the whole plan's is every link's boxes times
    them (a pull names one link: a peer that declares thousands of ranks and pulls many spans would otherwise
    have the whole plan built, millions of routes). ValueError names a rank outside its layout."""
    _check_ranks(src_layout, dst_layout, geometry, ("src", src, src_layout), ("dst", dst, dst_layout))
    return _routes(_link_pieces(src_layout, dst_layout, geometry, src, dst), tokens)


def routes_from_rank(src_layout: ParallelLayout, dst_layout: ParallelLayout, geometry: KVGeometry,
                     tokens: SpanSet | int, src: int) -> tuple[Route, ...]:
    """The routes :func:`plan` gives source rank ``src``, in its order: ``plan(...).routes_from(src)``, without
    planning the other source ranks (:func:`_rank_pieces`). Its work is the destination's ranks once and ``src``'s
    boxes (one a destination rank at most) times the spans of ``tokens``, where the whole plan's is both layouts'
    ranks times each other (a push to an engine whose reference, a client's ``kv_transfer_params``, names 4096
    ranks: seconds on the forward). Nothing is kept. ValueError names a rank outside its layout."""
    _check_ranks(src_layout, dst_layout, geometry, ("src", src, src_layout))
    return _routes(_rank_pieces(src_layout, dst_layout, geometry, src), tokens)


def _check_ranks(src_layout: ParallelLayout, dst_layout: ParallelLayout, geometry: KVGeometry,
                 *ranks: tuple[str, int, ParallelLayout]) -> None:
    """Both layouts hold ``geometry``, and each (side, rank, layout) names a rank of its layout; ValueError naming
    what is not."""
    src_layout.check(geometry)
    dst_layout.check(geometry)
    for side, rank, layout in ranks:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < layout.world_size:
            raise ValueError(f"{side} rank {rank!r} outside {layout.spec()} ({layout.world_size} ranks)")


def _routes(pieces: Iterable[_Piece], tokens: SpanSet | int) -> tuple[Route, ...]:
    """The routes of ``pieces`` (boxes, no tokens) over each span of ``tokens``, in :func:`plan`'s order."""
    spans = token_set(tokens)
    return tuple(sorted(Route(p.src, p.dst, p.layers, p.heads, span) for p in pieces for span in spans))


@lru_cache(maxsize=4096)
def _link_pieces(src_layout: ParallelLayout, dst_layout: ParallelLayout, geometry: KVGeometry, src: int,
                 dst: int) -> tuple[_Piece, ...]:
    """The boxes of :func:`_pieces` on the link ``src -> dst`` alone (:func:`_rank_pieces`'s to ``dst``). Work in
    the destination's ranks, where :func:`_pieces` costs both layouts' ranks times each other; what is kept is that
    link's box."""
    return tuple(p for p in _rank_pieces(src_layout, dst_layout, geometry, src) if p.dst == dst)


def _rank_pieces(src_layout: ParallelLayout, dst_layout: ParallelLayout, geometry: KVGeometry,
                 src: int) -> list[_Piece]:
    """The boxes of :func:`_pieces` from source rank ``src`` alone, from the deal of ``src``'s holder set only: a
    source rank holds one head block of one stage, so all its boxes come from that set's deal, one a destination
    at most (none to merge)."""
    tp_rank, pp_rank = src_layout.coords(src)
    stage = pp_layer_spans(geometry.num_layers, src_layout.pp_size, src_layout.layer_partition)[pp_rank]
    block, tp_ranks = next((b, ranks) for b, ranks in head_blocks(geometry, src_layout.tp_size) if tp_rank in ranks)
    holders = [src_layout.rank(r, pp_rank) for r in tp_ranks]
    return [p for p in _deal(_units(stage, block, _needs(dst_layout, geometry)), holders) if p.src == src]


@lru_cache(maxsize=256)
def _pieces(src_layout: ParallelLayout, dst_layout: ParallelLayout, geometry: KVGeometry) -> tuple[_Piece, ...]:
    """The boxes (no tokens) of :func:`plan`: a function of the layouts and the geometry alone."""
    stages = pp_layer_spans(geometry.num_layers, src_layout.pp_size, src_layout.layer_partition)
    blocks = head_blocks(geometry, src_layout.tp_size)
    needs = _needs(dst_layout, geometry)
    pieces: list[_Piece] = []
    for pp_rank, stage in enumerate(stages):
        for block, tp_ranks in blocks:
            holders = [src_layout.rank(tp_rank, pp_rank) for tp_rank in tp_ranks]
            pieces += _deal(_units(stage, block, needs), holders)
    return tuple(_merge(pieces))


def _needs(layout: ParallelLayout, geometry: KVGeometry) -> list[tuple[Span, Span]]:
    """(layers, heads) of each rank's shard, in rank order (:func:`shard_roi`'s, the pipeline split computed once,
    not once a rank)."""
    layout.check(geometry)
    stages = pp_layer_spans(geometry.num_layers, layout.pp_size, layout.layer_partition)
    coords = [layout.coords(rank) for rank in range(layout.world_size)]
    return [(stages[pp_rank], shard_heads(geometry, layout.tp_size, tp_rank)) for tp_rank, pp_rank in coords]


def _units(stage: Span, block: Span, needs: list[tuple[Span, Span]]) -> list[tuple[int, Span, Span]]:
    """What each destination rank needs of one source stage and head block: (dst, layers, heads), the empty left out."""
    units = [(d, stage.intersect(layers), block.intersect(heads)) for d, (layers, heads) in enumerate(needs)]
    return [(d, layers, heads) for d, layers, heads in units if not (layers.empty or heads.empty)]


def _deal(units: list[tuple[int, Span, Span]], holders: list[int]) -> list[_Piece]:
    """Lay ``units`` (dst, layers, heads) end to end in this order and cut them into runs of layer-rows, one run
    per holder in order (a row, one layer of a unit, weighs its heads and goes to the run its start lies in)."""
    if len(holders) == 1:
        return [_Piece(holders[0], d, layers, heads) for d, layers, heads in units]
    ends = list(accumulate(len(layers) * len(heads) for _, layers, heads in units))
    if not ends:
        return []
    bounds = [0, *accumulate(_run_lengths(ends[-1], min(len(holders), ends[-1]), set(ends)))]
    pieces: list[_Piece] = []
    offset = 0  # cells per token laid down before this unit
    for (d, layers, heads), end in zip(units, ends):
        weight = len(heads)
        run = bisect_right(bounds, offset) - 1
        start = layers.start
        while start < layers.stop:
            # the first layer whose row starts at or past this run's end
            stop = min(layers.stop, layers.start + max(0, -(-(bounds[run + 1] - offset) // weight)))
            if stop > start:
                pieces.append(_Piece(holders[run], d, Span(start, stop), heads))
                start = stop
            run += 1
        offset = end
    return pieces


# Holders x (longer runs + 1) past which _run_lengths no longer searches for cuts on unit ends (a bound on
# its work for absurd layouts; every real one is far below).
_ALIGN_LIMIT = 1 << 14


def _run_lengths(total: int, count: int, ends: set[int]) -> list[int]:
    """``count`` run lengths summing to ``total``, each ``total // count`` or one more, the longer ones placed
    so that as many runs as possible end on one of ``ends`` (a unit's end: no split there); ties: longer first."""
    short, longer = divmod(total, count)
    if not longer or count * (longer + 1) > _ALIGN_LIMIT:
        return [short + (i < longer) for i in range(count)]
    # best[i][c]: the most runs ending on ``ends`` after i runs, c of them longer (None: cannot finish).
    best: list[list[int | None]] = [[None] * (longer + 1) for _ in range(count + 1)]
    best[count][longer] = 0
    for i in range(count - 1, -1, -1):
        for c in range(max(0, longer - (count - i)), min(i, longer) + 1):
            nexts = [v for v in (best[i + 1][c], best[i + 1][c + 1] if c < longer else None) if v is not None]
            best[i][c] = int(0 < i and i * short + c in ends) + max(nexts)
    lengths, c = [], 0
    for i in range(count):
        more = best[i + 1][c + 1] if c < longer else None
        if more is not None and (best[i + 1][c] is None or more >= best[i + 1][c]):
            lengths.append(short + 1)
            c += 1
        else:
            lengths.append(short)
    return lengths


def _merge(pieces: Iterable[_Piece]) -> list[_Piece]:
    """Merge boxes of one (src, dst) link that touch along heads or layers, until none do."""
    current = sorted(set(pieces))
    while True:
        merged = _merge_axis(_merge_axis(current, "heads"), "layers")
        if merged == current:
            return merged
        current = merged


def _merge_axis(pieces: list[_Piece], axis: str) -> list[_Piece]:
    other = "layers" if axis == "heads" else "heads"
    out: list[_Piece] = []
    key = lambda p: (p.src, p.dst, getattr(p, other), getattr(p, axis))  # noqa: E731
    for piece in sorted(pieces, key=key):
        if out and key(out[-1])[:3] == key(piece)[:3] and getattr(out[-1], axis).stop == getattr(piece, axis).start:
            joined = Span(getattr(out[-1], axis).start, getattr(piece, axis).stop)
            out[-1] = out[-1]._replace(**{axis: joined})
        else:
            out.append(piece)
    return sorted(out)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _rank_label(prefix: str, layout: ParallelLayout, rank: int) -> str:
    tp_rank, pp_rank = layout.coords(rank)
    return f"{prefix}{rank}(tp{tp_rank},pp{pp_rank})"


def _first_outside(box: Roi, shard: Roi) -> tuple[int, int, int]:
    """The first (layer, head, token) of ``box`` not in ``shard``; ``box`` must not be covered."""
    tokens_out = box.tokens.difference(shard.tokens)
    for layer in box.layers:
        for head in box.heads:
            if layer not in shard.layers or head not in shard.heads:
                return layer, head, box.tokens.spans[0].start
            if not tokens_out.empty:
                return layer, head, tokens_out.spans[0].start
    raise AssertionError(f"{box!r} lies inside {shard!r}")


def _cuts(spans: Iterable[Span]) -> list[int]:
    return sorted({bound for span in spans for bound in (span.start, span.stop)})


def _check_cover(dst: int, need: Roi, routes: list[Route]) -> None:
    """Every cell of ``need`` delivered exactly once by ``routes`` (all inside ``need``)."""
    if need.empty:
        return
    layer_cuts = _cuts([need.layers, *(r.layers for r in routes)])
    head_cuts = _cuts([need.heads, *(r.heads for r in routes)])
    token_cuts = _cuts([*need.tokens.spans, *(r.tokens for r in routes)])  # .spans: len() counts tokens
    senders: dict[tuple[int, int, int], list[int]] = defaultdict(list)
    for route in routes:
        for li in range(bisect_left(layer_cuts, route.layers.start), bisect_left(layer_cuts, route.layers.stop)):
            for hi in range(bisect_left(head_cuts, route.heads.start), bisect_left(head_cuts, route.heads.stop)):
                for ti in range(bisect_left(token_cuts, route.tokens.start), bisect_left(token_cuts, route.tokens.stop)):
                    senders[li, hi, ti].append(route.src)
    # Elementary boxes in (layer, head, token) order: the first bad box's corner is the first bad cell.
    for li, layer in enumerate(layer_cuts[:-1]):
        if layer not in need.layers:
            continue
        for hi, head in enumerate(head_cuts[:-1]):
            if head not in need.heads:
                continue
            for ti, token in enumerate(token_cuts[:-1]):
                if token not in need.tokens:
                    continue
                srcs = senders.get((li, hi, ti), [])
                if len(srcs) != 1:
                    where = f"dst rank {dst} layer {layer} head {head} token {token}"
                    if not srcs:
                        raise PlanError(f"{where}: missing (no route delivers it)")
                    times = "twice" if len(srcs) == 2 else f"{len(srcs)} times"
                    names = [f"src {s}" for s in sorted(srcs)]
                    raise PlanError(f"{where}: delivered {times} (by {', '.join(names[:-1])} and {names[-1]})")


@lru_cache(maxsize=256)
def cached_plan(src_layout: ParallelLayout, dst_layout: ParallelLayout, geometry: KVGeometry,
                tokens: SpanSet) -> TransferPlan:
    """:func:`plan`, remembered: an engine plans the same layouts and prompt lengths again and again, on its
    message thread (a peer's pull or push offer is checked against it)."""
    return plan(src_layout, dst_layout, geometry, tokens)
