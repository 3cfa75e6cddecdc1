"""Span, SpanSet, Roi, KVGeometry, ParallelLayout and pp_layer_spans, against plain Python sets."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ncclkv.layout import DTYPE_SIZES, KVGeometry, ParallelLayout, Roi, Span, SpanSet, pp_layer_spans

spans = st.tuples(st.integers(0, 60), st.integers(0, 20)).map(lambda t: Span(t[0], t[0] + t[1]))
span_sets = st.lists(spans, max_size=6).map(SpanSet)


def members(value: SpanSet | Span) -> set[int]:
    return {i for s in ([value] if isinstance(value, Span) else value.spans) for i in range(s.start, s.stop)}


def test_span_basics() -> None:
    span = Span(2, 5)
    assert len(span) == 3 and list(span) == [2, 3, 4] and 2 in span and 5 not in span and "2" not in span
    assert span.intersect(Span(4, 9)) == Span(4, 5) and span.intersect(Span(7, 9)).empty
    assert span.covers(Span(3, 5)) and span.covers(Span(9, 9)) and not span.covers(Span(1, 3))
    assert span.as_list() == [2, 5] and repr(span) == "[2,5)"
    with pytest.raises(ValueError, match="start=3, stop=2"):
        Span(3, 2)
    with pytest.raises(ValueError, match="start=-1"):
        Span(-1, 2)
    with pytest.raises(TypeError):
        Span(0, 2.0)  # type: ignore[arg-type]


@settings(max_examples=200, deadline=None)
@given(raw=st.lists(spans, max_size=6))
def test_spanset_is_normalised(raw: list[Span]) -> None:
    value = SpanSet(raw)
    assert members(value) == set().union(set(), *(members(s) for s in raw))
    assert all(not s.empty for s in value.spans)
    assert all(a.stop < b.start for a, b in zip(value.spans, value.spans[1:]))  # sorted, disjoint, not touching
    assert len(value) == len(members(value))
    assert SpanSet(reversed(raw)) == value == SpanSet([(s.start, s.stop) for s in raw])


@settings(max_examples=200, deadline=None)
@given(a=span_sets, b=span_sets, span=spans)
def test_spanset_algebra_matches_sets(a: SpanSet, b: SpanSet, span: Span) -> None:
    assert members(a.intersect(b)) == members(a) & members(b)
    assert members(a.intersect(span)) == members(a) & members(span)
    assert members(a.union(b)) == members(a) | members(b)
    assert members(a.difference(b)) == members(a) - members(b)
    assert a.covers(b) == (members(b) <= members(a))
    for index in (span.start, span.stop):
        assert (index in a) == (index in members(a))
    assert members(a.bounds) >= members(a) and (a.empty or (a.bounds.start in a and a.bounds.stop - 1 in a))


@settings(max_examples=100, deadline=None)
@given(mask=st.lists(st.booleans(), max_size=40))
def test_spanset_from_mask(mask: list[bool]) -> None:
    value = SpanSet.from_mask(mask)
    assert members(value) == {i for i, flag in enumerate(mask) if flag}


def test_spanset_misc() -> None:
    holes = SpanSet([(5, 7), (0, 2), (2, 3), (9, 9)])
    assert holes.spans == (Span(0, 3), Span(5, 7)) and holes.as_lists() == [[0, 3], [5, 7]]
    assert repr(holes) == "{[0,3),[5,7)}" and list(holes) == [Span(0, 3), Span(5, 7)]
    assert SpanSet().bounds == Span(0, 0) and SpanSet.range(4, 4).empty and SpanSet.range(1, 4) == SpanSet([Span(1, 4)])


@settings(max_examples=150, deadline=None)
@given(a=span_sets, b=span_sets, la=spans, lb=spans, ha=spans, hb=spans)
def test_roi_intersect_covers_cells(a: SpanSet, b: SpanSet, la: Span, lb: Span, ha: Span, hb: Span) -> None:
    x, y = Roi(a, la, ha), Roi(b, lb, hb)

    def cells(roi: Roi) -> set[tuple[int, int, int]]:
        return {(t, l, h) for t in members(roi.tokens) for l in roi.layers for h in roi.heads}

    assert cells(x.intersect(y)) == cells(x) & cells(y)
    assert x.covers(y) == (cells(y) <= cells(x))
    assert x.num_cells == len(cells(x)) and x.empty == (not cells(x))


def test_roi_values() -> None:
    geometry = KVGeometry(4, 8, 64, "float16")
    full = Roi.full(geometry, 10)
    assert full == Roi(SpanSet.range(0, 10), Span(0, 4), Span(0, 8))
    assert full.num_cells == 320 and full.nbytes(geometry) == 320 * 2 * 64 * 2
    assert Roi(Span(0, 3), Span(0, 1), Span(0, 1)).tokens == SpanSet.range(0, 3)  # a Span is promoted
    assert full.with_tokens(SpanSet.range(2, 3)).num_cells == 32
    assert Roi.full(KVGeometry(4, 1, 576, use_mla=True), 5).heads == Span(0, 1)
    with pytest.raises(TypeError, match="list"):
        Roi([0, 1], Span(0, 1), Span(0, 1))  # type: ignore[arg-type]


@pytest.mark.parametrize("field", ["layers", "heads"])
@pytest.mark.parametrize("bad", [(0, 4), range(0, 4), [0, 4]], ids=["tuple", "range", "list"])
def test_roi_refuses_layers_or_heads_that_are_not_spans(field: str, bad: object) -> None:
    """Layers and heads are checked as tokens are: before, Roi(tokens, (0, 4), heads) was made, and the
    lookup buffer's insert of it failed with "AttributeError: 'tuple' object has no attribute 'empty'"."""
    spans = {"layers": Span(0, 4), "heads": Span(0, 2), field: bad}
    with pytest.raises(TypeError, match=rf"^Roi\.{field} must be a Span, got {type(bad).__name__} "):
        Roi(SpanSet.range(0, 3), spans["layers"], spans["heads"])  # type: ignore[arg-type]


