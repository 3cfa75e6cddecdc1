"""Failures that must stay with one request, and bad input refused where it is given (loopback links).

Each case is a race or a mistake a serving engine meets: a request released
while its pull waits for a link, a link that closes while a pull is queued,
a block id outside the caches, a push refused for room, an engine announcing
for a request it does not produce, a push finished before every layer was
saved. Order is forced with events, never sleeps.
"""

from __future__ import annotations

import contextlib
import logging
import math
import re
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from ncclkv.auth import ChannelAuth
from ncclkv.engine import EngineConfig, EngineRef, TransferEngine
from ncclkv.errors import (CapacityError, ClosedError, HandshakeError, PeerLostError, ShapeMismatchError,
                           TransferError, TransferTimeout)
from ncclkv.launch import free_port
from ncclkv.layout import KVGeometry, ParallelLayout, Span
from ncclkv.paged import CacheLayout
from ncclkv.protocol import Announce, RouteMsg
from ncclkv.transport import LoopbackHub, LoopbackTransport

from .kvsim import RankSide, build_sides, close_sides, engine_ref, start_pull, wait_sent

GQA = KVGeometry(num_layers=4, num_kv_heads=4, head_size=32, dtype="float32")
ONE = ParallelLayout(1, 1)
WAIT_S = 20.0


def _sides(hub: LoopbackHub, engine_id: str, role: str, **config: object) -> list[RankSide]:
    return build_sides(engine_id, ONE, GQA, CacheLayout.CPU, 16, role, transports=[LoopbackTransport(hub)], **config)


@contextlib.contextmanager
def _pair(producer: dict[str, Any] | None = None,
          consumer: dict[str, Any] | None = None) -> Iterator[tuple[list[RankSide], list[RankSide]]]:
    """A one-rank producer and a one-rank consumer engine on one loopback hub, closed after."""
    hub = LoopbackHub()
    prefill = _sides(hub, "prefill", "producer", **(producer or {}))
    decode = _sides(hub, "decode", "consumer", **(consumer or {}))
    try:
        yield prefill, decode
    finally:
        close_sides(prefill, decode)


