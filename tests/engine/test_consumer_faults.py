"""Faults on the receive side that must stay with one request and never put a link out of step.

A wire buffer or a receive that cannot be had for an announced tensor, pulls
queued behind handshakes with a dead producer, an abort of a push before its
offer or of a pull whose tensors are in flight, and a close while requests are
expected, a tensor landing after its request ended; and, on the sending
side, a push whose backlog is queued at its offer. Links are real gloo links
where the stream's order is what is tested, loopback links elsewhere; order is
forced with events, never sleeps.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from ncclkv.channel import Channel
from ncclkv.engine import BlockTokens, EngineRef
from ncclkv.engine import _engine as engine_module
from ncclkv.engine._engine import _TASKS_PER_PEER as TASKS_PER_PEER
from ncclkv.errors import (ClosedError, NcclKVError, PeerLostError, ShapeMismatchError, TransferError,
                           TransferTimeout)
from ncclkv.launch import free_port
from ncclkv.layout import Span
from ncclkv.paged import CacheLayout
from ncclkv.protocol import INCARNATION_RANDOM_BITS, Announce, ErrorCode, ErrorMsg, RouteMsg
from ncclkv.transport import LoopbackHub

from .kvsim import RankSide, build_sides, close_sides, engine_ref, start_pull
from .test_engine_failures import GQA, ONE, WAIT_S, _pair, _push, _sent, _sides, _staging, _until



@pytest.fixture
def gloo_pair() -> Iterator[tuple[list[RankSide], list[RankSide]]]:
    """A one-rank producer and consumer on real data planes (gloo links), a short deadline; a pull's tensor per
    layer (these tests fail the n-th tensor of a request)."""
    prefill = build_sides("prefill", ONE, GQA, CacheLayout.CPU, 16, "producer", deadline_s=3.0, pull_batch_bytes=0)
    decode = build_sides("decode", ONE, GQA, CacheLayout.CPU, 16, "consumer", deadline_s=3.0)
    try:
        yield prefill, decode
    finally:
        close_sides(prefill, decode)


def _outcomes(side: RankSide, *request_ids: str) -> dict[str, BaseException | None]:
    """Poll a consumer rank until it reported each of ``request_ids``; their outcomes."""
    got: dict[str, BaseException | None] = {}

    def poll() -> bool:
        got.update(side.engine.take_finished_receiving())
        return set(request_ids) <= got.keys()
    _until(poll, f"{request_ids} reported")
    return got


def _fail_call(n: int, real: Callable[..., Any], error: BaseException,
               which: Callable[..., bool] = lambda *args, **kwargs: True) -> Callable[..., Any]:
    """``real``, except that the ``n``-th of its calls that ``which`` picks raises ``error``."""
    calls = [0]

    def flaky(*args: Any, **kwargs: Any) -> Any:
        if which(*args, **kwargs):
            calls[0] += 1
            if calls[0] == n:
                raise error
        return real(*args, **kwargs)
    return flaky


def _link_id(side: RankSide, peer_id: str) -> str | None:
    peer = side.engine._peers.get(peer_id)  # noqa: SLF001
    return None if peer is None else peer.link_id


def _recorded_connects(channel: Channel) -> list[str]:
    """The addresses ``channel.connect()`` is given from now on, in order (each connect still made)."""
    connects: list[str] = []
    connect = channel.connect

    def counted_connect(peer_id: str, address: str, **kwargs: Any) -> None:
        connects.append(address)
        connect(peer_id, address, **kwargs)
    channel.connect = counted_connect  # type: ignore[method-assign]
    return connects


def test_a_wire_buffer_that_cannot_be_taken_fails_its_request_alone_and_keeps_the_link_in_step(
        gloo_pair: tuple[list[RankSide], list[RankSide]]) -> None:
    prefill, decode = gloo_pair
    start_pull("warm", prefill, decode, 9, [5], [5], 10)  # the link is up
    decode[0].engine.wait("warm", timeout_s=WAIT_S)
    link_before = _link_id(decode[0], "prefill.r0")
    caches = decode[0].engine._caches  # noqa: SLF001 - one allocation fails (CUDA OOM under vLLM's budget)
    caches.wire_buffer = _fail_call(  # type: ignore[method-assign]
        2, caches.wire_buffer, RuntimeError("out of memory (test)"), lambda tokens, heads, **_: len(tokens) == 20)
    start_pull("a", prefill, decode, 1, [1, 2], [1, 2], 20)  # a's second slice of 20 tokens finds no buffer
    start_pull("b", prefill, decode, 2, [3, 4], [3, 4], 24)  # its tensors beside a's on the link
    out = _outcomes(decode[0], "a", "b")
    assert isinstance(out["a"], TransferError) and "no wire buffer for" in str(out["a"]), out
    assert "out of memory (test)" in str(out["a"])
    # Before: a's tensor was never received, and b's receives took the tensors before their own.
    assert out["b"] is None, out
    assert decode[0].mismatches(2, [3, 4], 24, Span(0, 24)) == []
    assert _link_id(decode[0], "prefill.r0") == link_before  # drained: the link stayed in step, and open


def test_a_wire_buffer_that_cannot_be_taken_fails_a_staged_push_at_once(
        gloo_pair: tuple[list[RankSide], list[RankSide]]) -> None:
    prefill, decode = gloo_pair
    ref, producer = engine_ref("decode", ONE, decode), engine_ref("prefill", ONE, prefill)
    caches = decode[0].engine._caches  # noqa: SLF001
    caches.wire_buffer = _fail_call(2, caches.wire_buffer, RuntimeError("out of memory (test)"))  # type: ignore[method-assign]
    prefill[0].fill(seed=3, block_ids=[0, 1], num_tokens=32)
    _push(prefill[0], "p", ref, [0, 1], 32)  # staged here: not expected yet; its layer 1 finds no buffer
    _sent(prefill[0], "p")  # every send of p completed (received into staging or drained)
    _push(prefill[0], "q", ref, [0, 1], 32)  # right behind p on the link
    assert _sent(prefill[0], "q") is None
    # q's only: p's staging was given back at once. q's last tensor may be stored just after its send completed.
    _until(lambda: _staging(decode[0]) == (128 * 1024, 128 * 1024), "q's tensors stored and p's staging given back")
    decode[0].engine.expect("p", producer, [2, 3], 32, push=True)
    with pytest.raises(TransferError, match="no wire buffer for"):
        decode[0].engine.wait("p", timeout_s=WAIT_S)
    decode[0].engine.expect("q", producer, [4, 5], 32, push=True)
    decode[0].engine.wait("q", timeout_s=WAIT_S)  # its tensors were received in their own place
    assert decode[0].mismatches(3, [4, 5], 32, Span(0, 32)) == []


def test_a_receive_that_cannot_be_posted_closes_the_link_and_the_next_request_lands(
        gloo_pair: tuple[list[RankSide], list[RankSide]]) -> None:
    prefill, decode = gloo_pair
    start_pull("warm", prefill, decode, 9, [5], [5], 10)
    decode[0].engine.wait("warm", timeout_s=WAIT_S)
    link_before = _link_id(decode[0], "prefill.r0")
    link = decode[0].engine._peers.link("prefill.r0")  # noqa: SLF001 - its second receive cannot be posted
    link.recv = _fail_call(2, link.recv, ClosedError("receive refused (test)"))  # type: ignore[method-assign]
    start_pull("a", prefill, decode, 1, [1, 2], [1, 2], 20)
    error = _outcomes(decode[0], "a")["a"]
    # Before: the link stayed open, a waited deadline_s, and the next receive took the unreceived tensor.
    assert isinstance(error, ClosedError) and "no receive posted for announcement seq" in str(error), error
    assert "link closed" in str(error)
    start_pull("b", prefill, decode, 2, [3, 4], [3, 4], 20)
    decode[0].engine.wait("b", timeout_s=WAIT_S)
    assert decode[0].mismatches(2, [3, 4], 20, Span(0, 20)) == []
    assert _link_id(decode[0], "prefill.r0") not in (None, link_before)  # a new link


def test_a_receive_refused_by_a_link_a_tensor_broke_fails_with_that_cause_s_type(
        gloo_pair: tuple[list[RankSide], list[RankSide]]) -> None:
    """The link closes (broken by a tensor whose header did not match its receive) before that receive's own error
    lands on its request; the next announcement's receive is refused meanwhile. Before, every request on the link,
    the one whose tensor broke it too, failed with a ClosedError; seen once in the multiprocess oversized-sender
    test under load, which expects the ShapeMismatchError naming both sizes."""
    prefill, decode = gloo_pair
    start_pull("warm", prefill, decode, 9, [5], [5], 10)
    decode[0].engine.wait("warm", timeout_s=WAIT_S)
    link = decode[0].engine._peers.link("prefill.r0")  # noqa: SLF001
    broken = ShapeMismatchError("header says (2, 41, 4, 32), the receive is (2, 40, 4, 32) (test)")
    real_recv, calls = link.recv, [0]

    def recv(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == 2:  # the link's state at that moment: broken by an earlier tensor, so closed
            link._broken = broken  # noqa: SLF001
            raise ClosedError(f"link is closed (broken: {broken})")
        return real_recv(*args, **kwargs)
    link.recv = recv  # type: ignore[method-assign]
    start_pull("a", prefill, decode, 1, [1, 2], [1, 2], 20)
    error = _outcomes(decode[0], "a")["a"]
    assert isinstance(error, ShapeMismatchError) and "no receive posted for announcement seq" in str(error), error
    assert "(2, 41, 4, 32)" in str(error) and "link closed" in str(error)


def test_pulls_to_a_dead_producer_do_not_starve_a_pull_from_a_live_one() -> None:
    with _pair(producer=dict(deadline_s=2.0), consumer=dict(deadline_s=2.0)) as (prefill, decode):
        dead = EngineRef("deadprefill", ONE, (f"tcp://127.0.0.1:{free_port()}",))  # a crashed prefill engine
        dead_ids = [f"dead{i}" for i in range(2 * TASKS_PER_PEER)]  # more than run at once for one peer
        for i, request_id in enumerate(dead_ids):
            decode[0].engine.expect(request_id, dead, [8 + i], 10)
        prefill[0].fill(seed=1, block_ids=[1, 2], num_tokens=20)
        prefill[0].engine.finish("ok", [1, 2], 20)
        decode[0].engine.expect("ok", engine_ref("prefill", ONE, prefill), [1, 2], 20)
        # Before: queued behind the dead pulls, each waiting deadline_s, it stalled first.
        decode[0].engine.wait("ok", timeout_s=WAIT_S)
        assert decode[0].mismatches(1, [1, 2], 20, Span(0, 20)) == []
        out = _outcomes(decode[0], *dead_ids)
        assert all(isinstance(out[r], NcclKVError) for r in dead_ids), out  # each failed, typed


def test_an_offer_after_the_abort_of_an_expected_push_is_refused() -> None:
    with _pair(consumer=dict(hold_s=600.0)) as (prefill, decode):
        ref, producer = engine_ref("decode", ONE, decode), engine_ref("prefill", ONE, prefill)
        decode[0].engine.expect("p", producer, [0, 1], 32, push=True)  # before the producer's offer came
        decode[0].engine.abort("p")  # its decode request was cancelled
        _push(prefill[0], "p", ref, [0, 1], 32)
        error = _sent(prefill[0], "p")
        # Before: staged for no one until hold_s, and the producer told it succeeded.
        assert isinstance(error, TransferError) and "already failed here" in str(error), error
        assert "'p' aborted" in str(error)
        assert _staging(decode[0]) == (0, 0)
        assert decode[0].engine._consumer._stage.get("p") is None  # noqa: SLF001


def test_an_aborted_pull_larger_than_the_staging_is_drained_and_the_link_kept() -> None:
    # 20 KiB slices, 4 KiB of staging (pushes unused): what is drained is bounded by the plan, not the staging.
    with _pair(producer=dict(hold_s=30.0), consumer=dict(staging_bytes=4096)) as (prefill, decode):
        producer = engine_ref("prefill", ONE, prefill)
        decode[0].engine.expect("a", producer, [1, 2], 20)
        decode[0].engine.expect("b", producer, [3, 4], 20)
        early = prefill[0].engine._producer._early  # noqa: SLF001 - both pulls wait at the producer
        _until(lambda: {"a", "b"} <= early.keys(), "both pulls parked at the producer")
        link_before = _link_id(decode[0], "prefill.r0")
        decode[0].engine.abort("a")  # its tensors come after this, on the link b's come on
        for request_id, blocks in (("a", [1, 2]), ("b", [3, 4])):
            prefill[0].fill(seed=2, block_ids=blocks, num_tokens=20)
            prefill[0].engine.finish(request_id, blocks, 20)
        decode[0].engine.wait("b", timeout_s=WAIT_S)  # before: a's drain broke the link, and b failed
        assert decode[0].mismatches(2, [3, 4], 20, Span(0, 20)) == []
        assert _sent(prefill[0], "a") is None  # served, and drained here
        assert _link_id(decode[0], "prefill.r0") == link_before


def test_close_fails_expected_requests_and_wakes_their_waiters() -> None:
    with _pair(consumer=dict(deadline_s=60.0)) as (prefill, decode):
        decode[0].engine.expect("r", engine_ref("prefill", ONE, prefill), [1, 2], 20)  # its pull waits: not held
        early = prefill[0].engine._producer._early  # noqa: SLF001
        _until(lambda: "r" in early, "the pull parked at the producer")
        # and acknowledged here: else the close can fail it first, as the pull's ("... while waiting for a reply")
        req = decode[0].engine._consumer._requests["r"]  # noqa: SLF001
        _until(lambda: req.unsent == 0, "the pull's acknowledgement")
        got: dict[str, BaseException | bool] = {}
        waiting = threading.Barrier(3, timeout=WAIT_S)

        def wait_layer() -> None:
            waiting.wait()
            try:
                decode[0].engine.wait_layer("r", 0, timeout_s=WAIT_S)
            except BaseException as err:  # noqa: BLE001 - what the waiter saw is the outcome
                got["wait_layer"] = err

        def wait_finished() -> None:
            waiting.wait()
            got["wait_finished"] = decode[0].engine.wait_finished_receiving(WAIT_S)
        threads = [threading.Thread(target=wait_layer), threading.Thread(target=wait_finished)]
        for thread in threads:
            thread.start()
        waiting.wait()
        started = time.monotonic()
        decode[0].engine.close()
        for thread in threads:
            thread.join(WAIT_S)
        # Before: the waiters ran into their own limits (wait_layer: TransferTimeout), not the close.
        assert time.monotonic() - started < WAIT_S / 2, got
        assert isinstance(got.get("wait_layer"), ClosedError), got
        assert "closed while request 'r' was expected" in str(got["wait_layer"])
        assert got.get("wait_finished") is True, got
        assert isinstance(decode[0].engine.take_finished_receiving().get("r"), ClosedError)


def test_a_tensor_beyond_any_slice_planned_here_closes_the_link(caplog: pytest.LogCaptureFixture) -> None:
    hub = LoopbackHub()
    prefill = _sides(hub, "prefill", "producer")
    decode = _sides(hub, "decode", "consumer")  # staging_bytes: 1 GiB by default
    other = _sides(hub, "other", "producer")
    try:
        decode[0].engine.expect("r", engine_ref("prefill", ONE, prefill), [1, 2], 20)  # slices of 20 KiB
        peer = other[0].engine._peers.ensure("decode.r0", decode[0].engine.address, need_link=True)  # noqa: SLF001
        with caplog.at_level(logging.WARNING, logger="ncclkv.engine"):
            other[0].engine._channel.send("decode.r0", Announce(  # noqa: SLF001 - 40 KiB, for no request here
                "x", 0, RouteMsg(0, 0, (0, 4), (0, 4), (0, 40)), (2, 40, 4, 32), "float32", 2 * 40 * 4 * 32 * 4,
                0, peer.link_id, None))
            _until(lambda: decode[0].engine._peers.get("other.r0") is None,  # noqa: SLF001
                   "the link to the announcing engine closed")
        assert any("implausible announcement (2, 40, 4, 32) float32 40960 B (the largest slice planned here is "
                   "20480 B)" in r.getMessage() for r in caplog.records)
        prefill[0].fill(seed=4, block_ids=[1, 2], num_tokens=20)  # its own producer's request is untouched
        prefill[0].engine.finish("r", [1, 2], 20)
        decode[0].engine.wait("r", timeout_s=WAIT_S)
        assert decode[0].mismatches(4, [1, 2], 20, Span(0, 20)) == []
    finally:
        close_sides(prefill, decode, other)


def test_a_push_finished_before_its_offer_is_not_complete_until_its_backlog_is_sent(
        gloo_pair: tuple[list[RankSide], list[RankSide]]) -> None:
    """finish() before the consumer accepted the offer: every layer is backlog, queued in one go by the offer.
    A first send that completes before its callback is added (the offer thread descheduled right after
    link.send) must not complete the push, and hand its blocks back, while the later layers are not even
    queued: each later layer is gathered while the push is still open, and every layer lands right."""
    prefill, decode = gloo_pair
    producer = prefill[0].engine
    pusher = producer._producer._pusher  # noqa: SLF001 - the push side, to hold its offer and first send
    offer_go, completed_at_gather = threading.Event(), []
    real_offer, real_link, real_gather = pusher._offer, pusher._peers.link, producer._caches.gather  # noqa: SLF001

    def held_offer(*args: Any) -> None:  # the offer's round trip outlasts the prefill's forward
        assert offer_go.wait(WAIT_S)
        real_offer(*args)

    class FirstSendReturnsWhenDone:
        def __init__(self, link: Any) -> None:
            self._link, self._first = link, True

        def __getattr__(self, name: str) -> Any:
            return getattr(self._link, name)

        def send(self, *args: Any, **kwargs: Any) -> Any:
            future = self._link.send(*args, **kwargs)
            if self._first:  # the offer thread resumes only once that send completed
                self._first = False
                done = threading.Event()
                future.add_done_callback(lambda _: done.set())
                assert done.wait(WAIT_S)
            return future

    def gather(layer: int, *args: Any) -> Any:
        if layer >= 1:
            completed_at_gather.append("x" not in pusher._pushes)  # noqa: SLF001 - reported complete already?
        return real_gather(layer, *args)

    pusher._offer = held_offer  # noqa: SLF001
    pusher._peers.link = lambda dst: FirstSendReturnsWhenDone(real_link(dst))  # noqa: SLF001
    producer._caches.gather = gather  # noqa: SLF001
    n, blocks = 40, [1, 2, 3]
    prefill[0].fill(seed=7, block_ids=blocks, num_tokens=n)
    producer.start_push("x", engine_ref("decode", ONE, decode), blocks, n)
    for layer in range(GQA.num_layers):
        producer.save_layer("x", layer)
    producer.finish("x")
    offer_go.set()
    assert _sent(prefill[0], "x") is None
    assert completed_at_gather == [False] * (GQA.num_layers - 1)
    decode[0].engine.expect("x", engine_ref("prefill", ONE, prefill), [5, 6, 7], n, push=True)
    decode[0].engine.wait("x", timeout_s=WAIT_S)
    assert decode[0].mismatches(7, [5, 6, 7], n, Span(0, n)) == []


def test_a_tensor_landing_after_its_request_ended_gives_its_wire_buffer_back(
        gloo_pair: tuple[list[RankSide], list[RankSide]]) -> None:
    """A receive posted for an expected push lands after the request was aborted: nothing takes it, and its
    wire buffer is given back (else the buffers' count of bytes out stays high and their cache bound drifts)."""
    prefill, decode = gloo_pair
    consumer = decode[0].engine._consumer  # noqa: SLF001
    landing, go = threading.Event(), threading.Event()
    real_landed = consumer._landed  # noqa: SLF001

    def held_landed(*args: Any) -> None:  # the receive thread: the first landing waits for the abort
        landing.set()
        assert go.wait(WAIT_S)
        real_landed(*args)

    consumer._landed = held_landed  # noqa: SLF001
    n, blocks = 40, [1, 2, 3]
    prefill[0].fill(seed=7, block_ids=blocks, num_tokens=n)
    decode[0].engine.expect("a", engine_ref("prefill", ONE, prefill), [4, 5, 6], n, push=True)
    prefill[0].engine.start_push("a", engine_ref("decode", ONE, decode), blocks, n)
    prefill[0].engine.save_layer("a", 0)
    assert landing.wait(WAIT_S)
    decode[0].engine.abort("a")
    go.set()
    for layer in range(1, GQA.num_layers):
        prefill[0].engine.save_layer("a", layer)
    prefill[0].engine.finish("a")
    _sent(prefill[0], "a")
    buffers = decode[0].engine._caches._buffers  # noqa: SLF001
    _until(lambda: buffers._lent_bytes == 0, "every wire buffer given back")  # noqa: SLF001


def test_a_pull_under_the_id_of_an_aborted_or_failed_one_is_refused() -> None:
    with _pair(producer=dict(hold_s=30.0), consumer=dict(hold_s=600.0, deadline_s=2.0)) as (prefill, decode):
        producer = engine_ref("prefill", ONE, prefill)
        decode[0].engine.expect("a", producer, [1, 2], 20)
        early = prefill[0].engine._producer._early  # noqa: SLF001 - the pull waits at the producer
        _until(lambda: "a" in early, "the pull parked at the producer")
        decode[0].engine.abort("a")
        # Before: taken as a new pull, which took the first one's tensors when the producer served it.
        with pytest.raises(ValueError, match=r"request 'a' from 'prefill' ended here unloaded .*aborted.*new request id"):
            decode[0].engine.expect("a", producer, [3, 4], 20)
        assert "a" not in decode[0].engine._consumer._requests  # noqa: SLF001 - nothing registered
        # The aborted pull's tensors are drained, and a pull under a new id lands whole on the same link.
        prefill[0].fill(seed=3, block_ids=[1, 2], num_tokens=20)
        prefill[0].engine.finish("a", [1, 2], 20)
        prefill[0].engine.finish("a2", [1, 2], 20)
        decode[0].engine.expect("a2", producer, [3, 4], 20)
        decode[0].engine.wait("a2", timeout_s=WAIT_S)
        assert decode[0].mismatches(3, [3, 4], 20, Span(0, 20)) == []

        dead = EngineRef("deadprefill", ONE, (f"tcp://127.0.0.1:{free_port()}",))
        decode[0].engine.expect("d", dead, [5], 10)
        assert isinstance(_outcomes(decode[0], "d")["d"], NcclKVError)  # failed: the producer never answered
        with pytest.raises(ValueError, match=r"request 'd' from 'deadprefill' ended here unloaded"):
            decode[0].engine.expect("d", dead, [5], 10)
        decode[0].engine.expect("d", producer, [5], 10)  # another producer's request under that id: its own
        decode[0].engine.abort("d")


def test_a_staged_tensor_the_store_refuses_fails_its_push_at_once_and_gives_its_buffer_back(
        gloo_pair: tuple[list[RankSide], list[RankSide]]) -> None:
    """Staging a landed tensor runs in the receive's done-callback, whose exceptions concurrent.futures only
    logs: the tensor was lost, its wire buffer never handed back, and the expect() found out by a stall. Now the
    staged push fails at once, naming the request, its staging and the buffer go back, and the link goes on."""
    prefill, decode = gloo_pair
    ref, producer = engine_ref("decode", ONE, decode), engine_ref("prefill", ONE, prefill)
    consumer = decode[0].engine._consumer  # noqa: SLF001
    store = consumer._stage.store  # noqa: SLF001
    store.put = _fail_call(2, store.put, RuntimeError("store fault (test)"),  # type: ignore[method-assign]
                           lambda key, value, **_: value is not None)  # the second tensor staged
    prefill[0].fill(seed=3, block_ids=[0, 1], num_tokens=32)
    _push(prefill[0], "p", ref, [0, 1], 32)  # not expected here yet: every tensor goes to staging
    _sent(prefill[0], "p")  # every send of p completed: every landing ran
    _until(lambda: _staging(decode[0]) == (0, 0), "p's staging given back")
    buffers = decode[0].engine._caches._buffers  # noqa: SLF001
    _until(lambda: buffers._lent_bytes == 0, "every wire buffer of p given back")  # noqa: SLF001
    started = time.monotonic()
    decode[0].engine.expect("p", producer, [2, 3], 32, push=True)
    with pytest.raises(TransferError, match=r"request 'p': the tensor of layer 1 from rank 0 .* landed but could "
                                            r"not be taken: RuntimeError: store fault \(test\)"):
        decode[0].engine.wait("p", timeout_s=WAIT_S)
    assert time.monotonic() - started < 2.0  # at once, not after a stall (deadline_s=3)
    prefill[0].fill(seed=4, block_ids=[2, 3], num_tokens=32)
    _push(prefill[0], "q", ref, [2, 3], 32)  # the same link goes on
    assert _sent(prefill[0], "q") is None
    decode[0].engine.expect("q", producer, [4, 5], 32, push=True)
    decode[0].engine.wait("q", timeout_s=WAIT_S)
    assert decode[0].mismatches(4, [4, 5], 32, Span(0, 32)) == []


def test_a_staged_tensor_whose_bookkeeping_fails_after_the_store_took_it_is_given_back_once(
        gloo_pair: tuple[list[RankSide], list[RankSide]]) -> None:
    """The store holds the buffer once put: if reporting the push as stored then fails, the failed push gives it
    back (with the rest of its staging), and the landing must not hand it back again (another receive may hold it
    by then)."""
    prefill, decode = gloo_pair
    ref, producer = engine_ref("decode", ONE, decode), engine_ref("prefill", ONE, prefill)
    stage, caches = decode[0].engine._consumer._stage, decode[0].engine._caches  # noqa: SLF001
    stage._log.stored = _fail_call(1, stage._log.stored, RuntimeError("stored event fault (test)"))  # noqa: SLF001
    given: list[int] = []  # the storage of every wire buffer handed back, recycled or not
    for name in ("hand_back", "recycle"):
        real = getattr(caches, name)
        setattr(caches, name, lambda buf, *args, _real=real, **kwargs: (
            given.append(buf.untyped_storage().data_ptr()), _real(buf, *args, **kwargs))[1])
    prefill[0].fill(seed=3, block_ids=[0, 1], num_tokens=32)
    # Named blocks: the push is reported "stored" once its last tensor landed, which is the call that fails.
    prefill[0].engine.start_push("p", ref, [0, 1], 32, blocks=BlockTokens.of_prompt(list(range(32)), 16))
    for layer in range(GQA.num_layers):
        prefill[0].engine.save_layer("p", layer)
    prefill[0].engine.finish("p")
    _sent(prefill[0], "p")
    _until(lambda: _staging(decode[0]) == (0, 0), "p's staging given back")
    decode[0].engine.expect("p", producer, [2, 3], 32, push=True)
    with pytest.raises(TransferError, match=r"RuntimeError: stored event fault \(test\)"):
        decode[0].engine.wait("p", timeout_s=WAIT_S)
    assert len(given) == GQA.num_layers == len(set(given)), given  # each buffer once


def test_declines_to_a_dead_producer_do_not_hold_back_a_decline_to_a_live_one() -> None:
    """Declines are best effort on threads of their own, but one producer that never answers (each decline to it
    waits deadline_s for a handshake) delayed every later decline: a live producer held its blocks that long."""
    deadline_s = 8.0
    with _pair(producer=dict(hold_s=600.0), consumer=dict(deadline_s=deadline_s)) as (prefill, decode):
        dead = EngineRef("deadprefill", ONE, (f"tcp://127.0.0.1:{free_port()}",))  # a crashed prefill engine
        for i in range(3):
            decode[0].engine.decline(f"dead{i}", dead)
        _until(lambda: "deadprefill.r0" in decode[0].engine._peers._connecting, "the first decline's handshake")  # noqa: SLF001
        prefill[0].fill(seed=2, block_ids=[1, 2], num_tokens=20)
        prefill[0].engine.finish("ok", [1, 2], 20)
        started = time.monotonic()
        decode[0].engine.decline("ok", engine_ref("prefill", ONE, prefill))
        assert _sent(prefill[0], "ok") is None  # a pull of nothing: freed at once, not after hold_s
        took = time.monotonic() - started
        assert took < deadline_s / 2, f"the live producer heard the decline after {took:.2f}s (deadline_s={deadline_s})"


def test_a_decline_to_a_producer_lost_before_its_handshake_leaves_it_lost_and_its_restart_serves() -> None:
    """A producer rank that died before it answered the handshake is lost by the channel after deadline_s; its
    pull fails and is declined. The decline skipped only peers we shook hands with, so it connected to the dead
    address again: the channel held the dead life alive for another deadline_s and then reported it lost once
    more, and that second loss, reported after the restarted producer's request was expected, failed it
    ("nothing heard for more than deadline_s")."""
    deadline_s = 2.0
    with _pair(consumer=dict(deadline_s=deadline_s)) as (prefill, decode):
        engine = decode[0].engine
        channel, decliner = engine._channel, engine._consumer._decliner  # noqa: SLF001
        dead_at = f"tcp://127.0.0.1:{free_port()}"  # the producer's first life, killed before its handshake reply
        connects = _recorded_connects(channel)
        # The decline of the failed pull runs once the channel lost the dead life (as after a SIGKILL: the pull
        # failed by that loss), and the restarted producer's request is expected after the decline went, or is
        # at its handshake with the dead address.
        lost = threading.Event()
        real_lost = decliner._lost  # noqa: SLF001

        def after_the_loss(*args: Any) -> bool:
            assert lost.wait(WAIT_S)
            return real_lost(*args)
        decliner._lost = after_the_loss  # noqa: SLF001
        engine.expect("doomed", EngineRef("prefill", ONE, (dead_at,)), [1, 2], 20)
        with pytest.raises((PeerLostError, TransferTimeout)):
            engine.wait("doomed", timeout_s=WAIT_S)
        _until(lambda: not channel.peer_alive("prefill.r0") and channel.stats.peers_lost == 1, "the dead life lost")
        lost.set()
        _until(lambda: decliner.queued == 0 or "prefill.r0" in engine._peers._connecting,  # noqa: SLF001
               "the decline of the failed pull went, or is at its handshake")
        start_pull("again", prefill, decode, 3, [3, 4], [3, 4], 20)  # the restarted producer, at another address
        engine.wait("again", timeout_s=WAIT_S)  # before: PeerLostError "... nothing heard for more than ..."
        assert decode[0].mismatches(3, [3, 4], 20, Span(0, 20)) == []
        _until(lambda: decliner.queued == 0, "the decline gone")
        # The dead address was connected to once (by the pull), and its life lost once.
        assert connects.count(dead_at) == 1, connects
        assert channel.stats.peers_lost == 1, channel.stats


def _forge(producer: RankSide, consumer: RankSide, announce: Callable[[str], Announce]) -> None:
    """Send ``consumer`` the producer's own Announce (``announce(link_id)``), as the first on their link."""
    peer_id = f"{consumer.engine.config.engine_id}.r0"
    peer = producer.engine._peers.ensure(peer_id, consumer.engine.address, need_link=True)  # noqa: SLF001
    producer.engine._channel.send(peer_id, announce(peer.link_id))  # noqa: SLF001


@pytest.mark.parametrize(("first", "num_layers", "told"), [
    (3, 2, r"announced layers 3-4 .* which request 'r' does not expect"),  # GQA has 4 layers: 0-3
    (0, 5, r"announced layers 0-4 .*: 5 layers in one tensor, the model has 4"),
])
def test_a_batch_of_layers_the_request_cannot_take_fails_it_naming_them(first: int, num_layers: int,
                                                                        told: str) -> None:
    """The producer's own announcement of layers in one tensor that are not all the request's: it fails at once,
    typed, naming the layers."""
    with _pair() as (prefill, decode):
        decode[0].engine.expect("r", engine_ref("prefill", ONE, prefill), [1, 2], 20)
        # At both ends: the consumer installs the handshake once the reply is back (then sends the pull, which
        # orders a real producer's announcements after it); a forged one before that names an unknown link.
        _until(lambda: prefill[0].engine._peers.get("decode.r0") is not None  # noqa: SLF001
               and decode[0].engine._peers.get("prefill.r0") is not None, "the pull's handshake")  # noqa: SLF001
        _forge(prefill[0], decode[0], lambda link_id: Announce(
            "r", first, RouteMsg(0, 0, (0, 4), (0, 4), (0, 20)), (num_layers, 2, 20, 4, 32), "float32",
            num_layers * 2 * 20 * 4 * 32 * 4, 0, link_id, None, num_layers=num_layers))
        with pytest.raises(ShapeMismatchError, match=told):
            decode[0].engine.wait("r", timeout_s=WAIT_S)


@pytest.mark.parametrize("expected", [False, True], ids=["staged", "expected"])
def test_a_batch_of_layers_for_a_push_fails_that_push(expected: bool) -> None:
    """Only pulls batch layers (a push sends each as it is saved; a staged tensor is one slice's): a batch
    announced for a push, staged or expected, fails it."""
    with _pair() as (prefill, decode):
        if expected:
            decode[0].engine.expect("p", engine_ref("prefill", ONE, prefill), [1, 2], 20, push=True)
        prefill[0].engine.start_push("p", engine_ref("decode", ONE, decode), [1, 2], 20)
        consumer = decode[0].engine._consumer  # noqa: SLF001

        def offered() -> bool:
            push = consumer._requests.get("p") if expected else consumer._stage.get("p")  # noqa: SLF001
            return push is not None and prefill[0].engine._peers.get("decode.r0") is not None  # noqa: SLF001
        _until(offered, "p offered")
        _forge(prefill[0], decode[0], lambda link_id: Announce(
            "p", 0, RouteMsg(0, 0, (0, 4), (0, 4), (0, 20)), (2, 2, 20, 4, 32), "float32", 2 * 2 * 20 * 4 * 32 * 4,
            0, link_id, None, num_layers=2))
        if not expected:
            _until(lambda: consumer._stage.get("p").error is not None, "p failed")  # noqa: SLF001
            decode[0].engine.expect("p", engine_ref("prefill", ONE, prefill), [1, 2], 20, push=True)
        with pytest.raises(ShapeMismatchError, match=r"announced layers 0-1 .* in one tensor for push 'p': a push "
                                                     r"sends a layer per tensor"):
            decode[0].engine.wait("p", timeout_s=WAIT_S)


def _after_calls(target: Any, name: str, count: int, seen: Callable[..., bool] = lambda *_: True) -> threading.Event:
    """Wrap ``target.name``: the event is set once ``count`` calls for which ``seen(*args)`` holds have returned."""
    done, real, calls, lock = threading.Event(), getattr(target, name), [0], threading.Lock()

    def wrapped(*args: Any) -> Any:
        try:
            return real(*args)
        finally:
            with lock:
                calls[0] += seen(*args)
                if calls[0] >= count:
                    done.set()
    setattr(target, name, wrapped)
    return done


def test_a_late_tensor_of_an_aborted_pull_never_lands_in_the_next_request_under_its_id() -> None:
    """A pull from A is aborted after A announced its tensor; the id is then pulled from B. A's tensor, landing
    after B's, is handed back: before, it was scattered over B's KV and the request reported done (found by
    review, 2 of 2 runs)."""
    hub = LoopbackHub()
    a, b, decode = _sides(hub, "a", "producer"), _sides(hub, "b", "producer"), _sides(hub, "decode", "consumer")
    try:
        blocks = [1, 2]
        for side, seed in ((a, 1), (b, 2)):
            side[0].fill(seed=seed, block_ids=blocks, num_tokens=20)
            side[0].engine.finish("x", blocks, 20)
        gate, real_gather = threading.Event(), a[0].engine._caches.gather  # noqa: SLF001

        def held_gather(*args: Any, **kwargs: Any) -> Any:  # announced, then held before its bytes go
            assert gate.wait(WAIT_S)
            return real_gather(*args, **kwargs)
        a[0].engine._caches.gather = held_gather  # type: ignore[method-assign]  # noqa: SLF001
        consumer = decode[0].engine._consumer  # noqa: SLF001
        both_landed = _after_calls(consumer, "_landed", 2)  # a tensor each: their layers in one (pull_batch_bytes)
        decode[0].engine.expect("x", engine_ref("a", ONE, a), [5, 6], 20)
        _until(lambda: (req := consumer._requests.get("x")) is not None and req.announced,  # noqa: SLF001
               "a's announcement")
        decode[0].engine.abort("x")
        decode[0].engine.expect("x", engine_ref("b", ONE, b), [5, 6], 20)
        decode[0].engine.wait("x", timeout_s=WAIT_S)
        assert decode[0].mismatches(2, [5, 6], 20, Span(0, 20)) == []
        gate.set()
        assert both_landed.wait(WAIT_S)
        assert decode[0].mismatches(2, [5, 6], 20, Span(0, 20)) == []  # still b's
        assert decode[0].engine.take_finished_receiving() == {"x": None}
    finally:
        close_sides(a, b, decode)


def test_a_producer_leaving_while_its_last_bytes_are_scattered_fails_nothing() -> None:
    """Every byte of the request arrived and is being scattered when its producer closes (its Bye): the request
    completes. Before, the loss failed it, its slices still pending until their scatter ended (found by review:
    6 of 10 runs of 'serve, then close', 4 with every byte received)."""
    with _pair() as (prefill, decode):
        gate, entered = threading.Event(), threading.Event()
        caches = decode[0].engine._caches  # noqa: SLF001
        real_scatter = caches.scatter

        def held_scatter(*args: Any, **kwargs: Any) -> None:
            entered.set()
            assert gate.wait(WAIT_S)
            real_scatter(*args, **kwargs)
        caches.scatter = held_scatter  # type: ignore[method-assign]
        lost = _after_calls(decode[0].engine._consumer, "fail_peer", 1,  # noqa: SLF001
                            lambda peer_id, _: peer_id == "prefill.r0")
        start_pull("r", prefill, decode, 3, [1, 2], [1, 2], 20)
        assert entered.wait(WAIT_S)
        assert _sent(prefill[0], "r") is None
        prefill[0].engine.close()
        assert lost.wait(WAIT_S)
        gate.set()
        decode[0].engine.wait("r", timeout_s=WAIT_S)
        assert decode[0].mismatches(3, [1, 2], 20, Span(0, 20)) == []
        assert decode[0].engine.take_finished_receiving() == {"r": None}


def test_a_producers_error_after_this_side_broke_their_link_is_left_to_the_links_own_error() -> None:
    """This side broke the link (a tensor longer than announced): the producer's sends fail with it, and its
    ErrorMsg ('internal', the send failed) may be handled before the link settles its receives with the typed
    cause. Before, that error won and the request failed with a TransferError instead of its ShapeMismatchError
    (the multiprocess oversized-sender test, 1 in 8 runs on two loaded cores). Told apart by the request's link:
    broken, and a receive of that producer's still in flight."""
    with _pair() as (prefill, decode):
        gate, real_gather = threading.Event(), prefill[0].engine._caches.gather  # noqa: SLF001

        def held_gather(*args: Any, **kwargs: Any) -> Any:  # announced, its receive posted, its bytes held
            assert gate.wait(WAIT_S)
            return real_gather(*args, **kwargs)
        prefill[0].engine._caches.gather = held_gather  # type: ignore[method-assign]  # noqa: SLF001
        start_pull("r", prefill, decode, 3, [1, 2], [1, 2], 20)
        consumer = decode[0].engine._consumer  # noqa: SLF001
        _until(lambda: (req := consumer._requests.get("r")) is not None and req.announced,  # noqa: SLF001
               "r's announcement")
        req = consumer._requests["r"]  # noqa: SLF001
        link = req.links[0]
        failed_send = ErrorMsg("r", ErrorCode.INTERNAL, "send failed: connection closed by peer (test)")
        try:
            # As Link._fail records its cause, before it aborts the backend and settles the receives.
            link._broken = ShapeMismatchError("the peer sends more than announced (test)")  # noqa: SLF001
            consumer.on_error("prefill.r0", failed_send)
            assert req.error is None  # left to the link's failure of its receives
        finally:
            link._broken = None  # noqa: SLF001
        consumer.on_error("prefill.r0", failed_send)  # a link not broken here: the producer's error is the news
        assert isinstance(req.error, TransferError) and "connection closed by peer (test)" in str(req.error)
        gate.set()


@pytest.mark.parametrize("named", [True, False], ids=["incarnation", "no-incarnation"])
def test_a_pull_from_a_restarted_producer_is_not_failed_by_the_loss_of_its_dead_life(named: bool) -> None:
    """A producer rank died (its address silent) while a pull to it waited for its handshake, and came back at
    another address; the next request names that one, and is pulled while the dead life's loss is on its way
    (the channel found the dead address silent, and reports it once the new request's handshake went out). The
    loss is the dead address's: it failed the request expected from the new address (fail_peer), and the
    handshake's request to the new life (the channel). ``named``: the references name their lives'
    incarnations (as the connector's do)."""
    deadline_s = 2.0
    with _pair(consumer=dict(deadline_s=deadline_s)) as (prefill, decode):
        engine = decode[0].engine
        channel = engine._channel  # noqa: SLF001
        dead_at = f"tcp://127.0.0.1:{free_port()}"  # the producer's first life: nothing answers there
        live = prefill[0].engine._channel.incarnation  # noqa: SLF001
        earlier = (live - (60_000 << INCARNATION_RANDOM_BITS),) if named else ()  # a minute before
        real_lost, found, go = channel._io._lost, threading.Event(), threading.Event()  # noqa: SLF001

        def held(*args: Any) -> None:  # on the I/O thread: the dead life was found silent; reported after `go`
            found.set()
            assert go.wait(WAIT_S)
            real_lost(*args)
        channel._io._lost = held  # noqa: SLF001
        engine.expect("doomed", EngineRef("prefill", ONE, (dead_at,), earlier), [1, 2], 20)
        assert found.wait(WAIT_S)
        ref = engine_ref("prefill", ONE, prefill)
        if not named:
            ref = EngineRef(ref.engine_id, ref.layout, ref.control_addrs)
        prefill[0].fill(seed=3, block_ids=[3, 4], num_tokens=20)
        prefill[0].engine.finish("again", [3, 4], 20)
        engine.expect("again", ref, [3, 4], 20)
        # Its handshake went to the new address (the doomed one's request ended before, freeing the gate).
        _until(lambda: channel.connected_address("prefill.r0") == ref.control_addrs[0]
               and len(channel._pending) == 1, "the new life's handshake")  # noqa: SLF001
        go.set()
        with pytest.raises((PeerLostError, TransferTimeout)):
            engine.wait("doomed", timeout_s=WAIT_S)
        engine.wait("again", timeout_s=WAIT_S)  # before: PeerLostError "... nothing heard for more than ..."
        assert decode[0].mismatches(3, [3, 4], 20, Span(0, 20)) == []
        _until(lambda: engine._consumer._decliner.queued == 0, "the decline gone")  # noqa: SLF001
        assert channel.connected_address("prefill.r0") == ref.control_addrs[0] and channel.peer_alive("prefill.r0")


def _a_pull_from_a_lost_life_then_a_push_from_the_next(hub: LoopbackHub, first: list[RankSide],
                                                       decode: list[RankSide]) -> list[RankSide]:
    """The consumer pulls r1 from the producer's life ``first``, closed and lost, then a second life pushes it p2."""
    engine = decode[0].engine
    channel = engine._channel  # noqa: SLF001
    start_pull("r1", first, decode, 1, [1, 2], [1, 2], 20)
    engine.wait("r1", timeout_s=WAIT_S)
    close_sides(first)
    _until(lambda: not channel.peer_alive("prefill.r0") and channel.loss_seq == 1, "the first life lost")
    second = _sides(hub, "prefill", "producer")
    try:
        engine.expect("p2", engine_ref("prefill", ONE, second), [3, 4], 20, push=True)
        second[0].fill(seed=2, block_ids=[5, 6], num_tokens=20)
        _push(second[0], "p2", engine_ref("decode", ONE, decode), [5, 6], 20)
        engine.wait("p2", timeout_s=WAIT_S)
        assert _sent(second[0], "p2") is None
    except BaseException:
        close_sides(second)
        raise
    return second  # still open


def test_a_decline_to_an_earlier_life_s_address_is_skipped_once_the_later_life_that_reached_us_is_lost() -> None:
    """The consumer pulled from the producer's first life at X (a handshake there), which then closed; its second
    life, at Y, pushed to the consumer (its handshake on the consumer's ROUTER named Y) and closed too. A decline of a
    request made for the first life (a reference with no incarnation) was sent: the channel knew where the life lost
    last was (Y) and took X for a life never met, so it connected to the dead X again, held the peer id alive there
    for deadline_s and reported it lost once more (failing what was expected from the producer meanwhile). Now X,
    the address of a life we shook hands with and saw replaced, is a lost life's too: the decline is skipped."""
    deadline_s = 2.0
    hub = LoopbackHub()
    first = _sides(hub, "prefill", "producer")
    decode = _sides(hub, "decode", "consumer", deadline_s=deadline_s, hold_s=600.0)
    second: list[RankSide] = []
    try:
        engine = decode[0].engine
        channel, decliner = engine._channel, engine._consumer._decliner  # noqa: SLF001
        dead_at = first[0].engine.address
        second = _a_pull_from_a_lost_life_then_a_push_from_the_next(hub, first, decode)
        assert channel.connected_address("prefill.r0") == second[0].engine.address
        close_sides(second)
        _until(lambda: not channel.peer_alive("prefill.r0") and channel.loss_seq == 2, "the second life lost")
        connects = _recorded_connects(channel)
        engine.decline("old", EngineRef("prefill", ONE, (dead_at,)))  # made for the first life, naming none
        _until(lambda: decliner.queued == 0, "the decline gone", timeout_s=3 * deadline_s)
        assert connects == [], connects  # before: [X], the dead first life's address
        assert not channel.peer_alive("prefill.r0") and channel.loss_seq == 2, channel.stats
    finally:
        close_sides(first, second, decode)


def test_a_decline_to_a_life_restarted_at_an_earlier_life_s_address_is_sent() -> None:
    """As above, the first life at X replaced by the second at Y, which reached the consumer and was lost; then a
    third life started at X again, the first's port. A decline of a request made for that third life, its reference
    naming its incarnation (never met: a restart, not the replaced first life), was skipped as one to the first
    life's address, and the live third producer held the request's blocks for hold_s. It is sent: the producer frees
    them now."""
    deadline_s = 2.0
    hub = LoopbackHub()
    first = _sides(hub, "prefill", "producer")
    decode = _sides(hub, "decode", "consumer", deadline_s=deadline_s)
    second: list[RankSide] = []
    third: list[RankSide] = []
    try:
        engine = decode[0].engine
        channel = engine._channel  # noqa: SLF001
        first_at = first[0].engine.address
        second = _a_pull_from_a_lost_life_then_a_push_from_the_next(hub, first, decode)
        close_sides(second)
        _until(lambda: not channel.peer_alive("prefill.r0") and channel.loss_seq == 2, "the second life lost")
        saved = engine_module.Channel
        engine_module.Channel = functools.partial(Channel, port=int(first_at.rpartition(":")[2]))  # type: ignore[misc]
        try:
            third = _sides(hub, "prefill", "producer", hold_s=600.0)
        finally:
            engine_module.Channel = saved  # type: ignore[misc]
        assert third[0].engine.address == first_at
        third[0].fill(seed=3, block_ids=[1, 2], num_tokens=20)
        third[0].engine.finish("r3", [1, 2], 20)
        ref = EngineRef("prefill", ONE, (first_at,), incarnations=(third[0].engine.incarnation,))
        engine.decline("r3", ref)
        assert _sent(third[0], "r3") is None  # before: held for hold_s (the decline skipped), not reported
    finally:
        close_sides(first, second, third, decode)
