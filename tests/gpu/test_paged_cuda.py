"""Paged gather/scatter on CUDA caches (the torch-op path) against the native CPU kernel, byte for byte."""

from __future__ import annotations

import pytest
import torch

from ncclkv.layout import Span
from ncclkv.paged import CacheLayout, PagedCacheSpec, gather, scatter
from ncclkv.scenario._kv import cache_shape

pytestmark = pytest.mark.gpu

BLOCK_SIZE, NUM_BLOCKS = 16, 12
BLOCK_IDS = [7, 2, 9, 0, 5]  # shuffled: a slice's blocks are rarely in order
TOKENS = Span(5, 70)  # starts and ends inside a block


def random_cache(layout: CacheLayout, dtype: torch.dtype, seed: int) -> torch.Tensor:
    heads, head_size = (1, 64) if layout is CacheLayout.MLA else (4, 32)
    shape = cache_shape(layout, NUM_BLOCKS, BLOCK_SIZE, heads, head_size)
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen).to(dtype)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.cpu().view(torch.uint8), b.cpu().view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("layout", list(CacheLayout), ids=lambda layout: layout.name)
def test_gather_and_scatter_on_cuda_match_the_cpu_kernel(layout: CacheLayout, dtype: torch.dtype) -> None:
    mla = layout is CacheLayout.MLA
    src_heads, dst_heads = (Span(0, 1), Span(0, 1)) if mla else (Span(1, 3), Span(2, 4))
    cpu = random_cache(layout, dtype, seed=1)
    cuda = cpu.cuda()
    spec = PagedCacheSpec.from_tensor(cpu, layout)
    assert PagedCacheSpec.from_tensor(cuda, layout) == spec

    wire_shape = spec.wire_shape(len(TOKENS), len(src_heads))
    want = gather(cpu, spec, BLOCK_IDS, TOKENS, src_heads, torch.empty(wire_shape, dtype=dtype), kernel="native")
    got = gather(cuda, spec, BLOCK_IDS, TOKENS, src_heads, torch.full(wire_shape, 7.0, dtype=dtype, device="cuda"))
    assert got.is_cuda
    assert same_bytes(got, want)

    # Scatter another request's slice onto other heads of both caches: the same bytes land, nothing else moves.
    incoming = random_cache(layout, dtype, seed=2)
    wire = gather(incoming, spec, BLOCK_IDS[::-1], TOKENS, src_heads, torch.empty(wire_shape, dtype=dtype))
    scatter(wire, cpu, spec, BLOCK_IDS, TOKENS, dst_heads, kernel="native")
    scatter(wire.cuda(), cuda, spec, BLOCK_IDS, TOKENS, dst_heads)
    assert same_bytes(cuda, cpu)


def test_gather_runs_on_the_current_stream_after_what_it_queued() -> None:
    """A gather queued on a side stream reads what that stream wrote before it, without a host sync between."""
    layout, dtype = CacheLayout.FLASH_NHD, torch.bfloat16
    cache = random_cache(layout, dtype, seed=3).cuda()
    spec = PagedCacheSpec.from_tensor(cache, layout)
    heads = Span(0, 4)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # tens of ms of GPU time: the fill below lands long after the host moves on
        cache.fill_(3.0)
        wire = gather(cache, spec, BLOCK_IDS, TOKENS, heads, torch.empty(spec.wire_shape(len(TOKENS), 4), dtype=dtype,
                                                                            device="cuda"))
    side.synchronize()
    assert torch.equal(wire.cpu(), torch.full(wire.shape, 3.0, dtype=dtype))