def _until(poll: Any, what: str, timeout_s: float = WAIT_S) -> Any:
    """Call ``poll`` until it returns something truthy, at most ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = poll()
        if got:
            return got
        assert time.monotonic() < deadline, f"{what} not within {timeout_s}s"
        threading.Event().wait(0.01)


def _sent(side: RankSide, request_id: str) -> BaseException | None:
    return wait_sent(side, request_id, timeout_s=WAIT_S)[request_id]


def test_a_release_while_the_pull_waits_for_its_link_keeps_the_blocks_until_the_sends_end() -> None:
    with _pair(producer=dict(hold_s=30.0)) as (prefill, decode):
        peers = prefill[0].engine._peers  # noqa: SLF001 - a link that takes its time to open
        opening, opened = threading.Event(), threading.Event()
        link = peers.link

        def slow_link(sender: str) -> Any:
            opening.set()
            assert opened.wait(WAIT_S)
            return link(sender)
        peers.link = slow_link  # type: ignore[method-assign]
        start_pull("r", prefill, decode, 1, [1, 2], [1, 2], 20)
        assert opening.wait(WAIT_S)
        assert prefill[0].engine.release("r")
        # The pull is being served: its blocks are not the caller's to reuse yet.
        assert "r" not in prefill[0].engine.take_finished_sending()
        opened.set()
        decode[0].engine.wait("r", timeout_s=WAIT_S)
        assert decode[0].mismatches(1, [1, 2], 20, Span(0, 20)) == []
        assert isinstance(_sent(prefill[0], "r"), TransferError)  # released: reported with that error


def _held_at_second_announce(side: RankSide) -> tuple[list[int], threading.Event]:
    """Hold ``side``'s second announcement until the event is set (the link posts its sends in order: the rest
    wait behind it); the layers announced so far."""
    from ncclkv.engine._push import SliceHooks

    producer = side.engine._producer  # noqa: SLF001
    announcer, announced, go = producer._announcer, [], threading.Event()  # noqa: SLF001

    def held_announcer(*args: Any, **kwargs: Any) -> SliceHooks:
        hooks = announcer(*args, **kwargs)

        def announce() -> Any:
            announced.append(args[3])
            if len(announced) == 2:
                assert go.wait(WAIT_S), "the test never let the second send go"
            return hooks.announce()
        return SliceHooks(announce, hooks.gather)
    producer._announcer = held_announcer  # noqa: SLF001
    producer._pusher._announcer = held_announcer  # noqa: SLF001
    return announced, go


@pytest.mark.parametrize("reused", [False, True], ids=["reclaimed", "reused"])
@pytest.mark.parametrize("push", [False, True], ids=["pull", "push"])
def test_a_reclaimed_request_reads_its_blocks_no_more_and_fails_its_transfer(push: bool, reused: bool) -> None:
    """A request preempted while its sends wait in the link's queue: its blocks go back to vLLM, which writes
    another request's KV there. The sends not announced yet must not read them (``reused``: nor those announced
    and not gathered yet, whose link breaks): they fail, and so does the transfer, typed, on both sides.
    Released instead (as before), they gathered the new KV and the consumer took it as the request's,
    silently. The engines go on: the next request moves."""
    with _pair(producer=dict(hold_s=30.0, pull_batch_bytes=0)) as (prefill, decode):  # a send per layer
        announced, go = _held_at_second_announce(prefill[0])
        if push:
            decode[0].engine.expect("r", engine_ref("prefill", ONE, prefill), [1, 2], 20, push=True)
            prefill[0].fill(seed=1, block_ids=[1, 2], num_tokens=20)
            _push(prefill[0], "r", engine_ref("decode", ONE, decode), [1, 2], 20)
        else:
            start_pull("r", prefill, decode, 1, [1, 2], [1, 2], 20)
        _until(lambda: len(announced) == 2, "the second send at its post")
        assert prefill[0].engine.reclaim("r", reused=reused)
        prefill[0].fill(seed=2, block_ids=[1, 2], num_tokens=20)  # vLLM writes another request's KV there
        go.set()
        # Reused: the link broke under the announced tensor, which is what the consumer's receive names; or the
        # producer's error for the pull came first, naming its send refused at the announcement (the second
        # send's hook ran ahead of the first's gather, and failed before it): either way at once and typed.
        with pytest.raises(TransferError, match=r"link .* closed|request 'r' was reclaimed" if reused
                           else r"request 'r' was reclaimed"):
            decode[0].engine.wait("r", timeout_s=WAIT_S)
        assert isinstance(wait_sent(prefill[0], "r")["r"], TransferError)
        assert prefill[0].engine.reclaim("r") is False  # reported: neither held nor pushed under the id now
        start_pull("next", prefill, decode, 3, [3, 4], [3, 4], 20)
        decode[0].engine.wait("next", timeout_s=WAIT_S)
        assert decode[0].mismatches(3, [3, 4], 20, Span(0, 20)) == []


def test_a_pull_after_the_producer_broke_its_link_goes_on_a_new_link_though_the_consumer_never_saw_the_break() -> None:
    """reclaim(reused=True) breaks the push's link on the producer; the consumer learns of the break only when its
    receive of the announced tensor fails, and its request may fail first, by the producer's error. Here its end
    of the link is still opening then (its opener thread held after the rendezvous), so it sees no break at all:
    its next pull goes under the same handshake. Before, the producer served that pull on its broken link, and
    the request failed with ClosedError ('link ... is closed (broken: ... fill failed ...)'), needlessly."""
    with _pair(producer=dict(hold_s=30.0, pull_batch_bytes=0)) as (prefill, decode):  # a send per layer
        announced, go = _held_at_second_announce(prefill[0])
        peers = decode[0].engine._peers  # noqa: SLF001 - the consumer's end of the push's link opens late
        open_link, opens, settle = peers._open_link, [], threading.Event()  # noqa: SLF001

        def late_open(*args: Any) -> Any:
            link = open_link(*args)
            opens.append(link)
            if len(opens) == 1:
                assert settle.wait(WAIT_S), "the test never let the consumer's first link settle"
            return link
        peers._open_link = late_open  # type: ignore[method-assign]
        try:
            decode[0].engine.expect("r", engine_ref("prefill", ONE, prefill), [1, 2], 20, push=True)
            prefill[0].fill(seed=1, block_ids=[1, 2], num_tokens=20)
            _push(prefill[0], "r", engine_ref("decode", ONE, decode), [1, 2], 20)
            _until(lambda: len(announced) == 2, "the second send at its post")
            assert prefill[0].engine.reclaim("r", reused=True)
            prefill[0].fill(seed=2, block_ids=[1, 2], num_tokens=20)  # vLLM writes another request's KV there
            go.set()
            with pytest.raises(TransferError):  # the producer's error: the consumer's end never opened
                decode[0].engine.wait("r", timeout_s=WAIT_S)
            assert isinstance(wait_sent(prefill[0], "r")["r"], TransferError)  # its link broke before this
            _until(lambda: opens, "the consumer's end at the rendezvous")  # its opener thread may be slow to wake
            assert len(opens) == 1 and not opens[0].closed  # the consumer's end, held opening: no break seen
            start_pull("next", prefill, decode, 3, [3, 4], [3, 4], 20)
            decode[0].engine.wait("next", timeout_s=WAIT_S)
            assert decode[0].mismatches(3, [3, 4], 20, Span(0, 20)) == []
            assert len(opens) == 2  # on a new link
        finally:
            settle.set()


def test_blocks_reused_while_a_send_gathers_them_fail_that_send_not_hand_over_the_next_requests_kv() -> None:
    """reclaim(reused=True) comes while a send's gather is under way (past its check: a batch of layers, one at a
    time): the caller writes the next request's KV into the blocks as soon as it returns. The gather's later
    layers read those bytes; the send must fail (its link breaks), and the consumer with it, not take them as
    the request's. Before, the consumer's wait returned with the new request's KV in the last layers."""
    with _pair(producer=dict(hold_s=30.0)) as (prefill, decode):  # every layer in one batched send
        caches = prefill[0].engine._producer._caches  # noqa: SLF001
        real_gather, at_layer, go = caches.gather, threading.Event(), threading.Event()

        def gather(layer: int, *args: Any, **kwargs: Any) -> Any:
            if layer == 2:  # half the batch gathered: the rest waits for the test
                at_layer.set()
                assert go.wait(WAIT_S), "the test never let the gather go on"
            return real_gather(layer, *args, **kwargs)
        caches.gather = gather
        start_pull("r", prefill, decode, 1, [1, 2], [1, 2], 20)
        assert at_layer.wait(WAIT_S)
        assert prefill[0].engine.reclaim("r")
        assert prefill[0].engine.reclaim("r", reused=True)  # the connector, deadline_s later: the blocks go now
        prefill[0].fill(seed=2, block_ids=[1, 2], num_tokens=20)  # vLLM writes another request's KV there
        go.set()
        with pytest.raises(TransferError):
            decode[0].engine.wait("r", timeout_s=WAIT_S)
        assert isinstance(wait_sent(prefill[0], "r")["r"], TransferError)


