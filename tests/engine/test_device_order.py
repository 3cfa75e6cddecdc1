"""The consumer's device ordering, wired end to end on the CPU: RankCaches' CUDA hooks recorded.

On CUDA each scatter leaves an event (RankCaches.scattered), a layer's waiter
orders its stream after that layer's events (order_after), and a request is
reported done, or handed back by an abort, only once the device is past all of
them (wait_done). On the CPU those hooks do nothing; here they record, so the
wiring is checked where it runs in CI. tests/gpu checks the streams themselves.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from ncclkv.engine._caches import RankCaches
from ncclkv.errors import NcclKVError
from ncclkv.paged import CacheLayout

from .kvsim import build_sides, close_sides, start_pull
from .test_engine_failures import GQA, ONE, WAIT_S, _until


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, list[Any]]]:
    """Each scatter's 'event' (the wire tensor's shape, and a count), and what order_after and wait_done got."""
    seen: dict[str, list[Any]] = {"scattered": [], "order_after": [], "wait_done": []}

    def scattered(self: RankCaches, buf: Any) -> tuple[str, int]:
        event = ("event", len(seen["scattered"]))
        seen["scattered"].append(event)
        return event

    monkeypatch.setattr(RankCaches, "scattered", scattered)
    monkeypatch.setattr(RankCaches, "order_after", lambda self, events: seen["order_after"].append(list(events)))
    def wait_done(events: Any, timeout_s: float) -> int:
        seen["wait_done"].append(list(events))
        return 0

    monkeypatch.setattr(RankCaches, "wait_done", staticmethod(wait_done))
    yield seen


@pytest.mark.parametrize("batched", [False, True], ids=["a tensor per layer", "layers in one tensor"])
def test_a_layers_waiter_orders_after_that_layers_scatters_and_the_report_after_all(
        recorded: dict[str, list[Any]], batched: bool) -> None:
    prefill = build_sides("prefill", ONE, GQA, CacheLayout.CPU, 16, "producer",
                          **({} if batched else {"pull_batch_bytes": 0}))
    decode = build_sides("decode", ONE, GQA, CacheLayout.CPU, 16, "consumer")
    try:
        engine = decode[0].engine
        start_pull("r", prefill, decode, 3, [1, 2, 3], [4, 5, 6], 40)
        for layer in range(GQA.num_layers):
            engine.wait_layer("r", layer, timeout_s=WAIT_S)
        if batched:  # every layer's slice in one tensor, one scatter event after all of them
            assert len(recorded["scattered"]) == 1
            assert recorded["order_after"] == [recorded["scattered"]] * GQA.num_layers
        else:
            assert len(recorded["scattered"]) == GQA.num_layers  # one slice a layer here
            # Each wait ordered after its own layer's scatter alone.
            assert [len(events) for events in recorded["order_after"]] == [1] * GQA.num_layers
            assert sorted(e for events in recorded["order_after"] for e in events) == sorted(recorded["scattered"])
        done = _until(lambda: engine.take_finished_receiving(), "r reported")
        assert done == {"r": None}
        assert sorted(recorded["wait_done"][-1]) == sorted(recorded["scattered"])  # reported after every one
    finally:
        close_sides(prefill, decode)


def test_an_abort_hands_the_blocks_back_after_the_scatters_done(recorded: dict[str, list[Any]]) -> None:
    prefill = build_sides("prefill", ONE, GQA, CacheLayout.CPU, 16, "producer")
    decode = build_sides("decode", ONE, GQA, CacheLayout.CPU, 16, "consumer")
    try:
        engine = decode[0].engine
        start_pull("r", prefill, decode, 3, [1, 2, 3], [4, 5, 6], 40)
        engine.wait_layer("r", 0, timeout_s=WAIT_S)
        engine.abort("r")
        assert recorded["wait_done"] and set(recorded["wait_done"][-1]) >= {recorded["scattered"][0]}
    finally:
        close_sides(prefill, decode)


class _Event:
    """A CUDA event as wait_done polls it: done after ``ready_after`` queries (never, with None)."""

    def __init__(self, ready_after: int | None) -> None:
        self.ready_after, self.queries = ready_after, 0

    def query(self) -> bool:
        self.queries += 1
        return self.ready_after is not None and self.queries > self.ready_after


def test_wait_done_polls_until_the_device_is_past_every_event() -> None:
    events = [_Event(0), _Event(3), _Event(1)]
    assert RankCaches.wait_done(events, timeout_s=WAIT_S) == 0
    assert [e.queries for e in events] == [1, 4, 2]  # each queried until done, and not after


def test_wait_done_gives_up_at_its_deadline_and_counts_what_is_still_pending() -> None:
    stuck, done = _Event(None), _Event(0)
    start = time.monotonic()
    assert RankCaches.wait_done([stuck, done], timeout_s=0.05) == 1
    assert 0.05 <= time.monotonic() - start < 2.0  # the deadline held: Event.synchronize would have hung here
    assert stuck.queries > 1 and done.queries == 1


def test_scatters_stuck_on_the_device_are_reported_not_waited_for_forever(
        recorded: dict[str, list[Any]], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    prefill = build_sides("prefill", ONE, GQA, CacheLayout.CPU, 16, "producer")
    decode = build_sides("decode", ONE, GQA, CacheLayout.CPU, 16, "consumer")
    try:
        engine = decode[0].engine
        monkeypatch.setattr(RankCaches, "wait_done", staticmethod(lambda events, timeout_s: len(list(events))))
        start_pull("r", prefill, decode, 3, [1, 2, 3], [4, 5, 6], 40)
        with caplog.at_level("ERROR", logger="ncclkv.engine"):
            assert _until(lambda: engine.take_finished_receiving(), "r reported") == {"r": None}
        stuck = [r.getMessage() for r in caplog.records if "still not done on the device" in r.getMessage()]
        count = len(recorded["scattered"])  # one: the pull's layers came in one tensor
        assert count == 1 and stuck and f"{count} of {count} scatter(s)" in stuck[0], caplog.text
    finally:
        close_sides(prefill, decode)


def test_a_batch_whose_scatter_fails_part_way_still_orders_the_hand_back_after_the_layers_it_queued(
        recorded: dict[str, list[Any]], monkeypatch: pytest.MonkeyPatch) -> None:
    """Layers 0 and 1 of a batch are scattered (CUDA: kernels queued), layer 2's raises: the request fails, and
    its blocks go back only after an event recorded behind the queued scatters (found by review: no event, so
    vLLM could reuse the blocks while they were still being written)."""
    real_scatter = RankCaches.scatter

    def scatter(self: RankCaches, layer: int, *args: Any, **kwargs: Any) -> None:
        if layer == 2:
            raise RuntimeError("scatter failed (test)")
        real_scatter(self, layer, *args, **kwargs)
    monkeypatch.setattr(RankCaches, "scatter", scatter)
    prefill = build_sides("prefill", ONE, GQA, CacheLayout.CPU, 16, "producer")  # the four layers in one tensor
    decode = build_sides("decode", ONE, GQA, CacheLayout.CPU, 16, "consumer")
    try:
        start_pull("r", prefill, decode, 3, [1, 2, 3], [4, 5, 6], 40)
        done = _until(lambda: decode[0].engine.take_finished_receiving(), "r reported")
        assert isinstance(done["r"], NcclKVError) and "scatter failed (test)" in str(done["r"])
        assert len(recorded["scattered"]) == 1  # after layers 0 and 1
        assert recorded["wait_done"][-1] == recorded["scattered"]  # waited for before the report
    finally:
        close_sides(prefill, decode)