def test_geometry() -> None:
    g = KVGeometry(32, 8, 128)
    assert (g.dtype, g.itemsize, g.kv_parts, g.cell_bytes) == ("bfloat16", 2, 2, 512)
    mla = KVGeometry(61, 1, 576, "float8_e4m3fn", use_mla=True)
    assert (mla.kv_parts, mla.cell_bytes) == (1, 576)
    assert set(DTYPE_SIZES) >= {"float32", "float16", "bfloat16"}
    with pytest.raises(ValueError, match="num_kv_heads must be 1, got 8"):
        KVGeometry(32, 8, 128, use_mla=True)
    with pytest.raises(ValueError, match="'int4'"):
        KVGeometry(32, 8, 128, "int4")
    for bad in (0, -1, True, 2.0):
        with pytest.raises(ValueError, match="num_layers"):
            KVGeometry(bad, 8, 128)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [1, 0, None, "no", 1.0])
def test_geometry_refuses_a_use_mla_that_is_not_a_bool(bad: object) -> None:
    """Old code: accepted, the truthy ones read as MLA; the engine started, and every handshake failed at its
    encode ("Handshake would be refused by the peer: Expected `bool`, got `int` - at `$.body.geometry.use_mla`"),
    the handshake's wire type being a bool."""
    with pytest.raises(ValueError, match=rf"^KVGeometry.use_mla must be a bool, got {bad!r}$"):
        KVGeometry(32, 1, 128, use_mla=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("use_mla", [False, True])
def test_an_accepted_geometry_goes_in_a_handshake(use_mla: bool) -> None:
    from ncclkv.protocol import Envelope, Handshake, decode, encode

    geometry = KVGeometry(32, 1, 128, use_mla=use_mla)
    hello = Handshake.create("e", "producer", 0, ParallelLayout(), geometry, "tcp://127.0.0.1:5555", "127.0.0.1:6666")
    assert decode(encode(Envelope("e", 1, None, hello))).body.geometry.to_geometry() == geometry


def test_parallel_layout() -> None:
    layout = ParallelLayout(4, 2)
    assert layout.world_size == 8 and layout.rank(3, 1) == 7 and layout.coords(7) == (3, 1)
    assert [layout.coords(layout.rank(t, p)) for p in range(2) for t in range(4)] == [(t, p) for p in range(2) for t in range(4)]
    assert layout.spec() == "tp=4,pp=2" and ParallelLayout(1, 2, [3, 5]).spec() == "tp=1,pp=2,partition=3:5"
    assert ParallelLayout(1, 2, [3, 5]).layer_partition == (3, 5)  # lists become tuples
    with pytest.raises(ValueError, match="rank=8 outside world_size=8"):
        layout.coords(8)
    with pytest.raises(ValueError, match="tp_rank=4, pp_rank=0"):
        layout.rank(4, 0)
    with pytest.raises(ValueError, match="tp_size"):
        ParallelLayout(0, 1)
    with pytest.raises(ValueError, match="has 1 stages, pp_size is 2"):
        ParallelLayout(1, 2, (4,))
    layout.check(KVGeometry(8, 2, 64))  # 2 heads on tp 4: replicated, fine
    layout.check(KVGeometry(8, 1, 64, use_mla=True))
    with pytest.raises(ValueError, match="num_kv_heads=6 is neither divisible by nor a divisor of tp_size=4"):
        layout.check(KVGeometry(8, 6, 64))
    assert layout.layer_span(KVGeometry(7, 4, 64), 1) == Span(4, 7)


@pytest.mark.parametrize("pp_rank", [2, -1, -3])
def test_layer_span_refuses_a_stage_outside_the_layout(pp_rank: int) -> None:
    """Old code: pp_rank 2 of 2 stages, an IndexError; -1, the last stage's layers, silently; -3, IndexError."""
    with pytest.raises(ValueError, match=rf"^pp_rank={pp_rank} outside pp_size=2 \(tp=4\)$"):
        ParallelLayout(4, 2).layer_span(KVGeometry(7, 4, 64), pp_rank)


@pytest.mark.parametrize("partition", [("8", "8"), (8.0, 8.0), (True, 15), 16], ids=["str", "float", "bool", "int"])
def test_parallel_layout_refuses_a_partition_of_other_than_ints(partition: object) -> None:
    """As tp_size and pp_size are: before, ("8", "8") was taken and check() failed with "'<' not supported
    between instances of 'str' and 'int'", (8.0, 8.0) with a Span error naming neither the partition nor the
    stage, (True, 15) was read as (1, 15), and 16 failed with "'int' object is not iterable"."""
    with pytest.raises(ValueError, match=r"^ParallelLayout\.layer_partition must be a sequence of ints \(layers per "
                                         r"stage\), got "):
        ParallelLayout(1, 2, partition)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("num_layers", "pp_size", "sizes"),
    [(32, 1, [32]), (32, 4, [8, 8, 8, 8]), (32, 3, [11, 11, 10]), (5, 4, [1, 1, 2, 1]), (61, 8, [7, 7, 8, 8, 8, 8, 8, 7])],
)
def test_pp_layer_spans_follow_vllm_default(num_layers: int, pp_size: int, sizes: list[int]) -> None:
    result = pp_layer_spans(num_layers, pp_size)
    assert [len(s) for s in result] == sizes
    assert [s.start for s in result] == [0] + [s.stop for s in result[:-1]] and result[-1].stop == num_layers


def test_pp_layer_spans_partition_and_errors() -> None:
    assert pp_layer_spans(10, 2, (3, 7)) == [Span(0, 3), Span(3, 10)]
    for partition, text in [((3, 6), "sums to 9"), ((10, 0), "gives a stage no layer"), ((10,), "has 1 stages")]:
        with pytest.raises(ValueError, match=text):
            pp_layer_spans(10, 2, partition)
    with pytest.raises(ValueError, match="pp_size must be >= 1, got 0"):
        pp_layer_spans(10, 0)
    with pytest.raises(ValueError, match="pp_size=11 is more pipeline stages than num_layers=10"):
        pp_layer_spans(10, 11)