def test_a_link_closing_while_a_pull_is_queued_fails_that_request_and_reports_it() -> None:
    with _pair(producer=dict(hold_s=30.0, pull_batch_bytes=0)) as (prefill, decode):  # a send per layer
        peers = prefill[0].engine._peers  # noqa: SLF001 - the link closes after the pull's first send was queued
        link_of = peers.link

        def closing_link(sender: str) -> Any:
            link = link_of(sender)
            send, calls = link.send, [0]

            def send_then_close(*args: Any, **kwargs: Any) -> Any:
                calls[0] += 1
                if calls[0] == 2:
                    raise ClosedError("link closed while the pull was queued (test)")
                return send(*args, **kwargs)
            link.send = send_then_close
            return link
        peers.link = closing_link  # type: ignore[method-assign]
        start_pull("r", prefill, decode, 2, [1, 2], [1, 2], 20)
        error = _sent(prefill[0], "r")  # before the fix: held for ever, its blocks never given back
        assert isinstance(error, ClosedError) and "while the pull was queued" in str(error)
        assert prefill[0].engine.num_in_flight == 0
        with pytest.raises(ClosedError, match="while the pull was queued"):
            decode[0].engine.wait("r", timeout_s=WAIT_S)


def test_block_ids_outside_the_caches_are_refused_where_they_are_given() -> None:
    with _pair() as (prefill, decode):
        message = r"block ids \[16, 99\] are outside the 16 blocks of this rank's caches"
        with pytest.raises(ValueError, match=message):
            prefill[0].engine.finish("r", [1, 16, 99], 40)
        with pytest.raises(ValueError, match=message):
            prefill[0].engine.start_push("p", engine_ref("decode", ONE, decode), [1, 16, 99], 40)
        with pytest.raises(ValueError, match=message):
            decode[0].engine.expect("r", engine_ref("prefill", ONE, prefill), [1, 16, 99], 40)
        # Nothing half-started: the same ids, in range, go through.
        start_pull("r", prefill, decode, 3, [1, 15], [1, 15], 20)
        decode[0].engine.wait("r", timeout_s=WAIT_S)
        assert decode[0].mismatches(3, [1, 15], 20, Span(0, 20)) == []


def test_bad_request_arguments_are_refused_at_the_call_naming_them() -> None:
    """Mistakes a caller makes are refused where they are given, typed and naming the value: before, a block
    given twice among a held request's tokens went out as the same bytes twice (the pull "succeeded", every layer
    wrong), a negative or bool token count was held and failed the consumer's pull later, and a request id the
    protocol cannot carry was taken and failed asynchronously ("malformed control frame")."""
    with _pair() as (prefill, decode):
        producer, consumer = prefill[0].engine, decode[0].engine
        ref = engine_ref("prefill", ONE, prefill)
        repeated = r"block ids \[1\] appear more than once among the blocks of tokens \[0,20\)"
        with pytest.raises(ValueError, match=repeated):
            producer.finish("dup", [1, 1], 20)
        with pytest.raises(ValueError, match=repeated):
            producer.start_push("dup", engine_ref("decode", ONE, decode), [1, 1], 20)
        with pytest.raises(ValueError, match=repeated):
            consumer.expect("dup", ref, [1, 1], 20)
        for bad in (-5, 0, True, 20.5, "20"):
            with pytest.raises(ValueError, match=rf"'r': num_tokens must be an int >= 1, got {re.escape(repr(bad))}"):
                producer.finish("r", [1, 2], bad)  # type: ignore[arg-type]
            with pytest.raises(ValueError, match=r"'r': tokens \(a count, or a SpanSet\) must be an int >= 1"):
                consumer.expect("r", ref, [1, 2], bad)  # type: ignore[arg-type]
        for bad_id in ("", 7, None, b"r", "x" * 513):
            with pytest.raises(ValueError, match=r"request id must be a str of 1-512 chars, got "):
                producer.finish(bad_id, [1, 2], 20)  # type: ignore[arg-type]
            with pytest.raises(ValueError, match=r"request id must be a str of 1-512 chars, got "):
                consumer.expect(bad_id, ref, [1, 2], 20)  # type: ignore[arg-type]
            with pytest.raises(ValueError, match=r"request id must be a str of 1-512 chars, got "):
                consumer.decline(bad_id, ref)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=r"'r': layer must be an int .*got True"):
            consumer.wait_layer("r", True)  # type: ignore[arg-type]
        assert producer.num_in_flight == 0 and consumer.num_in_flight == 0  # nothing half-started
        # A block repeated past the tokens moved is no block of theirs: the same ids, distinct where used, go.
        start_pull("r", prefill, decode, 3, [1, 15, 15], [2, 14, 14], 20)
        consumer.wait("r", timeout_s=WAIT_S)
        assert decode[0].mismatches(3, [2, 14], 20, Span(0, 20)) == []


def test_a_request_id_the_protocol_cannot_encode_is_refused_at_the_call() -> None:
    """A lone surrogate (JSON's "\\ud800", which json.loads takes) is a str of the right length that the
    protocol's msgpack cannot encode: the engine took it (a hold, a push, a pull, a decline) and failed later,
    on the way out ('cannot encode PullRequest'), or never (a hold nobody can name, kept hold_s)."""
    with _pair() as (prefill, decode):
        producer, consumer = prefill[0].engine, decode[0].engine
        ref = engine_ref("prefill", ONE, prefill)
        bad_id = "xfer-\ud800"
        message = r"request id must be encodable as UTF-8 \(what the protocol carries\), got 'xfer-\\ud800'"
        with pytest.raises(ValueError, match=message):
            producer.finish(bad_id, [1, 2], 20)
        with pytest.raises(ValueError, match=message):
            producer.start_push(bad_id, engine_ref("decode", ONE, decode), [1, 2], 20)
        with pytest.raises(ValueError, match=message):
            consumer.expect(bad_id, ref, [1, 2], 20)
        with pytest.raises(ValueError, match=message):
            consumer.decline(bad_id, ref)
        assert producer.num_in_flight == 0 and consumer.num_in_flight == 0  # nothing half-started


