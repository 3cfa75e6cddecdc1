"""What a handshaken peer that lies can cost an engine (review of the control plane), over real ZMQ sockets.

An engine admitted by the handshake (under any auth mode: it holds the key) could
hang a producer with one small pull (a declared layout of 65536 x 8 ranks made
every pull plan over half a million ranks on the message thread), park pulls for
made-up request ids without bound, and refuse or fail another engine's push by
naming it in its offers.
"""

from __future__ import annotations

import itertools
import logging
import tracemalloc
from collections.abc import Callable

import pytest
import torch

from ncclkv.auth import ChannelAuth
from ncclkv.channel import Channel
from ncclkv.engine import EngineConfig, EngineRef, TransferEngine
from ncclkv.engine._producer import MAX_PARKED_PULLS_PER_PEER
from ncclkv.errors import NcclKVError
from ncclkv.layout import MAX_WORLD_SIZE, KVGeometry, ParallelLayout, Route, Span, SpanSet, plan
from ncclkv.paged import CacheLayout
from ncclkv.protocol import Handshake, LayoutMsg, PullRequest, PushOffer, RouteMsg

from .kvsim import RankSide

GEOMETRY = KVGeometry(num_layers=2, num_kv_heads=2, head_size=8, dtype="float32")
ONE = ParallelLayout(1, 1)
NONE = ChannelAuth()
WAIT_S = 10.0


def peer(name: str, role: str, engine: TransferEngine, layout: ParallelLayout = ONE,
         geometry: KVGeometry = GEOMETRY) -> Channel:
    channel = Channel(f"{name}.r0", auth=NONE, deadline_s=WAIT_S)
    target = f"{engine.config.engine_id}.r0"
    channel.connect(target, engine.address)
    channel.request(target, Handshake.create(name, role, 0, layout, geometry, channel.address, "127.0.0.1:1",
                                             session="s"), WAIT_S)
    return channel


def count_built(monkeypatch: pytest.MonkeyPatch, cls: type) -> Callable[[], int]:
    """Counts each ``cls`` built until ``monkeypatch.undo()`` (its ``__post_init__`` wrapped): call it for the count."""
    made = itertools.count()
    checked = cls.__post_init__

    def counted(obj: object) -> None:
        next(made)
        checked(obj)
    monkeypatch.setattr(cls, "__post_init__", counted)
    return lambda: next(made)


def layout_bytes_kept() -> int:
    """The bytes that the layout code's allocations still hold, by a tracemalloc snapshot (tracemalloc started)."""
    kept = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(True, "*/ncclkv/layout/*")])
    return sum(stat.size for stat in kept.statistics("filename"))


def request(channel: Channel, target: str, body: object) -> object:
    try:
        return channel.request(target, body, WAIT_S)
    except NcclKVError as err:
        return err


def test_a_layout_of_more_ranks_than_any_engine_has_is_refused_everywhere() -> None:
    with pytest.raises(ValueError, match=rf"tp_size=65536 x pp_size=8 is more than {MAX_WORLD_SIZE} ranks"):
        ParallelLayout(65536, 8)
    ParallelLayout(64, 64)  # the bound itself
    with pytest.raises(ValueError, match="more than"):  # a client's kv_transfer_params name engines this way
        EngineRef("big", LayoutMsg(8192, 1, None).to_layout(), ("tcp://127.0.0.1:1",) * 8192)


def test_a_handshake_declaring_half_a_million_ranks_is_refused() -> None:
    producer = TransferEngine(EngineConfig("prefill", 0, ONE, GEOMETRY, role="producer", auth=NONE, deadline_s=WAIT_S))
    channel = Channel("evil.r0", auth=NONE, deadline_s=WAIT_S)
    try:
        channel.connect("prefill.r0", producer.address)
        body = Handshake.create("evil", "consumer", 0, ONE, GEOMETRY, channel.address, "127.0.0.1:1", session="s")
        huge = Handshake(**{**{f: getattr(body, f) for f in body.__struct_fields__}, "layout": LayoutMsg(65536, 2, None)})
        outcome = request(channel, "prefill.r0", huge)
        assert isinstance(outcome, NcclKVError) and "more than 4096 ranks" in str(outcome), outcome
    finally:
        channel.close()
        producer.close()


