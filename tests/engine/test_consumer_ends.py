"""What a consumer rank keeps about transfers that ended, and about producer ranks it lost.

A loss of one producer rank fails only what still waits for that rank's bytes; what ended here (a pull
served, failed or declined, a push failed) shapes a later transfer under the same id only as far as it
must. Real ZMQ channels, every rank in this process; order comes from the engines' own state (a loss
handled, an error received, a push reported), never sleeps.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from ncclkv.errors import NcclKVError, PeerLostError, PeerResetError, ShapeMismatchError, TransferError
from ncclkv.layout import ParallelLayout, Span
from ncclkv.paged import CacheLayout
from ncclkv.transport import LoopbackHub, LoopbackTransport

from .kvsim import RankSide, build_sides, close_sides, engine_ref, start_pull, wait_sent
from .test_consumer_faults import _after_calls, _outcomes
from .test_engine_failures import GQA, WAIT_S, _push, _sent, _until

ONE = ParallelLayout(1, 1)
TWO = ParallelLayout(2, 1)  # 4 kv heads: consumer rank r needs producer rank r's heads only


@pytest.fixture
def tp2() -> Iterator[tuple[list[RankSide], list[RankSide]]]:
    """A producer and a consumer of two TP ranks each on one loopback hub; consumer rank r takes its bytes from
    producer rank r only (it still pulls nothing from the other: that rank learns it may free the blocks)."""
    hub = LoopbackHub()
    prefill = build_sides("prefill", TWO, GQA, CacheLayout.CPU, 16, "producer", deadline_s=2.0,
                          transports=[LoopbackTransport(hub), LoopbackTransport(hub)])
    decode = build_sides("decode", TWO, GQA, CacheLayout.CPU, 16, "consumer", hold_s=600.0,
                         transports=[LoopbackTransport(hub), LoopbackTransport(hub)])
    try:
        yield prefill, decode
    finally:
        close_sides(prefill, decode)


@pytest.fixture
def tp2_to_one() -> Iterator[tuple[list[RankSide], list[RankSide]]]:
    """A producer of two TP ranks and a consumer of one on one loopback hub: the consumer takes bytes from both."""
    hub = LoopbackHub()
    prefill = build_sides("prefill", TWO, GQA, CacheLayout.CPU, 16, "producer",
                          transports=[LoopbackTransport(hub), LoopbackTransport(hub)])
    decode = build_sides("decode", ONE, GQA, CacheLayout.CPU, 16, "consumer", hold_s=600.0,
                         transports=[LoopbackTransport(hub)])
    try:
        yield prefill, decode
    finally:
        close_sides(prefill, decode)


def test_losing_a_producer_rank_keeps_a_staged_push_that_owes_nothing_from_it(
        tp2: tuple[list[RankSide], list[RankSide]]) -> None:
    """Consumer rank 0 stages a push whose bytes all come from producer rank 0 when producer rank 1 closes.
    Before, the loss failed every unfinished push staged from that engine, so the push's expect() failed with
    rank 1's loss although rank 1 owed it nothing. Consumer rank 1's part, owed by rank 1, still fails."""
    prefill, decode = tp2
    start_pull("warm", prefill, decode, 1, [1, 2], [1, 2], 20)  # consumer rank 0 now knows producer rank 1
    for side in decode:
        side.engine.wait("warm", timeout_s=WAIT_S)
    consumer = decode[0].engine._consumer  # noqa: SLF001
    ref, producer = engine_ref("decode", TWO, decode), engine_ref("prefill", TWO, prefill)
    for side in prefill:
        side.fill(seed=2, block_ids=[3, 4], num_tokens=32)
        side.engine.start_push("p", ref, [3, 4], 32)
        for layer in (0, 1):
            side.engine.save_layer("p", layer)
    for side in decode:
        stage = side.engine._consumer._stage  # noqa: SLF001
        _until(lambda: (staged := stage.get("p")) is not None and len(staged.landed) == 2,
               f"p's first two layers staged on consumer rank {side.engine.config.rank}")
    lost = [_after_calls(side.engine._consumer, "fail_peer", 1, lambda peer_id, _: peer_id == "prefill.r1")  # noqa: SLF001
            for side in decode]
    prefill[1].engine.close()
    assert all(event.wait(WAIT_S) for event in lost)
    decode[1].engine.expect("p", producer, [5, 6], 32, push=True)  # rank 1 owed it two layers: failed at once
    with pytest.raises(PeerLostError, match="'prefill.r1' lost: it closed its channel"):
        decode[1].engine.wait("p", timeout_s=WAIT_S)
    staged = consumer._stage.get("p")  # noqa: SLF001
    assert staged is not None and staged.error is None, staged and staged.error
    for layer in (2, 3):
        prefill[0].engine.save_layer("p", layer)
    prefill[0].engine.finish("p")
    assert _sent(prefill[0], "p") is None
    decode[0].engine.expect("p", producer, [5, 6], 32, push=True)
    decode[0].engine.wait("p", timeout_s=WAIT_S)
    assert decode[0].mismatches(2, [5, 6], 32, Span(0, 32)) == []


def test_an_offer_for_an_expected_push_that_already_failed_is_refused_at_once(
        tp2_to_one: tuple[list[RankSide], list[RankSide]]) -> None:
    """Producer rank 0 finishes its push with layers unsaved: its ErrorMsg fails the expected request here. Rank
    1's offer comes after, before the request is reported. Before, it was acknowledged, and every tensor of it
    crossed the link only to be drained, the producer told its push succeeded."""
    prefill, decode = tp2_to_one
    ref = engine_ref("decode", ONE, decode)
    decode[0].engine.expect("p", engine_ref("prefill", TWO, prefill), [0, 1], 32, push=True)
    _push(prefill[0], "p", ref, [0, 1], 32, range(2))  # half its layers: it fails, and tells the consumer
    assert isinstance(_sent(prefill[0], "p"), TransferError)
    req = decode[0].engine._consumer._requests["p"]  # noqa: SLF001 - not reported yet: no take_finished
    _until(lambda: req.error is not None, "p failed by rank 0's error")
    received_before = decode[0].engine.stats().tensors_received
    _push(prefill[1], "p", ref, [0, 1], 32)
    error = _sent(prefill[1], "p")
    assert isinstance(error, TransferError) and "already failed here" in str(error), error
    assert "layers [2, 3] were saved" in str(error) or "were not saved" in str(error), error
    assert prefill[1].engine.stats().tensors_sent == 0  # nothing crossed the link for nothing
    assert decode[0].engine.stats().tensors_received == received_before
    assert isinstance(_outcomes(decode[0], "p")["p"], TransferError)


def test_a_late_error_for_a_pull_that_ended_here_refuses_nothing_later(
        tp2: tuple[list[RankSide], list[RankSide]]) -> None:
    """Consumer rank 0 pulls X, all of it from producer rank 0; its pull of nothing to rank 1, which never holds
    X, waits there until rank 1's deadline_s and is answered then with an ErrorMsg, long after X landed. Before,
    that error was taken for a push of X failing before it was expected here: X from that producer was
    remembered as refused, and pulling X again once the producer held it anew raised ValueError (a push of X
    would have been refused too)."""
    prefill, decode = tp2
    producer = engine_ref("prefill", TWO, prefill)
    prefill[0].fill(seed=3, block_ids=[1, 2], num_tokens=20)
    prefill[0].engine.finish("X", [1, 2], 20)  # rank 1 never holds this X
    late = _after_calls(decode[0].engine._consumer, "on_error", 1, lambda sender, err: err.request_id == "X")  # noqa: SLF001
    decode[0].engine.expect("X", producer, [1, 2], 20)
    decode[1].engine.decline("X", producer)  # rank 0's hold ends once both consumer ranks answered
    decode[0].engine.wait("X", timeout_s=WAIT_S)
    assert _outcomes(decode[0], "X") == {"X": None}
    assert wait_sent(prefill[0], "X")["X"] is None
    # Rank 1 answers the parked pulls of nothing once its deadline_s passed (its take_finished expires them).
    _until(lambda: prefill[1].engine.take_finished_sending() == {} and late.is_set(), "rank 1's late ErrorMsg")

    for side in prefill:  # the id held anew (the engine allows it: a served hold is no refusal)
        side.fill(seed=4, block_ids=[3, 4], num_tokens=20)
        side.engine.finish("X", [3, 4], 20)
    decode[0].engine.expect("X", producer, [5, 6], 20)
    decode[0].engine.wait("X", timeout_s=WAIT_S)
    assert decode[0].mismatches(4, [5, 6], 20, Span(0, 20)) == []


def test_a_push_under_the_id_of_a_pull_that_failed_here_is_refused_like_a_pull_again() -> None:
    """A pull of X fails here (its producer released X: refused at once); the producer then pushes X. A pull
    again under X is refused (ValueError): the failed pull's tensors may still come for hold_s. A push under X
    would take them the same way (they are announced for X from that producer), so it is refused as well:
    its expect() fails at once with the pull's cause, and its offer is refused, instead of landing late pull
    tensors over the push's KV or failing on them later. By design; this guards it. The refusal says so: no
    push failed (it used to say "its push failed before it was expected" and "it already failed here")."""
    hub = LoopbackHub()
    prefill = build_sides("prefill", ONE, GQA, CacheLayout.CPU, 16, "producer", hold_s=30.0,
                          transports=[LoopbackTransport(hub)])
    decode = build_sides("decode", ONE, GQA, CacheLayout.CPU, 16, "consumer", hold_s=600.0,
                         transports=[LoopbackTransport(hub)])
    try:
        ref, producer = engine_ref("decode", ONE, decode), engine_ref("prefill", ONE, prefill)
        prefill[0].engine.finish("X", [1, 2], 20)
        assert prefill[0].engine.release("X")
        assert isinstance(wait_sent(prefill[0], "X")["X"], TransferError)
        decode[0].engine.expect("X", producer, [1, 2], 20)
        assert "is no longer held" in str(_outcomes(decode[0], "X")["X"])
        with pytest.raises(ValueError, match="'X' from 'prefill' ended here unloaded"):
            decode[0].engine.expect("X", producer, [1, 2], 20)
        prefill[0].fill(seed=5, block_ids=[3, 4], num_tokens=32)
        _push(prefill[0], "X", ref, [3, 4], 32)
        refused = _sent(prefill[0], "X")
        # The words say what happened (no push failed; before, "it already failed here" and "its push failed
        # before it was expected" said one did).
        said = "a pull of it from 'prefill' failed or was aborted here "
        assert isinstance(refused, TransferError) and said in str(refused), refused
        assert "its tensors may still arrive, so the id from that producer is refused until hold_s=600s have " \
               "passed; the pull's cause: " in str(refused), refused
        assert "is no longer held" in str(refused) and prefill[0].engine.stats().tensors_sent == 0, refused
        assert "already failed" not in str(refused), refused
        decode[0].engine.expect("X", producer, [5, 6], 32, push=True)
        with pytest.raises(TransferError) as raised:
            decode[0].engine.wait("X", timeout_s=WAIT_S)
        text = str(raised.value)
        assert text.startswith(f"request 'X': {said}") and "its tensors may still arrive" in text, text
        assert "is no longer held" in text and "push failed" not in text, text
    finally:
        close_sides(prefill, decode)


@pytest.mark.parametrize("end", ["aborted", "failed"])
def test_an_expect_again_of_a_push_that_ended_after_it_was_expected_names_that_end(end: str) -> None:
    """A push expected here ends unloaded: aborted, or failed (pushed with another token count: its offer is
    refused, and the producer's error for it, the refusal coming back as its push ends, arrives after the request
    was reported). An expect of it again fails at once, as designed, with words that say what happened: it was
    expected here and ended. Before, it said "its push failed before it was expected", though it was expected,
    and once that producer's late error came, the remembered cause became that error instead."""
    hub = LoopbackHub()
    prefill = build_sides("prefill", ONE, GQA, CacheLayout.CPU, 16, "producer", transports=[LoopbackTransport(hub)])
    decode = build_sides("decode", ONE, GQA, CacheLayout.CPU, 16, "consumer", hold_s=600.0,
                         transports=[LoopbackTransport(hub)])
    try:
        ref, producer = engine_ref("decode", ONE, decode), engine_ref("prefill", ONE, prefill)
        engine = decode[0].engine
        engine.expect("p", producer, [0, 1], 20, push=True)
        if end == "aborted":
            engine.abort("p")
            cause = "request 'p' aborted"
        else:
            prefill[0].engine.start_push("p", ref, [0, 1], 21)  # refused at its offer: the request fails here
            first = _outcomes(decode[0], "p")["p"]
            assert isinstance(first, ShapeMismatchError), first
            late = _after_calls(engine._consumer, "on_error", 1, lambda sender, err: err.request_id == "p")  # noqa: SLF001
            for layer in range(GQA.num_layers):
                prefill[0].engine.save_layer("p", layer)
            prefill[0].engine.finish("p")
            assert isinstance(_sent(prefill[0], "p"), ShapeMismatchError)
            assert late.wait(WAIT_S), "the producer's error for p never came"
            cause = "expected here with 20 tokens, pushed with 21"
        engine.expect("p", producer, [0, 1], 20, push=True)
        with pytest.raises(NcclKVError) as raised:
            engine.wait("p", timeout_s=WAIT_S)
        text = str(raised.value)
        assert text.startswith("request 'p': a push of it expected here before failed or was aborted: "), text
        assert cause in text and "before it was expected" not in text and "replied error" not in text, text
    finally:
        close_sides(prefill, decode)


