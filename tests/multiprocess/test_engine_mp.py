"""The transfer engine across real processes: one spawned process per engine rank, real ZMQ and gloo.

Delivery (issue 4): heterogeneous TP/PP pulls byte-exact (GQA with fewer heads than ranks and MLA too), with different
block sizes and cache layouts on the two sides; a push whose layer 0 lands
while the producer processes are parked before saving their last layer;
2 producer engines feeding 1 consumer and 1 producer feeding 2 consumers,
16 requests per link at once. Failures are in test_engine_faults_mp.py.
Order is proven by events and data, never by sleeping.
"""

from __future__ import annotations

import time

import pytest

from ncclkv.engine import EngineRef
from ncclkv.layout import KVGeometry, ParallelLayout
from ncclkv.paged import CacheLayout

from _engine_pool import Pool, Proc, blocks, build_engine
from _engine_workers import Outcome, Req

pytestmark = pytest.mark.multiprocess

GQA = KVGeometry(num_layers=4, num_kv_heads=4, head_size=32, dtype="float32")


def assert_ok(outcomes: dict[str, Outcome], where: str) -> None:
    bad = {rid: o for rid, o in outcomes.items() if not o.ok}
    assert not bad, f"{where}: {bad}"


def report(what: str, started: float) -> None:
    print(f"\n[engine mp] {what}: {time.monotonic() - started:.2f}s")


GQA_FEW_HEADS = KVGeometry(num_layers=3, num_kv_heads=2, head_size=32, dtype="float32")  # heads < tp: replicated
MLA = KVGeometry(num_layers=4, num_kv_heads=1, head_size=64, dtype="bfloat16", use_mla=True)


@pytest.mark.parametrize(("src", "dst", "src_cache", "dst_cache", "geometry"), [
    ((2, 1), (1, 2), (CacheLayout.CPU, 16), (CacheLayout.PACKED, 32), GQA),  # vLLM 0.32's GPU view
    ((4, 1), (2, 2), (CacheLayout.FLASH_HND, 8), (CacheLayout.FLASHINFER, 16), GQA),
    ((2, 1), (1, 1), (CacheLayout.CPU_KT, 32), (CacheLayout.CPU_KT, 16), GQA),
    ((1, 2), (2, 1), (CacheLayout.FLASH_NHD, 16), (CacheLayout.CPU, 32), GQA),
    ((4, 1), (1, 1), (CacheLayout.CPU, 16), (CacheLayout.FLASH_NHD, 16), GQA_FEW_HEADS),
    ((1, 1), (4, 1), (CacheLayout.PACKED, 16), (CacheLayout.CPU_KT, 32), GQA_FEW_HEADS),
    ((2, 1), (1, 2), (CacheLayout.MLA, 16), (CacheLayout.MLA, 32), MLA),
], ids=["2x1-to-1x2", "4x1-to-2x2", "2x1-to-1x1", "1x2-to-2x1", "4x1-to-1x1-few-heads", "1x1-to-4x1-few-heads",
        "2x1-to-1x2-mla"])
def test_pull_byte_exact_one_process_per_rank(procs: Pool, src: tuple[int, int], dst: tuple[int, int],
                                              src_cache: tuple[CacheLayout, int],
                                              dst_cache: tuple[CacheLayout, int], geometry: KVGeometry) -> None:
    started = time.monotonic()
    src_layout, dst_layout = ParallelLayout(*src), ParallelLayout(*dst)
    producers = procs.procs[:src_layout.world_size]
    consumers = procs.procs[src_layout.world_size:src_layout.world_size + dst_layout.world_size]
    tag = f"{src[0]}x{src[1]}-{dst[0]}x{dst[1]}-{src_cache[0].name}-{geometry.num_kv_heads}"
    prefill = build_engine(producers, f"prefill-{tag}", src_layout, geometry, *src_cache, "producer")
    build_engine(consumers, f"decode-{tag}", dst_layout, geometry, *dst_cache, "consumer")
    (src_kind, src_block), (_, dst_block) = src_cache, dst_cache
    reqs = [
        Req("full", 1, 45, blocks(45, src_block, 3), blocks(45, dst_block, 1)),  # partial last block
        Req("prefix", 2, 60, blocks(60, src_block, 12), blocks(60, dst_block, 6), first=32),  # 0..32 held already
    ]
    for proc in consumers:  # pulls arrive before the producers hold the requests: they are parked, then served
        proc.submit("expect", key=f"decode-{tag}", producer=prefill, reqs=reqs)
    for proc in consumers:
        proc.result()
    for proc in producers:
        proc.submit("hold", key=f"prefill-{tag}", reqs=reqs)
    for proc in producers:
        proc.result()
    for proc in consumers:
        proc.submit("wait", key=f"decode-{tag}", reqs=reqs)
    for rank, proc in enumerate(consumers):
        assert_ok(proc.result(), f"consumer rank {rank}")
    for rank, proc in enumerate(producers):
        assert_ok(proc.call("take_sent", key=f"prefill-{tag}", rids=["full", "prefix"]), f"producer rank {rank}")
    report(f"pull {tag} ({src_kind.name} block {src_block} -> {dst_cache[0].name} block {dst_block})", started)


