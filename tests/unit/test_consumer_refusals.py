"""Refused pushes a consumer rank remembers (``ConsumerSide._ended``, an ``EndedTransfers``): expiry after ``hold_s``, in time order.

Expiry stops at the first entry still held, so the entries must stay in time
order: a refreshed entry moves to the end, and an entry made after the clock
stepped back (a pause of this process counted) is never older than the one
before it. The clock is a fake one moved by the test; no link, no channel.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any

import pytest

from fake_time import FakeTime
from ncclkv._clock import ActiveClock
from ncclkv.engine._caches import RankCaches
from ncclkv.engine._consumer import ConsumerSide
from ncclkv.engine._ended import MAX_REFUSALS
from ncclkv.engine._stats import EngineStats
from ncclkv.errors import CapacityError, TransferError
from ncclkv.layout import KVGeometry, ParallelLayout

HOLD_S = 1.0
TICK_S = 0.1
ONE = ParallelLayout(1, 1)
GEOMETRY = KVGeometry(num_layers=2, num_kv_heads=2, head_size=8, dtype="float32")


@pytest.fixture
def side() -> Iterator[tuple[ConsumerSide, FakeTime, ActiveClock]]:
    """A consumer rank on a fake clock (the only part of the channel it reads here)."""
    time = FakeTime()
    clock = ActiveClock(TICK_S, monotonic=time)
    channel: Any = SimpleNamespace(clock=clock)
    peers: Any = SimpleNamespace()
    with ThreadPoolExecutor(max_workers=1) as executor:
        consumer = ConsumerSide("decode", 0, ONE, GEOMETRY, RankCaches(ONE, GEOMETRY, 0, 0), channel, peers,
                                executor, EngineStats(), deadline_s=5.0, staging_bytes=1024, hold_s=HOLD_S)
        try:
            yield consumer, time, clock
        finally:
            consumer.close()


def _refuse(consumer: ConsumerSide, request_id: str, producer: str = "prefill") -> None:
    with consumer._cond:  # noqa: SLF001 - what on_push_offer, on_error, decline and take_finished do, under it
        consumer._remember_refusal(request_id, producer, CapacityError(f"{request_id} refused"))  # noqa: SLF001


def _refused(consumer: ConsumerSide) -> list[tuple[str, float]]:
    """(request id, when) of each remembered refusal, oldest first."""
    refused = consumer._ended._refused  # noqa: SLF001
    return [(request_id, refused.get(request_id)[0]) for request_id in refused]


def _in_time_order(entries: list[tuple[str, float]]) -> bool:
    return all(a[1] <= b[1] for a, b in zip(entries, entries[1:]))


def test_refusals_expire_after_hold_s_oldest_first(side: tuple[ConsumerSide, FakeTime, ActiveClock]) -> None:
    consumer, time, _ = side
    _refuse(consumer, "a")
    _refuse(consumer, "b")
    time.t += 0.6
    _refuse(consumer, "c")
    time.t += HOLD_S - 0.6  # a and b are exactly hold_s old: still held
    assert consumer.take_finished() == {}
    assert [r for r, _ in _refused(consumer)] == ["a", "b", "c"]
    time.t += 0.01
    consumer.take_finished()
    assert [r for r, _ in _refused(consumer)] == ["c"]
    time.t += 0.6
    consumer.take_finished()
    assert _refused(consumer) == []


def test_a_refreshed_refusal_moves_to_the_end_and_is_held_from_its_refresh(
        side: tuple[ConsumerSide, FakeTime, ActiveClock]) -> None:
    consumer, time, _ = side
    _refuse(consumer, "a")
    time.t += 0.5
    _refuse(consumer, "b")
    time.t += 0.3
    _refuse(consumer, "a", producer="other")  # refreshed: e.g. a second producer's offer refused for room
    assert [r for r, _ in _refused(consumer)] == ["b", "a"] and _in_time_order(_refused(consumer))
    assert consumer._ended.refusal("a", "other") is not None and consumer._ended.refusal("a", "prefill") is None  # noqa: SLF001 - the latest refusal is what an expect() meets
    time.t += 0.8  # b is 1.1 s old, a 0.8 s since its refresh
    consumer.take_finished()
    assert [r for r, _ in _refused(consumer)] == ["a"]  # before a, b would have hidden behind a's first place
    time.t += 0.3
    consumer.take_finished()
    assert _refused(consumer) == []


def test_a_refusal_after_the_clock_stepped_back_is_not_older_than_the_one_before(
        side: tuple[ConsumerSide, FakeTime, ActiveClock]) -> None:
    consumer, time, clock = side
    clock.tick()
    time.t += 5.0  # this process stopped 5 s; the loop has not turned since, so now() still counts the pause
    _refuse(consumer, "during")
    clock.tick()  # the pause is counted: now() steps back by it
    _refuse(consumer, "after")
    assert clock.now() < consumer._ended.refusal("during", "prefill").since  # noqa: SLF001 - the step back this test is about
    assert [r for r, _ in _refused(consumer)] == ["during", "after"] and _in_time_order(_refused(consumer))
    # "during" holds the uncounted pause in its time (as it always did); "after" is held as long, not
    # hold_s from its own now(): at most that pause longer, so that expiry may stop at the first entry held.
    stamp = consumer._ended.refusal("during", "prefill").since  # noqa: SLF001
    time.t += stamp + HOLD_S - 0.01 - clock.now()
    consumer.take_finished()
    assert [r for r, _ in _refused(consumer)] == ["during", "after"]
    time.t += 0.02
    consumer.take_finished()
    assert _refused(consumer) == []


def test_past_the_bound_the_oldest_refusal_is_dropped(side: tuple[ConsumerSide, FakeTime, ActiveClock]) -> None:
    consumer, time, _ = side
    for i in range(MAX_REFUSALS):
        _refuse(consumer, f"r{i}")
    time.t += 0.1
    _refuse(consumer, "r0")  # refreshed, not added: nothing dropped, r1 is now the oldest
    assert consumer._ended.num_refused == MAX_REFUSALS  # noqa: SLF001
    _refuse(consumer, "new")
    ids = [r for r, _ in _refused(consumer)]
    assert len(ids) == MAX_REFUSALS and "r1" not in ids and ids[-2:] == ["r0", "new"]


def test_a_push_declined_before_it_was_staged_is_remembered(
        side: tuple[ConsumerSide, FakeTime, ActiveClock]) -> None:
    consumer, _, _ = side
    producer: Any = SimpleNamespace(engine_id="prefill")
    consumer.decline("d", producer, push=True)
    refusal = consumer._ended.refusal("d", "prefill")  # noqa: SLF001
    assert refusal is not None and isinstance(refusal.error, TransferError) and not refusal.pulled
    assert str(refusal.error) == "push of 'd' was declined here (its request ended unloaded)"