def test_many_link_drops_leave_nothing_kept_for_gone_links() -> None:
    """60 pulls, the link dropped after each by the consumer, the producer or both (a lost peer, a reset: the
    next pull shakes hands anew, after a peer_reset answer where only the producer dropped it). What either
    side keeps per link or per peer holds the live link's entries only, not one per link ever."""
    hub = LoopbackHub()
    prefill = build_sides("prefill", ONE, GQA, CacheLayout.CPU, 16, "producer", transports=[LoopbackTransport(hub)])
    decode = build_sides("decode", ONE, GQA, CacheLayout.CPU, 16, "consumer", transports=[LoopbackTransport(hub)])
    try:
        p_engine, d_engine = prefill[0].engine, decode[0].engine
        links_made = set()
        for i in range(60):
            start_pull(f"r{i}", prefill, decode, i, [1, 2], [1, 2], 20)
            d_engine.wait(f"r{i}", timeout_s=WAIT_S)
            assert wait_sent(prefill[0], f"r{i}")[f"r{i}"] is None
            assert _outcomes(decode[0], f"r{i}") == {f"r{i}": None}
            links_made.add(d_engine._peers.get("prefill.r0").link_id)  # noqa: SLF001
            if i % 3 != 1:
                d_engine._peers.drop("prefill.r0", "test: the consumer drops the link")  # noqa: SLF001
            if i % 3 != 0:
                p_engine._peers.drop("decode.r0", "test: the producer drops the link")  # noqa: SLF001
        assert len(links_made) > 40  # the drops made new links
        for engine in (p_engine, d_engine):
            peers = engine._peers  # noqa: SLF001
            live = set(peers._links)  # noqa: SLF001
            assert len(live) <= 1 and not peers._waiting and not peers._connecting, (live, peers._waiting)  # noqa: SLF001
            # The announcement counters live on each link's Peer (sent_seq, heard_seq): only a live link's are kept.
        # A link made after all those drops counts from 0 at both ends: what one end sent, the other heard.
        start_pull("last", prefill, decode, 60, [1, 2], [1, 2], 20)
        d_engine.wait("last", timeout_s=WAIT_S)
        assert wait_sent(prefill[0], "last")["last"] is None
        assert _outcomes(decode[0], "last") == {"last": None}
        sent, heard = p_engine._peers.get("decode.r0"), d_engine._peers.get("prefill.r0")  # noqa: SLF001
        assert sent.link_id == heard.link_id and sent.sent_seq == heard.heard_seq > 0, (sent, heard)
        consumer, producer = d_engine._consumer, p_engine._producer  # noqa: SLF001
        assert not consumer._requests and consumer._stage.items() == [] and not producer._held  # noqa: SLF001
        assert not producer._early and not producer._parked_by and consumer._decliner.queued == 0  # noqa: SLF001
        assert consumer._ended.num_pulled == 61 and consumer._ended.num_refused == 0  # noqa: SLF001 - bounded, expire after hold_s
    finally:
        close_sides(prefill, decode)