def test_pulls_for_requests_not_held_are_parked_up_to_a_bound_per_peer() -> None:
    producer = TransferEngine(EngineConfig("prefill", 0, ONE, GEOMETRY, role="producer", auth=NONE, deadline_s=WAIT_S))
    evil, honest = peer("evil", "consumer", producer), peer("decode", "consumer", producer)
    try:
        for i in range(MAX_PARKED_PULLS_PER_PEER):
            evil.send("prefill.r0", PullRequest(f"made-up-{i}", 0, "evil", (), 0))
        refused = request(evil, "prefill.r0", PullRequest("one-more", 0, "evil", (), 0))
        assert isinstance(refused, NcclKVError) and "at most 4096, 1024 a peer" in str(refused), refused
        assert producer.num_in_flight == MAX_PARKED_PULLS_PER_PEER  # the one refused was not parked
        # Another peer's pull still parks; then its request is held and served from the parked pull.
        assert request(honest, "prefill.r0", PullRequest("real", 0, "decode", (), 0)) is not None
        assert producer.num_in_flight == MAX_PARKED_PULLS_PER_PEER + 1
    finally:
        evil.close()
        honest.close()
        producer.close()


def test_a_pull_of_many_token_spans_is_checked_against_its_own_link_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """A consumer declaring 4096 ranks (MLA: each needs every layer of ours) pulls 64 one-token spans. The producer
    checks the pull against the plan of that one link (one box per span); it used to plan every consumer rank for
    every span (262,144 routes here, on the message thread that serves every peer, kept in the plan cache; 16.7 M
    for the 4096 spans a pull may carry), to keep 64 of them."""
    mla = KVGeometry(num_layers=2, num_kv_heads=1, head_size=8, dtype="float32", use_mla=True)
    wide = ParallelLayout(MAX_WORLD_SIZE, 1)
    producer = TransferEngine(EngineConfig("prefill", 0, ONE, mla, role="producer", auth=NONE, deadline_s=WAIT_S))
    evil = peer("evil", "consumer", producer, wide, mla)
    spans = 64
    # What our plan gives the link to consumer rank 0: all our layers, the latent, one route per token span.
    routes = tuple(RouteMsg(0, 0, (0, 2), (0, 1), (2 * i, 2 * i + 1)) for i in range(spans))
    try:
        made = count_built(monkeypatch, Route)
        answer = request(evil, "prefill.r0", PullRequest("r", 0, "evil", routes, 2 * spans))
        built = made()
        monkeypatch.undo()
        assert not isinstance(answer, NcclKVError), answer  # the pull matches our plan: parked until "r" is held
        assert producer.num_in_flight == 1
        # The pull's own routes, and our plan of its link: as many again.
        assert built <= 2 * spans, f"checking a pull of {spans} routes built {built} routes"
        # A pull that is not our plan of its link is still refused.
        odd = RouteMsg(0, 0, (0, 1), (0, 1), (999, 1000))  # one layer of the two
        wrong = request(evil, "prefill.r0", PullRequest("w", 0, "evil", routes[:-1] + (odd,), 1000))
        assert isinstance(wrong, NcclKVError) and "asks routes" in str(wrong), wrong
    finally:
        monkeypatch.undo()
        evil.close()
        producer.close()


