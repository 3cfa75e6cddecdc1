"""Paged gather/scatter against a reference written as plain loops over tokens and heads."""

from __future__ import annotations

import itertools
import random
import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ncclkv.errors import ShapeMismatchError
from ncclkv.layout import Span
from ncclkv.paged import (
    CacheLayout, PagedCacheSpec, SlotMap, amx_views, cache_views, detect_layout, gather, kv_view, part_views, scatter,
    wire_shape,
)

from _paged_helpers import (
    ALL_SIZES, AMX_MIN, DTYPES, KERNELS, LAYOUTS, MLA_VARIANTS, VARIANTS, make_cache, ref_cell, ref_gather, ref_scatter,
    same_bytes,
)


def shuffled_blocks(num_blocks: int, count: int, rng: random.Random) -> list[int]:
    return rng.sample(range(num_blocks), count)


def round_trip(
    src_variant, dst_variant, bs_src, bs_dst, dtype, tokens, heads_src, heads_dst_start, rng, dim=None, kernel=None
):
    """Gather from one cache, scatter into another (with ``kernel``); check both against the reference.

    ``dim`` defaults to 8, or 16 where a side is cpu_amx (its tiles are 16 dims)."""
    if dim is None:
        dim = AMX_MIN if "cpu_amx" in (src_variant, dst_variant) else 8
    mla = src_variant in MLA_VARIANTS
    num_heads_src, num_heads_dst = (1, 1) if mla else (4, 3)
    need_src, need_dst = -(-tokens.stop // bs_src), -(-tokens.stop // bs_dst)
    src, src_raw = make_cache(src_variant, need_src + 3, bs_src, num_heads_src, dim, dtype, rng)
    dst, dst_raw = make_cache(dst_variant, need_dst + 2, bs_dst, num_heads_dst, dim, dtype, rng)
    src_ids, dst_ids = shuffled_blocks(need_src + 3, need_src, rng), shuffled_blocks(need_dst + 2, need_dst, rng)
    src_spec = PagedCacheSpec.from_tensor(src, LAYOUTS[src_variant])
    dst_spec = PagedCacheSpec.from_tensor(dst, LAYOUTS[dst_variant])
    src_before = src_raw.clone()

    wire = torch.full(wire_shape(len(tokens), len(heads_src), dim, mla), 7.0, dtype=dtype)
    assert gather(src, src_spec, src_ids, tokens, heads_src, wire, kernel=kernel) is wire
    assert same_bytes(wire, ref_gather(src_raw, src_variant, bs_src, src_ids, tokens, heads_src))
    assert same_bytes(src_raw, src_before)

    heads_dst = Span(heads_dst_start, heads_dst_start + len(heads_src))
    expected = dst_raw.clone()
    ref_scatter(wire, expected, dst_variant, bs_dst, dst_ids, tokens, heads_dst)
    wire_before = wire.clone()
    scatter(wire, dst, dst_spec, dst_ids, tokens, heads_dst, kernel=kernel)
    assert same_bytes(dst_raw, expected)  # the slice landed and nothing else moved
    assert same_bytes(wire, wire_before)
    parts = 1 if mla else 2
    for part, t, h in itertools.product(range(parts), tokens, range(len(heads_src))):
        got = ref_cell(dst_raw, dst_variant, part, dst_ids[t // bs_dst], t % bs_dst, heads_dst.start + h)
        want = ref_cell(src_raw, src_variant, part, src_ids[t // bs_src], t % bs_src, heads_src.start + h)
        assert same_bytes(got.reshape(-1), want.reshape(-1)), (part, t, h)


BLOCK_PAIRS = list(itertools.product([16, 32, 64], repeat=2))


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("src_variant,dst_variant", list(itertools.product(VARIANTS, repeat=2)))
def test_round_trip_every_layout_pair(src_variant: str, dst_variant: str, dtype: torch.dtype, kernel: str) -> None:
    case = VARIANTS.index(src_variant) * len(VARIANTS) + VARIANTS.index(dst_variant)
    bs_src, bs_dst = BLOCK_PAIRS[case % len(BLOCK_PAIRS)]
    rng = random.Random(case)
    # Starts mid-block, ends in a partial block, takes a head subrange, lands on other local heads.
    tokens = Span(bs_src // 2 + 3, bs_src // 2 + 3 + 2 * max(bs_src, bs_dst) + 5)
    round_trip(src_variant, dst_variant, bs_src, bs_dst, dtype, tokens, Span(1, 3), 0, rng, kernel=kernel)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bs_src,bs_dst", BLOCK_PAIRS)
def test_round_trip_mla(bs_src: int, bs_dst: int, dtype: torch.dtype, kernel: str) -> None:
    rng = random.Random(bs_src * 100 + bs_dst)
    tokens = Span(5, 5 + 2 * bs_dst + bs_src // 2)
    src, dst = MLA_VARIANTS if bs_src <= bs_dst else MLA_VARIANTS[::-1]  # 3-d and vLLM's 4-d view, both ways
    round_trip(src, dst, bs_src, bs_dst, dtype, tokens, Span(0, 1), 0, rng, dim=24, kernel=kernel)


@pytest.mark.parametrize(
    "tokens,heads",
    [
        (Span(0, 64), Span(0, 4)),  # whole blocks, all heads: the indexed fast path alone
        (Span(16, 32), Span(0, 4)),  # exactly one block
        (Span(3, 9), Span(2, 3)),  # inside one block: one partial run
        (Span(10, 20), Span(0, 4)),  # two partial runs, no whole block
        (Span(0, 50), Span(3, 4)),  # whole blocks and a partial last block
        (Span(7, 7), Span(0, 4)),  # empty token span
        (Span(0, 32), Span(2, 2)),  # empty head span
    ],
)
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_span_shapes(variant: str, tokens: Span, heads: Span, kernel: str) -> None:
    rng = random.Random(hash((variant, tokens.start, tokens.stop, heads.start)))
    dim = AMX_MIN if variant == "cpu_amx" else 8
    src, src_raw = make_cache(variant, 9, 16, 4, dim, torch.bfloat16, rng)
    spec = PagedCacheSpec.from_tensor(src, LAYOUTS[variant])
    ids = [8, 2, 5, 0]
    out = torch.zeros(spec.wire_shape(len(tokens), len(heads)), dtype=torch.bfloat16)
    gather(src, spec, ids, tokens, heads, out, kernel=kernel)
    assert same_bytes(out, ref_gather(src_raw, variant, 16, ids, tokens, heads))
    dst, dst_raw = make_cache(variant, 9, 16, 4, dim, torch.bfloat16, rng)
    expected = dst_raw.clone()
    ref_scatter(out, expected, variant, 16, ids, tokens, heads)
    scatter(out, dst, spec, ids, tokens, heads, kernel=kernel)
    assert same_bytes(dst_raw, expected)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype,dim", [(torch.float32, 3), (torch.bfloat16, 6), (torch.bfloat16, 1), (torch.float32, 2)])
def test_head_sizes_that_cannot_be_widened(dtype: torch.dtype, dim: int, kernel: str) -> None:
    rng = random.Random(dim)
    round_trip("nhd", "cpu", 16, 32, dtype, Span(5, 70), Span(0, 3), 0, rng, dim=dim, kernel=kernel)
    round_trip("hnd_view", "flashinfer", 32, 16, dtype, Span(0, 64), Span(1, 4), 0, rng, dim=dim, kernel=kernel)
    round_trip("cpu_kt", "cpu", 16, 32, dtype, Span(3, 70), Span(1, 4), 0, rng, dim=dim, kernel=kernel)
    round_trip("cpu", "cpu_kt", 32, 16, dtype, Span(0, 64), Span(1, 3), 1, rng, dim=dim, kernel=kernel)


@pytest.mark.parametrize("dtype", ALL_SIZES, ids=str)
@pytest.mark.parametrize("dim", [8, 16, 13, 64])
@pytest.mark.parametrize("variant", [v for v in VARIANTS if v != "cpu_amx"])  # 16-row tiles: see the next test
def test_native_kernel_every_element_size(variant: str, dim: int, dtype: torch.dtype) -> None:
    """Element sizes 1-8 and head sizes off the SIMD block (13), with blocks of 8, 16 and 24 tokens."""
    rng = random.Random(dim * 10 + dtype.itemsize)
    for bs in (8, 16, 24):
        tokens = Span(bs // 2 + 1, bs // 2 + 1 + 3 * bs + 5)
        round_trip(variant, "cpu_kt", bs, 16, dtype, tokens, Span(1, 4), 0, rng, dim=dim, kernel="native")
        round_trip("cpu_kt", variant, 16, bs, dtype, tokens, Span(0, 3), 0, rng, dim=dim, kernel="native")


@pytest.mark.parametrize("variant", [v for v in VARIANTS if v != "cpu_amx"])  # CPU_AMX has no part views
def test_cached_views_move_the_same_bytes(variant: str) -> None:
    """cache_views made once serve every slice of that cache and head span, with a wire at any address."""
    rng = random.Random(len(variant))
    cache, raw = make_cache(variant, 12, 16, 4, 8, torch.bfloat16, rng)
    spec = PagedCacheSpec.from_tensor(cache, LAYOUTS[variant])
    heads, ids = Span(1, 3), [9, 2, 6, 0, 11]
    views = cache_views(cache, spec, heads)
    for tokens in (Span(0, 80), Span(5, 70), Span(17, 18)):
        shape = spec.wire_shape(len(tokens), len(heads))
        store = torch.zeros(torch.Size(shape).numel() + 1, dtype=torch.bfloat16)
        for wire in (store[:-1].view(shape), store[1:].view(shape)):  # a wire on a 2-byte boundary cannot widen
            gather(cache, spec, ids, tokens, heads, wire, kernel="torch", views=views)
            assert same_bytes(wire, ref_gather(raw, variant, 16, ids, tokens, heads))
            expected = raw.clone()
            ref_scatter(wire, expected, variant, 16, ids, tokens, heads)
            scatter(wire, cache, spec, ids, tokens, heads, kernel="torch", views=views)
            assert same_bytes(raw, expected)
    other = cache_views(cache, spec, Span(0, 2))
    with pytest.raises(ValueError, match="views were made for"):
        gather(cache, spec, ids, Span(0, 16), heads, torch.empty(spec.wire_shape(16, 2), dtype=torch.bfloat16),
               kernel="torch", views=other)


@pytest.mark.parametrize("dtype", ALL_SIZES, ids=str)
@pytest.mark.parametrize("dim", [16, 48])
def test_native_kernel_cpu_amx_every_element_size(dim: int, dtype: torch.dtype) -> None:
    """CPU_AMX's key tiles and value pairs, from mid-tile and odd tokens, with blocks of 16, 32 and 48 tokens."""
    rng = random.Random(dim * 10 + dtype.itemsize)
    for bs in (16, 32, 48):
        tokens = Span(bs // 2 + 1, bs // 2 + 1 + 3 * bs + 5)
        round_trip("cpu_amx", "cpu_kt", bs, 16, dtype, tokens, Span(1, 4), 0, rng, dim=dim, kernel="native")
        round_trip("cpu_kt", "cpu_amx", 16, bs, dtype, tokens, Span(0, 3), 0, rng, dim=dim, kernel="native")


@pytest.mark.parametrize("bounce_blocks", [1, 3])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cpu_kt_keys_move_in_several_bounce_passes(monkeypatch, bounce_blocks: int, dtype: torch.dtype) -> None:
    """Many whole blocks: the transposed keys go through the bounce buffer a few blocks at a time."""
    from ncclkv.paged import _copy

    heads, dim, bs = 3, 8, 16
    monkeypatch.setattr(_copy, "_BOUNCE_BYTES", bounce_blocks * heads * dim * bs * dtype.itemsize)
    rng = random.Random(bounce_blocks)
    round_trip("cpu_kt", "cpu_kt", bs, bs, dtype, Span(5, 5 + 10 * bs), Span(1, 4), 0, rng, dim=dim, kernel="torch")
    round_trip("nhd", "cpu_kt", 32, bs, dtype, Span(0, 9 * bs), Span(0, 3), 0, rng, dim=dim, kernel="torch")


def test_cpu_and_cpu_kt_read_the_same_tensor_differently() -> None:
    """Same shape, same values half; the keys of a partial block differ, so the caller's choice matters."""
    cache, raw = make_cache("cpu", 4, 16, 2, 8, torch.float32, random.Random(5))
    tokens, heads = Span(3, 20), Span(0, 2)
    outs = []
    for layout in (CacheLayout.CPU, CacheLayout.CPU_KT):
        spec = PagedCacheSpec.from_tensor(cache, layout)
        out = torch.empty(spec.wire_shape(len(tokens), len(heads)))
        outs.append(gather(cache, spec, [2, 0], tokens, heads, out))
        assert same_bytes(out, ref_gather(raw, layout.value, 16, [2, 0], tokens, heads))
    assert same_bytes(outs[0][1], outs[1][1]) and not same_bytes(outs[0][0], outs[1][0])


def test_slot_map_reused_across_layers_and_tensor_block_ids() -> None:
    rng = random.Random(3)
    layers = [make_cache("cpu", 12, 32, 2, 16, torch.float32, rng) for _ in range(3)]
    spec = PagedCacheSpec.from_tensor(layers[0][0], CacheLayout.CPU)
    ids = [11, 3, 7, 0, 9]
    slot_map = SlotMap(torch.tensor(ids, dtype=torch.int32), 32)
    assert slot_map.block_ids == tuple(ids) and slot_map.num_tokens == 160
    tokens = Span(20, 150)
    assert slot_map.plan(tokens) is slot_map.plan(tokens)  # index tensors are made once per span
    out = torch.empty(spec.wire_shape(len(tokens), 2))
    for cache, raw in layers:
        gather(cache, spec, slot_map, tokens, Span(0, 2), out)
        assert same_bytes(out, ref_gather(raw, "cpu", 32, ids, tokens, Span(0, 2)))


def test_gather_tolerates_repeated_blocks_but_scatter_refuses() -> None:
    cache, raw = make_cache("nhd", 4, 16, 2, 8, torch.float32, random.Random(0))
    spec = PagedCacheSpec.from_tensor(cache, CacheLayout.FLASH_NHD)
    out = torch.empty(spec.wire_shape(48, 2))
    gather(cache, spec, [1, 1, 2], Span(0, 48), Span(0, 2), out)
    assert same_bytes(out, ref_gather(raw, "nhd", 16, [1, 1, 2], Span(0, 48), Span(0, 2)))
    with pytest.raises(ValueError, match=r"repeated block ids \[1\]"):
        scatter(out, cache, spec, [1, 1, 2], Span(0, 48), Span(0, 2))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_round_trip_property(data: st.DataObject) -> None:
    mla = data.draw(st.booleans(), "mla")
    src_variant = "mla" if mla else data.draw(st.sampled_from(VARIANTS), "src")
    dst_variant = "mla" if mla else data.draw(st.sampled_from(VARIANTS), "dst")
    amx = "cpu_amx" in (src_variant, dst_variant)  # 16-row tiles: block and head sizes multiples of 16
    bs_src = data.draw(st.sampled_from([16, 32, 64] if src_variant == "cpu_amx" else [1, 2, 16, 32, 64]), "bs_src")
    bs_dst = data.draw(st.sampled_from([16, 32, 64] if dst_variant == "cpu_amx" else [1, 3, 16, 32, 64]), "bs_dst")
    start = data.draw(st.integers(0, 80), "start")
    tokens = Span(start, start + data.draw(st.integers(0, 90), "length"))
    h0 = 0 if mla else data.draw(st.integers(0, 3), "h0")
    heads = Span(h0, data.draw(st.integers(h0, 1 if mla else min(4, h0 + 3)), "h1"))  # dst has 3 heads
    dst_start = data.draw(st.integers(0, 1 - len(heads) if mla else 3 - len(heads)), "dst_h0")
    dtype = data.draw(st.sampled_from(DTYPES), "dtype")
    dim = data.draw(st.sampled_from([16, 32] if amx else [2, 4, 8, 11, 16]), "dim")
    kernel = data.draw(st.sampled_from(KERNELS), "kernel")
    rng = random.Random(data.draw(st.integers(0, 2**16), "seed"))
    round_trip(src_variant, dst_variant, bs_src, bs_dst, dtype, tokens, heads, dst_start, rng, dim=dim, kernel=kernel)


# --- layout reading -------------------------------------------------------------------------


def test_from_tensor_reads_each_layout() -> None:
    specs = {
        CacheLayout.FLASH_NHD: torch.empty(2, 5, 16, 4, 8),
        CacheLayout.FLASH_HND: torch.empty(2, 5, 4, 16, 8),
        CacheLayout.FLASHINFER: torch.empty(5, 2, 16, 4, 8),
        CacheLayout.CPU: torch.empty(5, 4, 16, 16),
        CacheLayout.CPU_KT: torch.empty(5, 4, 16, 16),
    }
    for layout, tensor in specs.items():
        spec = PagedCacheSpec.from_tensor(tensor, layout)
        assert (spec.num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size) == (5, 16, 4, 8)
        assert spec.shape == tuple(tensor.shape)
        assert [p.shape for p in part_views(tensor, spec)] == [(5, 16, 4, 8)] * 2
        assert all(p.data_ptr() >= tensor.data_ptr() for p in part_views(tensor, spec))  # views, not copies
        if layout is CacheLayout.CPU_KT:
            with pytest.raises(ValueError, match=r"CPU_KT cache has no single .* use part_views"):
                kv_view(tensor, spec)
        else:
            assert kv_view(tensor, spec).shape == (2, 5, 16, 4, 8)
    amx_cache = torch.empty(5, 4, 32, 32)
    amx = PagedCacheSpec.from_tensor(amx_cache, CacheLayout.CPU_AMX)
    assert (amx.num_blocks, amx.block_size, amx.num_kv_heads, amx.head_size) == (5, 32, 4, 16)
    keys, values = amx_views(amx_cache, amx)
    assert (keys.shape, values.shape) == ((5, 2, 16, 4, 8, 2), (5, 16, 2, 4, 1, 16))
    for read in (kv_view, part_views):
        with pytest.raises(ValueError, match=r"CPU_AMX cache has no .* use amx_views"):
            read(amx_cache, amx)
    with pytest.raises(ValueError, match=r"amx_views reads CPU_AMX caches, the spec says CPU"):
        amx_views(specs[CacheLayout.CPU], PagedCacheSpec.from_tensor(specs[CacheLayout.CPU], CacheLayout.CPU))
    with pytest.raises(ValueError, match=r"multiples of 16, got block_size=16, head_size=8"):
        PagedCacheSpec.from_tensor(specs[CacheLayout.CPU], CacheLayout.CPU_AMX)
    assert detect_layout(amx_cache, 4, 16) is CacheLayout.CPU  # the shape cannot tell: the caller chooses
    hnd_view = specs[CacheLayout.FLASH_HND].permute(0, 1, 3, 2, 4)
    assert PagedCacheSpec.from_tensor(hnd_view, CacheLayout.FLASH_HND) == PagedCacheSpec.from_tensor(
        specs[CacheLayout.FLASH_HND], CacheLayout.FLASH_HND
    )
    # Block size 1 gives dims 2 and 3 equal strides; the size-1 dim is read as the tokens.
    for hnd in (torch.empty(2, 5, 4, 1, 8), torch.empty(2, 5, 4, 1, 8).permute(0, 1, 3, 2, 4)):
        spec = PagedCacheSpec.from_tensor(hnd, CacheLayout.FLASH_HND)
        assert (spec.block_size, spec.num_kv_heads) == (1, 4)
    mla = PagedCacheSpec.from_tensor(torch.empty(5, 16, 576, dtype=torch.bfloat16), CacheLayout.MLA)
    assert (mla.num_kv_heads, mla.head_size, mla.kv_parts, mla.dtype) == (1, 576, 1, torch.bfloat16)
    assert PagedCacheSpec.from_tensor(torch.empty(5, 1, 16, 576, dtype=torch.bfloat16), CacheLayout.MLA) == mla


def test_packed_reads_k_then_v_per_token_whatever_the_memory_order() -> None:
    """vLLM 0.32's GPU backends read a layer as ``cache.transpose(1, 2).split(head_size, dim=-1)``
    (vllm/v1/attention/backends/flash_attn.py): the views must see the same keys and values."""
    physical = torch.arange(2 * 5 * 16 * 4 * 16, dtype=torch.float32).view(2, 5, 16, 4, 16)  # [L, B, N, H, 2D]
    for cache in (physical[1].permute(0, 2, 1, 3),  # LBNHC: tokens before heads
                  physical.permute(1, 0, 3, 2, 4)[:, 1].contiguous(),  # LBHNC
                  physical.permute(1, 0, 2, 3, 4)[:, 1].permute(0, 2, 1, 3)):  # BLNHC: layer 1 of each block
        spec = PagedCacheSpec.from_tensor(cache, CacheLayout.PACKED)
        assert (spec.num_blocks, spec.num_kv_heads, spec.block_size, spec.head_size) == (5, 4, 16, 8)
        keys, values = cache.transpose(1, 2).split(spec.head_size, dim=-1)  # vLLM's reading: [B, N, H, D] each
        view = kv_view(cache, spec)
        assert torch.equal(view[0], keys) and torch.equal(view[1], values)
        assert all(torch.equal(a, b) for a, b in zip(part_views(cache, spec), (keys, values)))


@pytest.mark.parametrize(
    "shape,layout,pattern",
    [
        ((3, 5, 16, 4, 8), CacheLayout.FLASH_NHD, r"FLASH_NHD cache must be \[2, num_blocks.*got shape \[3, 5, 16, 4, 8\]"),
        ((5, 16, 4, 8), CacheLayout.FLASHINFER, r"got shape \[5, 16, 4, 8\]"),
        ((5, 4, 16, 15), CacheLayout.CPU, r"2\*head_size\], got shape \[5, 4, 16, 15\]"),
        ((5, 4, 16), CacheLayout.CPU_KT, r"CPU_KT cache must be .*got shape \[5, 4, 16\]"),
        ((5, 16), CacheLayout.MLA, r"\[num_blocks, block_size, latent\] .*, got shape \[5, 16\]"),
        ((5, 2, 16, 8), CacheLayout.MLA, r"got shape \[5, 2, 16, 8\]"),  # 4-d only with one head
        ((5, 4, 16, 15), CacheLayout.PACKED, r"PACKED cache must be .*2\*head_size\].*got shape \[5, 4, 16, 15\]"),
    ],
)
def test_from_tensor_rejects_wrong_shapes(shape, layout, pattern) -> None:
    with pytest.raises(ValueError, match=pattern):
        PagedCacheSpec.from_tensor(torch.empty(shape), layout)


def test_detect_layout() -> None:
    assert detect_layout(torch.empty(2, 7, 16, 4, 8), 4, 8) is CacheLayout.FLASH_NHD
    assert detect_layout(torch.empty(2, 7, 4, 16, 8), 4, 8) is CacheLayout.FLASH_HND
    assert detect_layout(torch.empty(2, 7, 4, 16, 8).permute(0, 1, 3, 2, 4), 4, 8) is CacheLayout.FLASH_HND
    assert detect_layout(torch.empty(7, 2, 16, 4, 8), 4, 8) is CacheLayout.FLASHINFER
    assert detect_layout(torch.empty(7, 4, 32, 16), 4, 8) is CacheLayout.CPU  # never CPU_KT: same shape
    assert detect_layout(torch.empty(7, 16, 64), 1, 64) is CacheLayout.MLA
    assert detect_layout(torch.empty(7, 1, 16, 576), 1, 576) is CacheLayout.MLA  # vLLM 0.32's view
    assert detect_layout(torch.empty(7, 1, 16, 576), 1, 288) is CacheLayout.CPU  # one head of 288
    assert detect_layout(torch.empty(7, 4, 32, 16, device="meta"), 4, 8) is CacheLayout.PACKED  # not on the CPU
    # Two blocks: NHD and FlashInfer both fit; the block size does not tell them apart.
    with pytest.raises(ValueError, match=r"\[2, 2, 16, 4, 8\] is ambiguous: it reads as FLASH_NHD, FLASHINFER"):
        detect_layout(torch.empty(2, 2, 16, 4, 8), 4, 8, block_size=16)
    # Heads == block size: contiguous NHD and physical HND read the same shape differently.
    with pytest.raises(ValueError, match=r"ambiguous.*FLASH_NHD, FLASH_HND"):
        detect_layout(torch.empty(2, 7, 4, 4, 8), 4, 8)
    with pytest.raises(ValueError, match=r"no cache layout has shape \[2, 7, 16, 4, 8\] with num_kv_heads=2"):
        detect_layout(torch.empty(2, 7, 16, 4, 8), 2, 8)
    with pytest.raises(ValueError, match=r"block_size=32"):
        detect_layout(torch.empty(2, 7, 16, 4, 8), 4, 8, block_size=32)


# --- errors ----------------------------------------------------------------------------------


@pytest.fixture
def nhd() -> tuple[torch.Tensor, PagedCacheSpec]:
    cache = torch.zeros(2, 6, 16, 4, 8)
    return cache, PagedCacheSpec.from_tensor(cache, CacheLayout.FLASH_NHD)


def test_errors_name_the_values(nhd) -> None:
    cache, spec = nhd
    out = torch.empty(spec.wire_shape(32, 4))
    with pytest.raises(ValueError, match=r"block id 9 is out of range for a cache of 6 blocks"):
        gather(cache, spec, [0, 9], Span(0, 32), Span(0, 4), out)
    with pytest.raises(ValueError, match=r"token span \[10,42\) runs past the 2 blocks given \(32 tokens"):
        gather(cache, spec, [0, 1], Span(10, 42), Span(0, 4), torch.empty(spec.wire_shape(32, 4)))
    with pytest.raises(ValueError, match=r"head span \[2,5\) is outside the cache's 4 kv heads"):
        gather(cache, spec, [0, 1], Span(0, 32), Span(2, 5), torch.empty(spec.wire_shape(32, 3)))
    with pytest.raises(ShapeMismatchError, match=r"out is torch.float32 \[2, 32, 3, 8\], expected .*\[2, 32, 4, 8\]"):
        gather(cache, spec, [0, 1], Span(0, 32), Span(0, 4), torch.empty(2, 32, 3, 8))
    with pytest.raises(ShapeMismatchError, match=r"out is torch.bfloat16 .* expected torch.float32"):
        gather(cache, spec, [0, 1], Span(0, 32), Span(0, 4), out.bfloat16())
    with pytest.raises(ShapeMismatchError, match=r"wire is .*\[2, 16, 4, 8\], expected .*\[2, 32, 4, 8\]"):
        scatter(torch.empty(2, 16, 4, 8), cache, spec, [0, 1], Span(0, 32), Span(0, 4))
    with pytest.raises(ValueError, match=r"out must be contiguous"):
        gather(cache, spec, [0, 1], Span(0, 32), Span(0, 4), torch.empty(2, 4, 32, 8).transpose(1, 2))
    with pytest.raises(ShapeMismatchError, match=r"cache has shape \[2, 5, 16, 4, 8\], spec expects \[2, 6, 16, 4, 8\]"):
        gather(cache[:, :5], spec, [0, 1], Span(0, 32), Span(0, 4), out)
    with pytest.raises(ShapeMismatchError, match=r"cache dtype is torch.float64"):
        gather(cache.double(), spec, [0, 1], Span(0, 32), Span(0, 4), out)
    with pytest.raises(ValueError, match=r"SlotMap has block_size 32, the cache has 16"):
        gather(cache, spec, SlotMap([0], 32), Span(0, 32), Span(0, 4), out)
    with pytest.raises(ValueError, match=r"block ids must be >= 0, got \[-1\]"):
        SlotMap([0, -1], 16)
    with pytest.raises(ValueError, match=r"1-D integer tensor"):
        SlotMap(torch.zeros(2, 2), 16)
    with pytest.raises(TypeError, match=r"tokens and heads must be Span"):
        gather(cache, spec, [0, 1], (0, 32), Span(0, 4), out)  # type: ignore[arg-type]


@pytest.mark.parametrize("kernel", KERNELS)
def test_block_ids_past_int64_are_refused_naming_them(nhd, kernel: str) -> None:
    """The native kernel reads the block table as int64: an id it cannot hold, even one the span does not use,
    is refused when the SlotMap is made, under both kernels; before, the torch ops moved the span and the native
    kernel failed with "Overflow when unpacking long long", naming nothing."""
    cache, spec = nhd
    out = torch.empty(spec.wire_shape(16, 4))
    with pytest.raises(ValueError, match=re.escape(f"block ids must be < 2**63, got [{2**63}]")):
        gather(cache, spec, [0, 2**63], Span(0, 16), Span(0, 4), out, kernel=kernel)
    with pytest.raises(ValueError, match=re.escape(f"block ids must be < 2**63, got [{2**70}]")):
        SlotMap([2**70, 1], 16)


def test_spec_and_wire_shape_validation() -> None:
    with pytest.raises(ValueError, match=r"num_kv_heads must be 1, got 2"):
        PagedCacheSpec(CacheLayout.MLA, 4, 16, 2, 64, torch.bfloat16)
    with pytest.raises(ValueError, match=r"block_size must be a positive int, got 0"):
        PagedCacheSpec(CacheLayout.CPU, 4, 0, 2, 64, torch.bfloat16)
    with pytest.raises(ValueError, match=r"num_heads must be 1, got 2"):
        wire_shape(8, 2, 64, mla=True)
    assert wire_shape(8, 2, 64, mla=False) == (2, 8, 2, 64)
    assert wire_shape(8, 1, 576, mla=True) == (1, 8, 576)


@pytest.mark.parametrize("layout", [CacheLayout.CPU, CacheLayout.CPU_KT])
def test_cpu_cache_with_strided_rows_is_rejected(layout: CacheLayout) -> None:
    base = torch.zeros(4, 2, 16, 32)
    spec = PagedCacheSpec(layout, 4, 16, 2, 8, torch.float32)
    with pytest.raises(ValueError, match=rf"a {layout.name} cache needs contiguous \[block_size, 2\*head_size\] rows"):
        part_views(base[..., ::2], spec)
    with pytest.raises(ValueError, match=r"contiguous \[block_size, 2\*head_size\] rows"):
        gather(base[..., ::2], spec, [0], Span(0, 16), Span(0, 2), torch.empty(spec.wire_shape(16, 2)))


def test_benchmark_quick_mode_writes_json(tmp_path) -> None:
    import json

    from benchmarks import bench_paged

    argv = ["--quick", "--no-plot", "--out", str(tmp_path), "--sizes-mib", "0.0625", "--repeats", "1", "--threads", "1"]
    assert bench_paged.main(argv) == 0
    rows = json.loads((tmp_path / "paged.json").read_text())["results"]
    expected = {(layout.name, op) for layout in CacheLayout for op in ("gather", "scatter")}
    assert {(r["layout"], r["op"]) for r in rows} == expected
    assert all(r["gbps_best"] > 0 and r["ratio_median"] > 0 for r in rows)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("variant", VARIANTS + list(MLA_VARIANTS))
def test_hot_path_allocates_nothing(variant: str, kernel: str) -> None:
    """Once a request's SlotMap exists and a first layer ran, gather and scatter allocate no memory."""
    from torch.profiler import ProfilerActivity, profile

    rng = random.Random(11)
    heads = 1 if variant in MLA_VARIANTS else 4
    cache, _ = make_cache(variant, 24, 16, heads, 64, torch.bfloat16, rng)
    spec = PagedCacheSpec.from_tensor(cache, LAYOUTS[variant])
    slots = SlotMap(shuffled_blocks(24, 20, rng), 16)
    tokens, head_span = Span(5, 300), Span(0, heads)  # partial first and last blocks, 17 whole ones
    wire = torch.empty(wire_shape(len(tokens), heads, 64, variant in MLA_VARIANTS), dtype=torch.bfloat16)

    def layer() -> None:
        gather(cache, spec, slots, tokens, head_span, wire, kernel=kernel)
        scatter(wire, cache, spec, slots, tokens, head_span, kernel=kernel)

    layer()  # the first layer builds the SlotMap's index tensors and the scratch buffers
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        layer()
    allocations = [(e.name, e.cpu_memory_usage) for e in prof.events() if e.cpu_memory_usage > 0]
    assert allocations == []


def test_scratch_made_under_inference_mode_serves_outside_it() -> None:
    """vLLM gathers under torch.inference_mode; the same thread may gather outside it later."""
    from ncclkv.paged import _copy

    _copy._scratch.__dict__.clear()  # so the first gather below makes this thread's scratch, in inference mode
    rng = random.Random(5)
    cache, raw = make_cache("cpu_kt", 8, 16, 2, 32, torch.float32, rng)
    spec = PagedCacheSpec.from_tensor(cache, CacheLayout.CPU_KT)
    first, second = (torch.empty(wire_shape(48, 2, 32, False)) for _ in range(2))
    with torch.inference_mode():
        gather(cache, spec, [3, 1, 6], Span(0, 48), Span(0, 2), first, kernel="torch")
    gather(cache, spec, [3, 1, 6], Span(0, 48), Span(0, 2), second, kernel="torch")
    assert same_bytes(first, second)
    assert same_bytes(second, ref_gather(raw, "cpu_kt", 16, [3, 1, 6], Span(0, 48), Span(0, 2)))