def test_an_offer_refused_for_another_ranks_reset_does_not_reset_the_offering_rank(
        tp2_to_one: tuple[list[RankSide], list[RankSide]]) -> None:
    """An expected push fails here with producer rank 1's PeerResetError (it restarted); producer rank 0's offer
    comes after and is refused. The refusal carried the failure's own type, so it reached rank 0 as a
    ``peer_reset`` answer, which means "this consumer holds no handshake with you": rank 0 forgot its handshake
    with this consumer, closing its data link (and whatever else was on it), shook hands again, offered once
    more and was refused the same way, its push failing with a PeerResetError about a reset it never had. It is
    refused as a PeerLostError now (the same words), and rank 0 keeps its link."""
    prefill, decode = tp2_to_one
    start_pull("warm", prefill, decode, 1, [2, 3], [2, 3], 20)  # both producer ranks shake hands with it
    decode[0].engine.wait("warm", timeout_s=WAIT_S)
    for side in prefill:
        assert wait_sent(side, "warm")["warm"] is None
    link_before = prefill[0].engine._peers.get("decode.r0").link_id  # noqa: SLF001
    ref, producer = engine_ref("decode", ONE, decode), engine_ref("prefill", TWO, prefill)
    decode[0].engine.expect("p", producer, [0, 1], 32, push=True)
    # What the channel reports when producer rank 1 restarted under its peer id (on the dispatcher).
    decode[0].engine._on_peer_lost("prefill.r1", PeerResetError("test: 'prefill.r1' restarted"))  # noqa: SLF001
    req = decode[0].engine._consumer._requests["p"]  # noqa: SLF001 - not reported yet
    assert isinstance(req.error, PeerResetError), req.error
    prefill[0].fill(seed=2, block_ids=[0, 1], num_tokens=32)
    _push(prefill[0], "p", ref, [0, 1], 32)
    error = _sent(prefill[0], "p")
    assert isinstance(error, PeerLostError) and "already failed here" in str(error), error
    assert not isinstance(error, PeerResetError), error  # rank 0's handshake was never reset
    assert "'prefill.r1' restarted" in str(error), error
    assert prefill[0].engine._peers.get("decode.r0").link_id == link_before  # noqa: SLF001 - its link kept


