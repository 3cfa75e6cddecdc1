"""Pulls for a request whose hold already ended on the producer: refused at once, never parked.

A producer parks a pull for a request it does not hold yet (the decode request
may come before the prefill finished). It used to park one for a request whose
hold had already ended and been reported (released, expired after ``hold_s``,
served) too: the pull then waited ``deadline_s`` for nothing, or, once the id
was held again, was served from the new hold, whose consumer it became: the
producer reported the new hold finished without its real consumer, which then
failed after ``deadline_s``. Now the producer remembers the holds it reported,
for ``hold_s`` (at most ``MAX_ENDED_HOLDS``), and answers a pull for one at once
with why it ended; the consumer fails the request at once with that reason.

A pull or decline that comes after the id was held again cannot be told from
one for the new hold by the id alone: a late decline counted as the new hold's
consumer declining it (the hold was reported done, its real consumer's pull
then refused), a late pull was served from it. A hold may be numbered
(``finish(..., hold=h)``, the consumer's ``expect`` / ``decline`` given the
same ``h``): a decline for another number counts for nothing, a pull for one
is refused naming both, a pull for a number to come waits for its hold.

Real ZMQ channels and gloo links, every rank in this process; order comes from
the engines' own state (a request reported, a decline answered), never sleeps.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from ncclkv.engine._push import SliceHooks
from ncclkv.engine._recent import RecentEnds
from ncclkv.errors import TransferError, TransferTimeout
from ncclkv.layout import KVGeometry, ParallelLayout, Span
from ncclkv.paged import CacheLayout
from ncclkv.protocol import Announce, Done, ErrorCode, ErrorMsg, RouteMsg

from .kvsim import RankSide, build_sides, close_sides, engine_ref, wait_sent

GQA = KVGeometry(num_layers=4, num_kv_heads=4, head_size=32, dtype="float32")
ONE = ParallelLayout(1, 1)
DEADLINE_S = 8.0
FAST_S = 2.5  # "at once": a control round trip on two busy cores, far below deadline_s
WAIT_S = 20.0
TOKENS = 64


def _until(what: str, ready: Callable[[], Any], timeout_s: float = WAIT_S) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (got := ready()):
        assert time.monotonic() < deadline, f"{what} not reached within {timeout_s}s"
        threading.Event().wait(0.005)
    return got


@pytest.fixture
def sides() -> Iterator[dict[str, RankSide]]:
    """Producer P (hold_s 4 s) and consumers D1, D2, each one rank."""
    p = build_sides("P", ONE, GQA, CacheLayout.CPU, 16, "producer", num_blocks=32, deadline_s=DEADLINE_S, hold_s=4.0)
    d1 = build_sides("D1", ONE, GQA, CacheLayout.CPU, 16, "consumer", num_blocks=32, deadline_s=DEADLINE_S)
    d2 = build_sides("D2", ONE, GQA, CacheLayout.FLASH_NHD, 32, "consumer", num_blocks=16, deadline_s=DEADLINE_S)
    try:
        yield {"P": p[0], "D1": d1[0], "D2": d2[0]}
    finally:
        close_sides(p, d1, d2)


def _pull_fails_fast(consumer: RankSide, producer: RankSide, rid: str, blocks: list[int]) -> TransferError:
    """``consumer`` pulls ``rid`` from ``producer``; the pull must fail far below deadline_s. Returns the error,
    once the consumer's decline of it (a pull of nothing, after the failure) was answered too."""
    ref = engine_ref("P", ONE, [producer])
    started = time.monotonic()
    consumer.engine.expect(rid, ref, blocks, TOKENS)
    with pytest.raises(TransferError) as raised:
        consumer.engine.wait(rid, WAIT_S)
    took = time.monotonic() - started
    assert took < FAST_S, f"the pull of {rid} failed after {took:.2f}s (deadline_s={DEADLINE_S}): {raised.value}"
    assert _until(f"{rid} reported failed", lambda: consumer.engine.take_finished_receiving().get(rid))
    # The failed pull is declined (a pull of nothing): acknowledged, never parked for a hold to come.
    _until(f"{rid}'s decline answered", lambda: consumer.engine._consumer._decliner.queued == 0)
    assert producer.engine.num_in_flight == 0, producer.engine._producer._early
    return raised.value


