"""Engine ranks with paged caches filled from one deterministic global KV (see ncclkv.scenario._kv)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import torch

from ncclkv.engine import EngineConfig, EngineRef, TransferEngine
from ncclkv.layout import KVGeometry, ParallelLayout, Roi, Span, shard_roi
from ncclkv.paged import CacheLayout
from ncclkv.scenario._kv import check_landed, fill_shard, global_kv, make_cache
from ncclkv.transport import LinkFactory

__all__ = ["RankSide", "build_sides", "close_sides", "engine_ref", "global_kv", "make_cache", "start_pull", "wait_sent"]


@dataclass
class RankSide:
    """One rank of one engine with its caches."""

    engine: TransferEngine
    caches: dict[int, torch.Tensor]
    cache_layout: CacheLayout
    block_size: int

    @classmethod
    def build(cls, engine_id: str, rank: int, layout: ParallelLayout, geometry: KVGeometry, cache_layout: CacheLayout,
              block_size: int, num_blocks: int, role: str, transport: LinkFactory | None = None,
              **config: object) -> RankSide:
        """``config["device"]`` (default cpu) holds the caches; ``transport`` defaults to a real data plane."""
        cfg = EngineConfig(engine_id, rank, layout, geometry, role=role, **config)  # type: ignore[arg-type]
        engine = TransferEngine(cfg, transport=transport)
        shard = shard_roi(layout, geometry, rank, 0)
        dtype = getattr(torch, geometry.dtype)
        caches = {layer: make_cache(cache_layout, num_blocks, block_size, len(shard.heads), geometry.head_size, dtype,
                                    device=cfg.device)
                  for layer in shard.layers}
        engine.register(caches, cache_layout)
        return cls(engine, caches, cache_layout, block_size)

    @property
    def shard(self) -> Roi:
        cfg = self.engine.config
        return shard_roi(cfg.layout, cfg.geometry, cfg.rank, 0)

    def fill(self, seed: int, block_ids: list[int], num_tokens: int) -> None:
        """Write the request's global KV for this rank's shard into its caches."""
        fill_shard(self.caches, self.cache_layout, self.engine.config.geometry, self.shard, seed, block_ids, num_tokens)

    def mismatches(self, seed: int, block_ids: list[int], num_tokens: int, tokens: Span) -> list[str]:
        """Every layer whose landed ``tokens`` differ from the global KV, byte for byte."""
        bad = check_landed(self.caches, self.cache_layout, self.engine.config.geometry, self.shard, seed, block_ids,
                           num_tokens, tokens)
        return [f"rank {self.engine.config.rank} layer {layer}" for layer in bad]


def build_sides(engine_id: str, layout: ParallelLayout, geometry: KVGeometry, cache_layout: CacheLayout,
                block_size: int, role: str, num_blocks: int = 16, transports: list[LinkFactory] | None = None,
                **config: object) -> list[RankSide]:
    """One in-process engine rank per rank of ``layout``; ``transports``: one per rank (default: real data planes)."""
    return [RankSide.build(engine_id, rank, layout, geometry, cache_layout, block_size, num_blocks, role,
                           transports[rank] if transports else None, **config)
            for rank in range(layout.world_size)]


def engine_ref(engine_id: str, layout: ParallelLayout, sides: list[RankSide]) -> EngineRef:
    return EngineRef(engine_id, layout, tuple(side.engine.address for side in sides))


def start_pull(request_id: str, prefill: list[RankSide], decode: list[RankSide], seed: int, src_blocks: list[int],
               dst_blocks: list[int], num_tokens: int) -> None:
    """Every producer rank holds seed's KV of ``request_id`` for pulling; every consumer rank expects it."""
    for side in prefill:
        side.fill(seed=seed, block_ids=src_blocks, num_tokens=num_tokens)
        side.engine.finish(request_id, src_blocks, num_tokens)
    ref = engine_ref(prefill[0].engine.config.engine_id, prefill[0].engine.config.layout, prefill)
    for side in decode:
        side.engine.expect(request_id, ref, dst_blocks, num_tokens)


def close_sides(*groups: list[RankSide]) -> None:
    for group in groups:
        for side in group:
            side.engine.close()


def wait_sent(side: RankSide, *request_ids: str, timeout_s: float = 20.0) -> dict[str, BaseException | None]:
    """Poll one producer rank until it reported every one of ``request_ids`` (the engine has no blocking
    variant); their outcomes, and whatever else it reported meanwhile."""
    deadline, finished = time.monotonic() + timeout_s, {}
    while not set(request_ids) <= finished.keys():
        assert time.monotonic() < deadline, (f"rank {side.engine.config.rank}: "
                                              f"{sorted(set(request_ids) - finished.keys())} never finished sending")
        finished.update(side.engine.take_finished_sending())
        if not set(request_ids) <= finished.keys():
            threading.Event().wait(0.005)
    return finished
