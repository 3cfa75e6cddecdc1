"""A failure past a task's own handling is reported on its request, once, and logged; never lost.

The engine runs offers, pulls and the end of a served pull off the caller's
thread (executor tasks, send callbacks) and keeps no future: an exception that
escaped there used to vanish, and the request was never reported (its blocks
held for ever). Each test injects one such failure into real engines in this
process and waits, bounded, for the report.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from ncclkv.engine._stats import EngineStats
from ncclkv.engine._tasks import submit_task
from ncclkv.errors import TransferError
from ncclkv.layout import KVGeometry, ParallelLayout
from ncclkv.paged import CacheLayout

from .kvsim import build_sides, close_sides, engine_ref, start_pull, wait_sent

GQA = KVGeometry(num_layers=4, num_kv_heads=4, head_size=32, dtype="float32")
ONE = ParallelLayout(1, 1)
WAIT_S = 10.0  # each report comes within a second; before the fixes none ever came


def _logged(caplog: pytest.LogCaptureFixture, *words: str) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno >= logging.ERROR and all(w in r.getMessage() for w in words)]


def test_a_push_whose_backlog_cannot_be_queued_is_reported_failed(caplog: pytest.LogCaptureFixture) -> None:
    """Layers saved before the offer is accepted are queued by the offer's task: a failure there fails the push."""
    prefill = build_sides("prefill", ONE, GQA, CacheLayout.CPU, 16, "producer")
    decode = build_sides("decode", ONE, GQA, CacheLayout.CPU, 16, "consumer")
    try:
        producer = prefill[0].engine
        pusher = producer._producer._pusher  # noqa: SLF001 - hold the offer until every layer is saved
        offer, go = pusher._offer_once_more_on_reset, threading.Event()  # noqa: SLF001

        def held_offer(*args: Any) -> Any:
            assert go.wait(WAIT_S)
            return offer(*args)

        def broken_placeholder(*args: Any) -> Any:
            raise ValueError("injected placeholder failure")

        pusher._offer_once_more_on_reset = held_offer  # noqa: SLF001
        producer._caches.placeholder = broken_placeholder  # type: ignore[method-assign]  # noqa: SLF001
        decode[0].engine.expect("p", engine_ref("prefill", ONE, prefill), [0, 1], 20, push=True)
        with caplog.at_level(logging.ERROR, logger="ncclkv.engine"):
            producer.start_push("p", engine_ref("decode", ONE, decode), [0, 1], 20)
            for layer in range(GQA.num_layers):
                producer.save_layer("p", layer)  # all in the backlog: the offer is not accepted yet
            producer.finish("p")
            go.set()
            error = wait_sent(prefill[0], "p", timeout_s=WAIT_S)["p"]  # before: never reported
        assert isinstance(error, TransferError)
        assert "ValueError: injected placeholder failure" in str(error) and "'decode.r0'" in str(error)
        assert _logged(caplog, "push of p to decode.r0", "injected placeholder failure")
        # Its consumer is told too: the request fails there, not after a stall.
        assert decode[0].engine.wait_finished_receiving(WAIT_S)
        outcome = decode[0].engine.take_finished_receiving()
        assert list(outcome) == ["p"] and "injected placeholder failure" in str(outcome["p"])
        assert producer.num_in_flight == 0
    finally:
        close_sides(prefill, decode)


class _AckedWithoutStamp:
    """What an acknowledged pull returns, broken: reading its handshake stamp raises."""

    @property
    def stamp(self) -> int:
        raise ValueError("injected stamp failure")


def test_a_pull_that_fails_after_its_acknowledgement_fails_its_request(caplog: pytest.LogCaptureFixture) -> None:
    prefill = build_sides("prefill", ONE, GQA, CacheLayout.CPU, 16, "producer")
    decode = build_sides("decode", ONE, GQA, CacheLayout.CPU, 16, "consumer", deadline_s=60.0, hold_s=60.0)
    try:
        consumer = decode[0].engine
        # The pull's bookkeeping after the acknowledgement (outside its try) fails; nothing is really sent.
        consumer._consumer._send_pull = lambda *args: _AckedWithoutStamp()  # noqa: SLF001
        with caplog.at_level(logging.ERROR, logger="ncclkv.engine"):
            consumer.expect("r", engine_ref("prefill", ONE, prefill), [0, 1], 20)
            # Before: the request waited for a stall (60 s here) and then failed with a TransferTimeout.
            assert consumer.wait_finished_receiving(WAIT_S), "the failed pull was never reported"
        outcome = consumer.take_finished_receiving()
        assert list(outcome) == ["r"]
        assert isinstance(outcome["r"], TransferError) and "ValueError: injected stamp failure" in str(outcome["r"])
        assert _logged(caplog, "pull of r from prefill.r0", "injected stamp failure")
    finally:
        close_sides(prefill, decode)


def test_a_served_pull_whose_end_fails_is_still_reported(monkeypatch: pytest.MonkeyPatch,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    """The end of a served pull runs on its last send's callback: if it raises, the request is still reported."""
    prefill = build_sides("prefill", ONE, GQA, CacheLayout.CPU, 16, "producer", hold_s=60.0)
    decode = build_sides("decode", ONE, GQA, CacheLayout.CPU, 16, "consumer")
    try:
        stats = prefill[0].engine._stats  # noqa: SLF001
        record_send = EngineStats.record_send

        def broken_record_send(self: EngineStats, *args: Any) -> None:
            if self is stats:
                raise ValueError("injected stats failure")
            record_send(self, *args)

        monkeypatch.setattr(EngineStats, "record_send", broken_record_send)
        with caplog.at_level(logging.ERROR, logger="ncclkv.engine"):
            start_pull("r", prefill, decode, 5, [0, 1], [0, 1], 20)
            # Before: held.serving never dropped, so the request was never reported (for hold_s and after).
            error = wait_sent(prefill[0], "r", timeout_s=WAIT_S)["r"]
        assert isinstance(error, TransferError) and "ValueError: injected stats failure" in str(error)
        assert _logged(caplog, "pull r from decode.r0", "injected stats failure")
        assert prefill[0].engine.num_in_flight == 0
    finally:
        close_sides(prefill, decode)


def test_submit_task_reports_an_escaped_error_once_and_logs_it(caplog: pytest.LogCaptureFixture) -> None:
    reported: list[BaseException] = []
    # The executor is left (its worker joined, the done-callbacks run) before the log level is restored.
    with caplog.at_level(logging.ERROR, logger="ncclkv.engine"), ThreadPoolExecutor(max_workers=1) as executor:
        def boom() -> None:
            raise ValueError("injected task failure")

        def refuse(error: BaseException) -> None:
            reported.append(error)
            raise RuntimeError("injected report failure")

        ok = submit_task(executor, "task ok", reported.append, lambda: None)
        failed = submit_task(executor, "task x", refuse, boom)
        assert ok.exception(timeout=WAIT_S) is None
        assert isinstance(failed.exception(timeout=WAIT_S), ValueError)
    assert [str(e) for e in reported] == ["injected task failure"]
    assert _logged(caplog, "task x failed", "ValueError: injected task failure")
    assert _logged(caplog, "task x: reporting its failure failed too", "injected report failure")