def test_a_pull_after_release_is_refused_and_the_next_hold_of_the_id_serves_its_own_consumer(
        sides: dict[str, RankSide]) -> None:
    """The reviewer's scenario: X held and released (reported); D1's pull comes after. It was parked, and the
    next hold of X (for D2) served it: P reported X sent with D1 as its consumer, and D2 failed after
    deadline_s."""
    p, d1, d2 = sides["P"], sides["D1"], sides["D2"]
    ref = engine_ref("P", ONE, [p])
    p.fill(1, [0, 1, 2, 3], TOKENS)
    p.engine.finish("X", [0, 1, 2, 3], TOKENS)
    assert p.engine.release("X")
    gen1 = wait_sent(p, "X")["X"]
    assert isinstance(gen1, TransferError), gen1

    error = _pull_fails_fast(d1, p, "X", [0, 1, 2, 3])
    text = str(error)
    assert "'unknown_request'" in text and "is no longer held by producer rank 'P.r0'" in text, text
    assert "released by its producer before every consumer rank pulled" in text, text
    d1.engine.abort("X")  # D1 is done with X (a no-op now: it already failed)

    p.fill(2, [8, 9, 10, 11], TOKENS)  # the next hold of X, other blocks and other KV, for D2
    p.engine.finish("X", [8, 9, 10, 11], TOKENS)
    assert "X" not in p.engine.take_finished_sending()  # nobody pulled it yet
    held = p.engine._producer._held["X"]
    assert held.expected is None and not held.served, (held.expected, held.served)
    d2.engine.expect("X", ref, [4, 5], TOKENS)
    d2.engine.wait("X", WAIT_S)
    assert d2.mismatches(2, [4, 5], TOKENS, Span(0, TOKENS)) == []
    received: dict[str, BaseException | None] = {}
    _until("X reported by D2", lambda: received.update(d2.engine.take_finished_receiving()) or "X" in received)
    assert received["X"] is None
    assert wait_sent(p, "X")["X"] is None  # reported once D2 pulled: served to every consumer rank


def test_a_pull_after_the_hold_expired_or_was_served_fails_at_once_naming_why(sides: dict[str, RankSide]) -> None:
    p, d1, d2 = sides["P"], sides["D1"], sides["D2"]
    ref = engine_ref("P", ONE, [p])
    # Served: D1 pulled Y; a pull of Y after that (a client's retry through D2) is told so.
    p.fill(3, [0, 1, 2, 3], TOKENS)
    p.engine.finish("Y", [0, 1, 2, 3], TOKENS)
    d1.engine.expect("Y", ref, [0, 1, 2, 3], TOKENS)
    d1.engine.wait("Y", WAIT_S)
    assert wait_sent(p, "Y")["Y"] is None
    text = str(_pull_fails_fast(d2, p, "Y", [0, 1]))
    assert "its hold ended" in text and "it was pulled by every consumer rank (D1.r0)" in text, text

    # Expired: Z held, never pulled, released after hold_s; a pull after that is told so, at once.
    p.fill(4, [4, 5, 6, 7], TOKENS)
    p.engine.finish("Z", [4, 5, 6, 7], TOKENS)
    expired = wait_sent(p, "Z")["Z"]  # after hold_s=4 s
    assert "released after hold_s=4s" in str(expired), expired
    text = str(_pull_fails_fast(d1, p, "Z", [4, 5, 6, 7]))
    assert "Z' was released after hold_s=4s" in text and "TransferTimeout" not in text, text