def test_a_reference_whose_layout_differs_from_the_producers_handshake_fails_naming_both() -> None:
    """The reference says tp=1,pp=2 while the producer runs tp=2: the routes were planned from the reference,
    so the producer refused the pull naming routes ("asks routes ... but our plan gives ..."), not the cause.
    The layout the producer shook hands with is checked first: a HandshakeError naming both, nothing pulled."""
    hub = LoopbackHub()
    two = ParallelLayout(2, 1)
    prefill = build_sides("prefill", two, GQA, CacheLayout.CPU, 16, "producer",
                          transports=[LoopbackTransport(hub), LoopbackTransport(hub)])
    decode = _sides(hub, "decode", "consumer")
    try:
        for side in prefill:
            side.fill(seed=4, block_ids=[1, 2], num_tokens=20)
            side.engine.finish("r", [1, 2], 20)
        decode[0].engine.expect("r", engine_ref("prefill", ParallelLayout(1, 2), prefill), [3, 4], 20)
        with pytest.raises(HandshakeError, match=r"'r': the reference to 'prefill' says layout tp=1,pp=2, its rank "
                                                 r"'prefill.r[01]' shook hands with tp=2,pp=1"):
            decode[0].engine.wait("r", timeout_s=WAIT_S)
        decode[0].engine.expect("s", engine_ref("prefill", two, prefill), [5, 6], 20)  # the right one goes through
        for side in prefill:
            side.engine.finish("s", [1, 2], 20)
        decode[0].engine.wait("s", timeout_s=WAIT_S)
        assert decode[0].mismatches(4, [5, 6], 20, Span(0, 20)) == []
    finally:
        close_sides(prefill, decode)


def test_a_reference_with_its_ranks_addresses_swapped_fails_at_once_naming_both() -> None:
    """Rank 0's address is rank 1's and the reverse: each answered under its own name on our connection to the
    other, a frame that was only logged and dropped, so the pull waited deadline_s ("nothing heard")."""
    hub = LoopbackHub()
    two = ParallelLayout(2, 1)
    # The producer ranks' deadline bounds only their link openings for the handshakes they answered (the
    # consumer dropped those at once): the close waits for them.
    prefill = build_sides("prefill", two, GQA, CacheLayout.CPU, 16, "producer", deadline_s=3.0,
                          transports=[LoopbackTransport(hub), LoopbackTransport(hub)])
    decode = _sides(hub, "decode", "consumer", deadline_s=30.0)
    try:
        swapped = EngineRef("prefill", two, (prefill[1].engine.address, prefill[0].engine.address))
        started = time.monotonic()
        decode[0].engine.expect("r", swapped, [3, 4], 20)
        with pytest.raises(PeerLostError, match=r"answers as 'prefill.r[01]', not as 'prefill.r[01]': the address "
                                                r"given for 'prefill.r[01]' is another peer's"):
            decode[0].engine.wait("r", timeout_s=WAIT_S)
        assert time.monotonic() - started < 10  # not deadline_s (30 s)
    finally:
        close_sides(prefill, decode)


@pytest.mark.parametrize("consumer_secret", [None, b"another secret, 32 bytes or more!"], ids=["none", "another"])
def test_engines_whose_shared_secrets_differ_fail_the_pull_at_once_naming_them(consumer_secret: bytes | None) -> None:
    """Before, each side dropped the other's frames unanswered: the pull waited deadline_s and failed with
    "nothing heard", and only the producer's log named a bad MAC."""
    producer_auth = ChannelAuth(shared_secret=b"the producer's secret: 32+ bytes!")
    consumer_auth = ChannelAuth(shared_secret=consumer_secret) if consumer_secret else ChannelAuth()
    with _pair(producer=dict(auth=producer_auth, deadline_s=3.0),
               consumer=dict(auth=consumer_auth, deadline_s=60.0)) as (prefill, decode):
        prefill[0].fill(seed=7, block_ids=[1, 2], num_tokens=20)
        prefill[0].engine.finish("r", [1, 2], 20)
        decode[0].engine.expect("r", engine_ref("prefill", ONE, prefill), [3, 4], 20)
        told = "it has a shared secret and this channel has none" if consumer_secret is None else \
            "its shared secret differs from ours"
        with pytest.raises(PeerLostError, match=rf"refused our frames as not authenticated: {told} \(NCCLKV_SHARED_"
                                                rf"SECRET or NCCLKV_SHARED_SECRET_FILE must be set alike"):
            decode[0].engine.wait("r", timeout_s=WAIT_S)  # WAIT_S < the consumer's deadline_s
        prefill[0].engine.release("r")