def test_a_late_error_for_an_earlier_pull_of_nothing_does_not_fail_the_ids_next_hold(
        tp2: tuple[list[RankSide], list[RankSide]]) -> None:
    """As above, but the id is held again (hold 2) and pulled by consumer rank 0 before producer rank 1 answers hold
    1's pull of nothing: hold 2 lands whole from rank 0, rank 1 holds it too and takes hold 2's pull of nothing.
    Rank 1's late timeout for hold 1's pull (an ErrorMsg naming only the id) failed hold 2 here, although that
    rank owes it nothing; a failure sending a pull of nothing was only logged. Such an error from a rank the pull
    takes nothing from is only logged now."""
    prefill, decode = tp2
    producer = engine_ref("prefill", TWO, prefill)
    prefill[0].fill(seed=3, block_ids=[1, 2], num_tokens=20)
    prefill[0].engine.finish("X", [1, 2], 20, hold=1)  # rank 1 never holds hold 1
    late = _after_calls(decode[0].engine._consumer, "on_error", 1, lambda sender, err: err.request_id == "X")  # noqa: SLF001
    decode[0].engine.expect("X", producer, [1, 2], 20, hold=1)
    decode[1].engine.decline("X", producer, hold=1)
    decode[0].engine.wait("X", timeout_s=WAIT_S)
    assert _outcomes(decode[0], "X") == {"X": None}
    assert wait_sent(prefill[0], "X")["X"] is None
    parked = prefill[1].engine._producer._early  # noqa: SLF001
    _until(lambda: len(parked.get("X", ())) == 2, "hold 1's pull of nothing and decline parked on rank 1")
    clock = prefill[1].engine._channel.clock  # noqa: SLF001 - hold 2's pull parks a second after hold 1's
    first = max(deadline for _, _, deadline in parked["X"])
    _until(lambda: clock.now() > first - 1.0, "a second on rank 1's clock")

    prefill[0].fill(seed=4, block_ids=[3, 4], num_tokens=20)
    prefill[0].engine.finish("X", [3, 4], 20, hold=2)
    decode[0].engine.expect("X", producer, [5, 6], 20, hold=2)
    decode[0].engine.wait("X", timeout_s=WAIT_S)  # landed whole from rank 0, not reported yet
    _until(lambda: prefill[1].engine.take_finished_sending() == {} and late.is_set(), "rank 1's late ErrorMsg")
    assert [pull.hold for _, pull, _ in parked["X"]] == [2]  # hold 2's pull of nothing still waits there
    prefill[1].fill(seed=4, block_ids=[3, 4], num_tokens=20)
    prefill[1].engine.finish("X", [3, 4], 20, hold=2)  # and is served
    assert decode[0].mismatches(4, [5, 6], 20, Span(0, 20)) == []
    assert _outcomes(decode[0], "X") == {"X": None}