def test_a_pull_for_an_id_never_held_still_waits_for_its_hold(sides: dict[str, RankSide]) -> None:
    """A decode request may come before its prefill finished: its pull is parked, then served by the hold."""
    p, d1 = sides["P"], sides["D1"]
    d1.engine.expect("early", engine_ref("P", ONE, [p]), [0, 1, 2, 3], TOKENS)
    _until("the pull parked", lambda: "early" in p.engine._producer._early)
    p.fill(5, [0, 1, 2, 3], TOKENS)
    p.engine.finish("early", [0, 1, 2, 3], TOKENS)
    d1.engine.wait("early", WAIT_S)
    assert d1.mismatches(5, [0, 1, 2, 3], TOKENS, Span(0, TOKENS)) == []
    assert wait_sent(p, "early")["early"] is None


def test_ended_holds_are_remembered_within_a_bound(monkeypatch: pytest.MonkeyPatch,
                                                   sides: dict[str, RankSide]) -> None:
    p = sides["P"]
    # The producer's memo of ended holds, bound to 3 instead of MAX_ENDED_HOLDS (made with the engine).
    monkeypatch.setattr(p.engine._producer, "_ended", RecentEnds(p.engine.config.hold_s, 3))
    for i in range(5):
        p.engine.finish(f"r{i}", [i], 8)
        p.engine.release(f"r{i}")
    wait_sent(p, *(f"r{i}" for i in range(5)))
    assert list(p.engine._producer._ended) == ["r2", "r3", "r4"]  # the oldest forgotten first
    p.engine.finish("r3", [3], 8)  # held anew: no longer an ended hold
    assert list(p.engine._producer._ended) == ["r2", "r4"]


def _declines_answered(consumer: RankSide) -> None:
    _until("the consumer's declines answered", lambda: consumer.engine._consumer._decliner.queued == 0)


def _still_held_unpulled(producer: RankSide, rid: str, hold: int) -> None:
    """``rid`` is held on ``producer`` under ``hold``, not reported, and no consumer counted for it."""
    assert rid not in producer.engine.take_finished_sending()
    held = producer.engine._producer._held[rid]
    assert (held.hold, held.expected, held.served) == (hold, None, set()), (held.hold, held.expected, held.served)


def test_a_late_decline_counts_for_nothing_toward_the_next_hold_of_the_id(sides: dict[str, RankSide]) -> None:
    """X held as hold 1 and released; held again as hold 2 for D1; then D1's decline of hold 1 comes. Before,
    the producer took it for hold 2's: D1 counted as having declined, hold 2 reported done (its blocks freed)
    and D1's pull of it refused. Now it is acknowledged and counts for nothing; D1 pulls hold 2 whole."""
    p, d1 = sides["P"], sides["D1"]
    ref = engine_ref("P", ONE, [p])
    p.engine.finish("X", [0, 1, 2, 3], TOKENS, hold=1)
    assert p.engine.release("X")
    assert isinstance(wait_sent(p, "X")["X"], TransferError)
    p.fill(6, [8, 9, 10, 11], TOKENS)
    p.engine.finish("X", [8, 9, 10, 11], TOKENS, hold=2)

    d1.engine.decline("X", ref, hold=1)  # late: hold 1 ended before it came
    _declines_answered(d1)
    _still_held_unpulled(p, "X", 2)

    d1.engine.expect("X", ref, [0, 1, 2, 3], TOKENS, hold=2)
    d1.engine.wait("X", WAIT_S)
    assert d1.mismatches(6, [0, 1, 2, 3], TOKENS, Span(0, TOKENS)) == []
    assert _until("X reported by D1", lambda: "X" in (got := d1.engine.take_finished_receiving()) and got)["X"] is None
    assert wait_sent(p, "X")["X"] is None  # D1 pulled it: served to every consumer rank