def test_a_hold_for_pull_expected_as_a_push_names_the_likely_mix_up_on_both_sides() -> None:
    """The producer holds the request for a pull, the consumer waits for a push: neither asks the other, so both
    time out. Before, neither error said why; each now names the other mode as the likely cause."""
    with _pair(producer=dict(hold_s=1.5, deadline_s=1.5), consumer=dict(hold_s=1.5, deadline_s=1.5)) as (
            prefill, decode):
        prefill[0].fill(seed=8, block_ids=[1, 2], num_tokens=20)
        prefill[0].engine.finish("r", [1, 2], 20)
        decode[0].engine.expect("r", engine_ref("prefill", ONE, prefill), [3, 4], 20, push=True)
        with pytest.raises(TransferTimeout, match=r"nothing of it was announced: 'prefill' may hold it for a pull "
                                                  r"\(expect it without push=True\)"):
            decode[0].engine.wait("r", timeout_s=WAIT_S)
        finished = _until(lambda: prefill[0].engine.take_finished_sending(), "the hold expired")
        assert isinstance(finished["r"], TransferTimeout), finished
        assert "no consumer rank asked for it (one that expects it pushed" in str(finished["r"])


def test_a_push_and_an_expect_that_disagree_fail_at_once_naming_both() -> None:
    """Before, a push staged with 20 tokens and expected with 16 stalled deadline_s ("no progress"), naming
    neither count; an offer of 20 tokens for a push expected with 30 failed at its first announcement naming
    a route; and a pull of a request being pushed here waited deadline_s for an answer the pushing producer
    never sends."""
    with _pair(producer=dict(deadline_s=30.0), consumer=dict(deadline_s=30.0)) as (prefill, decode):
        producer, consumer = prefill[0].engine, decode[0].engine
        to_decode, ref = engine_ref("decode", ONE, decode), engine_ref("prefill", ONE, prefill)

        def push(rid: str) -> None:
            prefill[0].fill(seed=6, block_ids=[1, 2], num_tokens=20)
            producer.start_push(rid, to_decode, [1, 2], 20)
            for layer in range(GQA.num_layers):
                producer.save_layer(rid, layer)
            producer.finish(rid)

        push("staged")
        _until(lambda: consumer._consumer._stage.get("staged"), "the push staged")  # noqa: SLF001
        with pytest.raises(ValueError, match=r"'staged' is being pushed here by 'prefill' .*expect it with push=True"):
            consumer.expect("staged", ref, [3, 4], 20)
        started = time.monotonic()
        consumer.expect("staged", ref, [3, 4], 16, push=True)
        with pytest.raises(ShapeMismatchError, match=r"'staged' was pushed with 20 tokens, expected here with 16"):
            consumer.wait("staged", timeout_s=WAIT_S)
        consumer.expect("early", ref, [5, 6], 30, push=True)
        push("early")
        with pytest.raises(ShapeMismatchError, match=r"push of 'early' from 'prefill.r0': expected here with 30 "
                                                     r"tokens, pushed with 20"):
            consumer.wait("early", timeout_s=WAIT_S)
        assert isinstance(_sent(prefill[0], "early"), ShapeMismatchError)  # the producer hears it too
        assert time.monotonic() - started < 10  # not deadline_s (30 s)
        producer.finish("short", [9, 10], 20)  # a pull of more tokens than held: both counts named
        consumer.expect("short", ref, [11, 12], 30)
        with pytest.raises(ShapeMismatchError, match=r"'short' asks tokens up to 30, beyond the 20 held"):
            consumer.wait("short", timeout_s=WAIT_S)
        push("fine")  # the same engines go on
        consumer.expect("fine", ref, [7, 8], 20, push=True)
        consumer.wait("fine", timeout_s=WAIT_S)
        assert decode[0].mismatches(6, [7, 8], 20, Span(0, 20)) == []


def test_an_expect_of_a_refused_push_fails_at_once_with_the_refusal() -> None:
    with _pair(consumer=dict(staging_bytes=4096, hold_s=60.0)) as (prefill, decode):
        prefill[0].engine.start_push("big", engine_ref("decode", ONE, decode), [0, 1], 32)
        for layer in range(GQA.num_layers):
            prefill[0].engine.save_layer("big", layer)
        prefill[0].engine.finish("big")
        assert isinstance(_sent(prefill[0], "big"), CapacityError)
        decode[0].engine.expect("big", engine_ref("prefill", ONE, prefill), [0, 1], 32, push=True)
        started = time.monotonic()
        with pytest.raises(CapacityError, match=r"'big': its push failed before it was expected: .*needs 131072 B of staging"):
            decode[0].engine.wait("big", timeout_s=WAIT_S)
        assert time.monotonic() - started < 10  # not hold_s (60 s)


def test_an_announcement_from_another_engine_does_not_fail_a_request(caplog: pytest.LogCaptureFixture) -> None:
    hub = LoopbackHub()
    prefill = _sides(hub, "prefill", "producer")
    decode = _sides(hub, "decode", "consumer")
    other = _sides(hub, "other", "producer")
    try:
        decode[0].engine.expect("r", engine_ref("prefill", ONE, prefill), [1, 2], 20)  # its pull is parked
        peer = other[0].engine._peers.ensure("decode.r0", decode[0].engine.address, need_link=True)  # noqa: SLF001
        with caplog.at_level(logging.WARNING, logger="ncclkv.engine"):
            other[0].engine._channel.send("decode.r0", Announce(  # noqa: SLF001
                "r", 0, RouteMsg(0, 0, (0, 4), (0, 4), (0, 20)), (2, 20, 4, 32), "float32", 2 * 20 * 4 * 32 * 4,
                0, peer.link_id, None))
            _until(lambda: [r for r in caplog.records if "whose producer is 'prefill'" in r.getMessage()],
                   "the consumer's refusal of the foreign announcement")
        assert decode[0].engine.take_finished_receiving() == {}
        prefill[0].fill(seed=4, block_ids=[1, 2], num_tokens=20)
        prefill[0].engine.finish("r", [1, 2], 20)
        decode[0].engine.wait("r", timeout_s=WAIT_S)
        assert decode[0].mismatches(4, [1, 2], 20, Span(0, 20)) == []
    finally:
        close_sides(prefill, decode, other)


