"""Build engine ranks with paged caches filled from one global KV, and check what landed.

Shared by the single-process and multi-process engine tests: the global KV of
a request is a deterministic function of (seed, layer), so every process
computes the same values without exchanging them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ncclkv.engine import EngineConfig, TransferEngine
from ncclkv.layout import KVGeometry, ParallelLayout, Span, shard_roi
from ncclkv.paged import CacheLayout, PagedCacheSpec, gather, scatter

__all__ = ["RankSide", "global_kv", "make_cache", "read_tokens", "fill_tokens"]


def global_kv(geometry: KVGeometry, seed: int, layer: int, num_tokens: int) -> torch.Tensor:
    """The whole request's KV of one layer in wire form [2, T, H, D] (MLA [1, T, D])."""
    gen = torch.Generator().manual_seed(seed * 1000 + layer)
    parts = geometry.kv_parts
    heads = 1 if geometry.use_mla else geometry.num_kv_heads
    shape = (parts, num_tokens, geometry.head_size) if geometry.use_mla else (parts, num_tokens, heads, geometry.head_size)
    dtype = getattr(torch, geometry.dtype)
    return torch.randn(shape, generator=gen).to(dtype)


def cache_shape(layout: CacheLayout, num_blocks: int, block_size: int, heads: int, head_size: int) -> tuple[int, ...]:
    return {
        CacheLayout.FLASH_NHD: (2, num_blocks, block_size, heads, head_size),
        CacheLayout.FLASH_HND: (2, num_blocks, heads, block_size, head_size),
        CacheLayout.FLASHINFER: (num_blocks, 2, block_size, heads, head_size),
        CacheLayout.CPU: (num_blocks, heads, block_size, 2 * head_size),
        CacheLayout.MLA: (num_blocks, block_size, head_size),
    }[layout]


def make_cache(layout: CacheLayout, num_blocks: int, block_size: int, heads: int, head_size: int,
               dtype: torch.dtype) -> torch.Tensor:
    # NaN-free sentinel so an unfilled slot never equals real data by chance.
    return torch.full(cache_shape(layout, num_blocks, block_size, heads, head_size), -7.0, dtype=dtype)


def _wire_view(kv: torch.Tensor, geometry: KVGeometry, tokens: Span, heads: Span) -> torch.Tensor:
    if geometry.use_mla:
        return kv[:, tokens.start:tokens.stop]
    return kv[:, tokens.start:tokens.stop, heads.start:heads.stop]


def fill_tokens(cache: torch.Tensor, layout: CacheLayout, geometry: KVGeometry, kv: torch.Tensor,
                block_ids: list[int], tokens: Span, heads: Span, local_heads: Span) -> None:
    spec = PagedCacheSpec.from_tensor(cache, layout)
    scatter(_wire_view(kv, geometry, tokens, heads).contiguous(), cache, spec, block_ids, tokens, local_heads)


def read_tokens(cache: torch.Tensor, layout: CacheLayout, geometry: KVGeometry, block_ids: list[int],
                tokens: Span, local_heads: Span) -> torch.Tensor:
    spec = PagedCacheSpec.from_tensor(cache, layout)
    shape = spec.wire_shape(len(tokens), len(local_heads))
    out = torch.empty(shape, dtype=cache.dtype)
    return gather(cache, spec, block_ids, tokens, local_heads, out)


@dataclass
class RankSide:
    """One rank of one engine with its caches."""

    engine: TransferEngine
    caches: dict[int, torch.Tensor]
    cache_layout: CacheLayout
    block_size: int

    @classmethod
    def build(cls, engine_id: str, rank: int, layout: ParallelLayout, geometry: KVGeometry, cache_layout: CacheLayout,
              block_size: int, num_blocks: int, role: str, **config: object) -> RankSide:
        cfg = EngineConfig(engine_id, rank, layout, geometry, role=role, **config)  # type: ignore[arg-type]
        engine = TransferEngine(cfg)
        shard = shard_roi(layout, geometry, rank, 0)
        heads = len(shard.heads)
        dtype = getattr(torch, geometry.dtype)
        caches = {layer: make_cache(cache_layout, num_blocks, block_size, heads, geometry.head_size, dtype)
                  for layer in shard.layers}
        engine.register(caches, cache_layout)
        return cls(engine, caches, cache_layout, block_size)

    @property
    def shard(self):  # type: ignore[no-untyped-def]
        cfg = self.engine.config
        return shard_roi(cfg.layout, cfg.geometry, cfg.rank, 0)

    def fill(self, seed: int, block_ids: list[int], num_tokens: int) -> None:
        """Write the request's global KV for this rank's shard into its caches."""
        geometry = self.engine.config.geometry
        shard = self.shard
        local = Span(0, len(shard.heads))
        for layer in shard.layers:
            kv = global_kv(geometry, seed, layer, num_tokens)
            fill_tokens(self.caches[layer], self.cache_layout, geometry, kv, block_ids, Span(0, num_tokens),
                        shard.heads, local)

    def mismatches(self, seed: int, block_ids: list[int], num_tokens: int, tokens: Span) -> list[str]:
        """Every (layer) whose landed tokens differ from the global KV, byte for byte."""
        geometry = self.engine.config.geometry
        shard = self.shard
        bad = []
        for layer in shard.layers:
            want = _wire_view(global_kv(geometry, seed, layer, num_tokens), geometry, tokens, shard.heads)
            got = read_tokens(self.caches[layer], self.cache_layout, geometry, block_ids, tokens,
                              Span(0, len(shard.heads)))
            if not torch.equal(want.contiguous().view(torch.uint8), got.contiguous().view(torch.uint8)):
                bad.append(f"rank {self.engine.config.rank} layer {layer}")
        return bad
