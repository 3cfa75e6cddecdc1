"""The engine with real ZMQ channels and real gloo links, every rank in this one process."""

from __future__ import annotations

import threading

import pytest

from ncclkv.engine import EngineRef
from ncclkv.layout import KVGeometry, ParallelLayout, Span
from ncclkv.paged import CacheLayout

from .kvsim import RankSide

GEOMETRY = KVGeometry(num_layers=4, num_kv_heads=4, head_size=32, dtype="float32")


def _engines(engine_id, layout, cache_layout, block_size, role, geometry=GEOMETRY, **config):  # type: ignore[no-untyped-def]
    return [RankSide.build(engine_id, rank, layout, geometry, cache_layout, block_size, 16, role, **config)
            for rank in range(layout.world_size)]


def _ref(engine_id: str, layout: ParallelLayout, sides: list[RankSide]) -> EngineRef:
    return EngineRef(engine_id, layout, tuple(side.engine.address for side in sides))


def _close(*groups: list[RankSide]) -> None:
    for group in groups:
        for side in group:
            side.engine.close()


def test_pull_2x1_to_1x2_byte_exact() -> None:
    src_layout, dst_layout = ParallelLayout(2, 1), ParallelLayout(1, 2)
    prefill = _engines("prefill", src_layout, CacheLayout.CPU, 16, "producer")
    decode = _engines("decode", dst_layout, CacheLayout.FLASH_NHD, 32, "consumer")
    try:
        num_tokens, src_blocks, dst_blocks = 45, [5, 2, 9], [3, 0]
        for side in prefill:
            side.fill(seed=1, block_ids=src_blocks, num_tokens=num_tokens)
            side.engine.finish("req-1", src_blocks, num_tokens)
        ref = _ref("prefill", src_layout, prefill)
        for side in decode:
            side.engine.expect("req-1", ref, dst_blocks, num_tokens)
        for side in decode:
            for layer in side.shard.layers:
                side.engine.wait_layer("req-1", layer, timeout_s=20)
            assert side.mismatches(1, dst_blocks, num_tokens, Span(0, num_tokens)) == []
            assert side.engine.take_finished_receiving() == {"req-1": None}
        for side in prefill:
            finished = {}
            for _ in range(200):
                finished.update(side.engine.take_finished_sending())
                if finished:
                    break
                threading.Event().wait(0.01)
            assert finished == {"req-1": None}
    finally:
        _close(prefill, decode)