def test_a_push_must_save_each_of_its_layers_once() -> None:
    with _pair() as (prefill, decode):
        decode_ref = engine_ref("decode", ONE, decode)
        prefill[0].engine.start_push("p", decode_ref, [0, 1], 20)
        prefill[0].engine.save_layer("p", 0)
        with pytest.raises(ValueError, match="request 'p': layer 0 was already saved"):
            prefill[0].engine.save_layer("p", 0)
        prefill[0].engine.save_layer("p", 1)
        prefill[0].engine.finish("p")  # layers 2 and 3 never saved
        error = _sent(prefill[0], "p")
        assert isinstance(error, TransferError) and r"finish() before layers [2, 3] were saved" in str(error)
        decode[0].engine.expect("p", engine_ref("prefill", ONE, prefill), [2, 3], 20, push=True)
        with pytest.raises(TransferError, match=r"layers \[2, 3\] were saved"):
            decode[0].engine.wait("p", timeout_s=WAIT_S)


def test_a_layer_that_is_no_int_is_refused_by_save_layer_naming_it() -> None:
    """``save_layer(req, True)`` was taken as layer 1 (``True in Span(0, 4)``): its Announce was refused on the way
    out (msgspec: a bool is no int), the push failed with a ProtocolError, and the real layer 1 was refused as
    "already saved"; a numpy int was refused as "layer 1 is not on this rank (layers [0,4))", though it is."""
    np = pytest.importorskip("numpy")
    with _pair() as (prefill, decode):
        producer = prefill[0].engine
        prefill[0].fill(seed=6, block_ids=[0, 1], num_tokens=20)
        producer.start_push("p", engine_ref("decode", ONE, decode), [0, 1], 20)
        decode[0].engine.expect("p", engine_ref("prefill", ONE, prefill), [2, 3], 20, push=True)
        for bad in (True, np.int64(1), 1.0):
            with pytest.raises(ValueError, match=rf"'p': layer must be an int .*got {re.escape(repr(bad))}"):
                producer.save_layer("p", bad)  # type: ignore[arg-type]
        for layer in range(GQA.num_layers):  # nothing recorded for the refused ones: each layer goes once
            producer.save_layer("p", layer)
        producer.finish("p")
        assert _sent(prefill[0], "p") is None
        decode[0].engine.wait("p", timeout_s=WAIT_S)
        assert decode[0].mismatches(6, [2, 3], 20, Span(0, 20)) == []


def test_a_push_to_this_engine_itself_is_refused_at_the_call_like_an_expect_from_it() -> None:
    """A reference to this engine as the push's consumer (a proxy's mistake, role "both") was taken: its offer
    task shook hands with itself and failed asynchronously (over a real data plane: "link id ... is already open
    on data plane ...", a ValueError logged with its traceback as a bug, the link's other end waiting deadline_s
    to open), where an expect() from this engine is refused at the call."""
    hub = LoopbackHub()
    both = _sides(hub, "both", "both")
    try:
        engine, ref = both[0].engine, engine_ref("both", ONE, both)
        with pytest.raises(ValueError, match=r"request 'p': consumer engine 'both' is this engine"):
            engine.start_push("p", ref, [0, 1], 20)
        with pytest.raises(ValueError, match=r"request 'p': producer engine 'both' is this engine"):
            engine.expect("p", ref, [2, 3], 20, push=True)
        assert engine.num_in_flight == 0 and engine.take_finished_sending() == {}
        with pytest.raises(ValueError, match="not being pushed"):  # nothing started: no push of it to finish
            engine.save_layer("p", 0)
    finally:
        close_sides(both)


def test_an_engine_without_caches_says_so() -> None:
    hub = LoopbackHub()
    bare = TransferEngine(EngineConfig("bare", 0, ONE, GQA, role="both"), transport=LoopbackTransport(hub))
    prefill = _sides(hub, "prefill", "producer")
    try:
        with pytest.raises(ValueError, match="no KV caches registered on this rank"):
            bare.finish("r", [0], 8)
        with pytest.raises(ValueError, match="no KV caches registered on this rank"):
            bare.expect("r", engine_ref("prefill", ONE, prefill), [0], 8)
        # A push to it is refused up front, not accepted and then out of step.
        prefill[0].engine.start_push("p", EngineRef("bare", ONE, (bare.address,)), [0], 8)
        for layer in range(GQA.num_layers):
            prefill[0].engine.save_layer("p", layer)
        prefill[0].engine.finish("p")
        error = _sent(prefill[0], "p")
        assert isinstance(error, TransferError) and "has no KV caches registered" in str(error)
    finally:
        bare.close()
        close_sides(prefill)


