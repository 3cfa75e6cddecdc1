"""The engine with real ZMQ channels and real gloo links, every rank in this one process.

Each engine rank has its own channel, data plane and threads, exactly as in
separate processes; keeping them in one process makes the layout matrix
cheap. tests/multiprocess/ runs the same flows across processes.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import msgspec
import pytest

from ncclkv.engine import EngineConfig, TransferEngine
from ncclkv.engine._buffers import capacity_class
from ncclkv.errors import CapacityError, HandshakeError, PeerClosedError, ShapeMismatchError, TransferError
from ncclkv.layout import KVGeometry, ParallelLayout, Span, SpanSet, plan
from ncclkv.paged import CacheLayout
from ncclkv.protocol import Announce

from link_probes import sleepy_poster

from .kvsim import RankSide, build_sides, close_sides, engine_ref, start_pull, wait_sent

GQA = KVGeometry(num_layers=4, num_kv_heads=4, head_size=32, dtype="float32")


def _wait_sent(sides: list[RankSide], request_id: str, timeout_s: float = 20) -> dict[str, BaseException | None]:
    """Each producer rank's outcome of ``request_id``, by rank."""
    return {f"{side.engine.config.rank}": wait_sent(side, request_id, timeout_s=timeout_s)[request_id]
            for side in sides}


LAYOUTS = [
    ((1, 1), (1, 1), GQA),
    ((2, 1), (1, 1), GQA),
    ((1, 1), (2, 1), GQA),
    ((2, 1), (1, 2), GQA),
    ((1, 2), (2, 1), GQA),
    ((4, 1), (2, 2), GQA),
    ((4, 1), (1, 1), KVGeometry(num_layers=3, num_kv_heads=2, head_size=32, dtype="float32")),  # GQA heads < tp
    ((1, 1), (4, 1), KVGeometry(num_layers=2, num_kv_heads=2, head_size=32, dtype="bfloat16")),  # replicated on dst
    ((2, 1), (1, 2), KVGeometry(num_layers=4, num_kv_heads=1, head_size=64, dtype="bfloat16", use_mla=True)),
]


@pytest.mark.parametrize(("src", "dst", "geometry"), LAYOUTS, ids=lambda v: str(v) if isinstance(v, tuple) else None)
def test_pull_byte_exact(src: tuple[int, int], dst: tuple[int, int], geometry: KVGeometry) -> None:
    src_layout, dst_layout = ParallelLayout(*src), ParallelLayout(*dst)
    mla = geometry.use_mla
    prefill = build_sides("prefill", src_layout, geometry, CacheLayout.MLA if mla else CacheLayout.CPU, 16, "producer")
    decode = build_sides("decode", dst_layout, geometry, CacheLayout.MLA if mla else CacheLayout.FLASH_NHD, 32, "consumer")
    try:
        num_tokens, src_blocks, dst_blocks = 45, [5, 2, 9], [3, 0]  # a partial last block on both sides
        start_pull("req-1", prefill, decode, 1, src_blocks, dst_blocks, num_tokens)
        for side in decode:
            for layer in side.shard.layers:
                side.engine.wait_layer("req-1", layer, timeout_s=20)
            assert side.mismatches(1, dst_blocks, num_tokens, Span(0, num_tokens)) == []
            assert side.engine.take_finished_receiving() == {"req-1": None}
        assert set(_wait_sent(prefill, "req-1").values()) == {None}
    finally:
        close_sides(prefill, decode)


# A producer rank of TP 2 holds 2 of GQA's 4 heads: 45 tokens x 2 heads x 32 x (K, V) x 4 B = 23040 B per slice
@pytest.mark.parametrize(("batch_bytes", "piece_bytes", "tensors_per_route"), [
    (0, 0, 4),  # a tensor per layer
    (4 << 20, 0, 1),  # the default: the route's four layers in one
    (50_000, 0, 2),  # two slices fit: two runs of two layers
    (4 << 20, 10_000, 4 * 3),  # slices cut into pieces (3 of 15 tokens) go alone: a piece of a layer each
    (4 << 20, 50_000, 2),  # slices in one piece are batched, piece_bytes bounding the run: two of two layers
])
def test_a_pull_batches_a_routes_small_layers_into_one_tensor_each_run(batch_bytes: int, piece_bytes: int,
                                                                       tensors_per_route: int) -> None:
    src_layout, dst_layout = ParallelLayout(2, 1), ParallelLayout(1, 1)  # two routes: one per producer rank
    prefill = build_sides("prefill", src_layout, GQA, CacheLayout.CPU, 16, "producer", pull_batch_bytes=batch_bytes,
                          piece_bytes=piece_bytes)
    decode = build_sides("decode", dst_layout, GQA, CacheLayout.FLASH_NHD, 32, "consumer")
    try:
        num_tokens, src_blocks, dst_blocks = 45, [5, 2, 9], [3, 0]
        start_pull("r", prefill, decode, 6, src_blocks, dst_blocks, num_tokens)
        for layer in decode[0].shard.layers:  # each layer lands, whichever tensor it came in
            decode[0].engine.wait_layer("r", layer, timeout_s=20)
        assert decode[0].mismatches(6, dst_blocks, num_tokens, Span(0, num_tokens)) == []
        assert set(_wait_sent(prefill, "r").values()) == {None}
        assert [side.engine.stats().tensors_sent for side in prefill] == [tensors_per_route] * 2
        received = decode[0].engine.stats()
        assert received.tensors_received == 2 * tensors_per_route
        assert received.bytes_received == 2 * 4 * 23040
    finally:
        close_sides(prefill, decode)