def test_push_layer_zero_lands_while_producers_are_parked_before_their_last_layer(procs: Pool) -> None:
    started = time.monotonic()
    producers, consumer = procs.procs[:2], procs[2]
    prefill = build_engine(producers, "push-prefill", ParallelLayout(2, 1), GQA, CacheLayout.CPU, 16, "producer")
    decode = build_engine([consumer], "push-decode", ParallelLayout(1, 1), GQA, CacheLayout.FLASH_NHD, 32, "consumer")
    req = Req("p", 3, 40, blocks(40, 16, 4), blocks(40, 32, 0))
    last = GQA.num_layers - 1
    consumer.call("expect", key="push-decode", producer=prefill, reqs=[req], push=True)
    for proc in producers:
        proc.submit("push", key="push-prefill", req=req, consumer=decode, gate_after=last - 1)
    for proc in producers:
        assert proc.note() == ("parked", "p", last - 1)
    # Layer 0 is complete on the consumer while the last layer is not even saved: its blocks still hold
    # the sentinel, and both producer processes wait for the gate that only this test opens, now.
    assert consumer.call("wait_layer", key="push-decode", req=req, layer=0, probe_layer=last) == "empty"
    assert all(proc.busy == "push" and not proc.conn.poll(0) for proc in producers)
    for proc in producers:
        proc.gate.set()
    for rank, proc in enumerate(producers):
        outcome = proc.result()
        assert outcome.ok, f"producer rank {rank}: {outcome}"
    assert_ok(consumer.call("wait", key="push-decode", reqs=[req]), "consumer")
    report("push 2x1 -> 1x1 with parked producers", started)


def _many(prefix: str, count: int, seed: int, src_block: int, dst_first: int) -> list[Req]:
    """``count`` requests of 17..32 tokens: two 16-token blocks each on the consumer from ``dst_first`` on."""
    return [Req(f"{prefix}{i}", seed + i, 17 + (i * 5) % 16, blocks(32, src_block, 4 * i),
                (dst_first + 2 * i + 1, dst_first + 2 * i)) for i in range(count)]


def test_two_producer_engines_feed_one_consumer_sixteen_requests_each(procs: Pool) -> None:
    started = time.monotonic()
    first, second, consumer = procs[0], procs[1], procs[2]
    ref_a = build_engine([first], "p2-a", ParallelLayout(1, 1), GQA, CacheLayout.CPU, 16, "producer", num_blocks=64)
    ref_b = build_engine([second], "p2-b", ParallelLayout(1, 1), GQA, CacheLayout.FLASHINFER, 8, "producer",
                         num_blocks=128)
    build_engine([consumer], "p2-d", ParallelLayout(1, 1), GQA, CacheLayout.FLASH_NHD, 16, "consumer", num_blocks=64)
    reqs_a, reqs_b = _many("a", 16, 100, 16, 0), _many("b", 16, 200, 8, 32)
    consumer.call("expect", key="p2-d", producer=ref_a, reqs=reqs_a)
    consumer.call("expect", key="p2-d", producer=ref_b, reqs=reqs_b)
    first.submit("hold", key="p2-a", reqs=reqs_a)
    second.submit("hold", key="p2-b", reqs=reqs_b)
    first.result(), second.result()
    interleaved = [r for pair in zip(reqs_a, reqs_b) for r in pair]
    assert_ok(consumer.call("wait", key="p2-d", reqs=interleaved), "consumer")
    assert_ok(first.call("take_sent", key="p2-a", rids=[r.rid for r in reqs_a]), "producer a")
    assert_ok(second.call("take_sent", key="p2-b", rids=[r.rid for r in reqs_b]), "producer b")
    # One link per producer carried all 16 requests with no sequence gap, a tensor each: a request's four layers
    # (under 4 MiB) go in one (pull_batch_bytes).
    assert consumer.call("stats", key="p2-d")["links"] == {"p2-a.r0": 16, "p2-b.r0": 16}
    report("2P1D, 2 x 16 requests", started)


def test_one_producer_engine_feeds_two_consumers_sixteen_requests_each(procs: Pool) -> None:
    started = time.monotonic()
    producer, left, right = procs[0], procs[1], procs[2]
    ref = build_engine([producer], "p1-p", ParallelLayout(1, 1), GQA, CacheLayout.CPU, 16, "producer",
                       num_blocks=128)
    build_engine([left], "p1-x", ParallelLayout(1, 1), GQA, CacheLayout.FLASH_NHD, 16, "consumer", num_blocks=64)
    build_engine([right], "p1-y", ParallelLayout(1, 1), GQA, CacheLayout.CPU, 32, "consumer", num_blocks=64)
    reqs_x = _many("x", 16, 300, 16, 0)
    reqs_y = [Req(r.rid, r.seed, r.num_tokens, tuple(b + 64 for b in r.src_blocks), (i,))
              for i, r in enumerate(_many("y", 16, 400, 16, 0))]  # one 32-token block each on consumer y
    producer.call("hold", key="p1-p", reqs=reqs_x + reqs_y)
    _expect_and_wait([(left, "p1-x", reqs_x), (right, "p1-y", reqs_y)], ref)
    assert_ok(producer.call("take_sent", key="p1-p", rids=[r.rid for r in reqs_x + reqs_y]), "producer")
    stats = producer.call("stats", key="p1-p")
    assert stats["tensors_sent"] == 32 and stats["requests_sent"] == 32  # a request's layers in one tensor each
    report("1P2D, 2 x 16 requests", started)


def _expect_and_wait(consumers: list[tuple[Proc, str, list[Req]]], producer: EngineRef) -> None:
    for proc, key, reqs in consumers:
        proc.call("expect", key=key, producer=producer, reqs=reqs)
    for proc, key, reqs in consumers:  # both consumers pull at once
        proc.submit("wait", key=key, reqs=reqs)
    for proc, key, _ in consumers:
        assert_ok(proc.result(), key)