def test_a_late_pull_for_another_hold_is_refused_naming_both_and_serves_nothing(sides: dict[str, RankSide]) -> None:
    """X held as hold 2; D2's pull of hold 1 comes late. Before, it was served from hold 2, whose consumer D2
    became (hold 2 reported done without D1). Now it fails at once naming both holds, its decline (after the
    failure) counts for nothing, and hold 2 serves D1."""
    p, d1, d2 = sides["P"], sides["D1"], sides["D2"]
    ref = engine_ref("P", ONE, [p])
    p.fill(7, [0, 1, 2, 3], TOKENS)
    p.engine.finish("X", [0, 1, 2, 3], TOKENS, hold=2)

    started = time.monotonic()
    d2.engine.expect("X", ref, [0, 1], TOKENS, hold=1)
    with pytest.raises(TransferError) as raised:
        d2.engine.wait("X", WAIT_S)
    assert time.monotonic() - started < FAST_S, raised.value
    text = str(raised.value)
    assert "'unknown_request'" in text and "is held here as hold 2, the pull is for hold 1" in text, text
    _declines_answered(d2)
    _still_held_unpulled(p, "X", 2)

    d1.engine.expect("X", ref, [4, 5, 6, 7], TOKENS, hold=2)
    d1.engine.wait("X", WAIT_S)
    assert d1.mismatches(7, [4, 5, 6, 7], TOKENS, Span(0, TOKENS)) == []
    assert wait_sent(p, "X")["X"] is None
    assert p.engine._producer._held == {} and d2.engine.stats().tensors_received == 0


def test_a_pull_for_the_next_hold_waits_for_it_and_one_parked_for_another_is_refused_then(
        sides: dict[str, RankSide]) -> None:
    """X's hold 1 ended (released). D1 pulls hold 2 and D2 hold 3, neither held yet: both wait (before, hold
    numbers unknown, both were refused as pulls of the hold that ended). finish(X, hold=2) serves D1 and refuses
    D2's at once, naming both holds."""
    p, d1, d2 = sides["P"], sides["D1"], sides["D2"]
    ref = engine_ref("P", ONE, [p])
    p.engine.finish("X", [0, 1, 2, 3], TOKENS, hold=1)
    assert p.engine.release("X")
    assert isinstance(wait_sent(p, "X")["X"], TransferError)

    d1.engine.expect("X", ref, [0, 1, 2, 3], TOKENS, hold=2)
    d2.engine.expect("X", ref, [0, 1], TOKENS, hold=3)
    _until("both pulls parked", lambda: len(p.engine._producer._early.get("X", ())) == 2)
    assert sorted(pull.hold for _, pull, _ in p.engine._producer._early["X"]) == [2, 3]

    p.fill(8, [8, 9, 10, 11], TOKENS)
    p.engine.finish("X", [8, 9, 10, 11], TOKENS, hold=2)
    d1.engine.wait("X", WAIT_S)
    assert d1.mismatches(8, [0, 1, 2, 3], TOKENS, Span(0, TOKENS)) == []
    with pytest.raises(TransferError, match="is held here as hold 2, the pull is for hold 3"):
        d2.engine.wait("X", WAIT_S)
    assert wait_sent(p, "X")["X"] is None  # D1 was its consumer; D2's refused pull counted for nothing
    assert not p.engine._producer._early and not p.engine._producer._parked_by


@pytest.mark.parametrize("bad", [-1, 2**63, True, 1.0, "1"])
def test_a_hold_number_is_an_int_below_2_63_and_only_for_pulls(sides: dict[str, RankSide], bad: object) -> None:
    p, d1 = sides["P"], sides["D1"]
    ref = engine_ref("P", ONE, [p])
    for call in (lambda: p.engine.finish("X", [0], 8, hold=bad), lambda: d1.engine.expect("X", ref, [0], 8, hold=bad),
                 lambda: d1.engine.decline("X", ref, hold=bad)):
        with pytest.raises(ValueError, match=r"request 'X': hold must be an int in \[0, 2\*\*63\)"):
            call()
    with pytest.raises(ValueError, match="a push has none"):
        d1.engine.expect("X", ref, [0], 8, push=True, hold=5)
    with pytest.raises(ValueError, match="a push has none"):
        d1.engine.decline("X", ref, push=True, hold=5)
    assert p.engine.num_in_flight == 0 and d1.engine.num_in_flight == 0