def test_pull_partial_prefix_leaves_cached_tokens_alone() -> None:
    layout = ParallelLayout(2, 1)
    prefill = build_sides("prefill", layout, GQA, CacheLayout.CPU, 16, "producer")
    decode = build_sides("decode", ParallelLayout(1, 1), GQA, CacheLayout.FLASHINFER, 16, "consumer")
    try:
        num_tokens, blocks = 60, [1, 2, 3, 4]
        for side in prefill:
            side.fill(seed=2, block_ids=blocks, num_tokens=num_tokens)
            side.engine.finish("r", blocks, num_tokens)
        # The decode side already holds the first two blocks (32 tokens): only 32..60 moves.
        decode[0].fill(seed=99, block_ids=blocks[:2], num_tokens=32)
        decode[0].engine.expect("r", engine_ref("prefill", layout, prefill), blocks, SpanSet.range(32, num_tokens))
        decode[0].engine.wait("r", timeout_s=20)
        assert decode[0].mismatches(2, blocks, num_tokens, Span(32, num_tokens)) == []
        # The cached prefix is untouched: it still holds seed 99's values, not the producer's.
        assert decode[0].mismatches(99, blocks[:2], 32, Span(0, 32)) == []
        # 28 tokens x 4 heads x 32 x (K, V) x 4 B x 4 layers
        assert decode[0].engine.stats().bytes_received == 28 * 4 * 32 * 2 * 4 * 4
        assert set(_wait_sent(prefill, "r").values()) == {None}
    finally:
        close_sides(prefill, decode)


def test_push_layer_zero_lands_before_the_last_layer_is_saved() -> None:
    src_layout, dst_layout = ParallelLayout(2, 1), ParallelLayout(1, 1)
    prefill = build_sides("prefill", src_layout, GQA, CacheLayout.CPU, 16, "producer")
    decode = build_sides("decode", dst_layout, GQA, CacheLayout.FLASH_NHD, 16, "consumer")
    try:
        num_tokens, blocks = 40, [7, 1, 4]
        consumer_ref = engine_ref("decode", dst_layout, decode)
        layer0_landed = threading.Event()

        def consume() -> None:
            decode[0].engine.wait_layer("p", 0, timeout_s=20)
            layer0_landed.set()

        for side in prefill:
            side.fill(seed=3, block_ids=blocks, num_tokens=num_tokens)
            side.engine.start_push("p", consumer_ref, blocks, num_tokens)
        decode[0].engine.expect("p", engine_ref("prefill", src_layout, prefill), blocks, num_tokens, push=True)
        waiter = threading.Thread(target=consume)
        waiter.start()
        for layer in range(GQA.num_layers - 1):
            for side in prefill:
                side.engine.save_layer("p", layer)
        # The consumer must see layer 0 while the last layer has not even been saved (this thread saves it below).
        assert layer0_landed.wait(20), "layer 0 never landed"
        waiter.join(5)
        for side in prefill:
            side.engine.save_layer("p", GQA.num_layers - 1)
            side.engine.finish("p")
        decode[0].engine.wait("p", timeout_s=20)
        assert decode[0].mismatches(3, blocks, num_tokens, Span(0, num_tokens)) == []
        assert set(_wait_sent(prefill, "p").values()) == {None}
    finally:
        close_sides(prefill, decode)