def test_a_pull_from_a_declared_layout_of_4096_ranks_plans_in_its_ranks_and_keeps_nothing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 of an 8 x 8 producer (64 layers, 8 kv-heads) checks one small pull from a consumer declaring 64 x 64
    ranks. Its plan of the link deals its own holder set's boxes over the 4096 consumer ranks, once; it used to
    plan every box of both layouts, each of its 64 stage-head blocks against every consumer rank, and each
    consumer rank's shard from its layout's whole pipeline split again (some 1.5 M spans, seconds on the message
    thread), then keep all 4096 links' boxes in the boxes cache (256 layout pairs: any peer can declare a new
    layout, a new VLLM_PP_LAYER_PARTITION, at each handshake)."""
    geometry = KVGeometry(num_layers=64, num_kv_heads=8, head_size=4, dtype="float32")  # its own: planned afresh
    producer = TransferEngine(EngineConfig("prefill", 0, ParallelLayout(8, 8), geometry, role="producer", auth=NONE,
                                           deadline_s=WAIT_S))
    evil = peer("evil", "consumer", producer, ParallelLayout(64, 64), geometry)
    # Rank 0 holds layers [0, 8) of head 0; consumer rank 0 needs layer 0 of head 0 (replicated on 8 TP ranks).
    routes = (RouteMsg(0, 0, (0, 1), (0, 1), (0, 16)),)
    tracemalloc.start()
    try:
        made = count_built(monkeypatch, Span)
        answer = request(evil, "prefill.r0", PullRequest("r", 0, "evil", routes, 16))
        built = made()
        monkeypatch.undo()
        kept_bytes = layout_bytes_kept()
        assert not isinstance(answer, NcclKVError), answer  # the pull matches our plan: parked until "r" is held
        assert built <= 8 * 4096, f"checking a pull of one route from 4096 declared ranks built {built} spans"
        assert kept_bytes < 256 << 10, f"the plans of layout code keep {kept_bytes} bytes after one pull"
    finally:
        tracemalloc.stop()
        monkeypatch.undo()
        evil.close()
        producer.close()


def test_a_push_offer_speaks_only_for_its_sender_and_never_fails_anothers_staged_push() -> None:
    consumer = TransferEngine(EngineConfig("decode", 0, ONE, GEOMETRY, role="consumer", auth=NONE,
                                           staging_bytes=64 << 10, deadline_s=WAIT_S, hold_s=30.0))
    consumer.register({layer: torch.zeros(16, 2, 4, 16) for layer in range(2)}, CacheLayout.CPU)
    evil, prefill = peer("evil", "producer", consumer), peer("prefill", "producer", consumer)

    def offer(channel: Channel, request_id: str, claimed: str, num_tokens: int) -> object:
        routes = plan(ONE, ONE, GEOMETRY, SpanSet.range(0, num_tokens)).routes_to(0)
        return request(channel, "decode.r0", PushOffer(request_id, 0, claimed, tuple(RouteMsg.from_route(r) for r in routes),
                                                       num_tokens, sum(r.nbytes(GEOMETRY) for r in routes), None))
    try:
        # In another engine's name: refused, and nothing is remembered against that engine.
        forged = offer(evil, "x", "prefill", 4096)
        assert isinstance(forged, NcclKVError) and "but it shook hands as engine 'evil'" in str(forged), forged
        assert not isinstance(offer(prefill, "x", "prefill", 8), NcclKVError)  # the real one is staged
        # Under its own name, for a request another engine staged: refused, the staged push untouched.
        assert not isinstance(offer(prefill, "y", "prefill", 8), NcclKVError)
        other = offer(evil, "y", "evil", 4096)
        assert isinstance(other, NcclKVError) and "staged here from 'prefill'" in str(other), other
        stage = consumer._consumer._stage
        staged_x, staged_y = stage.get("x"), stage.get("y")
        assert staged_y is not None and staged_y.error is None and staged_y.producer_engine_id == "prefill"
        assert staged_x is not None and staged_x.error is None
    finally:
        evil.close()
        prefill.close()
        consumer.close()


def test_a_push_to_a_named_layout_of_4096_ranks_plans_its_own_rank_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 of an 8 x 8 producer (64 layers, 8 kv-heads) starts a push to an engine whose reference names 64 x 64
    ranks (a client's kv_transfer_params carry it: ``remote_decode``, parsed on the prefill side and pushed to on
    the model's forward, before any handshake). Its routes deal its own holder set's boxes over the 4096 consumer
    ranks, once; it used to plan every box of both layouts (every producer rank's routes, some 1.5 M spans, seconds
    on the forward of every producer rank) to keep its own, then keep that whole plan in the plan cache (256
    entries: each new prompt length or layout a client names, some megabytes each)."""
    geometry = KVGeometry(num_layers=64, num_kv_heads=8, head_size=4, dtype="float32")  # its own: planned afresh
    mine = ParallelLayout(8, 8)
    side = RankSide.build("prefill", 0, mine, geometry, CacheLayout.FLASH_NHD, 16, 4, "producer", auth=NONE,
                          deadline_s=WAIT_S)
    producer = side.engine
    wide = ParallelLayout(64, 64)
    # Every rank at our own address: the offers are refused at once (it answers as another peer), none hangs.
    ref = EngineRef("big", wide, (producer.address,) * wide.world_size)
    tracemalloc.start()
    try:
        made = count_built(monkeypatch, Span)
        producer.start_push("p", ref, [0, 1], 32)
        built = made()
        monkeypatch.undo()
        kept_bytes = layout_bytes_kept()
        assert built <= 8 * 4096, f"starting a push to 4096 named ranks built {built} spans"
        assert kept_bytes < 256 << 10, f"the plans of layout code keep {kept_bytes} bytes after one push"
        # Its routes are the whole plan's routes from rank 0, in their order.
        whole = plan(mine, wide, geometry, 32).routes_from(0)
        by_dst = producer._producer._pusher._pushes["p"].by_dst  # noqa: SLF001
        assert by_dst == {ref.peer_id(d): [r for r in whole if r.dst == d] for d in sorted({r.dst for r in whole})}
    finally:
        tracemalloc.stop()
        monkeypatch.undo()
        producer.close()