def test_a_pull_for_the_next_hold_waits_while_the_hold_before_is_released_but_not_yet_reported(
        sides: dict[str, RankSide]) -> None:
    """X's hold 1 is released; before take_finished_sending reports it, D1's pull of hold 2 comes (the producer
    is about to hold X again; its caller learns hold 1 ended at its next poll). A pull of hold 1 then would be
    answered with why it ended, as after the report, and a pull of another number after the report waits for
    its hold; this one was refused instead ("held here as hold 1, the pull is for hold 2"), D1 failing at once.
    It waits now, and hold 2 serves it."""
    p, d1 = sides["P"], sides["D1"]
    ref = engine_ref("P", ONE, [p])
    p.engine.finish("X", [0, 1, 2, 3], TOKENS, hold=1)
    assert p.engine.release("X")  # not reported yet: no take_finished_sending

    d1.engine.expect("X", ref, [0, 1, 2, 3], TOKENS, hold=2)
    req = d1.engine._consumer._requests["X"]  # noqa: SLF001
    _until("D1's pull answered", lambda: not req.unsent or req.error is not None)
    assert req.error is None, req.error
    assert [pull.hold for _, pull, _ in p.engine._producer._early.get("X", ())] == [2]  # noqa: SLF001

    assert isinstance(wait_sent(p, "X")["X"], TransferError)  # hold 1 reported
    p.fill(9, [8, 9, 10, 11], TOKENS)
    p.engine.finish("X", [8, 9, 10, 11], TOKENS, hold=2)
    d1.engine.wait("X", WAIT_S)
    assert d1.mismatches(9, [0, 1, 2, 3], TOKENS, Span(0, TOKENS)) == []
    assert wait_sent(p, "X")["X"] is None