@pytest.mark.parametrize(("field", "value", "error", "message"), [
    ("staging_bytes", 0, ValueError, "staging_bytes must be an int >= 1, got 0"),
    ("staging_bytes", 1.5, ValueError, "staging_bytes must be an int >= 1, got 1.5"),
    ("deadline_s", math.inf, ValueError, "deadline_s must be a finite number of seconds > 0 (at most 1e+09), got inf"),
    ("hold_s", True, TypeError, "hold_s must be a number of seconds, got bool True"),
    ("heartbeat_s", math.nan, ValueError, "heartbeat_s must be a finite number of seconds > 0 (at most 1e+09), got nan"),
    ("hold_s", 2e9, ValueError, "hold_s must be a finite number of seconds > 0 (at most 1e+09), got 2000000000.0"),
    ("device", "tpu", ValueError, "device must be 'cpu', 'cuda' or 'cuda:N', got 'tpu'"),
    ("rank", True, ValueError, "rank=True outside"),
    # Past the protocol's bounds: the engine started, and every handshake it sent was refused at encode.
    ("geometry", KVGeometry(70000, 8, 128), ValueError,
     "engine 'e': every peer would refuse its handshake: Handshake would be refused by the peer: malformed control "
     "frame"),
])
def test_engine_config_refuses_bad_values_naming_them(field: str, value: object, error: type[Exception],
                                                      message: str) -> None:
    kwargs: dict[str, Any] = {"engine_id": "e", "rank": 0, "layout": ONE, "geometry": GQA, field: value}
    before = {t.name for t in threading.enumerate()}
    with pytest.raises(error, match=re.escape(message)):
        EngineConfig(**kwargs)
    assert not {t.name for t in threading.enumerate()} - before