def test_a_pull_that_is_not_our_plan_is_logged_in_a_bounded_text(caplog: pytest.LogCaptureFixture) -> None:
    """A consumer pulls 4096 one-token spans (the most a pull carries, some 100 KB on the wire), each of the wrong
    layers. The producer refuses it, logged at ERROR with its traceback, naming both counts and the first routes
    that differ; it used to list both route lists whole (4096 routes each: half a megabyte of log a pull, no rate
    limit: any handshaken peer, or a version skew on every pull). Short lists are still named whole (above)."""
    mla = KVGeometry(num_layers=2, num_kv_heads=1, head_size=8, dtype="float32", use_mla=True)
    producer = TransferEngine(EngineConfig("prefill", 0, ONE, mla, role="producer", auth=NONE, deadline_s=WAIT_S))
    evil = peer("evil", "consumer", producer, ONE, mla)
    spans = 4096
    # Our plan gives the link every layer, the latent, one route a token span: these ask layer 0 alone.
    routes = tuple(RouteMsg(0, 0, (0, 1), (0, 1), (2 * i, 2 * i + 1)) for i in range(spans))
    try:
        with caplog.at_level(logging.ERROR):
            wrong = request(evil, "prefill.r0", PullRequest("w", 0, "evil", routes, 2 * spans))
        assert isinstance(wrong, NcclKVError), wrong
        logged = [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert logged, caplog.text
        size = max(len(caplog.handler.format(r)) for r in logged)
        assert size < 16 << 10, f"one refused pull logged {size} chars"
        for text in (str(wrong), caplog.text):  # the counts and the first routes that differ, both ways
            assert "asks routes [4096 routes, 4096 of them not in the other list, the first 8: Route(src 0 -> dst 0: " \
                   "layers [0,1) heads [0,1) tokens [0,1))" in text, text[:2000]
            assert "our plan gives [4096 routes, 4096 of them not in the other list, the first 8: Route(src 0 -> " \
                   "dst 0: layers [0,2) heads [0,1) tokens [0,1))" in text, text[:2000]
    finally:
        evil.close()
        producer.close()


def test_a_push_offer_that_is_not_our_plan_is_logged_in_a_bounded_text(caplog: pytest.LogCaptureFixture) -> None:
    """The same for a push offer of 4096 one-token routes (our plan gives the link one): named by its count and its
    first routes our plan lacks, where the whole list was a quarter of a megabyte of log an offer."""
    consumer = TransferEngine(EngineConfig("decode", 0, ONE, GEOMETRY, role="consumer", auth=NONE,
                                           staging_bytes=64 << 10, deadline_s=WAIT_S, hold_s=30.0))
    consumer.register({layer: torch.zeros(16, 2, 4, 16) for layer in range(2)}, CacheLayout.CPU)
    evil = peer("evil", "producer", consumer)
    spans = 4096
    routes = tuple(RouteMsg(0, 0, (0, 2), (0, 2), (i, i + 1)) for i in range(spans))
    try:
        with caplog.at_level(logging.ERROR):
            wrong = request(evil, "decode.r0", PushOffer("w", 0, "evil", routes, spans, 1 << 20, None))
        assert isinstance(wrong, NcclKVError), wrong
        logged = [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert logged, caplog.text
        size = max(len(caplog.handler.format(r)) for r in logged)
        assert size < 16 << 10, f"one refused push offer logged {size} chars"
        for text in (str(wrong), caplog.text):
            assert "offers [4096 routes, 4096 of them not in the other list, the first 8: Route(src 0 -> dst 0: " \
                   "layers [0,2) heads [0,2) tokens [0,1))" in text, text[:2000]
            assert "our plan gives [Route(src 0 -> dst 0: layers [0,2) heads [0,2) tokens [0,4096))]" in text, text[:2000]
    finally:
        evil.close()
        consumer.close()
