"""Transfer plans: exact cover, shard containment, load balance, merging, validate()."""

from __future__ import annotations

import dataclasses
import json
from collections import defaultdict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ncclkv.layout import (KVGeometry, ParallelLayout, PlanError, Route, Span, SpanSet, TransferPlan, plan,
                           routes_between, routes_from_rank, shard_roi)
from ncclkv.layout._plan import _merge, _Piece, _pieces, _run_lengths
from ncclkv.layout._shard import head_blocks

# ---------------------------------------------------------------- strategies


@st.composite
def layouts(draw: st.DrawFn, num_layers: int) -> ParallelLayout:
    tp, pp = draw(st.integers(1, 8)), draw(st.integers(1, min(8, num_layers)))
    if pp > 1 and draw(st.integers(0, 3)) == 0:  # sometimes an explicit VLLM_PP_LAYER_PARTITION
        cuts = sorted(draw(st.sets(st.integers(1, num_layers - 1), min_size=pp - 1, max_size=pp - 1)))
        bounds = [0, *cuts, num_layers]
        return ParallelLayout(tp, pp, tuple(b - a for a, b in zip(bounds, bounds[1:])))
    return ParallelLayout(tp, pp)


token_sets = st.lists(st.tuples(st.integers(0, 3000), st.integers(1, 400)), max_size=5).map(
    lambda spans: SpanSet([(start, start + size) for start, size in spans])
)


@st.composite
def cases(draw: st.DrawFn) -> tuple[ParallelLayout, ParallelLayout, KVGeometry, SpanSet]:
    num_layers = draw(st.integers(1, 80))
    src, dst = draw(layouts(num_layers)), draw(layouts(num_layers))
    mla = draw(st.booleans())
    fits = [h for h in range(1, 65) if all(h % t == 0 or t % h == 0 for t in (src.tp_size, dst.tp_size))]
    heads = 1 if mla else draw(st.sampled_from(fits))
    dtype = draw(st.sampled_from(["bfloat16", "float32", "float8_e4m3fn"]))
    return src, dst, KVGeometry(num_layers, heads, 64, dtype, mla), draw(token_sets)


# ---------------------------------------------------------------- independent oracles


def assert_exact_cover(result: TransferPlan) -> None:
    """Checked differently from validate(): containment, pairwise disjointness, then cell counts."""
    src, dst, geometry, tokens = result.src_layout, result.dst_layout, result.geometry, result.tokens
    by_dst: dict[int, list[Route]] = defaultdict(list)
    for route in result.routes:
        assert shard_roi(src, geometry, route.src, tokens).covers(route.roi), route
        assert shard_roi(dst, geometry, route.dst, tokens).covers(route.roi), route
        by_dst[route.dst].append(route)
    for rank in range(dst.world_size):
        routes = by_dst[rank]
        for i, a in enumerate(routes):
            for b in routes[i + 1 :]:
                assert a.roi.intersect(b.roi).empty, (a, b)
        need = shard_roi(dst, geometry, rank, tokens)
        assert sum(r.num_cells for r in routes) == need.num_cells
        assert result.recv_bytes()[rank] == need.nbytes(geometry)


def assert_balanced(result: TransferPlan) -> None:
    """Holders of the same heads in the same stage send within one layer-row of each other.

    Layer-row: one layer of the heads one dst rank needs from that block, over all tokens (the
    planner cuts a holder set's units only at layer boundaries, into runs as even as layers allow).
    """
    src, dst, geometry, tokens = result.src_layout, result.dst_layout, result.geometry, result.tokens
    sent: dict[int, int] = defaultdict(int)
    for route in result.routes:
        sent[route.src] += route.num_cells
    holder_sets: dict[tuple[Span, Span], list[int]] = defaultdict(list)
    for rank in range(src.world_size):
        roi = shard_roi(src, geometry, rank, tokens)
        holder_sets[roi.layers, roi.heads].append(rank)
    for (layers, heads), ranks in holder_sets.items():
        row = max(
            len(heads.intersect(need.heads)) * len(tokens) * (not layers.intersect(need.layers).empty)
            for need in (shard_roi(dst, geometry, d, tokens) for d in range(dst.world_size))
        )
        loads = [sent[r] for r in ranks]
        assert max(loads) - min(loads) <= row, (layers, heads, dict(zip(ranks, loads)), row)


def assert_one_box_per_link(result: TransferPlan) -> None:
    """A src rank sends a dst rank one (layers x heads) box at most: its holder set's share of that dst's
    unit is one run of layers (routes differ only by token span)."""
    links: dict[tuple[int, int], set[tuple[Span, Span]]] = defaultdict(set)
    for route in result.routes:
        links[route.src, route.dst].add((route.layers, route.heads))
    assert all(len(box) == 1 for box in links.values()), {k: v for k, v in links.items() if len(v) > 1}