@pytest.mark.parametrize("piece_bytes", [0, 2048], ids=["whole", "pieces"])
def test_finish_posts_the_last_layers_sends_from_its_callers_thread(piece_bytes: int) -> None:
    """The link's poster is kept asleep for the last layer: finish() gathers and posts that layer itself."""
    layout = ParallelLayout(1, 1)
    prefill = build_sides("prefill", layout, GQA, CacheLayout.CPU, 16, "producer", piece_bytes=piece_bytes)
    decode = build_sides("decode", layout, GQA, CacheLayout.FLASH_NHD, 16, "consumer")
    try:
        num_tokens, blocks, last = 40, [7, 1, 4], GQA.num_layers - 1
        producer = prefill[0].engine
        gathered: list[tuple[int, str]] = []
        gather = producer._caches.gather  # noqa: SLF001 - which thread gathers is what this test is about

        def recording(layer: int, *args: Any) -> Any:
            gathered.append((layer, threading.current_thread().name))
            return gather(layer, *args)

        producer._caches.gather = recording  # type: ignore[method-assign]  # noqa: SLF001
        prefill[0].fill(seed=5, block_ids=blocks, num_tokens=num_tokens)
        producer.start_push("p", engine_ref("decode", layout, decode), blocks, num_tokens)
        decode[0].engine.expect("p", engine_ref("prefill", layout, prefill), blocks, num_tokens, push=True)
        for layer in range(last):
            producer.save_layer("p", layer)
        for layer in range(last):
            decode[0].engine.wait_layer("p", layer, timeout_s=20)
        (link,) = producer._data_plane.links()  # noqa: SLF001
        with sleepy_poster(link):
            producer.save_layer("p", last)
            assert [t for layer, t in gathered if layer == last] == []  # left to the poster, asleep
            producer.finish("p")
            decode[0].engine.wait("p", timeout_s=20)
        me = threading.current_thread().name
        tail = [t for layer, t in gathered if layer == last]
        assert tail and set(tail) == {me}, gathered
        assert all(t.endswith("-send-post") for layer, t in gathered if layer < last), gathered
        token_bytes = 2 * GQA.num_kv_heads * GQA.head_size * 4  # K and V, float32
        assert len(tail) == (num_tokens * token_bytes // piece_bytes if piece_bytes else 1)
        assert decode[0].mismatches(5, blocks, num_tokens, Span(0, num_tokens)) == []
        assert set(_wait_sent(prefill, "p").values()) == {None}
    finally:
        close_sides(prefill, decode)


def test_push_before_blocks_exist_is_staged_then_scattered() -> None:
    layout = ParallelLayout(1, 1)
    prefill = build_sides("prefill", layout, GQA, CacheLayout.CPU, 16, "producer")
    decode = build_sides("decode", layout, GQA, CacheLayout.CPU, 32, "consumer")
    try:
        num_tokens, src_blocks, dst_blocks = 33, [0, 5, 6], [2, 8]
        prefill[0].fill(seed=4, block_ids=src_blocks, num_tokens=num_tokens)
        prefill[0].engine.start_push("s", engine_ref("decode", layout, decode), src_blocks, num_tokens)
        for layer in range(GQA.num_layers):
            prefill[0].engine.save_layer("s", layer)
        prefill[0].engine.finish("s")
        assert _wait_sent(prefill, "s") == {"0": None}  # everything sent while decode had no blocks
        decode[0].engine.expect("s", engine_ref("prefill", layout, prefill), dst_blocks, num_tokens, push=True)
        decode[0].engine.wait("s", timeout_s=20)
        assert decode[0].mismatches(4, dst_blocks, num_tokens, Span(0, num_tokens)) == []
    finally:
        close_sides(prefill, decode)


def test_push_larger_than_staging_is_refused_before_sending() -> None:
    layout = ParallelLayout(1, 1)
    prefill = build_sides("prefill", layout, GQA, CacheLayout.CPU, 16, "producer")
    decode = build_sides("decode", layout, GQA, CacheLayout.CPU, 16, "consumer", staging_bytes=4096)
    try:
        prefill[0].engine.start_push("big", engine_ref("decode", layout, decode), [0, 1], 32)
        prefill[0].engine.save_layer("big", 0)
        prefill[0].engine.finish("big")
        outcome = _wait_sent(prefill, "big")
        assert isinstance(outcome["0"], CapacityError)
        assert "4096" in str(outcome["0"]) and "131072" in str(outcome["0"])  # 32 tokens x 4 heads x 32 x 2 x 4 B x 4 layers
        assert prefill[0].engine.stats().tensors_sent == 0
        assert decode[0].engine.stats().tensors_received == 0
    finally:
        close_sides(prefill, decode)


def test_many_concurrent_requests_share_one_link_in_order() -> None:
    layout = ParallelLayout(1, 1)
    prefill = build_sides("prefill", layout, GQA, CacheLayout.CPU, 16, "producer", num_blocks=64)
    decode = build_sides("decode", layout, GQA, CacheLayout.FLASH_NHD, 16, "consumer", num_blocks=64)
    try:
        ref = engine_ref("prefill", layout, prefill)
        requests = [(f"c{i}", [2 * i, 2 * i + 1], 17 + i % 16) for i in range(24)]
        for i, (rid, blocks, n) in enumerate(requests):
            prefill[0].fill(seed=100 + i, block_ids=blocks, num_tokens=n)
            prefill[0].engine.finish(rid, blocks, n)
        for rid, blocks, n in requests:
            decode[0].engine.expect(rid, ref, blocks, n)
        for i, (rid, blocks, n) in enumerate(requests):
            decode[0].engine.wait(rid, timeout_s=30)
            assert decode[0].mismatches(100 + i, blocks, n, Span(0, n)) == [], rid
        assert len(prefill[0].engine._peers._peers) == 1  # one peer, one link, all requests
    finally:
        close_sides(prefill, decode)


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_wire_buffers_are_reused_from_request_to_request(mode: str) -> None:
    """Each slice's wire buffer goes back once sent / scattered; the next request of that size takes it again."""
    layout = ParallelLayout(1, 1)
    prefill = build_sides("prefill", layout, GQA, CacheLayout.CPU, 16, "producer", num_blocks=16)
    decode = build_sides("decode", layout, GQA, CacheLayout.FLASH_NHD, 32, "consumer", num_blocks=16)
    engines = {"producer": prefill[0].engine, "consumer": decode[0].engine}
    try:
        ref, dst_ref = engine_ref("prefill", layout, prefill), engine_ref("decode", layout, decode)
        cached = []
        for i in range(3):
            rid, blocks, num_tokens = f"reuse{i}", [3 * i, 3 * i + 1, 3 * i + 2], 40
            prefill[0].fill(seed=10 + i, block_ids=blocks, num_tokens=num_tokens)
            decode[0].engine.expect(rid, ref, blocks[:2], num_tokens, push=mode == "push")
            if mode == "push":
                prefill[0].engine.start_push(rid, dst_ref, blocks, num_tokens)
                for layer in range(GQA.num_layers):
                    prefill[0].engine.save_layer(rid, layer)
            prefill[0].engine.finish(rid, blocks, num_tokens)
            decode[0].engine.wait(rid, timeout_s=20)
            assert decode[0].mismatches(10 + i, blocks[:2], num_tokens, Span(0, num_tokens)) == []
            assert set(_wait_sent(prefill, rid).values()) == {None}
            cached.append({side: engine.stats().wire_buffers_cached_bytes for side, engine in engines.items()})
        # At most one buffer per layer is out at a time (one request at a time, one slice per layer), so a
        # pool that hands its buffers out again never holds more than that; one that did not would hold
        # every request's. Every buffer came back each time.
        per_request = GQA.num_layers * capacity_class(2 * 40 * GQA.num_kv_heads * GQA.head_size * 4)
        for after in cached:
            assert all(0 < n <= per_request for n in after.values()), (cached, per_request)
    finally:
        close_sides(prefill, decode)


def test_wire_cache_bytes_bounds_the_free_buffers_kept() -> None:
    """wire_cache_bytes=0 keeps no buffer for reuse, and the transfer is as exact; bad values are refused."""
    layout = ParallelLayout(1, 1)
    prefill = build_sides("prefill", layout, GQA, CacheLayout.CPU, 16, "producer", wire_cache_bytes=0)
    decode = build_sides("decode", layout, GQA, CacheLayout.FLASH_NHD, 32, "consumer", wire_cache_bytes=0)
    try:
        assert prefill[0].engine.config.wire_cache_bytes == 0
        prefill[0].fill(seed=5, block_ids=[0, 1], num_tokens=20)
        prefill[0].engine.finish("nocache", [0, 1], 20)
        decode[0].engine.expect("nocache", engine_ref("prefill", layout, prefill), [1], 20)
        decode[0].engine.wait("nocache", timeout_s=20)
        assert decode[0].mismatches(5, [1], 20, Span(0, 20)) == []
        assert set(_wait_sent(prefill, "nocache").values()) == {None}
        for side in (prefill[0], decode[0]):
            assert side.engine._caches._buffers.cached_bytes == 0
    finally:
        close_sides(prefill, decode)
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match=r"wire_cache_bytes must be an int >= 0"):
            EngineConfig("bad", 0, layout, GQA, wire_cache_bytes=bad)  # type: ignore[arg-type]