def test_a_pull_again_under_another_hold_number_is_taken_and_the_ended_pulls_late_tensors_are_drained(
        caplog: pytest.LogCaptureFixture) -> None:
    """D1 pulls X (hold 1) and aborts it while P still sends it; X is then held again (hold 2) and D1 pulls it.
    Before, the consumer refused that pull for hold_s ("pull it under a new request id"): hold 1's tensors could
    still come, announced for X, and would land in it. Now P's announcements, Done and errors name the pull's
    hold: hold 1's late tensors (announced once hold 2 is expected here) are drained, its late Done and error
    count for nothing, and hold 2 lands whole, its own bytes."""
    p = build_sides("P", ONE, GQA, CacheLayout.CPU, 16, "producer", num_blocks=32, deadline_s=DEADLINE_S,
                    hold_s=4.0, pull_batch_bytes=0)[0]  # a tensor per layer: several of hold 1's come late
    d1 = build_sides("D1", ONE, GQA, CacheLayout.CPU, 16, "consumer", num_blocks=32, deadline_s=DEADLINE_S,
                     hold_s=600.0)[0]  # its refusal of X outlives the test: only the hold numbers let it pull again
    entered, go = threading.Event(), threading.Event()
    try:
        ref = engine_ref("P", ONE, [p])
        producer = p.engine._producer  # noqa: SLF001
        announcer = producer._announcer  # noqa: SLF001

        def held_announcer(*args: Any, **kwargs: Any) -> SliceHooks:
            # Hold 1's announcements wait for the test, the first one and so every one after it (they go in send
            # order, on the link's send thread). A held gather held only the first: the link runs the hooks of the
            # sends queued behind it before its fill, so every layer could be announced while hold 1 was expected.
            hooks = announcer(*args, **kwargs)

            def announce() -> torch.Tensor:
                entered.set()
                assert go.wait(WAIT_S), "the test never let hold 1's announcements go"
                return hooks.announce()
            return SliceHooks(announce, hooks.gather)
        producer._announcer = held_announcer  # noqa: SLF001
        p.fill(1, [0, 1, 2, 3], TOKENS)
        p.engine.finish("X", [0, 1, 2, 3], TOKENS, hold=1)
        d1.engine.expect("X", ref, [0, 1, 2, 3], TOKENS, hold=1)
        assert entered.wait(WAIT_S), "hold 1 never served"
        producer._announcer = announcer  # noqa: SLF001
        d1.engine.abort("X")
        assert p.engine.release("X")  # its sends run on; a pull of another hold waits for that hold

        d1.engine.expect("X", ref, [4, 5, 6, 7], TOKENS, hold=2)  # before: ValueError, for hold_s
        with caplog.at_level("INFO", logger="ncclkv.engine"):
            go.set()  # hold 1's layers are announced now, to D1 expecting hold 2
            assert isinstance(wait_sent(p, "X")["X"], TransferError)  # released: hold 1's sends all ended
            # What a late answer to hold 1 looks like, on P's own channel, ahead of anything of hold 2's.
            p.engine._channel.send("D1.r0", Done("X", 99, 0, hold=1))  # noqa: SLF001
            p.engine._channel.send("D1.r0", ErrorMsg("X", ErrorCode.TIMEOUT, "hold 1 timed out", hold=1))  # noqa: SLF001
            p.fill(2, [8, 9, 10, 11], TOKENS)
            p.engine.finish("X", [8, 9, 10, 11], TOKENS, hold=2)
            d1.engine.wait("X", WAIT_S)
        assert d1.mismatches(2, [4, 5, 6, 7], TOKENS, Span(0, TOKENS)) == []
        assert _until("X reported by D1", lambda: "X" in (got := d1.engine.take_finished_receiving()) and got)["X"] \
            is None
        assert wait_sent(p, "X")["X"] is None
        drained = [r.getMessage() for r in caplog.records if "for hold 1 of 'X', expected here for hold 2" in
                   r.getMessage()]
        assert drained, "no tensor of hold 1 came once hold 2 was expected"
        told = [r.getMessage() for r in caplog.records if "for hold 1 of X" in r.getMessage()]
        assert any(m.startswith("Done from") for m in told) and any(m.startswith("error from") for m in told), told
    finally:
        go.set()  # never left waiting, whatever failed
        close_sides([p], [d1])


def test_a_late_error_of_a_declined_pull_never_fails_a_push_of_the_id(caplog: pytest.LogCaptureFixture) -> None:
    """D1 declines X's hold 1 before P holds X (its decline is parked on P); X then comes to D1 as a push from P,
    which D1 expects. P's parked decline expires (deadline_s) and P tells D1 so, naming hold 1: a pull's error,
    which a push (hold 0) never is. Before, D1 took it for the expected push's own: the push failed with the
    decline's TransferTimeout ('not held ... within deadline_s of its pull'), though its bytes were on the way;
    a late Done naming a hold was counted against the push too. The same error is ignored for a push still
    staged here."""
    p = build_sides("P", ONE, GQA, CacheLayout.CPU, 16, "producer", num_blocks=32, deadline_s=2.0, hold_s=4.0)[0]
    d1 = build_sides("D1", ONE, GQA, CacheLayout.CPU, 16, "consumer", num_blocks=32, deadline_s=DEADLINE_S,
                     hold_s=600.0)[0]
    try:
        ref_p, ref_d = engine_ref("P", ONE, [p]), engine_ref("D1", ONE, [d1])
        d1.engine.decline("X", ref_p, hold=1)
        _declines_answered(d1)
        assert [pull.hold for _, pull, _ in p.engine._producer._early["X"]] == [1]  # noqa: SLF001 - parked
        d1.engine.expect("X", ref_p, [0, 1, 2, 3], TOKENS, push=True)
        p.fill(11, [0, 1, 2, 3], TOKENS)
        p.engine.start_push("X", ref_d, [0, 1, 2, 3], TOKENS)
        p.engine.save_layer("X", 0)
        with caplog.at_level("INFO", logger="ncclkv.engine"):
            # P's poll expires the parked decline (after its deadline_s) and tells D1, naming hold 1.
            _until("the parked decline expired", lambda: (p.engine.take_finished_sending() is not None
                                                          and "X" not in p.engine._producer._early))  # noqa: SLF001
            p.engine._channel.send("D1.r0", Done("X", 99, 0, hold=1))  # noqa: SLF001 - a pull's, late
            _until("D1 heard the decline's error", lambda: any(
                "X" in r.getMessage() and "deadline_s=2s of its pull" in r.getMessage() for r in caplog.records))
            _until("D1 heard the late Done", lambda: any(
                "Done from" in r.getMessage() and "hold 1 of X" in r.getMessage() for r in caplog.records)
                or d1.engine._consumer._requests["X"].error is not None)  # noqa: SLF001
        for layer in (1, 2, 3):
            p.engine.save_layer("X", layer)
        p.engine.finish("X")
        d1.engine.wait("X", WAIT_S)  # before: TransferTimeout "... within deadline_s=2s of its pull ..."
        assert d1.mismatches(11, [0, 1, 2, 3], TOKENS, Span(0, TOKENS)) == []
        assert wait_sent(p, "X")["X"] is None
    finally:
        close_sides([p], [d1])


