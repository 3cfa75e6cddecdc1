"""shard_roi: which (layer, kv-head, token) cells each TP x PP rank holds."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ncclkv.layout import KVGeometry, ParallelLayout, Roi, Span, SpanSet, shard_roi
from ncclkv.layout._shard import head_blocks, shard_heads, token_set


def heads_of(layout: ParallelLayout, geometry: KVGeometry) -> list[Span]:
    return [shard_roi(layout, geometry, layout.rank(t, 0), 1).heads for t in range(layout.tp_size)]


def test_heads_split_evenly_when_enough_heads() -> None:
    geometry = KVGeometry(32, 8, 128)
    assert heads_of(ParallelLayout(4, 1), geometry) == [Span(0, 2), Span(2, 4), Span(4, 6), Span(6, 8)]
    assert heads_of(ParallelLayout(8, 1), geometry) == [Span(i, i + 1) for i in range(8)]
    assert heads_of(ParallelLayout(1, 1), geometry) == [Span(0, 8)]


def test_gqa_heads_replicated_on_consecutive_tp_ranks() -> None:
    # 8 kv heads on tp 16: each head on 2 ranks, tp rank i holds head i // 2 (vLLM's rule).
    geometry = KVGeometry(32, 8, 128)
    assert heads_of(ParallelLayout(16, 1), geometry) == [Span(i // 2, i // 2 + 1) for i in range(16)]
    assert heads_of(ParallelLayout(8, 1), KVGeometry(4, 2, 64)) == [Span(i // 4, i // 4 + 1) for i in range(8)]


def test_mla_latent_on_every_tp_rank() -> None:
    geometry = KVGeometry(61, 1, 576, use_mla=True)
    assert heads_of(ParallelLayout(8, 1), geometry) == [Span(0, 1)] * 8


def test_ranks_are_pp_major_and_layers_follow_vllm_split() -> None:
    layout, geometry = ParallelLayout(2, 3), KVGeometry(32, 4, 64)
    # vLLM's default: 32 // 3 = 10 each, the remainder 2 to the stages before the last.
    expected_layers = [Span(0, 11), Span(11, 22), Span(22, 32)]
    for rank in range(6):
        roi = shard_roi(layout, geometry, rank, 100)
        assert roi.layers == expected_layers[rank // 2]
        assert roi.heads == Span(2 * (rank % 2), 2 * (rank % 2) + 2)
        assert roi.tokens == SpanSet.range(0, 100)


def test_explicit_layer_partition() -> None:
    layout, geometry = ParallelLayout(1, 3, (4, 20, 8)), KVGeometry(32, 4, 64)
    assert [shard_roi(layout, geometry, r, 1).layers for r in range(3)] == [Span(0, 4), Span(4, 24), Span(24, 32)]


@pytest.mark.parametrize(
    ("partition", "message"),
    [
        ((3, -1), r"layer partition \(3, -1\) has a negative entry, -1 \(stage 1\)"),
        ((-1, 3), r"has a negative entry, -1 \(stage 0\)"),  # sums to 2: the negative entry is named first
        ((2, 0), r"gives a stage no layer \(stage 1 has 0\)"),
        ((1, 2), r"sums to 3, num_layers is 2"),
    ],
)
def test_bad_layer_partition_is_named(partition: tuple[int, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        shard_roi(ParallelLayout(1, 2, partition), KVGeometry(2, 1, 8), 0, 1)


def test_tokens_argument_forms() -> None:
    layout, geometry = ParallelLayout(1, 1), KVGeometry(2, 1, 8)
    holes = SpanSet([(0, 10), (20, 30)])
    assert shard_roi(layout, geometry, 0, holes) == Roi(holes, Span(0, 2), Span(0, 1))
    assert shard_roi(layout, geometry, 0, 0).empty
    assert token_set(Span(3, 5)) == SpanSet.range(3, 5)
    with pytest.raises(ValueError, match="-1"):
        shard_roi(layout, geometry, 0, -1)
    with pytest.raises(TypeError):
        token_set(True)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        token_set("10")  # type: ignore[arg-type]


def test_rank_outside_world_is_rejected() -> None:
    with pytest.raises(ValueError, match="rank=4 outside world_size=4"):
        shard_roi(ParallelLayout(2, 2), KVGeometry(4, 2, 8), 4, 10)
    with pytest.raises(ValueError, match="tp_rank=3 outside tp_size=2"):
        shard_heads(KVGeometry(4, 2, 8), 2, 3)


@pytest.mark.parametrize(
    ("tp", "pp", "layers", "heads", "numbers"),
    [
        (4, 1, 32, 6, ("num_kv_heads=6", "tp_size=4")),
        (3, 1, 32, 2, ("num_kv_heads=2", "tp_size=3")),
        (1, 9, 8, 8, ("pp_size=9", "num_layers=8")),
    ],
)
def test_layouts_that_cannot_hold_the_geometry(tp: int, pp: int, layers: int, heads: int, numbers: tuple[str, ...]) -> None:
    with pytest.raises(ValueError) as info:
        shard_roi(ParallelLayout(tp, pp), KVGeometry(layers, heads, 64), 0, 10)
    for number in numbers:
        assert number in str(info.value)


@st.composite
def invalid_case(draw: st.DrawFn) -> tuple[int, int, int, int, bool]:
    """(tp, pp, layers, heads, mla) with bad heads for tp, or more stages than layers (or both)."""
    if draw(st.booleans()):
        tp = draw(st.integers(2, 8))
        heads = draw(st.sampled_from([h for h in range(1, 65) if h % tp and tp % h]))
        layers, pp = draw(st.integers(1, 80)), draw(st.integers(1, 8))
        return tp, pp, layers, heads, False
    layers = draw(st.integers(1, 7))
    mla = draw(st.booleans())
    return draw(st.integers(1, 8)), draw(st.integers(layers + 1, 8)), layers, 1 if mla else draw(st.integers(1, 64)), mla


@settings(max_examples=150, deadline=None)
@given(case=invalid_case())
def test_invalid_layouts_raise_naming_numbers(case: tuple[int, int, int, int, bool]) -> None:
    tp, pp, layers, heads, mla = case
    bad_heads = not mla and heads % tp != 0 and tp % heads != 0
    assert bad_heads or pp > layers
    with pytest.raises(ValueError) as info:
        shard_roi(ParallelLayout(tp, pp), KVGeometry(layers, heads, 64, use_mla=mla), 0, 10)
    message = str(info.value)
    if bad_heads:
        assert f"num_kv_heads={heads}" in message and f"tp_size={tp}" in message
    else:
        assert f"pp_size={pp}" in message and f"num_layers={layers}" in message


@st.composite
def layout_and_geometry(draw: st.DrawFn) -> tuple[ParallelLayout, KVGeometry]:
    layers = draw(st.integers(1, 80))
    tp, pp = draw(st.integers(1, 8)), draw(st.integers(1, min(8, layers)))
    mla = draw(st.booleans())
    heads = 1 if mla else draw(st.sampled_from([h for h in range(1, 65) if h % tp == 0 or tp % h == 0]))
    return ParallelLayout(tp, pp), KVGeometry(layers, heads, 64, use_mla=mla)


@settings(max_examples=150, deadline=None)
@given(case=layout_and_geometry())
def test_shards_cover_every_cell_with_the_expected_replication(case: tuple[ParallelLayout, KVGeometry]) -> None:
    layout, geometry = case
    heads, tp = geometry.num_kv_heads, layout.tp_size
    replicas = tp if geometry.use_mla else max(1, tp // heads)
    per_stage = [shard_roi(layout, geometry, layout.rank(0, p), 5).layers for p in range(layout.pp_size)]
    # Stages tile the layers in order, each non-empty.
    assert [s.start for s in per_stage] == [0] + [s.stop for s in per_stage[:-1]]
    assert per_stage[-1].stop == geometry.num_layers and all(not s.empty for s in per_stage)
    for pp_rank in range(layout.pp_size):
        held = [0] * heads
        for tp_rank in range(tp):
            roi = shard_roi(layout, geometry, layout.rank(tp_rank, pp_rank), 5)
            assert roi.layers == per_stage[pp_rank] and roi.tokens == SpanSet.range(0, 5)
            assert len(roi.heads) == (1 if replicas > 1 else heads // tp)
            for head in roi.heads:
                held[head] += 1
        assert held == [replicas] * heads
    # head_blocks groups exactly the ranks holding the same heads, in head order.
    blocks = head_blocks(geometry, tp)
    assert [b.start for b, _ in blocks] == [0] + [b.stop for b, _ in blocks][:-1]
    assert blocks[-1][0].stop == heads
    for block, ranks in blocks:
        assert len(ranks) == replicas and all(shard_heads(geometry, tp, r) == block for r in ranks)