def test_a_deadline_the_store_cannot_keep_or_a_heartbeat_not_below_it_is_refused_by_the_config() -> None:
    """A peer silent for deadline_s is lost, so a heartbeat as slow would lose every live peer: refused when the
    config is made, naming both, not later when the channel is built; an unset one defaults below deadline_s."""
    layout = ParallelLayout(1, 1)
    with pytest.raises(ValueError, match=r"heartbeat_s=12 must be below deadline_s=10"):
        EngineConfig("bad", 0, layout, GQA, deadline_s=10.0, heartbeat_s=12.0)
    assert EngineConfig("ok", 0, layout, GQA, deadline_s=2.0).heartbeat_s <= 0.5
    # torch's store rounds its timeout down to whole milliseconds: below one, TransferEngine() failed in torch.
    with pytest.raises(ValueError, match=r"deadline_s=1e-06 must be at least 0.001 s"):
        EngineConfig("bad", 0, layout, GQA, deadline_s=1e-6)


@pytest.mark.parametrize("host", ["0.0.0.0", "*", "::", "[::]", " 0.0.0.0 "])
def test_a_wildcard_bind_host_is_refused_by_the_config(host: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """An engine advertises the address it binds: before, 0.0.0.0 went into the params and peers on other hosts
    waited deadline_s for every request (found by review). Refused when the config is made, from either source."""
    layout = ParallelLayout(1, 1)
    with pytest.raises(ValueError, match=r"bind_host=.* is not an address peers can reach"):
        EngineConfig("bad", 0, layout, GQA, bind_host=host)
    monkeypatch.setenv("NCCLKV_BIND_HOST", host)
    with pytest.raises(ValueError, match=r"NCCLKV_BIND_HOST\) is not an address peers can reach"):
        EngineConfig("bad", 0, layout, GQA)


def test_a_bind_host_that_is_not_this_hosts_is_refused_naming_it() -> None:
    """Before, the engine failed with the socket's bare OSError ("Cannot assign requested address"), naming
    neither the setting nor the value (found by review)."""
    with pytest.raises(ValueError, match=r"cannot listen on bind_host='192.0.2.1' .*: .*; it must be an address "
                                         r"of this host"):
        TransferEngine(EngineConfig("elsewhere", 0, ParallelLayout(1, 1), GQA, bind_host="192.0.2.1"))


def test_mismatched_geometry_fails_on_both_sides_naming_both_values(caplog: pytest.LogCaptureFixture) -> None:
    layout = ParallelLayout(1, 1)
    prefill = build_sides("prefill", layout, GQA, CacheLayout.CPU, 16, "producer")
    other = KVGeometry(num_layers=4, num_kv_heads=4, head_size=64, dtype="float32")
    decode = build_sides("decode", layout, other, CacheLayout.CPU, 16, "consumer")
    try:
        prefill[0].engine.finish("m", [0], 8)
        decode[0].engine.expect("m", engine_ref("prefill", layout, prefill), [0], 8)
        with pytest.raises(HandshakeError) as err:
            decode[0].engine.wait("m", timeout_s=20)
        assert "head_size" in str(err.value) and "32" in str(err.value) and "64" in str(err.value)
        assert any("refused handshake" in r.message and "head_size" in r.message for r in caplog.records)
    finally:
        close_sides(prefill, decode)


def test_abort_drops_late_tensors_and_keeps_the_link_in_step() -> None:
    layout = ParallelLayout(1, 1)
    prefill = build_sides("prefill", layout, GQA, CacheLayout.CPU, 16, "producer")
    decode = build_sides("decode", layout, GQA, CacheLayout.CPU, 16, "consumer")
    try:
        ref = engine_ref("prefill", layout, prefill)
        for i, rid in enumerate(("a", "b")):
            prefill[0].fill(seed=10 + i, block_ids=[i], num_tokens=16)
            prefill[0].engine.finish(rid, [i], 16)
        decode[0].engine.expect("a", ref, [0], 16)
        decode[0].engine.abort("a")
        decode[0].engine.expect("b", ref, [1], 16)
        decode[0].engine.wait("b", timeout_s=20)
        assert decode[0].mismatches(11, [1], 16, Span(0, 16)) == []
        with pytest.raises((ValueError, TransferError)):
            decode[0].engine.wait("a", timeout_s=1)
    finally:
        close_sides(prefill, decode)


def test_a_closing_producer_fails_what_waits_on_it_at_once_and_is_dropped_quietly(
        caplog: pytest.LogCaptureFixture) -> None:
    """A producer engine that closes says Bye: the consumer fails the request still waiting on it with
    PeerClosedError at once (its deadline is 30 s) and drops the peer, logging the loss at INFO (the
    request's own failure is still a warning: it must be recomputed). The first pull opened the link."""
    caplog.set_level(logging.INFO, logger="ncclkv")
    layout = ParallelLayout(1, 1)
    prefill = build_sides("prefill", layout, GQA, CacheLayout.CPU, 16, "producer", deadline_s=30.0)
    decode = build_sides("decode", layout, GQA, CacheLayout.CPU, 16, "consumer", deadline_s=30.0)
    try:
        ref = engine_ref("prefill", layout, prefill)
        prefill[0].fill(seed=4, block_ids=[2], num_tokens=16)
        prefill[0].engine.finish("served", [2], 16)
        decode[0].engine.expect("served", ref, [0], 16)
        decode[0].engine.wait("served", timeout_s=20)  # the handshake, link and a pull before the close
        held = prefill[0].engine._producer.num_held  # "served" may still count until it is reported
        decode[0].engine.expect("never", ref, [1], 16)  # the producer never computes it: it waits
        deadline = time.monotonic() + 20
        while prefill[0].engine._producer.num_held == held:  # its pull reached the producer (parked there)
            assert time.monotonic() < deadline, "the pull never reached the producer"
            threading.Event().wait(0.005)
        closed_at = time.monotonic()
        prefill[0].engine.close()
        # Its Ack may or may not have come back before the Bye: either way the loss names the close.
        with pytest.raises(PeerClosedError, match=r"'prefill.r0' lost.*: it closed its channel"):
            decode[0].engine.wait("never", timeout_s=20)
        assert time.monotonic() - closed_at < 10  # the Bye, not the 30 s deadline
        after = [r for r in caplog.records if r.name.startswith("ncclkv") and r.created >= closed_at]
        loss = [r for r in after if r.getMessage().startswith(
            ("dropping peer prefill.r0:", "channel 'decode.r0': peer 'prefill.r0' lost:"))]
        assert len(loss) == 2 and {r.levelno for r in loss} == {logging.INFO}, [r.getMessage() for r in loss]
        assert not [r for r in after if "send failed" in r.getMessage() or "nothing heard" in r.getMessage()]
    finally:
        close_sides(prefill, decode)


def test_pushed_request_may_wait_hold_s_for_its_first_tensor_then_deadline_s_applies() -> None:
    layout = ParallelLayout(1, 1)
    prefill = build_sides("prefill", layout, GQA, CacheLayout.CPU, 16, "producer", deadline_s=0.4)
    decode = build_sides("decode", layout, GQA, CacheLayout.CPU, 16, "consumer", deadline_s=0.4, hold_s=30)
    try:
        prefill_ref, decode_ref = engine_ref("prefill", layout, prefill), engine_ref("decode", layout, decode)
        # A producer never heard from gets deadline_s: it may be dead.
        decode[0].engine.expect("orphan", prefill_ref, [6], 8, push=True)
        with pytest.raises(TransferError, match=r"request 'orphan': no progress for 0\.4s \(deadline_s\)"):
            decode[0].engine.wait("orphan", timeout_s=20)
        # Once the producer is known and alive (an earlier push made contact) ...
        prefill[0].fill(seed=22, block_ids=[0], num_tokens=8)
        prefill[0].engine.start_push("first", decode_ref, [0], 8)
        for layer in range(GQA.num_layers):
            prefill[0].engine.save_layer("first", layer)
        prefill[0].engine.finish("first")
        decode[0].engine.expect("first", prefill_ref, [4], 8, push=True)
        decode[0].engine.wait("first", timeout_s=20)
        prefill[0].fill(seed=21, block_ids=[0, 1], num_tokens=20)
        decode[0].engine.expect("late", prefill_ref, [2, 3], 20, push=True)
        # ... its next prefill may be queued for longer than deadline_s: the first tensor may take hold_s.
        time.sleep(1.0)  # outlasts deadline_s (0.4 s): "late" must still be waiting, not stalled
        finished = decode[0].engine.take_finished_receiving()
        assert finished.keys() == {"orphan", "first"} and finished["first"] is None
        assert isinstance(finished["orphan"], TransferError)
        assert "no progress for 0.4s (deadline_s)" in str(finished["orphan"])
        prefill[0].engine.start_push("late", decode_ref, [0, 1], 20)
        for layer in range(GQA.num_layers):
            prefill[0].engine.save_layer("late", layer)
        prefill[0].engine.finish("late")
        decode[0].engine.wait("late", timeout_s=20)
        assert decode[0].mismatches(21, [2, 3], 20, Span(0, 20)) == []
        # A pull, on the other hand, stalls after deadline_s when its producer holds nothing; it may wait
        # hold_s only until its producer acknowledged it. Here the pull goes out once wait() waits (under
        # hold_s then): the acknowledgement must wake it to apply deadline_s.
        consumer, waiting = decode[0].engine._consumer, threading.Event()  # noqa: SLF001
        cond_wait, send_pull = consumer._cond.wait, consumer._send_pull  # noqa: SLF001

        def noting_wait(*args: Any, **kwargs: Any) -> Any:
            if threading.current_thread() is threading.main_thread():
                waiting.set()
            return cond_wait(*args, **kwargs)

        def pull_once_waiting(*args: Any, **kwargs: Any) -> Any:
            assert waiting.wait(20), "wait() never waited"
            return send_pull(*args, **kwargs)
        consumer._cond.wait = noting_wait  # type: ignore[method-assign]
        consumer._send_pull = pull_once_waiting  # type: ignore[method-assign]
        decode[0].engine.expect("never", engine_ref("prefill", layout, prefill), [4], 8)
        asked = time.monotonic()
        # Its own stall, named as such: not wait()'s timeout (20 s), nor hold_s (30 s).
        with pytest.raises(TransferError, match=r"request 'never': no progress for 0\.4s \(deadline_s\)"):
            decode[0].engine.wait("never", timeout_s=20)
        elapsed = time.monotonic() - asked  # deadline_s (0.4 s) after the pull's answer, far from wait()'s 20 s
        assert elapsed < 10, f"stalled {elapsed:.1f} s after the pull: not woken by its acknowledgement"
    finally:
        close_sides(prefill, decode)


def test_a_failed_engine_start_leaves_no_thread_behind() -> None:
    from ncclkv.engine import EngineConfig, TransferEngine

    before = {t.name for t in threading.enumerate()}
    with pytest.raises(ValueError, match=r"bind_host='203\.0\.113\.1'"):  # not ours: the bind fails, naming it
        TransferEngine(EngineConfig("bad", 0, ParallelLayout(1, 1), GQA, bind_host="203.0.113.1"))
    left = {t.name for t in threading.enumerate()} - before
    assert not [name for name in left if name.startswith("ncclkv")], left


def _cross_handshakes(*sides: RankSide, timeout_s: float = 20) -> list[tuple[str, str, bool]]:
    """Hold each side's handling of a handshake until every side received one: the handshakes cross, for sure.

    No side answers before both hellos are out, so neither ``ensure`` can finish first and make the other
    side's unnecessary. Returns the record, filled as handshakes arrive: (receiver, sender, whether the
    receiver already knew the sender)."""
    crossing = threading.Barrier(len(sides), timeout=timeout_s)
    seen: list[tuple[str, str, bool]] = []
    for side in sides:
        peers, me = side.engine._peers, side.engine.config.peer_id  # noqa: SLF001 - as slow_link does

        def hold(sender: str, remote: Any, peers: Any = peers, me: str = me,
                 on_handshake: Any = peers.on_handshake) -> Any:
            seen.append((me, sender, peers.get(sender) is not None))
            crossing.wait()  # BrokenBarrierError on timeout: answered as an error, the initiator fails
            return on_handshake(sender, remote)
        peers.on_handshake = hold  # type: ignore[method-assign]
    return seen


def test_crossed_handshakes_pull_and_push_on_a_new_pair() -> None:
    # The consumer starts a pull and the producer a push to the same, so far
    # unknown, peer at once: both handshakes cross and each side may send on
    # a different link; every tensor must still land, announced on its own link.
    layout = ParallelLayout(1, 1)
    prefill = build_sides("prefill", layout, GQA, CacheLayout.CPU, 16, "both", deadline_s=20)
    decode = build_sides("decode", layout, GQA, CacheLayout.FLASH_NHD, 16, "both", deadline_s=20)
    try:
        prefill_ref, decode_ref = engine_ref("prefill", layout, prefill), engine_ref("decode", layout, decode)
        crossed = _cross_handshakes(prefill[0], decode[0])
        prefill[0].fill(seed=31, block_ids=[0, 1], num_tokens=24)
        prefill[0].fill(seed=32, block_ids=[2, 3], num_tokens=30)
        prefill[0].engine.finish("pulled", [0, 1], 24)

        def push() -> None:
            prefill[0].engine.start_push("pushed", decode_ref, [2, 3], 30)
            for layer in range(GQA.num_layers):
                prefill[0].engine.save_layer("pushed", layer)
            prefill[0].engine.finish("pushed")

        pusher = threading.Thread(target=push)
        pusher.start()
        decode[0].engine.expect("pulled", prefill_ref, [4, 5], 24)
        decode[0].engine.expect("pushed", prefill_ref, [6, 7], 30, push=True)
        pusher.join(20)
        assert not pusher.is_alive()
        decode[0].engine.wait("pulled", timeout_s=20)
        decode[0].engine.wait("pushed", timeout_s=20)
        # Each side got the other's hello before knowing it: the handshakes crossed.
        assert sorted(crossed) == [("decode.r0", "prefill.r0", False), ("prefill.r0", "decode.r0", False)]
        assert decode[0].mismatches(31, [4, 5], 24, Span(0, 24)) == []
        assert decode[0].mismatches(32, [6, 7], 30, Span(0, 30)) == []
        assert set(_wait_sent(prefill, "pulled").values()) == {None}
    finally:
        close_sides(prefill, decode)


def test_responder_opens_its_link_while_every_executor_worker_waits() -> None:
    """Every worker of the producer's executor waits (as push offers waiting for a link do); a
    consumer's handshake still gets its link opened. Regression: the open used to queue behind
    those workers and never run (the quick soak hung 2 in 20 runs)."""
    layout = ParallelLayout(1, 1)
    prefill = build_sides("prefill", layout, GQA, CacheLayout.CPU, 16, "producer", deadline_s=5.0)
    decode = build_sides("decode", layout, GQA, CacheLayout.FLASH_NHD, 32, "consumer", deadline_s=5.0)
    producer, release = prefill[0].engine, threading.Event()
    try:
        busy = [producer._executor.submit(release.wait, 30.0) for _ in range(producer._executor._max_workers)]
        num_tokens, src_blocks, dst_blocks = 40, [4, 1, 7], [2, 0]
        prefill[0].fill(seed=3, block_ids=src_blocks, num_tokens=num_tokens)
        producer.finish("r", src_blocks, num_tokens)
        decode[0].engine.expect("r", engine_ref("prefill", layout, prefill), dst_blocks, num_tokens)
        deadline = time.monotonic() + 20
        while producer._peers.get("decode.r0") is None:  # the consumer's handshake is on its way
            assert time.monotonic() < deadline, "no handshake from the consumer"
            threading.Event().wait(0.005)
        assert not any(task.done() for task in busy)
        assert producer._peers.link("decode.r0").link_id  # open, within the deadline, no worker free
        release.set()
        decode[0].engine.wait("r", timeout_s=20)
        assert decode[0].mismatches(3, dst_blocks, num_tokens, Span(0, num_tokens)) == []
    finally:
        release.set()
        close_sides(prefill, decode)


def test_wait_finished_receiving_sleeps_until_a_request_lands() -> None:
    """The idle-step wait of the vLLM worker: nothing to report -> it times out; a landing ends it."""
    layout = ParallelLayout(1, 1)
    prefill = build_sides("prefill", layout, GQA, CacheLayout.CPU, 16, "producer")
    decode = build_sides("decode", layout, GQA, CacheLayout.CPU, 16, "consumer")
    try:
        (producer,), (consumer,) = prefill, decode
        blocks, num_tokens = [1, 4], 30
        producer.fill(seed=3, block_ids=blocks, num_tokens=num_tokens)
        consumer.engine.expect("req-w", engine_ref("prefill", layout, prefill), blocks, num_tokens)
        # The producer holds nothing yet: the pull is parked, nothing can land.
        assert consumer.engine.wait_finished_receiving(0.2) is False
        outcome: list[bool] = []
        returned = threading.Event()

        def waiter() -> None:
            outcome.append(consumer.engine.wait_finished_receiving(30.0))
            returned.set()

        thread = threading.Thread(target=waiter)
        thread.start()
        assert not returned.wait(0.2)  # still waiting: the request has not landed
        producer.engine.finish("req-w", blocks, num_tokens)  # now the parked pull is served
        assert returned.wait(20), "the wait did not end when the request landed"
        thread.join()
        assert outcome == [True]
        assert consumer.engine.take_finished_receiving() == {"req-w": None}
        assert consumer.mismatches(3, blocks, num_tokens, Span(0, num_tokens)) == []
        with pytest.raises(ValueError, match="timeout_s must be .*, got -1"):
            consumer.engine.wait_finished_receiving(-1)
    finally:
        close_sides(prefill, decode)


# -- slices sent in token pieces (EngineConfig.piece_bytes) ------------------------------------------
PIECE_BYTES = 5000  # 4-9 tokens of these geometries per piece: every slice of 45 tokens goes in several


def _tensors_per_slice(src: ParallelLayout, dst: ParallelLayout, geometry: KVGeometry, num_tokens: int,
                       last_only: bool = False) -> tuple[int, int]:
    """(slices, pieces) the producers send for ``num_tokens``: (layer, route) pairs, and tensors; ``last_only``:
    only each route's last layer goes in pieces."""
    routes = plan(src, dst, geometry, num_tokens).routes
    slices = sum(len(r.layers) for r in routes)
    if last_only:
        return slices, sum(len(r.layers) - 1 + len(r.pieces(geometry, PIECE_BYTES)) for r in routes)
    return slices, sum(len(r.layers) * len(r.pieces(geometry, PIECE_BYTES)) for r in routes)


@pytest.mark.parametrize(("src", "dst", "geometry"), [LAYOUTS[1], LAYOUTS[4], LAYOUTS[8]],
                         ids=lambda v: str(v) if isinstance(v, tuple) else None)
def test_pull_in_pieces_is_byte_exact(src: tuple[int, int], dst: tuple[int, int], geometry: KVGeometry) -> None:
    src_layout, dst_layout = ParallelLayout(*src), ParallelLayout(*dst)
    mla = geometry.use_mla
    prefill = build_sides("prefill", src_layout, geometry, CacheLayout.MLA if mla else CacheLayout.CPU, 16, "producer",
                          piece_bytes=PIECE_BYTES)
    decode = build_sides("decode", dst_layout, geometry, CacheLayout.MLA if mla else CacheLayout.FLASH_NHD, 32, "consumer")
    try:
        num_tokens, src_blocks, dst_blocks = 45, [5, 2, 9], [3, 0]
        start_pull("pc", prefill, decode, 21, src_blocks, dst_blocks, num_tokens)
        for side in decode:
            side.engine.wait("pc", timeout_s=20)  # Done counted slices, not pieces: else the request failed
            assert side.mismatches(21, dst_blocks, num_tokens, Span(0, num_tokens)) == []
            assert side.engine.take_finished_receiving() == {"pc": None}
        assert set(_wait_sent(prefill, "pc").values()) == {None}
        slices, pieces = _tensors_per_slice(src_layout, dst_layout, geometry, num_tokens)
        assert pieces > slices
        assert sum(side.engine.stats().tensors_sent for side in prefill) == pieces
    finally:
        close_sides(prefill, decode)


@pytest.mark.parametrize("last_only", [False, True], ids=["every-layer", "last-layer"])
@pytest.mark.parametrize("staged", [False, True], ids=["direct", "staged"])
def test_push_in_pieces_is_byte_exact(staged: bool, last_only: bool) -> None:
    """piece_bytes cuts every layer; last_piece_bytes (the default: whole layers, the last in pieces) the last."""
    src_layout, dst_layout = ParallelLayout(2, 1), ParallelLayout(1, 1)
    sizes = {"piece_bytes": 0, "last_piece_bytes": PIECE_BYTES} if last_only else {"piece_bytes": PIECE_BYTES}
    prefill = build_sides("prefill", src_layout, GQA, CacheLayout.CPU, 16, "producer", **sizes)
    decode = build_sides("decode", dst_layout, GQA, CacheLayout.CPU, 32, "consumer")
    try:
        num_tokens, src_blocks, dst_blocks = 45, [0, 5, 6], [2, 8]
        for side in prefill:
            side.fill(seed=22, block_ids=src_blocks, num_tokens=num_tokens)
            side.engine.start_push("pp", engine_ref("decode", dst_layout, decode), src_blocks, num_tokens)
        producer_ref = engine_ref("prefill", src_layout, prefill)
        if not staged:
            decode[0].engine.expect("pp", producer_ref, dst_blocks, num_tokens, push=True)
        for layer in range(GQA.num_layers):
            for side in prefill:
                side.engine.save_layer("pp", layer)
        for side in prefill:
            side.engine.finish("pp")
        if staged:
            assert set(_wait_sent(prefill, "pp").values()) == {None}  # every piece staged before blocks exist
            decode[0].engine.expect("pp", producer_ref, dst_blocks, num_tokens, push=True)
        decode[0].engine.wait("pp", timeout_s=20)
        assert decode[0].mismatches(22, dst_blocks, num_tokens, Span(0, num_tokens)) == []
        if not staged:
            assert set(_wait_sent(prefill, "pp").values()) == {None}
        slices, pieces = _tensors_per_slice(src_layout, dst_layout, GQA, num_tokens, last_only)
        assert pieces > slices and sum(side.engine.stats().tensors_sent for side in prefill) == pieces
    finally:
        close_sides(prefill, decode)


@pytest.mark.parametrize(("lie", "message"), [
    ("again", r"announced layer 0 .* tokens \[0,4\) of request 'lie' again"),
    ("empty", r"announced layer 0 .* tokens \[4,4\): the piece is empty or outside the route's tokens"),
    ("outside", r"announced layer 0 .* tokens \[40,44\): the piece is empty or outside the route's tokens"),
])
def test_a_lying_piece_fails_its_request_and_the_link_stays_in_step(lie: str, message: str) -> None:
    layout = ParallelLayout(1, 1)
    prefill = build_sides("prefill", layout, GQA, CacheLayout.CPU, 16, "producer", piece_bytes=PIECE_BYTES)
    decode = build_sides("decode", layout, GQA, CacheLayout.CPU, 16, "consumer")
    try:
        engine = prefill[0].engine
        send = engine._channel.send  # noqa: SLF001 - a producer that lies about its pieces
        first_piece: list[tuple[int, int]] = []

        def forged(peer_id: str, body: Any, reply_to: int | None = None) -> int:
            # From the second piece of layer 0 on (pieces of 4 tokens), each claims other tokens.
            if isinstance(body, Announce) and body.request_id == "lie" and body.layer == 0:
                if first_piece:
                    piece = {"again": first_piece[0], "empty": (4, 4), "outside": (40, 44)}[lie]
                    body = msgspec.structs.replace(body, piece=piece)
                else:
                    first_piece.append(body.piece)
            return send(peer_id, body, reply_to)

        engine._channel.send = forged  # type: ignore[method-assign]  # noqa: SLF001
        ref = engine_ref("prefill", layout, prefill)
        for i, rid in enumerate(("lie", "ok")):
            prefill[0].fill(seed=30 + i, block_ids=[2 * i, 2 * i + 1], num_tokens=32)
            engine.finish(rid, [2 * i, 2 * i + 1], 32)
        decode[0].engine.expect("lie", ref, [0, 1], 32)
        with pytest.raises(ShapeMismatchError, match=message):
            decode[0].engine.wait("lie", timeout_s=20)
        decode[0].engine.expect("ok", ref, [2, 3], 32)  # the same link, in step: every lying piece was drained
        decode[0].engine.wait("ok", timeout_s=20)
        assert decode[0].mismatches(31, [2, 3], 32, Span(0, 32)) == []
    finally:
        close_sides(prefill, decode)