def test_a_pull_refused_after_a_push_of_the_id_ended_here_does_not_offer_hold_numbers_as_the_way_out(
        sides: dict[str, RankSide]) -> None:
    """D1 declined X's push from P (its refusal is remembered hold_s); a pull of X from P is refused then, hold
    numbers or not: the push's tensors, announced with no hold, may still come. The refusal told the caller to
    'pull it under a new request id (or both pulls under hold numbers)', though no pull had ended and the second
    way out is refused too. It names only what works after a push ended."""
    p, d1 = sides["P"], sides["D1"]
    ref = engine_ref("P", ONE, [p])
    d1.engine.decline("X", ref, push=True)
    with pytest.raises(ValueError, match="push of 'X' was declined here") as raised:
        d1.engine.expect("X", ref, [0, 1, 2, 3], TOKENS, hold=2)
    assert "new request id" in str(raised.value) and "hold numbers" not in str(raised.value), raised.value
    with pytest.raises(ValueError, match="push of 'X' was declined here"):  # the way it did not offer: refused
        d1.engine.expect("X", ref, [0, 1, 2, 3], TOKENS, hold=3)
    assert "X" not in d1.engine._consumer._requests  # noqa: SLF001 - nothing registered


def test_an_announcement_of_another_hold_whose_link_never_opened_fails_nothing(sides: dict[str, RankSide]) -> None:
    """A tensor announced for hold 1 of X whose link never opens (its peer dropped while it opened) will never
    come; that failed the request expected under X, although it is hold 2's and hold 1's tensor is none of its
    own. Only an announcement of its own hold fails it now."""
    p, d1 = sides["P"], sides["D1"]
    d1.engine.expect("X", engine_ref("P", ONE, [p]), [0, 1, 2, 3], TOKENS, hold=2)  # parked on P: not held yet
    consumer = d1.engine._consumer  # noqa: SLF001
    peer: Any = SimpleNamespace(remote=SimpleNamespace(engine_id="P"))  # what a link's peer says of itself here

    def never_opened(hold: int) -> None:  # what PeerLinks.when_open reports for a link that never opened
        ann = Announce("X", 0, RouteMsg(0, 0, (0, 4), (0, 4), (0, TOKENS)), (2, TOKENS, 4, 32), "float32",
                       2 * TOKENS * 4 * 32 * 4, 0, "kv-gone", hold=hold)
        consumer._on_announce_open("P.r0", peer, ann, None, TransferTimeout("link 'kv-gone' never opened"))  # noqa: SLF001

    never_opened(1)
    assert consumer._requests["X"].error is None  # noqa: SLF001
    never_opened(2)
    assert isinstance(consumer._requests["X"].error, TransferTimeout)  # noqa: SLF001