def cell_sources(result: TransferPlan) -> dict[tuple[int, int, int], int]:
    """(dst, layer, head) -> the src rank that sends it (for any token: one per cell, checked)."""
    out: dict[tuple[int, int, int], int] = {}
    for route in result.routes:
        for layer in route.layers:
            for head in route.heads:
                assert out.setdefault((route.dst, layer, head), route.src) == route.src, route
    return out


def assert_merged(result: TransferPlan) -> None:
    """No two routes of one link with the same tokens touch along layers or heads."""
    for i, a in enumerate(result.routes):
        for b in result.routes[i + 1 :]:
            if (a.src, a.dst, a.tokens) != (b.src, b.dst, b.tokens):
                continue
            assert not (a.layers == b.layers and (a.heads.stop == b.heads.start or b.heads.stop == a.heads.start)), (a, b)
            assert not (a.heads == b.heads and (a.layers.stop == b.layers.start or b.layers.stop == a.layers.start)), (a, b)


# ---------------------------------------------------------------- properties


@settings(max_examples=200, deadline=None)
@given(case=cases())
def test_plan_properties(case: tuple[ParallelLayout, ParallelLayout, KVGeometry, SpanSet]) -> None:
    src, dst, geometry, tokens = case
    result = plan(src, dst, geometry, tokens)
    result.validate()
    assert_exact_cover(result)
    assert_balanced(result)
    assert_merged(result)
    assert_one_box_per_link(result)
    assert list(result.routes) == sorted(result.routes)
    assert {r.tokens for r in result.routes} <= set(tokens.spans)
    assert plan(src, dst, geometry, tokens) == result  # deterministic
    send, recv = result.send_bytes(), result.recv_bytes()
    assert sorted(send) == list(range(src.world_size)) and sorted(recv) == list(range(dst.world_size))
    assert sum(send.values()) == sum(recv.values())
    assert sorted(sum((result.routes_from(s) for s in send), ())) == list(result.routes)
    assert sorted(sum((result.routes_to(d) for d in recv), ())) == list(result.routes)


@settings(max_examples=200, deadline=None)
@given(case=cases(), holes=st.lists(st.integers(0, 3400), max_size=6))
def test_routes_between_is_the_plan_of_one_link(case: tuple[ParallelLayout, ParallelLayout, KVGeometry, SpanSet],
                                                holes: list[int]) -> None:
    """Every (src, dst) link, PP splits and partitions, MLA, replicated heads, token sets with holes (one-token
    holes punched too): what a producer checks a pull against is what the consumer's whole plan gave it."""
    src, dst, geometry, tokens = case
    tokens = tokens.difference(SpanSet([(h, h + 1) for h in holes]))
    whole = plan(src, dst, geometry, tokens)
    for s in range(src.world_size):
        for d in range(dst.world_size):
            link = routes_between(src, dst, geometry, tokens, s, d)
            assert link == tuple(r for r in whole.routes_from(s) if r.dst == d), (s, d)
            assert link == tuple(r for r in whole.routes_to(d) if r.src == s), (s, d)
            assert len(link) <= len(tokens.spans)  # one box a link: its work is the pull's spans
    count = tokens.bounds.stop  # a token count: [0, count)
    last = src.world_size - 1, dst.world_size - 1
    assert routes_between(src, dst, geometry, count, *last) == tuple(
        r for r in plan(src, dst, geometry, count).routes_from(last[0]) if r.dst == last[1])


@settings(max_examples=200, deadline=None)
@given(case=cases(), holes=st.lists(st.integers(0, 3400), max_size=6))
def test_routes_from_rank_is_the_plan_of_one_source_rank(
        case: tuple[ParallelLayout, ParallelLayout, KVGeometry, SpanSet], holes: list[int]) -> None:
    """Every source rank, the same cases: what a producer rank pushes (its routes to every consumer rank) is what
    the whole plan gives it, in its order, one box a destination rank."""
    src, dst, geometry, tokens = case
    tokens = tokens.difference(SpanSet([(h, h + 1) for h in holes]))
    whole = plan(src, dst, geometry, tokens)
    for s in range(src.world_size):
        mine = routes_from_rank(src, dst, geometry, tokens, s)
        assert mine == whole.routes_from(s), s
        assert len(mine) <= dst.world_size * len(tokens.spans)
    count = tokens.bounds.stop
    assert routes_from_rank(src, dst, geometry, count, src.world_size - 1) == plan(
        src, dst, geometry, count).routes_from(src.world_size - 1)
    for bad in (src.world_size, -1, True):
        with pytest.raises(ValueError, match=rf"src rank {bad!r} outside {src.spec()}"):
            routes_from_rank(src, dst, geometry, tokens, bad)  # type: ignore[arg-type]


