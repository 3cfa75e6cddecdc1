"""Deterministic request KV for scenarios and tests: fill a rank's paged caches, check what landed.

The global KV of a request is a function of (seed, layer) alone, so producer
and consumer processes compute the same values without exchanging them, and
a consumer can say byte for byte whether what landed is right.
"""

from __future__ import annotations

import torch

from ..layout import KVGeometry, Roi, Span
from ..paged import CacheLayout, PagedCacheSpec, gather, scatter

__all__ = ["cache_shape", "check_landed", "fill_shard", "global_kv", "make_cache", "read_tokens", "write_tokens"]


def global_kv(geometry: KVGeometry, seed: int, layer: int, num_tokens: int) -> torch.Tensor:
    """The whole request's KV of one layer in wire form: [2, T, H, D] (MLA: [1, T, D])."""
    gen = torch.Generator().manual_seed(seed * 1000 + layer)
    if geometry.use_mla:
        shape: tuple[int, ...] = (1, num_tokens, geometry.head_size)
    else:
        shape = (2, num_tokens, geometry.num_kv_heads, geometry.head_size)
    return torch.randn(shape, generator=gen).to(getattr(torch, geometry.dtype))


def cache_shape(layout: CacheLayout, num_blocks: int, block_size: int, heads: int, head_size: int) -> tuple[int, ...]:
    """The contiguous cache tensor's shape (HND: the physical order); MLA holds one latent per token."""
    heads = 1 if layout is CacheLayout.MLA else heads
    return PagedCacheSpec(layout, num_blocks, block_size, heads, head_size, torch.float32).shape


def make_cache(layout: CacheLayout, num_blocks: int, block_size: int, heads: int, head_size: int,
               dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    # A sentinel, not zeros: an unfilled slot never equals real data by chance.
    return torch.full(cache_shape(layout, num_blocks, block_size, heads, head_size), -7.0, dtype=dtype, device=device)


def _box(kv: torch.Tensor, geometry: KVGeometry, tokens: Span, heads: Span) -> torch.Tensor:
    if geometry.use_mla:
        return kv[:, tokens.start:tokens.stop]
    return kv[:, tokens.start:tokens.stop, heads.start:heads.stop]


def write_tokens(cache: torch.Tensor, layout: CacheLayout, wire: torch.Tensor, block_ids: list[int], tokens: Span,
                 local_heads: Span) -> None:
    spec = PagedCacheSpec.from_tensor(cache, layout)
    scatter(wire.to(cache.device).contiguous(), cache, spec, block_ids, tokens, local_heads)


def read_tokens(cache: torch.Tensor, layout: CacheLayout, block_ids: list[int], tokens: Span,
                local_heads: Span) -> torch.Tensor:
    spec = PagedCacheSpec.from_tensor(cache, layout)
    out = torch.empty(spec.wire_shape(len(tokens), len(local_heads)), dtype=cache.dtype, device=cache.device)
    return gather(cache, spec, block_ids, tokens, local_heads, out)


def fill_shard(caches: dict[int, torch.Tensor], layout: CacheLayout, geometry: KVGeometry, shard: Roi, seed: int,
               block_ids: list[int], num_tokens: int, tokens: Span | None = None) -> None:
    """Write request ``seed``'s KV for ``shard``'s layers and heads into ``caches`` (``tokens``: default all)."""
    span = tokens or Span(0, num_tokens)
    local = Span(0, len(shard.heads))
    for layer in shard.layers:
        kv = global_kv(geometry, seed, layer, num_tokens)
        write_tokens(caches[layer], layout, _box(kv, geometry, span, shard.heads), block_ids, span, local)


def check_landed(caches: dict[int, torch.Tensor], layout: CacheLayout, geometry: KVGeometry, shard: Roi, seed: int,
                 block_ids: list[int], num_tokens: int, tokens: Span | None = None) -> list[int]:
    """The layers of ``shard`` whose ``tokens`` differ, byte for byte, from request ``seed``'s KV."""
    span = tokens or Span(0, num_tokens)
    bad = []
    for layer in shard.layers:
        want = _box(global_kv(geometry, seed, layer, num_tokens), geometry, span, shard.heads).contiguous()
        got = read_tokens(caches[layer], layout, block_ids, span, Span(0, len(shard.heads))).cpu()
        if not torch.equal(want.view(torch.uint8), got.view(torch.uint8)):
            bad.append(layer)
    return bad
