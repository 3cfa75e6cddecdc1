"""The engine with CUDA caches, over loopback links: every CUDA-only line above the transport.

Gather and scatter on the device, the link's own stream, the producer's ready
event on the caller's stream (push) and the wire buffers on the device all
run here; only NCCL itself is replaced, because NCCL refuses two ranks on one
GPU (see test_nccl_links.py, which runs the same flows over NCCL where a
machine has two GPUs).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from ncclkv.layout import KVGeometry, ParallelLayout, Span
from ncclkv.paged import CacheLayout
from ncclkv.transport import LoopbackHub, LoopbackTransport

from engine.kvsim import RankSide, build_sides, close_sides, engine_ref, start_pull

pytestmark = pytest.mark.gpu

GQA = KVGeometry(num_layers=4, num_kv_heads=4, head_size=64, dtype="bfloat16")
MLA = KVGeometry(num_layers=3, num_kv_heads=1, head_size=576, dtype="bfloat16", use_mla=True)
WAIT_S = 30.0

LAYOUTS = [
    ((1, 1), (1, 1), GQA),
    ((2, 1), (1, 2), GQA),  # TP -> PP: each decode rank gathers from both prefill ranks
    ((1, 2), (4, 1), GQA),  # PP -> TP: each prefill stage feeds every decode rank
    ((2, 1), (1, 1), MLA),
]


def sides(hub: LoopbackHub, engine_id: str, layout: ParallelLayout, geometry: KVGeometry, role: str,
          **config: object) -> list[RankSide]:
    cache_layout = CacheLayout.MLA if geometry.use_mla else CacheLayout.PACKED  # vLLM 0.32's GPU view
    transports = [LoopbackTransport(hub) for _ in range(layout.world_size)]
    return build_sides(engine_id, layout, geometry, cache_layout, 16, role, transports=transports, device="cuda",
                       **config)


def check_landed(decode: list[RankSide], request_id: str, seed: int, blocks: list[int], num_tokens: int) -> None:
    for side in decode:
        assert all(cache.is_cuda for cache in side.caches.values())
        assert side.mismatches(seed, blocks, num_tokens, Span(0, num_tokens)) == []
        assert side.engine.take_finished_receiving() == {request_id: None}


@pytest.mark.parametrize(("src", "dst", "geometry"), LAYOUTS, ids=lambda v: str(v) if isinstance(v, tuple) else None)
def test_pull_lands_byte_exact_in_cuda_caches(src: tuple[int, int], dst: tuple[int, int], geometry: KVGeometry) -> None:
    hub = LoopbackHub()
    src_layout, dst_layout = ParallelLayout(*src), ParallelLayout(*dst)
    prefill = sides(hub, "prefill", src_layout, geometry, "producer")
    decode = sides(hub, "decode", dst_layout, geometry, "consumer")
    try:
        num_tokens, src_blocks, dst_blocks = 45, [5, 2, 9], [3, 0, 7]
        start_pull("req", prefill, decode, 1, src_blocks, dst_blocks, num_tokens)
        for side in decode:
            for layer in side.shard.layers:
                side.engine.wait_layer("req", layer, timeout_s=WAIT_S)
        check_landed(decode, "req", 1, dst_blocks, num_tokens)
    finally:
        close_sides(prefill, decode)


def written_on_a_busy_stream(sides: list[RankSide], seed: int, blocks: list[int], num_tokens: int,
                             then: Callable[[RankSide, int], None]) -> None:
    """Each rank's layers, written by a (non-default) stream held busy in front of each write; ``then(side, layer)``
    right after each write is queued (the host does not wait), on that stream."""
    computed = []  # each rank's layers as its compute will write them, kept aside on the GPU
    for side in sides:
        side.fill(seed=seed, block_ids=blocks, num_tokens=num_tokens)
        computed.append({layer: cache.clone() for layer, cache in side.caches.items()})
        for cache in side.caches.values():
            cache.fill_(-7.0)
    torch.cuda.synchronize()
    compute = torch.cuda.Stream()
    with torch.cuda.stream(compute):
        for layer in sorted({layer for side in sides for layer in side.caches}):
            for side, layers in zip(sides, computed):
                if layer in layers:
                    torch.cuda._sleep(20_000_000)  # the "compute": its write lands well after `then` returns
                    side.caches[layer].copy_(layers[layer])
                    then(side, layer)


def test_pull_after_finish_with_the_compute_still_queued() -> None:
    """finish() returns before the GPU wrote the layers: the pulls' gathers must wait for that stream."""
    hub = LoopbackHub()
    src_layout, dst_layout = ParallelLayout(2, 1), ParallelLayout(1, 2)
    prefill = sides(hub, "prefill", src_layout, GQA, "producer")
    decode = sides(hub, "decode", dst_layout, GQA, "consumer")
    try:
        num_tokens, src_blocks, dst_blocks = 40, [2, 6, 1], [0, 5, 3]
        last = {side.engine.config.rank: max(side.caches) for side in prefill}
        written_on_a_busy_stream(prefill, 6, src_blocks, num_tokens, lambda side, layer: (
            side.engine.finish("pull", src_blocks, num_tokens) if layer == last[side.engine.config.rank] else None))
        for side in decode:
            side.engine.expect("pull", engine_ref("prefill", src_layout, prefill), dst_blocks, num_tokens)
        for side in decode:
            side.engine.wait("pull", timeout_s=WAIT_S)
        check_landed(decode, "pull", 6, dst_blocks, num_tokens)
    finally:
        close_sides(prefill, decode)