def test_routes_between_names_a_rank_outside_its_layout() -> None:
    for src_rank, dst_rank, match in ((2, 0, r"src rank 2 outside tp=2,pp=1 \(2 ranks\)"),
                                      (0, 4, r"dst rank 4 outside tp=2,pp=2 \(4 ranks\)"),
                                      (-1, 0, r"src rank -1 outside"), (0, True, r"dst rank True outside")):
        with pytest.raises(ValueError, match=match):
            routes_between(ParallelLayout(2, 1), ParallelLayout(2, 2), G32x8, 10, src_rank, dst_rank)


@st.composite
def broken_plans(draw: st.DrawFn) -> TransferPlan:
    src, dst, geometry, tokens = draw(cases())
    result = plan(src, dst, geometry, tokens)
    routes = list(result.routes)
    if not routes:
        extra = Route(0, 0, Span(0, 1), Span(0, 1), Span(5000, 5001))  # tokens outside the request
        return dataclasses.replace(result, routes=(extra,))
    index = draw(st.integers(0, len(routes) - 1))
    victim = routes[index]
    kind = draw(st.sampled_from(["drop", "double", "shrink", "grow", "move"]))
    if kind == "drop":
        del routes[index]
    elif kind == "double":
        routes.append(victim)
    elif kind == "shrink" and len(victim.tokens) > 1:
        routes[index] = dataclasses.replace(victim, tokens=Span(victim.tokens.start + 1, victim.tokens.stop))
    elif kind == "grow" or kind == "shrink":
        routes[index] = dataclasses.replace(victim, tokens=Span(victim.tokens.start, victim.tokens.stop + 1))
    else:  # a src that does not hold these layers and heads at all, or a src rank past the world
        strangers = [s for s in range(src.world_size + 1) if s >= src.world_size or not shard_roi(src, geometry, s, tokens).covers(victim.roi)]
        routes[index] = dataclasses.replace(victim, src=draw(st.sampled_from(strangers)))
    return dataclasses.replace(result, routes=tuple(routes))


@settings(max_examples=200, deadline=None)
@given(broken=broken_plans())
def test_validate_rejects_every_broken_plan(broken: TransferPlan) -> None:
    with pytest.raises(PlanError, match=r"dst rank \d+ layer \d+ head \d+ token \d+|outside"):
        broken.validate()


# ---------------------------------------------------------------- tables

G32x8 = KVGeometry(32, 8, 128)


def boxes(result: TransferPlan) -> set[tuple[int, int, tuple[int, int], tuple[int, int]]]:
    return {(r.src, r.dst, (r.layers.start, r.layers.stop), (r.heads.start, r.heads.stop)) for r in result.routes}


def test_tp4_to_tp2_pp2() -> None:
    result = plan(ParallelLayout(4, 1), ParallelLayout(2, 2), G32x8, 4096)
    result.validate()
    assert boxes(result) == {
        (0, 0, (0, 16), (0, 2)), (1, 0, (0, 16), (2, 4)), (2, 1, (0, 16), (4, 6)), (3, 1, (0, 16), (6, 8)),
        (0, 2, (16, 32), (0, 2)), (1, 2, (16, 32), (2, 4)), (2, 3, (16, 32), (4, 6)), (3, 3, (16, 32), (6, 8)),
    }  # fmt: skip
    assert result.send_bytes() == dict.fromkeys(range(4), 32 * 2 * 4096 * 2 * 128 * 2)
    assert result.recv_bytes() == dict.fromkeys(range(4), 16 * 4 * 4096 * 2 * 128 * 2)


def test_tp8_to_pp8() -> None:
    result = plan(ParallelLayout(8, 1), ParallelLayout(1, 8), G32x8, 100)
    result.validate()
    assert boxes(result) == {(s, d, (4 * d, 4 * d + 4), (s, s + 1)) for s in range(8) for d in range(8)}


def test_tp2_to_pp2_and_back() -> None:
    there = plan(ParallelLayout(2, 1), ParallelLayout(1, 2), G32x8, 64)
    back = plan(ParallelLayout(1, 2), ParallelLayout(2, 1), G32x8, 64)
    assert boxes(there) == {(0, 0, (0, 16), (0, 4)), (1, 0, (0, 16), (4, 8)), (0, 1, (16, 32), (0, 4)), (1, 1, (16, 32), (4, 8))}
    assert boxes(back) == {(0, 0, (0, 16), (0, 4)), (1, 0, (16, 32), (0, 4)), (0, 1, (0, 16), (4, 8)), (1, 1, (16, 32), (4, 8))}