def test_engine_config_bounds_the_environments_deadline_too(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NCCLKV_DEADLINE_S", "2e9")  # finite, but past what a link's waits take
    with pytest.raises(ValueError, match=r"NCCLKV_DEADLINE_S='2e9' must be a finite number .*\(at most 1e\+09\), "
                                         r"got 2000000000.0"):
        EngineConfig("e", 0, ONE, GQA)


def test_engine_ref_checks_its_engine_id_like_the_config() -> None:
    with pytest.raises(ValueError, match=r"engine_id must be 1-128 chars of .*got 'a b'"):
        EngineRef("a b", ONE, ("tcp://127.0.0.1:1",))


def test_a_request_every_consumer_rank_declines_is_freed_before_hold_s() -> None:
    hub = LoopbackHub()
    prefill = _sides(hub, "prefill", "producer", hold_s=600.0)
    two = ParallelLayout(2, 1)
    decode = build_sides("decode", two, GQA, CacheLayout.CPU, 16, "consumer",
                         transports=[LoopbackTransport(hub), LoopbackTransport(hub)])
    try:
        prefill[0].fill(seed=6, block_ids=[1, 2], num_tokens=20)
        prefill[0].engine.finish("r", [1, 2], 20)
        ref = engine_ref("prefill", ONE, prefill)
        for side in decode:  # neither will pull it (the decode request was aborted, or computed locally)
            side.engine.decline("r", ref)
        assert _sent(prefill[0], "r") is None  # served by a pull of nothing from each: freed, not expired
        assert prefill[0].engine.stats().tensors_sent == 0
        decode[0].engine.expect("s", ref, [3], 8)
        with pytest.raises(ValueError, match="request 's' is expected here: abort"):
            decode[0].engine.decline("s", ref)
        decode[0].engine.abort("s")
    finally:
        close_sides(prefill, decode)


def test_declines_to_a_dead_producer_never_delay_a_pull() -> None:
    with _pair(producer=dict(deadline_s=2.0), consumer=dict(deadline_s=2.0)) as (prefill, decode):
        # Requests of a crashed prefill instance that clients gave up on: each decline waits a deadline.
        nobody = [f"tcp://127.0.0.1:{free_port()}" for _ in range(2)]
        dead = EngineRef("gone", ParallelLayout(2, 1), tuple(nobody))
        for i in range(8):
            decode[0].engine.decline(f"gone-{i}", dead)
        prefill[0].fill(seed=7, block_ids=[1, 2], num_tokens=20)
        prefill[0].engine.finish("live", [1, 2], 20)
        decode[0].engine.expect("live", engine_ref("prefill", ONE, prefill), [3, 4], 20)
        decode[0].engine.wait("live", timeout_s=WAIT_S)  # before: behind 16 hopeless handshakes, it stalled
        assert decode[0].mismatches(7, [3, 4], 20, Span(0, 20)) == []


def test_what_is_kept_per_link_goes_with_the_link() -> None:
    with _pair() as (prefill, decode):
        start_pull("r", prefill, decode, 8, [1, 2], [1, 2], 20)
        decode[0].engine.wait("r", timeout_s=WAIT_S)
        assert wait_sent(prefill[0], "r")["r"] is None  # its sends ended, and were counted, before it is reported
        p_peers, d_peers = prefill[0].engine._peers, decode[0].engine._peers  # noqa: SLF001
        sent, heard = p_peers.get("decode.r0"), d_peers.get("prefill.r0")
        assert sent is not None and heard is not None and sent.link_id == heard.link_id
        # The link's announcement counters are on its record at each end, and agree: every tensor announced.
        assert sent.sent_seq == heard.heard_seq == prefill[0].engine.stats().tensors_sent > 0
        p_peers.drop("decode.r0", "test: the consumer went away")
        d_peers.drop("prefill.r0", "test: the producer went away")
        # Nothing of the link is kept (its counters went with its record; before, maps by link id kept them).
        assert p_peers.kept(sent.link_id) is None and d_peers.kept(heard.link_id) is None


def _staging(side: RankSide) -> tuple[int, int]:
    """(bytes reserved for staged pushes, bytes in the staging store) of a consumer rank."""
    consumer = side.engine._consumer  # noqa: SLF001
    return consumer._stage.reserved_bytes, consumer._stage.store.used_bytes  # noqa: SLF001


def _push(side: RankSide, request_id: str, consumer: EngineRef, blocks: list[int], num_tokens: int,
          layers: range = range(GQA.num_layers)) -> None:
    side.engine.start_push(request_id, consumer, blocks, num_tokens)
    for layer in layers:
        side.engine.save_layer(request_id, layer)
    side.engine.finish(request_id)


def test_a_staged_push_that_fails_gives_its_staging_back_at_once() -> None:
    with _pair(consumer=dict(staging_bytes=160 * 1024, hold_s=600.0)) as (prefill, decode):
        ref = engine_ref("decode", ONE, decode)
        _push(prefill[0], "half", ref, [0, 1], 32, range(2))  # half its layers: it fails
        assert isinstance(_sent(prefill[0], "half"), TransferError)
        _until(lambda: _staging(decode[0]) == (0, 0), "the failed push's staging back")  # not after hold_s
        _push(prefill[0], "next", ref, [2, 3], 32)  # 128 KiB: refused while "half" held its 64 KiB
        assert _sent(prefill[0], "next") is None
        with pytest.raises(TransferError, match="layers \\[2, 3\\] were saved"):
            decode[0].engine.expect("half", engine_ref("prefill", ONE, prefill), [4, 5], 32, push=True)
            decode[0].engine.wait("half", timeout_s=WAIT_S)


def test_a_push_refused_for_room_on_one_rank_gives_back_what_the_others_staged() -> None:
    hub = LoopbackHub()
    two = ParallelLayout(2, 1)
    prefill = build_sides("prefill", two, GQA, CacheLayout.CPU, 16, "producer",
                          transports=[LoopbackTransport(hub), LoopbackTransport(hub)])
    decode = _sides(hub, "decode", "consumer", staging_bytes=100 * 1024, hold_s=600.0)  # room for one rank's part
    try:
        ref = engine_ref("decode", ONE, decode)
        for side in prefill:
            _push(side, "r", ref, [0, 1], 32)
        outcomes = [_sent(side, "r") for side in prefill]
        assert any(isinstance(o, CapacityError) for o in outcomes), outcomes
        _until(lambda: _staging(decode[0]) == (0, 0), "the accepted rank's staging back")
        _push(prefill[0], "r2", ref, [2, 3], 32)  # the room is free again: another push of that size fits
        assert _sent(prefill[0], "r2") is None
    finally:
        close_sides(prefill, decode)


def test_an_expect_after_a_push_expired_in_staging_fails_at_once() -> None:
    with _pair(consumer=dict(hold_s=0.5)) as (prefill, decode):
        _push(prefill[0], "late", engine_ref("decode", ONE, decode), [0, 1], 32)
        assert _sent(prefill[0], "late") is None
        consumer = decode[0].engine._consumer  # noqa: SLF001
        _until(lambda: not decode[0].engine.take_finished_receiving() and consumer._stage.get("late") is None,  # noqa: SLF001
               "the push expiring from staging")
        assert _staging(decode[0]) == (0, 0)
        decode[0].engine.expect("late", engine_ref("prefill", ONE, prefill), [4, 5], 32, push=True)
        started = time.monotonic()
        with pytest.raises(TransferError, match="expired in staging"):
            decode[0].engine.wait("late", timeout_s=WAIT_S)
        assert time.monotonic() - started < 0.5  # before: a wait of hold_s for tensors that never come


def test_a_declined_push_gives_its_staging_back_and_refuses_the_rest() -> None:
    with _pair(consumer=dict(hold_s=600.0)) as (prefill, decode):
        ref, producer = engine_ref("decode", ONE, decode), engine_ref("prefill", ONE, prefill)
        _push(prefill[0], "staged", ref, [0, 1], 32)
        assert _sent(prefill[0], "staged") is None
        # Sent on the producer may come before the consumer's receive thread put the last tensor in the store.
        _until(lambda: _staging(decode[0])[1] > 0, "the push staged")
        decode[0].engine.decline("staged", producer, push=True)  # its decode request ended, unloaded
        assert _staging(decode[0]) == (0, 0)
        decode[0].engine.decline("coming", producer, push=True)  # declined before it was even pushed
        _push(prefill[0], "coming", ref, [2, 3], 32)
        assert isinstance(_sent(prefill[0], "coming"), TransferError)  # refused: the producer frees its blocks
        assert _staging(decode[0]) == (0, 0)


def test_losing_a_peer_that_is_no_engine_rank_is_no_handler_error(caplog: pytest.LogCaptureFixture) -> None:
    """Anyone that reaches a channel is a peer, under any id; losing one whose id is not ``<engine>.r<rank>`` (a
    raw channel client) raised ValueError in the engine's on_peer_lost (a traceback, a handler error)."""
    from ncclkv.auth import ChannelAuth
    from ncclkv.channel import Channel
    from ncclkv.protocol import Handshake

    caplog.set_level(logging.INFO, logger="ncclkv")
    none = ChannelAuth()
    with _pair(producer=dict(auth=none)) as (prefill, _):
        engine = prefill[0].engine
        channel = engine._channel  # noqa: SLF001
        with Channel("raw client", auth=none, deadline_s=WAIT_S) as raw:
            raw.connect("prefill.r0", engine.address)
            _until(lambda: channel.peer_alive("raw client"), "the raw client heard")
        _until(lambda: channel.stats.peers_lost == 1, "the raw client lost (its Bye)")
        # A reply from the dispatcher after the loss: it handled the loss first (one queue, in order).
        with Channel("probe.r0", auth=none, deadline_s=WAIT_S) as probe:
            probe.connect("prefill.r0", engine.address)
            hello = Handshake.create("probe", "consumer", 0, ONE, GQA, probe.address, "127.0.0.1:1", session="s")
            assert isinstance(probe.request("prefill.r0", hello, WAIT_S), Handshake)
        assert channel.stats.handler_errors == 0, [r.getMessage() for r in caplog.records]
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR], [r.getMessage() for r in caplog.records]