@pytest.mark.parametrize("piece_bytes", [0, 8192], ids=["whole", "pieces"])
def test_push_after_each_layers_compute_on_the_callers_stream(piece_bytes: int) -> None:
    """save_layer returns before the GPU wrote the layer, and layers saved before the consumer accepted are
    sent later from another thread: each gather must wait for the caller's stream as it was at save_layer."""
    hub = LoopbackHub()
    src_layout, dst_layout = ParallelLayout(2, 1), ParallelLayout(1, 1)
    prefill = sides(hub, "prefill", src_layout, GQA, "producer", piece_bytes=piece_bytes)
    decode = sides(hub, "decode", dst_layout, GQA, "consumer")
    try:
        num_tokens, blocks = 40, [7, 1, 4]
        for side in prefill:
            side.engine.start_push("p", engine_ref("decode", dst_layout, decode), blocks, num_tokens)
        decode[0].engine.expect("p", engine_ref("prefill", src_layout, prefill), blocks, num_tokens, push=True)
        written_on_a_busy_stream(prefill, 4, blocks, num_tokens, lambda side, layer: side.engine.save_layer("p", layer))
        for side in prefill:
            side.engine.finish("p")
        decode[0].engine.wait("p", timeout_s=WAIT_S)
        check_landed(decode, "p", 4, blocks, num_tokens)
    finally:
        close_sides(prefill, decode)


def test_a_layers_reader_on_another_stream_sees_it_landed() -> None:
    """vLLM's forward runs on a stream of its own, not the one the landing threads scatter on. A scatter held
    back on the device (a sleep queued before it) must still come before what the waiter queues on its stream
    right after wait_layer, with no host sync between."""
    hub = LoopbackHub()
    prefill = sides(hub, "prefill", ParallelLayout(1, 1), GQA, "producer")
    decode = sides(hub, "decode", ParallelLayout(1, 1), GQA, "consumer")
    try:
        side = decode[0]
        caches = side.engine._caches  # noqa: SLF001 - each scatter queued behind tens of ms of GPU time
        real_scatter = caches.scatter

        def late_scatter(*args: object, **kwargs: object) -> None:
            torch.cuda._sleep(50_000_000)
            real_scatter(*args, **kwargs)

        caches.scatter = late_scatter  # type: ignore[method-assign]
        num_tokens, src_blocks, dst_blocks = 45, [5, 2, 9], [3, 0, 7]
        start_pull("req", prefill, decode, 1, src_blocks, dst_blocks, num_tokens)
        reader = torch.cuda.Stream()
        with torch.cuda.stream(reader):
            copies = {}
            for layer in side.shard.layers:
                side.engine.wait_layer("req", layer, timeout_s=WAIT_S)
                copies[layer] = side.caches[layer].clone()  # queued on the reader's stream, the host goes on
        reader.synchronize()
        torch.cuda.synchronize()
        assert all(torch.equal(copies[layer], side.caches[layer]) for layer in side.shard.layers)
        check_landed(decode, "req", 1, dst_blocks, num_tokens)
    finally:
        close_sides(prefill, decode)