def test_gqa_8_heads_on_tp16() -> None:
    same = plan(ParallelLayout(16, 1), ParallelLayout(16, 1), G32x8, 10)
    # Each head has two holders and two needers: each holder sends to exactly one of them.
    assert sorted(r.src for r in same.routes) == list(range(16))
    assert all(r.heads == Span(r.dst // 2, r.dst // 2 + 1) and r.src // 2 == r.dst // 2 for r in same.routes)
    to_tp2 = plan(ParallelLayout(16, 1), ParallelLayout(2, 1), G32x8, 10)
    # One unit per head (its one needer): split along layers over the head's two holders, half each.
    assert boxes(to_tp2) == {(2 * h + i, h // 4, (16 * i, 16 * i + 16), (h, h + 1)) for h in range(8) for i in range(2)}
    from_tp2 = plan(ParallelLayout(2, 1), ParallelLayout(16, 1), G32x8, 10)
    assert boxes(from_tp2) == {(d // 8, d, (0, 32), (d // 2, d // 2 + 1)) for d in range(16)}


def test_mla_tp8_to_tp4_spreads_over_holders() -> None:
    geometry = KVGeometry(61, 1, 576, use_mla=True)
    result = plan(ParallelLayout(8, 1), ParallelLayout(4, 1), geometry, 1000)
    result.validate()
    # 4 units of 61 layers over 8 holders: each unit in two runs (31 + 30 layers), cut where no run straddles.
    assert boxes(result) == {(s, s // 2, (0, 31) if s % 2 == 0 else (31, 61), (0, 1)) for s in range(8)}
    assert result.to_json()["routes"][0] == {"src": 0, "dst": 0, "layers": [0, 31], "heads": [0, 1], "tokens": [0, 1000]}
    one_to_many = plan(ParallelLayout(2, 1), ParallelLayout(8, 1), geometry, 1000)
    assert [len(one_to_many.routes_from(s)) for s in range(2)] == [4, 4]


def test_uneven_units_are_cut_along_layers_into_even_runs() -> None:
    # MLA tp2 -> pp3 over 32 layers: units of 11, 11, 10 layers laid end to end, cut at 16: each holder 16 layers
    # (dealt whole, largest first, they were 21 and 11); the middle unit is the one split.
    result = plan(ParallelLayout(2, 1), ParallelLayout(1, 3), KVGeometry(32, 1, 64, use_mla=True), 10)
    assert [sum(len(r.layers) for r in result.routes_from(s)) for s in range(2)] == [16, 16]
    assert boxes(result) == {(0, 0, (0, 11), (0, 1)), (0, 1, (11, 16), (0, 1)), (1, 1, (16, 22), (0, 1)), (1, 2, (22, 32), (0, 1))}


def senders_and_loads(result: TransferPlan) -> dict[int, int]:
    """Layer-rows (cells per token) each src rank sends; 0 for a rank that sends nothing."""
    tokens = max(len(result.tokens), 1)
    return {rank: sent // (result.geometry.cell_bytes * tokens) for rank, sent in result.send_bytes().items()}


@pytest.mark.parametrize(
    ("src", "dst", "geometry", "loads"),
    [
        # the reviewer's cases: before, ranks [0, 2, ..., 14] sent 32 rows each (one whole head), odd ranks nothing
        (ParallelLayout(16, 1), ParallelLayout(2, 1), G32x8, [16] * 16),
        # before, ranks 0 and 1 sent the whole latent (61 rows) each, ranks 2..7 nothing
        (ParallelLayout(8, 1), ParallelLayout(2, 1), KVGeometry(61, 1, 576, use_mla=True), [16, 15, 15, 15] * 2),
        (ParallelLayout(8, 1), ParallelLayout(2, 1), KVGeometry(32, 1, 576, use_mla=True), [8] * 8),
        # GQA 2 heads on tp4 x pp2 -> tp1: before, ranks 0, 2, 4, 6 only
        (ParallelLayout(4, 2), ParallelLayout(1, 1), KVGeometry(32, 2, 128), [8] * 8),
        (ParallelLayout(4, 2, (5, 27)), ParallelLayout(1, 1), KVGeometry(32, 2, 128), [3, 2, 3, 2, 14, 13, 14, 13]),
        # fewer layers than holders: one layer each to the first holders
        (ParallelLayout(8, 1), ParallelLayout(1, 1), KVGeometry(3, 1, 64, use_mla=True), [1, 1, 1, 0, 0, 0, 0, 0]),
        # two needers of one replicated head: each holder serves its own dst rank whole
        (ParallelLayout(16, 1), ParallelLayout(16, 1), G32x8, [32] * 16),
    ],
)
def test_replicated_blocks_spread_over_every_holder(src: ParallelLayout, dst: ParallelLayout, geometry: KVGeometry,
                                                    loads: list[int]) -> None:
    result = plan(src, dst, geometry, 100)
    result.validate()
    assert list(senders_and_loads(result).values()) == loads
    assert_balanced(result)
    assert_one_box_per_link(result)


@settings(max_examples=150, deadline=None)
@given(case=cases())
def test_every_holder_sends_when_the_units_have_enough_layers(case: tuple[ParallelLayout, ParallelLayout, KVGeometry, SpanSet]) -> None:
    src, dst, geometry, tokens = case
    if tokens.empty:
        tokens = SpanSet.range(0, 1)
    result = plan(src, dst, geometry, tokens)
    sending = {r.src for r in result.routes}
    stages = [src.layer_span(geometry, p) for p in range(src.pp_size)]
    needs = [shard_roi(dst, geometry, d, 1) for d in range(dst.world_size)]
    for pp_rank, stage in enumerate(stages):
        for block, tp_ranks in head_blocks(geometry, src.tp_size):
            rows = sum(len(stage.intersect(n.layers)) for n in needs if not block.intersect(n.heads).empty)
            holders = [src.rank(t, pp_rank) for t in tp_ranks]
            # rows: the layers this holder set owes, one head (or the latent) each when it has several holders
            assert len([h for h in holders if h in sending]) == min(len(holders), rows), (pp_rank, block, holders, rows)


def test_run_lengths_end_on_unit_ends_where_they_can() -> None:
    assert _run_lengths(122, 8, {61, 122}) == [16, 15, 15, 15, 16, 15, 15, 15]  # no run straddles 61
    assert _run_lengths(244, 8, {61, 122, 183, 244}) == [31, 30] * 4
    assert _run_lengths(32, 2, {11, 22, 32}) == [16, 16]
    assert _run_lengths(10, 4, {10}) == [3, 3, 2, 2]  # nothing to align: the longer runs first
    assert _run_lengths(10, 4, {2, 10}) == [2, 3, 3, 2]
    assert _run_lengths(3, 3, {1, 2, 3}) == [1, 1, 1]


TOKENS = SpanSet([(0, 64)])
SUBSETS = [SpanSet([(3, 5), (40, 41)]), SpanSet([(63, 64)])]
GRID_TP, GRID_PP, GRID_LAYERS = (1, 2, 3, 4, 8, 16), (1, 2, 4), (1, 2, 5, 12, 32)


@pytest.mark.parametrize("kind", [1, 2, 4, 8, 16, "mla"])
def test_sources_do_not_depend_on_the_tokens(kind: int | str) -> None:
    """A producer re-plans a pull with only the tokens it asks for, a consumer a push offer: for every layout
    pair the plan of a token subset is the plan of the whole, restricted to those tokens (the same boxes, the
    same source for each (dst, layer, head)); and every plan is an exact cover."""
    for num_layers in GRID_LAYERS:
        geometry = KVGeometry(num_layers, 1, 8, use_mla=True) if kind == "mla" else KVGeometry(num_layers, int(kind), 8)
        heads = geometry.num_kv_heads
        tps = [t for t in GRID_TP if geometry.use_mla or heads % t == 0 or t % heads == 0]
        sides = [ParallelLayout(tp, pp) for tp in tps for pp in GRID_PP if pp <= num_layers]
        for src in sides:
            for dst in sides:
                _pieces.cache_clear()  # each plan computed afresh, not the same cached boxes
                whole = plan(src, dst, geometry, TOKENS)
                whole.validate()
                for subset in SUBSETS:
                    _pieces.cache_clear()
                    part = plan(src, dst, geometry, subset)
                    assert boxes(part) == boxes(whole), (src, dst, geometry, subset)
                    assert part.routes == tuple(sorted(dataclasses.replace(r, tokens=span) for r in whole.routes
                                                       for span in subset.spans))


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_cell_sources_do_not_depend_on_the_tokens_hypothesis(data: st.DataObject) -> None:
    """Prefill and decode TP 1..16, PP 1..4, kv heads {1, 2, 4, 8, 16} or MLA, layers {1, 2, 5, 12, 32}; a token
    set with holes and a subset of it (a pull or push that carries some of the tokens)."""
    num_layers = data.draw(st.sampled_from([1, 2, 5, 12, 32]))
    mla = data.draw(st.booleans())
    heads = 1 if mla else data.draw(st.sampled_from([1, 2, 4, 8, 16]))
    fits = [t for t in range(1, 17) if mla or heads % t == 0 or t % heads == 0]
    src, dst = (ParallelLayout(data.draw(st.sampled_from(fits)), data.draw(st.integers(1, min(4, num_layers))))
                for _ in range(2))
    geometry = KVGeometry(num_layers, heads, 8, use_mla=mla)
    tokens = data.draw(token_sets.filter(lambda t: not t.empty))
    subset = SpanSet(s for s in tokens.spans if data.draw(st.booleans()))
    first = tokens.spans[0]
    subset = subset.union(SpanSet([(first.start + 1, first.stop)]))  # a span's tail: its own boundaries
    subset = subset if not subset.empty else tokens
    _pieces.cache_clear()
    whole = plan(src, dst, geometry, tokens)
    _pieces.cache_clear()
    part = plan(src, dst, geometry, subset)
    whole.validate()
    part.validate()
    assert cell_sources(part) == cell_sources(whole)


def test_token_holes_give_one_route_per_span_and_empty_tokens_no_routes() -> None:
    tokens = SpanSet([(0, 100), (200, 300), (301, 302)])
    result = plan(ParallelLayout(2, 1), ParallelLayout(2, 1), G32x8, tokens)
    assert [(r.src, r.dst, r.tokens) for r in result.routes] == [(s, s, t) for s in range(2) for t in tokens.spans]
    empty = plan(ParallelLayout(2, 1), ParallelLayout(1, 2), G32x8, SpanSet())
    empty.validate()
    assert empty.routes == () and empty.send_bytes() == {0: 0, 1: 0} and empty.recv_bytes() == {0: 0, 1: 0}


def test_to_json_shape_and_grid() -> None:
    result = plan(ParallelLayout(4, 1), ParallelLayout(2, 2), G32x8, 4096)
    data = json.loads(json.dumps(result.to_json()))
    assert set(data) == {"routes", "send_bytes", "recv_bytes"}
    assert data["routes"][0] == {"src": 0, "dst": 0, "layers": [0, 16], "heads": [0, 2], "tokens": [0, 4096]}
    assert data["send_bytes"] == {str(r): n for r, n in result.send_bytes().items()}
    grid = result.grid().splitlines()
    assert grid[1].split()[1:] == ["s0(tp0,pp0)", "s1(tp1,pp0)", "s2(tp2,pp0)", "s3(tp3,pp0)"]
    assert grid[2].split() == ["d0(tp0,pp0)", "L0:16", "H0:2", "L0:16", "H2:4", ".", "."]
    assert grid[5].split() == ["d3(tp1,pp1)", ".", ".", "L16:32", "H4:6", "L16:32", "H6:8"]


def test_plan_rejects_layouts_that_cannot_hold_the_geometry() -> None:
    with pytest.raises(ValueError, match="num_kv_heads=8 is neither divisible by nor a divisor of tp_size=3"):
        plan(ParallelLayout(4, 1), ParallelLayout(3, 1), G32x8, 10)
    with pytest.raises(ValueError, match="pp_size=4 is more pipeline stages than num_layers=3"):
        plan(ParallelLayout(1, 4), ParallelLayout(1, 1), KVGeometry(3, 8, 64), 10)


def test_route_values() -> None:
    route = Route(1, 2, Span(0, 4), Span(2, 4), Span(10, 20))
    assert route.roi.num_cells == route.num_cells == 80
    assert route.nbytes(KVGeometry(4, 8, 64, "float16")) == 80 * 2 * 64 * 2
    assert route.nbytes(KVGeometry(4, 1, 576, "float16", use_mla=True)) == 80 * 576 * 2
    with pytest.raises(ValueError, match="heads"):
        Route(0, 0, Span(0, 1), Span(3, 3), Span(0, 1))
    with pytest.raises(ValueError, match="src"):
        Route(-1, 0, Span(0, 1), Span(0, 1), Span(0, 1))


def test_merge_joins_touching_boxes_of_one_link() -> None:
    a, b = Span(0, 4), Span(4, 8)
    pieces = [_Piece(0, 1, a, Span(0, 2)), _Piece(0, 1, a, Span(2, 3)), _Piece(0, 1, b, Span(0, 3)), _Piece(1, 1, b, Span(3, 4))]
    assert _merge(pieces) == [_Piece(0, 1, Span(0, 8), Span(0, 3)), _Piece(1, 1, b, Span(3, 4))]
    assert _merge([_Piece(0, 1, a, Span(0, 2)), _Piece(0, 1, b, Span(1, 2))]) == sorted(
        [_Piece(0, 1, a, Span(0, 2)), _Piece(0, 1, b, Span(1, 2))]
    )


# ---------------------------------------------------------------- validate() on hand-broken plans


def base_plan() -> TransferPlan:
    return plan(ParallelLayout(2, 1), ParallelLayout(1, 2), KVGeometry(4, 2, 8), SpanSet([(0, 100)]))


def with_routes(result: TransferPlan, routes: list[Route]) -> TransferPlan:
    return dataclasses.replace(result, routes=tuple(routes))


def test_validate_names_a_missing_cell() -> None:
    good = base_plan()  # src 0 holds head 0, src 1 head 1; dst 0 layers [0,2), dst 1 layers [2,4)
    r = good.routes_to(1)[1]
    assert (r.src, r.layers, r.heads) == (1, Span(2, 4), Span(1, 2))
    routes = [x for x in good.routes if x != r] + [
        dataclasses.replace(r, tokens=Span(0, 40)),
        dataclasses.replace(r, tokens=Span(41, 100)),
    ]
    with pytest.raises(PlanError, match=r"^dst rank 1 layer 2 head 1 token 40: missing \(no route delivers it\)$"):
        with_routes(good, routes).validate()
    with pytest.raises(PlanError, match=r"^dst rank 0 layer 0 head 0 token 0: missing"):
        with_routes(good, list(good.routes[1:])).validate()


def test_validate_names_a_doubled_cell() -> None:
    good = base_plan()
    r = good.routes_to(0)[0]
    overlap = [dataclasses.replace(r, tokens=Span(0, 60)), dataclasses.replace(r, tokens=Span(50, 100))]
    with pytest.raises(PlanError, match=r"^dst rank 0 layer 0 head 0 token 50: delivered twice \(by src 0 and src 0\)$"):
        with_routes(good, [x for x in good.routes if x != r] + overlap).validate()
    mla = plan(ParallelLayout(3, 1), ParallelLayout(1, 1), KVGeometry(4, 1, 8, use_mla=True), 10)
    extra = [dataclasses.replace(mla.routes[0], src=s) for s in (1, 2)]
    with pytest.raises(PlanError, match=r"^dst rank 0 layer 0 head 0 token 0: delivered 3 times \(by src 0, src 1 and src 2\)$"):
        with_routes(mla, list(mla.routes) + extra).validate()


def test_validate_names_a_cell_outside_a_shard() -> None:
    good = base_plan()
    r = good.routes_to(0)[1]  # src 1 -> dst 0, head 1
    with pytest.raises(PlanError, match=r"^dst rank 0 layer 0 head 1 token 0: outside src rank 0's shard"):
        with_routes(good, [dataclasses.replace(x, src=0) if x == r else x for x in good.routes]).validate()
    wide = dataclasses.replace(r, layers=Span(1, 3))
    with pytest.raises(PlanError, match=r"^dst rank 0 layer 2 head 1 token 0: outside dst rank 0's need"):
        with_routes(good, [wide if x == r else x for x in good.routes]).validate()
    late = dataclasses.replace(r, tokens=Span(90, 101))
    with pytest.raises(PlanError, match=r"^dst rank 0 layer 0 head 1 token 100: outside src rank 1's shard"):
        with_routes(good, [late if x == r else x for x in good.routes]).validate()
    with pytest.raises(PlanError, match=r"^dst rank 0 layer 0 head 1 token 0: src rank 2 outside tp=2,pp=1 \(2 ranks"):
        with_routes(good, [dataclasses.replace(r, src=2)]).validate()


def test_largest_layouts_plan_and_validate() -> None:
    tokens = SpanSet([(i * 1000, i * 1000 + 500) for i in range(8)])
    for src, dst in [(ParallelLayout(8, 8), ParallelLayout(8, 8)), (ParallelLayout(8, 8), ParallelLayout(1, 1)), (ParallelLayout(1, 1), ParallelLayout(8, 8))]:
        result = plan(src, dst, KVGeometry(80, 64, 128), tokens)
        result.validate()
        assert_exact_cover(result)


@given(st.integers(0, 60), st.integers(0, 60), st.integers(1, 70))
def test_span_split_covers_the_span_in_order(start: int, length: int, size: int) -> None:
    span = Span(start, start + length)
    parts = span.split(size)
    assert [p.start for p in parts[1:]] == [p.stop for p in parts[:-1]]  # consecutive, no gap, no overlap
    assert SpanSet(parts) == SpanSet([span]) and all(1 <= len(p) <= size for p in parts)
    assert all(len(p) == size for p in parts[:-1])


def test_span_split_needs_a_positive_size() -> None:
    with pytest.raises(ValueError, match="size >= 1, got 0"):
        Span(0, 4).split(0)


@given(st.integers(0, 60), st.integers(1, 60), st.data())
def test_span_split_even_covers_the_span_in_order(start: int, length: int, data: st.DataObject) -> None:
    span = Span(start, start + length)
    count = data.draw(st.integers(1, length))
    parts = span.split_even(count)
    assert len(parts) == count and [p.start for p in parts[1:]] == [p.stop for p in parts[:-1]]
    assert SpanSet(parts) == SpanSet([span])
    lengths = [len(p) for p in parts]
    assert lengths == sorted(lengths, reverse=True) and lengths[0] - lengths[-1] <= 1 and lengths[-1] >= 1


@pytest.mark.parametrize("count", [0, 5, True, 2.0])
def test_span_split_even_needs_a_count_within_the_length(count: object) -> None:
    with pytest.raises(ValueError, match=rf"needs 1 <= count <= 4 \(the span's length\), got {count!r}"):
        Span(3, 7).split_even(count)  # type: ignore[arg-type]


def test_route_pieces_hold_at_most_max_bytes_per_layer() -> None:
    geometry = KVGeometry(num_layers=4, num_kv_heads=8, head_size=128, dtype="bfloat16")  # 512 B per token and head
    route = Route(0, 1, Span(0, 4), Span(2, 6), Span(10, 110))  # 4 heads: 2 KiB per token and layer
    assert route.pieces(geometry, 0) == (Span(10, 110),)
    pieces = route.pieces(geometry, 40 << 10)  # 20 tokens each
    assert pieces == tuple(Span(t, t + 20) for t in range(10, 110, 20))
    assert route.pieces(geometry, 100) == tuple(Span(t, t + 1) for t in range(10, 110))  # at least one token
    # 30 tokens at most: 4 pieces, as even as 4 allow (25 each), not 30, 30, 30 and a short 10
    assert route.pieces(geometry, 60 << 10) == tuple(Span(t, t + 25) for t in range(10, 110, 25))
    assert [len(p) for p in route.pieces(geometry, 68 << 10)] == [34, 33, 33]  # 34 at most: 3 pieces, no short tail
    with pytest.raises(ValueError, match="max_bytes must be an int >= 0, got -1"):
        route.pieces(geometry, -1)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 300), st.integers(1, 4), st.integers(1, 400))
def test_route_pieces_are_even_and_as_few_as_max_bytes_allows(num_tokens: int, num_heads: int, most: int) -> None:
    """Lengths differ by at most one (no short tail), the count is the fewest pieces of at most ``most``
    tokens, and each piece's layer stays within max_bytes: producers cut with this, consumers accept it."""
    geometry = KVGeometry(num_layers=2, num_kv_heads=4, head_size=8, dtype="float32")
    route = Route(0, 0, Span(0, 2), Span(0, num_heads), Span(5, 5 + num_tokens))
    max_bytes = most * num_heads * geometry.cell_bytes
    pieces = route.pieces(geometry, max_bytes)
    lengths = [len(p) for p in pieces]
    assert len(pieces) == -(-num_tokens // most)
    assert max(lengths) - min(lengths) <= 1 and min(lengths) >= 1
    assert all(len(p) * num_heads * geometry.cell_bytes <= max_bytes for p in pieces)
    assert SpanSet(pieces) == SpanSet([route.tokens]) and list(pieces) == sorted(pieces)


def test_route_layer_runs_hold_at_most_max_bytes_of_slices() -> None:
    geometry = KVGeometry(num_layers=32, num_kv_heads=8, head_size=128, dtype="bfloat16")  # 512 B per token and head
    route = Route(0, 1, Span(8, 18), Span(2, 6), Span(0, 64))  # 10 layers of 4 heads x 64 tokens: 128 KiB each
    assert route.layer_runs(geometry, 0) == tuple(Span(layer, layer + 1) for layer in range(8, 18))
    assert route.layer_runs(geometry, 4 << 20) == (Span(8, 18),)  # all ten fit in 4 MiB
    assert route.layer_runs(geometry, 512 << 10) == (Span(8, 12), Span(12, 15), Span(15, 18))  # 4 at most, even
    assert [len(r) for r in route.layer_runs(geometry, 640 << 10)] == [5, 5]  # 5 at most: two runs, none short
    assert route.layer_runs(geometry, 100) == route.layer_runs(geometry, 0)  # a slice over max_bytes goes alone
    with pytest.raises(ValueError, match="max_bytes must be an int >= 0, got -1"):
        route.layer_runs(geometry, -1)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 40), st.integers(1, 64), st.integers(0, 3 << 20))
def test_route_layer_runs_are_even_ordered_and_as_few_as_max_bytes_allows(num_layers: int, num_tokens: int,
                                                                          max_bytes: int) -> None:
    geometry = KVGeometry(num_layers=64, num_kv_heads=4, head_size=64, dtype="bfloat16")
    route = Route(0, 0, Span(3, 3 + num_layers), Span(0, 4), Span(0, num_tokens))
    per_layer = num_tokens * 4 * geometry.cell_bytes
    runs = route.layer_runs(geometry, max_bytes)
    lengths = [len(r) for r in runs]
    most = 1 if max_bytes < per_layer else max_bytes // per_layer
    assert len(runs) == -(-num_layers // most)
    assert max(lengths) - min(lengths) <= 1 and min(lengths) >= 1
    assert all(len(r) == 1 or len(r) * per_layer <= max_bytes for r in runs)
    assert SpanSet(runs) == SpanSet([route.layers]) and list(runs) == sorted(runs)


def test_route_hash_is_computed_once_and_follows_equality() -> None:
    a = Route(0, 1, Span(0, 2), Span(0, 4), Span(0, 9))
    b = Route(0, 1, Span(0, 2), Span(0, 4), Span(0, 9))
    c = Route(0, 1, Span(0, 2), Span(0, 4), Span(0, 8))
    assert a == b and hash(a) == hash(b) and a is not b
    assert a != c and c < a
    assert {a: 1}[b] == 1 and c not in {a}
    assert "_hash" not in repr(a) and dataclasses.replace(a, tokens=Span(0, 8)) == c
    assert hash(dataclasses.replace(a, tokens=Span(0, 8))) == hash(c)
