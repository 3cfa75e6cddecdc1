"""ncclkv._clock.ActiveClock: pauses of the owning loop are left out of deadlines."""

from __future__ import annotations

import threading
import time

import pytest

from ncclkv._clock import ActiveClock

from fake_time import FakeTime


def test_ordinary_turns_count_no_pause() -> None:
    now = FakeTime()
    clock = ActiveClock(0.1, monotonic=now)
    for _ in range(20):
        assert clock.tick().paused_s == 0.0
        now.t += 0.5  # slow turns, still under the threshold
    assert clock.paused_s == 0.0 and clock.pauses == 0
    assert clock.now() == now.t


def test_a_late_turn_is_a_pause_left_out_of_now() -> None:
    now = FakeTime()
    clock = ActiveClock(0.1, threshold_s=1.0, monotonic=now)
    clock.tick()
    now.t += 7.1
    turn = clock.tick()
    assert turn.paused_s == pytest.approx(7.0) and turn.now == pytest.approx(now.t - 7.0)
    assert clock.pauses == 1 and clock.paused_s == pytest.approx(7.0)
    assert clock.now() == pytest.approx(now.t - 7.0)


def test_wait_extends_by_a_pause_counted_while_waiting() -> None:
    now = FakeTime()
    clock = ActiveClock(0.1, threshold_s=1.0, monotonic=now)
    clock.tick()
    calls: list[float] = []

    def attempt(seconds: float) -> bool:
        calls.append(seconds)
        if len(calls) == 1:  # we "slept" 5 s, of which the loop saw 4.9 s as a pause
            now.t += 5.0
            clock.tick()
            return False
        return True

    assert clock.wait(attempt, 2.0)
    assert calls[0] == pytest.approx(2.0) and calls[1] == pytest.approx(1.9)


def test_wait_times_out_on_active_time() -> None:
    now = FakeTime()
    clock = ActiveClock(0.1, monotonic=now)
    clock.stop()  # no loop: settle() must not wait for a turn

    def attempt(seconds: float) -> bool:
        now.t += seconds
        return False

    assert not clock.wait(attempt, 2.0)
    assert now.t == pytest.approx(102.0)


def test_settle_waits_for_the_next_turn() -> None:
    clock = ActiveClock(0.05)
    clock.tick()
    started = time.monotonic()
    clock.settle(timeout_s=0.2)  # no turn comes: it gives up at its timeout
    assert time.monotonic() - started >= 0.2
    done = threading.Event()
    thread = threading.Thread(target=lambda: (clock.settle(timeout_s=30.0), done.set()))
    thread.start()
    deadline = time.monotonic() + 10.0
    while not done.wait(0.01) and time.monotonic() < deadline:
        clock.tick()  # the loop turning
    thread.join(5.0)
    assert done.is_set()


def test_bad_ticks_are_refused() -> None:
    with pytest.raises(ValueError, match="tick_s=0"):
        ActiveClock(0)
    with pytest.raises(ValueError, match="threshold_s=0.1"):
        ActiveClock(0.5, threshold_s=0.1)
    with pytest.raises(ValueError, match="tick_s=nan"):
        ActiveClock(float("nan"))


@pytest.mark.parametrize("timeout_s", [float("nan"), float("inf"), -1.0])
def test_a_wait_without_a_deadline_is_refused(timeout_s: float) -> None:
    """nan never expires (the wait used to spin on a zero-second attempt forever), inf is no deadline."""
    clock = ActiveClock(0.05)
    release = threading.Event()
    outcome: list[BaseException | bool] = []

    def wait() -> None:
        try:
            outcome.append(clock.wait(release.wait, timeout_s))
        except ValueError as exc:
            outcome.append(exc)

    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    try:
        waiter.join(5)
        assert len(outcome) == 1 and isinstance(outcome[0], ValueError), outcome
        assert f"timeout_s must be a finite number >= 0, got {timeout_s!r}" in str(outcome[0])
    finally:
        release.set()  # frees a waiter that did not refuse
        waiter.join(5)


def test_a_pause_counted_late_still_extends_a_deadline_read_during_it() -> None:
    """A waiter that woke during a pause, before the loop counted it, still gets the pause back."""
    now = FakeTime()
    clock = ActiveClock(0.1, threshold_s=1.0, monotonic=now)
    clock.tick()
    deadline = clock.now() + 2.0
    now.t += 5.0  # the whole process stopped for 5 s
    assert clock.now() > deadline  # read before the loop turned
    clock.tick()  # the loop counts the pause
    assert clock.now() < deadline
