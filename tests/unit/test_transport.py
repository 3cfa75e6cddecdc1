"""ncclkv.transport in one process: loopback links, and real gloo links between two data planes."""

from __future__ import annotations

import contextlib
import os
import random
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from ncclkv.auth import ChannelAuth
from ncclkv.errors import ClosedError, ShapeMismatchError, TransferError, TransferTimeout
from ncclkv.transport import (
    DataPlane,
    Link,
    LinkBase,
    LinkFactory,
    LoopbackHub,
    LoopbackTransport,
    loopback_pair,
)
from ncclkv.transport._base import check_link_args, split_address
from ncclkv.transport._framing import BATCH, EARLY_FLUSH_BYTES
from ncclkv.transport._pipe import Completed, Op, Pipe

from link_probes import open_both, sleepy_poster

WAIT_S = 10.0
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.uint8)


def sample(seq: int) -> torch.Tensor:
    """A tensor whose shape, dtype and bytes all depend on ``seq`` (seq 3 is empty, seq 5 a scalar)."""
    dtype = DTYPES[seq % len(DTYPES)]
    shape: tuple[int, ...] = (seq % 4 + 1, seq % 7 + 2) if seq % 2 else (seq * 13 % 97 + 1,)
    if seq == 3:
        shape = (0, 4)
    if seq == 5:
        shape = ()
    gen = torch.Generator().manual_seed(seq)
    raw = torch.randint(0, 256, (max(1, torch.Size(shape).numel()) * 8,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype)[: torch.Size(shape).numel()].reshape(shape).clone()


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


@pytest.fixture
def pair() -> Iterator[tuple[Link, Link]]:
    a, b = loopback_pair("unit", timeout_s=WAIT_S)
    yield a, b
    a.close()
    b.close()


def link_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("ncclkv-link-")]


def test_loopback_delivers_in_order_and_counts(pair: tuple[Link, Link]) -> None:
    a, b = pair
    sent = [sample(seq) for seq in range(30)]
    done_order: list[int] = []
    recvs, sends = [], []
    for seq, tensor in enumerate(sent):  # receives posted before, between and after the sends
        if seq % 3 == 0:
            recvs.append(b.recv(tensor.shape, tensor.dtype))
        sends.append(a.send(tensor))
        if seq % 3:
            recvs.append(b.recv(tensor.shape, tensor.dtype))
    for seq, fut in enumerate(recvs):
        fut.add_done_callback(lambda _f, seq=seq: done_order.append(seq))
    got = [fut.result(WAIT_S) for fut in recvs]
    assert all(same_bytes(x, y) for x, y in zip(got, sent, strict=True))
    assert done_order == sorted(done_order)
    nbytes = sum(t.numel() * t.element_size() for t in sent)
    for fut in sends:  # a send is counted when its own future settles, which may trail the receive
        fut.result(WAIT_S)
    sa, sb = a.stats(), b.stats()
    assert (sa.tensors_sent, sa.bytes_sent, sa.next_send_seq) == (30, nbytes, 30)
    assert (sb.tensors_received, sb.bytes_received, sb.next_recv_seq) == (30, nbytes, 30)
    assert isinstance(a, LinkBase) and a.backend_name == "loopback"


def test_recv_fills_out_in_place(pair: tuple[Link, Link]) -> None:
    a, b = pair
    out = torch.zeros(2, 3)
    fut = b.recv((2, 3), torch.float32, out=out)
    a.send(torch.arange(6.0).reshape(2, 3))
    assert fut.result(WAIT_S) is out and out[1, 2].item() == 5.0


def test_before_send_runs_in_order_right_before_the_data(pair: tuple[Link, Link]) -> None:
    a, b = pair
    recvs = [b.recv(sample(seq).shape, sample(seq).dtype) for seq in range(20)]
    hooks: list[tuple[int, bool]] = []
    sends = [a.send(sample(seq), before_send=lambda seq=seq: hooks.append((seq, recvs[seq].done()))) for seq in range(20)]
    for fut in sends:
        fut.result(WAIT_S)
    # Each hook ran in send order, and before its tensor reached the receiver
    # (an empty tensor never touches the wire: its receive completes alone).
    assert [seq for seq, _ in hooks] == list(range(20))
    assert [seq for seq, arrived in hooks if arrived] in ([], [3])


def test_a_placeholder_send_takes_its_buffer_only_when_posted() -> None:
    """A meta tensor queues the shape; the hook makes the real tensor when the link posts it (window of 1)."""
    a, b = loopback_pair("lazy", timeout_s=WAIT_S, max_in_flight=1)
    made: list[int] = []
    made_events = [threading.Event() for _ in range(3)]

    def make(seq: int) -> torch.Tensor:
        made.append(seq)
        made_events[seq].set()
        return torch.full((3, 2), float(seq))

    try:
        sends = [a.send(torch.empty((3, 2), device="meta"), before_send=lambda seq=seq: make(seq)) for seq in range(3)]
        # The poster makes the first buffer on its own thread: wait for it, or the check below races it.
        assert made_events[0].wait(WAIT_S), "the first buffer was never made"
        assert not made_events[1].wait(0.3), "the second buffer was made while the first send was still in flight"
        assert made == [0]
        got = [b.recv((3, 2), torch.float32).result(WAIT_S) for _ in range(3)]
        assert [t[0, 0].item() for t in got] == [0.0, 1.0, 2.0] and made == [0, 1, 2]
        assert [f.result(WAIT_S) for f in sends] == [None] * 3
        assert a.stats().bytes_sent == 3 * 6 * 4
    finally:
        a.close(), b.close()


@pytest.mark.parametrize("framed", [False, True], ids=["plain", "framed"])
@pytest.mark.parametrize("returned", ["wrong shape", "wrong dtype", "not contiguous", "nothing", "meta"])
def test_a_placeholder_hook_that_returns_the_wrong_tensor_breaks_the_link(returned: str, framed: bool) -> None:
    """The hook returned, so it may have announced its tensor (the producer's does) and the peer posted a
    receive for it: skipping the send would land the next tensor in that receive. The link breaks instead,
    with a typed error naming what the hook returned and what the placeholder promised."""
    bad, kind, what = {
        "wrong shape": (lambda: torch.ones(3), ShapeMismatchError, r"\(3,\) torch.float32 on cpu"),
        "wrong dtype": (lambda: torch.ones(2, dtype=torch.int32), ShapeMismatchError, r"\(2,\) torch.int32 on cpu"),
        "not contiguous": (lambda: torch.ones(4)[::2], ShapeMismatchError, r"\(2,\) torch.float32 on cpu, not contig"),
        "nothing": (lambda: None, TransferError, "NoneType"),
        "meta": (lambda: torch.empty(2, device="meta"), ShapeMismatchError, r"\(2,\) torch.float32 on meta"),
    }[returned]
    a, b = loopback_pair(f"bad-result-{framed}", timeout_s=WAIT_S, framed=framed)
    with a, b:
        announced: list[int] = []

        def announcing(seq: int, make: Callable[[], Any]) -> Callable[[], Any]:
            def hook() -> Any:
                announced.append(seq)  # what the producer's hook does before it returns its buffer
                return make()
            return hook

        # All asked for before the break, which would make a later call raise ClosedError itself: the peer's
        # receives (one per announcement, + one), then the sends, queued while the poster sleeps.
        got = [b.recv((2,), torch.float32) for _ in range(3)]
        with sleepy_poster(a):
            a.send(torch.empty(2, device="meta"), before_send=announcing(0, lambda: torch.full((2,), 1.0)))  # may land
            refused = a.send(torch.empty(2, device="meta"), before_send=announcing(1, bad))
            behind = a.send(torch.full((2,), 3.0))
        with pytest.raises(kind, match=rf"seq 1.*before_send returned {what}.*placeholder is \(2,\) torch.float32"):
            refused.result(WAIT_S)
        with pytest.raises(TransferError, match="seq 2.*the link broke"):
            behind.result(WAIT_S)
        start = time.monotonic()
        for receive in got[1:]:  # never the tensor behind the refused one; and the peer learns now, not at its deadline
            with pytest.raises((TransferError, ClosedError)):
                receive.result(WAIT_S)
        assert time.monotonic() - start < WAIT_S / 2
        assert announced == [0, 1] and isinstance(a.broken, kind) and a.closed


class PostedReceives:
    """Counts the receives ``link`` posts to its backend."""

    def __init__(self, link: Link) -> None:
        self._count, self._cond = 0, threading.Condition()
        backend = link._backend  # noqa: SLF001 - when a receive is posted is what these tests are about
        post = backend.post_recv

        def recording(tensor: torch.Tensor) -> Any:
            pending = post(tensor)
            with self._cond:
                self._count += 1
                self._cond.notify_all()
            return pending

        backend.post_recv = recording

    def wait_for(self, count: int, timeout_s: float = WAIT_S) -> bool:
        """Whether ``count`` receives were posted by ``timeout_s`` from now."""
        with self._cond:
            return self._cond.wait_for(lambda: self._count >= count, timeout_s)


def fill_sends(link: Link, shape: tuple[int, ...], count: int, fill: Callable[[int, torch.Tensor], None],
               hook: Callable[[int], None] | None = None) -> list[Any]:
    """``count`` placeholder sends of ``shape`` (float32): the hook runs ``hook(seq)`` (which may raise) and
    takes a buffer; the fill runs ``fill(seq, out)``, then writes seq into ``out``."""
    def taking(seq: int) -> torch.Tensor:
        if hook is not None:
            hook(seq)
        return torch.empty(shape)

    def filling(seq: int, out: torch.Tensor) -> None:
        fill(seq, out)
        out.fill_(float(seq))
    return [link.send(torch.empty(shape, device="meta"), before_send=lambda seq=seq: taking(seq),
                      fill=lambda out, seq=seq: filling(seq, out)) for seq in range(count)]


def check_fill_after_the_peers_receive(a: Link, b: Link) -> None:
    """Each fill of ``a`` runs once ``b`` posted the receive for that tensor: its header went out first.

    The tensors are EARLY_FLUSH_BYTES each, so every header goes at once, sends in flight or not.
    """
    shape = (EARLY_FLUSH_BYTES // 4 // 2, 2)
    posted = PostedReceives(b)
    recvs = [b.recv(shape, torch.float32) for _ in range(3)]
    seen: list[bool] = []
    sends = fill_sends(a, shape, 3, lambda seq, out: seen.append(posted.wait_for(seq + 1)))
    assert [f.result(WAIT_S)[0, 0].item() for f in recvs] == [0.0, 1.0, 2.0]
    assert [f.result(WAIT_S) for f in sends] == [None] * 3 and seen == [True] * 3


def check_fill_after_the_next_receive(a: Link, b: Link) -> None:
    """Small sends queued together: each fill runs once the peer posted the receive of its tensor and of the
    next one, whose header went out ahead of this tensor's bytes."""
    posted, count = PostedReceives(b), 4
    recvs = [b.recv((3, 2), torch.float32) for _ in range(count)]
    seen: list[bool] = []
    with sleepy_poster(a):  # all queued before the first is posted
        sends = fill_sends(a, (3, 2), count, lambda seq, out: seen.append(posted.wait_for(min(seq + 2, count), 5.0)))
    assert [f.result(WAIT_S)[0, 0].item() for f in recvs] == [float(seq) for seq in range(count)]
    assert [f.result(WAIT_S) for f in sends] == [None] * count and seen == [True] * count


@pytest.mark.parametrize("transport", ["loopback", "gloo"])
def test_a_fill_send_describes_the_next_queued_send_before_its_bytes(transport: str) -> None:
    if transport == "loopback":
        a, b = loopback_pair("ahead", timeout_s=WAIT_S, framed=True)
        with a, b:
            check_fill_after_the_next_receive(a, b)
        return
    with DataPlane() as p0, DataPlane() as p1:
        l0, l1 = open_both(p0, p1, "ahead", p0.address)
        check_fill_after_the_next_receive(l0, l1)


def hooked_fill_sends(link: Link, count: int, events: list[tuple[str, int]],
                      refuse: int | None = None) -> list[Any]:
    """``count`` placeholder sends of 2 floats whose hook and fill log (step, seq) in ``events``; the hook of
    send ``refuse`` raises."""
    def hook(seq: int) -> None:
        events.append(("hook", seq))
        if seq == refuse:
            raise OSError("no wire buffer left")
    return fill_sends(link, (2,), count, lambda seq, out: events.append(("fill", seq)), hook)


def check_next_hook_before_this_fill(a: Link, b: Link) -> None:
    events: list[tuple[str, int]] = []
    count = 4
    with sleepy_poster(a):  # all queued before the first is posted
        sends = hooked_fill_sends(a, count, events)
    got = [b.recv((2,), torch.float32) for _ in range(count)]
    assert [f.result(WAIT_S)[0].item() for f in got] == [float(seq) for seq in range(count)]
    assert [f.result(WAIT_S) for f in sends] == [None] * count
    assert sorted(events) == sorted([(step, seq) for seq in range(count) for step in ("hook", "fill")])
    for seq in range(count - 1):
        assert events.index(("hook", seq + 1)) < events.index(("fill", seq)), events


@pytest.mark.parametrize("transport", ["plain", "framed", "gloo"])
def test_the_next_sends_hook_runs_before_this_sends_fill(transport: str) -> None:
    """The producer's hook announces a piece: the next piece is announced while this one is gathered, so the
    consumer posts that receive before its bytes come, not a control round trip after. Each hook runs once."""
    if transport == "gloo":
        with DataPlane() as p0, DataPlane() as p1:
            check_next_hook_before_this_fill(*open_both(p0, p1, "hook-ahead", p0.address))
        return
    a, b = loopback_pair(f"hook-ahead-{transport}", timeout_s=WAIT_S, framed=transport == "framed")
    with a, b:
        check_next_hook_before_this_fill(a, b)


@pytest.mark.parametrize("transport", ["plain", "framed", "gloo"])
@pytest.mark.parametrize("mib", [0, 3])
def test_a_backlog_is_described_ahead_in_runs_up_to_a_batch_and_the_byte_bound(transport: str, mib: int) -> None:
    """Small queued sends are announced (hooks run) and described BATCH at a time: one header, and one wake-up
    of the peer, per run. Large ones (3 MiB: two would pass AHEAD_BYTES) still look one send ahead."""
    count = BATCH + 2
    shape = (mib << 18, 1) if mib else (2,)
    events: list[tuple[str, int]] = []

    def check(a: Link, b: Link) -> None:
        with sleepy_poster(a):  # all queued before the first is posted
            sends = fill_sends(a, shape, count, lambda seq, out: events.append(("fill", seq)),
                               lambda seq: events.append(("hook", seq)))
        got = [b.recv(shape, torch.float32) for _ in range(count)]
        assert [f.result(WAIT_S).flatten()[0].item() for f in got] == [float(seq) for seq in range(count)]
        assert [f.result(WAIT_S) for f in sends] == [None] * count

    if transport == "gloo":
        with DataPlane() as p0, DataPlane() as p1:
            check(*open_both(p0, p1, f"runs-{mib}", p0.address))
    else:
        a, b = loopback_pair(f"runs-{transport}-{mib}", timeout_s=WAIT_S, framed=transport == "framed")
        with a, b:
            check(a, b)
    hook, fill = (lambda seq: ("hook", seq)), (lambda seq: ("fill", seq))
    if mib:  # one ahead: each fill after the next send's hook
        expected = [hook(0), hook(1), fill(0)] + [e for seq in range(1, count - 1) for e in (hook(seq + 1), fill(seq))]
        expected.append(fill(count - 1))
    else:  # the first post announces the next BATCH - 1; the last of that run announces the rest
        expected = [hook(seq) for seq in range(BATCH)] + [fill(seq) for seq in range(BATCH - 1)]
        expected += [hook(BATCH), hook(BATCH + 1), fill(BATCH - 1), fill(BATCH), fill(BATCH + 1)]
    assert events == expected


@pytest.mark.parametrize("framed", [False, True], ids=["plain", "framed"])
def test_a_hook_run_ahead_that_fails_skips_only_its_send(framed: bool) -> None:
    """Run ahead, before anyone was told of its send, a failing hook fails that send alone, as at its turn."""
    a, b = loopback_pair(f"hook-ahead-fails-{framed}", timeout_s=WAIT_S, framed=framed)
    with a, b:
        events: list[tuple[str, int]] = []
        with sleepy_poster(a):
            sends = hooked_fill_sends(a, 3, events, refuse=1)
        got = [b.recv((2,), torch.float32) for _ in range(2)]
        with pytest.raises(TransferError, match="seq 1.*before_send failed, not sent.*no wire buffer left"):
            sends[1].result(WAIT_S)
        assert [f.result(WAIT_S)[0].item() for f in got] == [0.0, 2.0]
        assert sends[0].result(WAIT_S) is None and sends[2].result(WAIT_S) is None
        assert events.index(("hook", 1)) < events.index(("fill", 0)) and ("fill", 1) not in events
        assert a.broken is None and a.stats().tensors_sent == 2


def test_a_framed_fill_runs_after_the_peer_posted_its_receive() -> None:
    a, b = loopback_pair("fill-framed", timeout_s=WAIT_S, framed=True)
    with a, b:
        check_fill_after_the_peers_receive(a, b)


def test_a_gloo_fill_runs_after_the_peer_posted_its_receive() -> None:
    with DataPlane() as p0, DataPlane() as p1:
        l0, l1 = open_both(p0, p1, "fill", p0.address)
        check_fill_after_the_peers_receive(l0, l1)


def test_a_fill_writes_a_plain_tensor_on_an_unframed_link(pair: tuple[Link, Link]) -> None:
    a, b = pair
    sent = a.send(torch.zeros(4), fill=lambda out: out.add_(7.0))
    assert b.recv((4,), torch.float32).result(WAIT_S).tolist() == [7.0] * 4 and sent.result(WAIT_S) is None


@pytest.mark.parametrize("framed", [False, True], ids=["plain", "framed"])
def test_a_failing_fill_breaks_the_link_typed(framed: bool) -> None:
    """The peer was told the tensor comes: a fill that fails cannot skip it, so the link breaks on both ends."""
    a, b = loopback_pair(f"fill-fails-{framed}", timeout_s=WAIT_S, framed=framed)
    with a, b:
        def broken_gather(out: torch.Tensor) -> None:
            raise RuntimeError("gather kernel refused the slots")

        got = [b.recv((2,), torch.float32) for _ in range(3)]
        a.send(torch.ones(2))  # may land or fail with the link: the break aborts what is on the wire
        failed = a.send(torch.empty(2, device="meta"), before_send=lambda: torch.empty(2), fill=broken_gather)
        with pytest.raises(TransferError, match="seq 1.*fill failed.*gather kernel refused the slots"):
            failed.result(WAIT_S)
        start = time.monotonic()
        for receive in got[1:]:  # the peer's receives end too, and not at their deadline
            with pytest.raises((TransferError, ClosedError)):
                receive.result(WAIT_S)
        assert time.monotonic() - start < WAIT_S / 2
        assert isinstance(a.broken, TransferError) and a.closed
        with pytest.raises(ClosedError):
            a.send(torch.ones(2))


def test_post_queued_sends_runs_hooks_and_fills_on_the_callers_thread(pair: tuple[Link, Link]) -> None:
    """What the producer's finish relies on: queued hooked sends go out from the caller, up to the limit."""
    a, b = pair
    ran: list[tuple[str, int, str]] = []

    def hooks(seq: int) -> dict[str, Any]:
        def announce() -> torch.Tensor:
            ran.append(("hook", seq, threading.current_thread().name))
            return torch.empty(2)

        def fill(out: torch.Tensor) -> None:
            ran.append(("fill", seq, threading.current_thread().name))
            out.fill_(float(seq))
        return {"before_send": announce, "fill": fill}

    me = threading.current_thread().name
    with sleepy_poster(a):
        sends = [a.send(torch.empty(2, device="meta"), **hooks(seq)) for seq in range(3)]
        assert ran == []  # left to the poster, which sleeps
        a.post_queued_sends(2)
        # The first send's fill comes after the hooks of the queued sends behind it (the look-ahead), so the
        # third's hook ran here too.
        assert ran == [("hook", 0, me), ("hook", 1, me), ("hook", 2, me), ("fill", 0, me), ("fill", 1, me)]
        got = [b.recv((2,), torch.float32) for _ in range(3)]
        assert [f.result(WAIT_S)[0].item() for f in got[:2]] == [0.0, 1.0] and not got[2].done()
    # Woken, the poster posts the third.
    assert got[2].result(WAIT_S)[0].item() == 2.0 and [f.result(WAIT_S) for f in sends] == [None] * 3
    assert ran[-1][:2] == ("fill", 2) and ran[-1][2].endswith("-send-post")
    with pytest.raises(ValueError, match="limit must be an int >= 0"):
        a.post_queued_sends(-1)


def test_post_queued_sends_leaves_the_sends_to_a_poster_that_is_posting(pair: tuple[Link, Link]) -> None:
    a, b = pair
    in_hook, go_on = threading.Event(), threading.Event()
    hook_threads: list[str] = []

    def slow_hook() -> None:
        hook_threads.append(threading.current_thread().name)
        in_hook.set()
        assert go_on.wait(WAIT_S)

    first = a.send(torch.ones(2), before_send=slow_hook)
    assert in_hook.wait(WAIT_S)  # the poster holds the gate inside the first hook
    second = a.send(torch.full((2,), 2.0), before_send=lambda: hook_threads.append(threading.current_thread().name))
    start = time.monotonic()
    a.post_queued_sends(5)  # returns at once: another thread is posting
    assert time.monotonic() - start < 1.0 and len(hook_threads) == 1
    go_on.set()
    assert [b.recv((2,), torch.float32).result(WAIT_S)[0].item() for _ in range(2)] == [1.0, 2.0]
    first.result(WAIT_S), second.result(WAIT_S)
    assert all(name.endswith("-send-post") for name in hook_threads), hook_threads


def test_a_meta_tensor_without_a_hook_is_refused(pair: tuple[Link, Link]) -> None:
    a, _ = pair
    with pytest.raises(ValueError, match="placeholder; before_send must return"):
        a.send(torch.empty((2, 2), device="meta"))
    assert a.stats().tensors_sent == 0 and a.broken is None


class _PausingGate:
    """The pipe's gate, holding its poster right after it releases the gate, until the test lets it go on."""

    def __init__(self, poster: threading.Thread) -> None:
        self._lock, self._poster = threading.Lock(), poster
        self.armed, self.released, self.go_on = False, threading.Event(), threading.Event()

    def acquire(self, blocking: bool = True) -> bool:
        return self._lock.acquire(blocking)

    def release(self) -> None:
        self._lock.release()
        if self.armed and threading.current_thread() is self._poster:
            self.armed = False
            self.released.set()
            assert self.go_on.wait(WAIT_S)

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def test_a_header_left_for_the_poster_is_flushed_when_the_caller_posts_as_the_poster_goes_to_sleep() -> None:
    """The race found by bench overlap: the poster found nothing to flush and released the gate; before it
    went to sleep the caller posted a send inline and left its header (grace period) to the poster with a
    wake-up that nobody was waiting for. The poster must not then sleep until the next send."""
    a, b = loopback_pair("lost-wake", timeout_s=WAIT_S, framed=True)
    try:
        pipe = a._pipes[0]  # noqa: SLF001 - the interleaving is inside the pipe
        gate = _PausingGate(pipe._threads[0])  # noqa: SLF001
        first = a.send(torch.full((4,), 1.0))  # its header goes at once; it stays in flight (no receive yet)
        pipe._gate = gate  # noqa: SLF001
        gate.armed = True
        pipe._wake_poster()  # noqa: SLF001 - one more round of the poster: idle, release the gate, pause
        assert gate.released.wait(WAIT_S)
        # Posted on this thread; with the first send in flight its header waits for the grace period,
        # which the poster (paused between the gate and its sleep) must honour.
        second = a.send(torch.full((4,), 2.0))
        gate.go_on.set()
        assert b.recv((4,), torch.float32).result(WAIT_S).tolist() == [1.0] * 4
        first.result(WAIT_S)  # the second stays in flight: no completion wakes the poster for it
        got = b.recv((4,), torch.float32).result(5.0)  # its header must come without a third send
        assert got.tolist() == [2.0] * 4
        second.result(WAIT_S)
    finally:
        a.close(), b.close()


def test_bounded_number_of_posted_sends() -> None:
    a, b = loopback_pair("bounded", timeout_s=WAIT_S, max_in_flight=2)
    hooks: list[int] = []
    posted = [threading.Event() for _ in range(5)]

    def hook(seq: int) -> None:
        hooks.append(seq)
        posted[seq].set()

    sends = [a.send(torch.full((1,), float(seq)), before_send=lambda seq=seq: hook(seq)) for seq in range(5)]
    # The poster posts the first two on its own thread: wait for them, or the check below races it.
    assert posted[0].wait(WAIT_S) and posted[1].wait(WAIT_S), "the first two sends were never posted"
    assert not posted[2].wait(0.3), "a third send was posted while two were unmatched"
    assert hooks == [0, 1]
    b.recv((1,), torch.float32).result(WAIT_S)  # completes send 0, which frees one slot
    assert posted[2].wait(WAIT_S) and hooks == [0, 1, 2]
    for _ in range(4):
        b.recv((1,), torch.float32)
    assert [f.result(WAIT_S) for f in sends] == [None] * 5
    a.close(), b.close()


def record_post_threads(link: Link, method: str = "post_send") -> list[str]:
    """The name of the thread that posted each of ``link``'s sends (or receives) to its backend, in post order."""
    names: list[str] = []
    backend = link._backend  # noqa: SLF001 - the thread that posts is what these tests are about
    post = getattr(backend, method)

    def recording(tensor: torch.Tensor) -> Any:
        names.append(threading.current_thread().name)
        return post(tensor)

    setattr(backend, method, recording)
    return names


@pytest.mark.parametrize("framed", [False, True], ids=["plain", "framed"])
def test_a_receive_is_posted_on_the_callers_thread_unless_it_waits_for_a_header(framed: bool) -> None:
    a, b = loopback_pair(f"inline-recv-{framed}", timeout_s=WAIT_S, framed=framed, max_in_flight=2)
    with a, b:
        posted = record_post_threads(b, "post_recv")
        recvs = [b.recv((2,), torch.float32) for _ in range(3)]  # the third waits for room
        sends = [a.send(torch.full((2,), float(seq))) for seq in range(3)]
        assert [f.result(WAIT_S)[0].item() for f in recvs] == [0.0, 1.0, 2.0]
        assert all(f.result(WAIT_S) is None for f in sends) and len(posted) == 3
        if framed:  # each receive waited for its header on the link's receive thread
            assert all(name.endswith("-recv-post") for name in posted), posted
        else:
            assert posted[:2] == [threading.current_thread().name] * 2 and posted[2].endswith("-recv-post"), posted


@pytest.mark.parametrize("framed", [False, True], ids=["plain", "framed"])
def test_a_send_without_hook_is_posted_on_the_callers_thread(framed: bool) -> None:
    a, b = loopback_pair(f"inline-{framed}", timeout_s=WAIT_S, framed=framed)
    with a, b:
        posted = record_post_threads(a)
        hooked = threading.Event()
        sends = [a.send(torch.full((4,), 1.0)), a.send(torch.full((4,), 2.0), before_send=hooked.set),
                 a.send(torch.full((4,), 3.0))]
        recvs = [b.recv((4,), torch.float32) for _ in sends]
        assert [f.result(WAIT_S)[0].item() for f in recvs] == [1.0, 2.0, 3.0]
        assert all(f.result(WAIT_S) is None for f in sends) and hooked.is_set()
        me = threading.current_thread().name
        # The hooked send runs on the poster; the one behind it waits its turn there.
        assert posted[0] == me and posted[1].endswith("-send-post"), posted


def test_a_full_window_leaves_sends_to_the_poster_in_order() -> None:
    a, b = loopback_pair("inline-full", timeout_s=WAIT_S, max_in_flight=1)
    with a, b:
        posted = record_post_threads(a)
        sends = [a.send(torch.full((2,), float(seq))) for seq in range(3)]
        assert posted == [threading.current_thread().name]  # the others wait for room
        got = [b.recv((2,), torch.float32).result(WAIT_S)[0].item() for _ in range(3)]
        assert got == [0.0, 1.0, 2.0] and all(f.result(WAIT_S) is None for f in sends)
        assert len(posted) == 3 and all(name.endswith("-send-post") for name in posted[1:]), posted


def test_a_header_left_by_a_send_on_the_callers_thread_is_flushed_by_the_poster() -> None:
    # The first send's header goes at once (nothing else in flight); the second joins a
    # part-full batch, which the woken poster flushes after the grace period. Without that
    # wake, the second receive would never be posted.
    a, b = loopback_pair("inline-grace", framed=True, timeout_s=WAIT_S)
    with a, b:
        posted = record_post_threads(a)
        first, second = a.send(torch.ones(3)), a.send(torch.full((3,), 2.0))
        assert posted == [threading.current_thread().name] * 2
        r0, r1 = b.recv((3,), torch.float32), b.recv((3,), torch.float32)
        assert r0.result(WAIT_S).tolist() == [1.0] * 3 and r1.result(WAIT_S).tolist() == [2.0] * 3
        assert first.result(WAIT_S) is None and second.result(WAIT_S) is None


def test_sends_from_many_threads_keep_each_threads_order() -> None:
    # Callers race for the posting gate with each other and with the poster (a window of 3,
    # every fifth send hooked): every tensor arrives once, each thread's in its call order.
    threads, per_thread = 4, 60
    a, b = loopback_pair("inline-race", framed=True, timeout_s=WAIT_S, max_in_flight=3)
    with a, b:
        recvs = [b.recv((1,), torch.int64) for _ in range(threads * per_thread)]
        start = threading.Barrier(threads)

        def sender(worker: int) -> list[Any]:
            start.wait(WAIT_S)
            hook = None
            return [a.send(torch.tensor([worker * 1000 + i]), before_send=hook if i % 5 else (lambda: None))
                    for i in range(per_thread)]

        with ThreadPoolExecutor(threads) as pool:
            sends = [f for batch in pool.map(sender, range(threads)) for f in batch]
        got = [f.result(WAIT_S).item() for f in recvs]
        assert all(f.result(WAIT_S) is None for f in sends)
        assert sorted(got) == sorted(w * 1000 + i for w in range(threads) for i in range(per_thread))
        for worker in range(threads):
            mine = [v for v in got if v // 1000 == worker]
            assert mine == sorted(mine), f"thread {worker}'s sends arrived out of order"
        assert a.broken is None and b.broken is None


def test_close_fails_pending_futures_and_joins_threads() -> None:
    a, b = loopback_pair("closing", timeout_s=WAIT_S)
    pending = [b.recv((3,), torch.float32) for _ in range(3)]
    b.close()
    for fut in pending:
        with pytest.raises(ClosedError, match="link 'closing' recv seq"):
            fut.result(1.0)
    with pytest.raises(TransferError, match="closed by link rank 1"):  # the peer learns at its next transfer
        a.send(torch.ones(3)).result(WAIT_S)
    assert isinstance(a.broken, TransferError)
    with pytest.raises(ClosedError):
        b.recv((3,), torch.float32)
    a.close()
    with pytest.raises(ClosedError):
        a.send(torch.ones(1))
    assert link_threads() == []


def test_timeout_is_typed_and_breaks_the_link(pair: tuple[Link, Link]) -> None:
    a, b = pair
    late = b.recv((4,), torch.int32, timeout_s=0.2)
    behind = b.recv((4,), torch.int32)
    start = time.monotonic()
    with pytest.raises(TransferTimeout, match=r"link 'unit' recv seq 0 shape \(4,\) torch.int32.*0.2 s"):
        late.result(WAIT_S)
    assert time.monotonic() - start < 2.0
    with pytest.raises(TransferError, match="seq 1.*the link broke"):
        behind.result(WAIT_S)
    assert isinstance(b.broken, TransferTimeout)
    with pytest.raises(ClosedError, match="broken"):
        b.recv((4,), torch.int32)
    # The peer learns at its next transfer, from the broken side's close (not from its own op timeout).
    with pytest.raises(TransferError, match=r"send seq 0 .*closed by link rank 1"):
        a.send(torch.zeros(4, dtype=torch.int32)).result(WAIT_S)


def test_shape_mismatch_is_typed(pair: tuple[Link, Link]) -> None:
    a, b = pair
    a.send(torch.zeros(2, 3))
    with pytest.raises(ShapeMismatchError, match=r"sent \(2, 3\) torch.float32, receive posted for \(3, 2\)"):
        b.recv((3, 2), torch.float32).result(WAIT_S)


def test_bad_arguments_are_value_errors(pair: tuple[Link, Link]) -> None:
    a, b = pair
    with pytest.raises(ValueError, match="not contiguous"):
        a.send(torch.zeros(4, 4).t())
    with pytest.raises(ValueError, match=r"out is \(2,\) torch.float32, receive announced \(3,\)"):
        b.recv((3,), torch.float32, out=torch.zeros(2))
    with pytest.raises(ValueError, match="timeout_s"):
        a.send(torch.zeros(1), timeout_s=0)
    with pytest.raises(TypeError):
        a.send([1, 2])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="link_id"):
        loopback_pair("has space")
    with pytest.raises(ValueError, match="meta"):
        loopback_pair("ok", device="meta")
    with DataPlane() as plane:
        with pytest.raises(ValueError, match="link_rank must be 0 or 1"):
            plane.open_link("x", 2, plane.address, "cpu", 1.0)
        # 1.0 == 1, but the rendezvous keys spell the rank ("joined/1.0"): taken, it met no peer and both ends
        # waited out their deadline, the error naming "link rank 0.0" as the peer.
        for rank in (1.0, 0.0, True):
            with pytest.raises(ValueError, match=rf"link_rank must be 0 or 1, got {rank!r}"):
                plane.open_link("x", rank, plane.address, "cpu", 1.0)  # type: ignore[arg-type]
        assert plane.links() == []
        with pytest.raises(ValueError, match="host:port"):
            plane.open_link("x", 0, "no-port", "cpu", 1.0)


def test_loopback_transport_meets_by_store_address_and_id() -> None:
    hub = LoopbackHub()
    left, right = LoopbackTransport(hub), LoopbackTransport(hub)
    assert isinstance(left, LinkFactory)
    with ThreadPoolExecutor(2) as pool:
        f0 = pool.submit(left.open_link, "m1", 0, right.address, "cpu", WAIT_S)
        f1 = pool.submit(right.open_link, "m1", 1, right.address, "cpu", WAIT_S)
        l0, l1 = f0.result(WAIT_S), f1.result(WAIT_S)
    l0.send(torch.arange(3))
    assert l1.recv((3,), torch.int64).result(WAIT_S).tolist() == [0, 1, 2]
    with pytest.raises(ValueError, match="already used"):
        left.open_link("m1", 0, right.address, "cpu", 0.2)
    start = time.monotonic()
    with pytest.raises(TransferTimeout, match="'m2'.*store loopback:2"):
        left.open_link("m2", 0, right.address, "cpu", 0.3)
    assert time.monotonic() - start < 2.0
    left.close(), right.close()
    assert l0.closed and l1.closed and link_threads() == []


@pytest.mark.parametrize("make", [DataPlane, LoopbackTransport], ids=["data_plane", "loopback"])
def test_both_transports_check_open_link_the_same_way(make: Callable[[], DataPlane | LoopbackTransport]) -> None:
    transport = make()
    try:
        with pytest.raises(ValueError, match=r"op_timeout_s must be a finite number of seconds > 0 \(at most 1e\+09\), got 0"):
            transport.open_link("t1", 0, transport.address, "cpu", 1.0, op_timeout_s=0)
        assert transport.links() == []
    finally:
        transport.close()
    with pytest.raises(ClosedError, match=f"{transport.kind} {transport.address} is closed"):
        transport.open_link("t2", 0, transport.address, "cpu", 1.0)


# -- real gloo links between two data planes in this process -----------------


def listening_sockets() -> dict[str, tuple[str, int]]:
    """Socket inode -> (IPv4 address, port), for this process's listening TCP sockets (from /proc; Linux only)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    found = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as fh:
            for line in fh.readlines()[1:]:
                cols = line.split()
                if cols[3] == "0A" and cols[9] in inodes:  # LISTEN
                    raw, port = cols[1].split(":")
                    host = ".".join(str(int(raw[i : i + 2], 16)) for i in (6, 4, 2, 0)) if len(raw) == 8 else raw
                    found[cols[9]] = (host, int(port, 16))
    return found


def test_gloo_links_between_two_data_planes() -> None:
    before = listening_sockets()
    with DataPlane() as p0, DataPlane() as p1:
        assert p0.address.startswith("127.0.0.1:") and p0.address != p1.address
        l0, l1 = open_both(p0, p1, "g1", p0.address)
        m0, m1 = open_both(p0, p1, "g2", p1.address)  # hosted by the other plane's store
        assert l0.backend_name == "gloo" and len(p0.links()) == 2
        # Two store servers and the planes' gloo listeners, all bound to the bind host only.
        ours = [host for inode, (host, _) in listening_sockets().items() if inode not in before]
        assert len(ours) >= 3 and set(ours) == {"127.0.0.1"}
        sent = [sample(seq) for seq in range(12)]
        sends = [l0.send(t) for t in sent] + [m1.send(t) for t in sent]
        got = [l1.recv(t.shape, t.dtype) for t in sent] + [m0.recv(t.shape, t.dtype) for t in sent]
        assert all(same_bytes(f.result(WAIT_S), t) for f, t in zip(got, sent + sent, strict=True))
        assert all(f.result(WAIT_S) is None for f in sends)
        back = l0.recv((2,), torch.float64)
        l1.send(torch.tensor([1.5, -2.0], dtype=torch.float64))
        assert back.result(WAIT_S).tolist() == [1.5, -2.0]
        with pytest.raises(ValueError, match="already open"):
            p0.open_link("g1", 0, p0.address, "cpu", 1.0)
        with pytest.raises(ValueError, match="already joined"):  # a closed id cannot be reused either
            l0.close()
            p0.open_link("g1", 0, p0.address, "cpu", 1.0)
    assert link_threads() == [] and p0.links() == []


def test_link_creation_deadline_names_link_and_store() -> None:
    with DataPlane() as plane:
        start = time.monotonic()
        with pytest.raises(TransferTimeout, match=rf"link 'lonely' \(link rank 0, store {plane.address}\)"):
            plane.open_link("lonely", 0, plane.address, "cpu", 0.5)
        assert time.monotonic() - start < 0.5 + 1.0
        assert plane.links() == []


def test_closing_a_gloo_link_fails_pending_ops_on_both_ends_at_once() -> None:
    with DataPlane() as p0, DataPlane() as p1:
        l0, l1 = open_both(p0, p1, "c1", p0.address)
        k0, k1 = open_both(p0, p1, "other", p0.address)  # same planes, same gloo devices
        mine, theirs = l0.recv((8,), torch.float32), l1.recv((8,), torch.float32)
        start = time.monotonic()
        l0.close()
        with pytest.raises(ClosedError):
            mine.result(1.0)
        with pytest.raises(TransferError, match="'c1' recv seq 0.*(closed|reset) by peer"):  # gloo: FIN or RST
            theirs.result(WAIT_S)
        assert time.monotonic() - start < 2.0  # not the 10 s operation deadline
        # The other link is unaffected, and the same two planes can link again under a new id.
        n0, n1 = open_both(p0, p1, "c1.1", p1.address)
        for a, b in ((k0, k1), (n1, n0)):
            a.send(torch.arange(4.0))
            assert b.recv((4,), torch.float32).result(WAIT_S).tolist() == [0.0, 1.0, 2.0, 3.0]


def test_posted_bytes_are_bounded_but_one_large_tensor_always_goes() -> None:
    a, b = loopback_pair("bounded-bytes", timeout_s=WAIT_S, max_in_flight=64, max_in_flight_bytes=1000)
    sizes = [2000, 100, 100, 900]  # the first exceeds the bound alone; then 100 + 100 fit, + 900 does not
    hooks: list[int] = []
    posted = [threading.Event() for _ in sizes]

    def hook(seq: int) -> None:
        hooks.append(seq)
        posted[seq].set()

    sends = [a.send(torch.zeros(n, dtype=torch.uint8), before_send=lambda seq=seq: hook(seq)) for seq, n in enumerate(sizes)]
    assert posted[0].wait(WAIT_S), "a tensor larger than the byte bound was never posted"
    assert not posted[1].wait(0.3), "a second tensor was posted next to one over the byte bound"
    b.recv((2000,), torch.uint8).result(WAIT_S)  # completes send 0
    assert posted[2].wait(WAIT_S) and not posted[3].wait(0.3), "900 bytes were posted next to 200 (bound 1000)"
    assert hooks == [0, 1, 2]
    for n in sizes[1:]:
        b.recv((n,), torch.uint8).result(WAIT_S)
    assert [f.result(WAIT_S) for f in sends] == [None] * 4 and hooks == [0, 1, 2, 3]
    a.close(), b.close()


# -- data-plane links and authentication (issue 9) ----------------------------------------------
# The engine names each link ChannelAuth.link_id(a, b, session); the two ends meet under that
# id in a TCPStore any process can reach.

SECRET = b"k" * 32
A, B, SESSION = "prefill.r0", "decode.r0", "0123456789abcdef0123456789abcdef"


def test_link_ids_are_keyed_by_the_shared_secret() -> None:
    keyed, public = ChannelAuth(shared_secret=SECRET), ChannelAuth()
    assert keyed.link_id(A, B, SESSION) == keyed.link_id(B, A, SESSION)  # both ends agree
    assert keyed.link_id(A, B, SESSION) != public.link_id(A, B, SESSION)  # the session alone does not name it
    assert keyed.link_id(A, B, SESSION) != ChannelAuth(shared_secret=b"j" * 32).link_id(A, B, SESSION)
    assert keyed.link_id(A, B, SESSION) != keyed.link_id(A, B, SESSION[::-1])
    check_link_args(keyed.link_id(A, B, SESSION), 0, "cpu", 1.0)  # a valid link id


def _squat(store_addr: str, link_id: str, link_rank: int) -> Any:
    """What a process that saw the session does: take ``link_rank`` of ``link_id`` before its owner."""
    host, port = split_address(store_addr)
    client = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=WAIT_S))
    prefixed = dist.PrefixStore(f"ncclkv/{link_id}", client)
    assert prefixed.add(f"joined/{link_rank}", 1) == 1
    prefixed.set(f"backend/{link_rank}", "gloo")
    return client


def test_a_process_that_saw_the_session_cannot_take_a_keyed_link() -> None:
    """The squatter computes the id from the session (all it can) and joins link rank 0 first.

    Without a secret that is the real id: the owner of rank 0 is refused and its peer waits
    for a gloo end that never comes. With the secret the real link opens and carries data.
    """
    with DataPlane() as p0, DataPlane() as p1:
        sniffed = ChannelAuth().link_id(A, B, SESSION)
        squatter = _squat(p0.address, sniffed, 0)
        with ThreadPoolExecutor(2) as pool:
            f0 = pool.submit(p0.open_link, sniffed, 0, p0.address, "cpu", 2.0)
            f1 = pool.submit(p1.open_link, sniffed, 1, p0.address, "cpu", 2.0)
            with pytest.raises(ValueError, match="link rank 0 already joined"):
                f0.result(WAIT_S)
            with pytest.raises((TransferTimeout, TransferError), match=rf"link '{sniffed}' \(link rank 1"):
                f1.result(WAIT_S)

        keyed = ChannelAuth(shared_secret=SECRET).link_id(A, B, SESSION)
        _squat(p0.address, ChannelAuth().link_id(B, A, SESSION[::-1]), 0)  # and any other guess
        l0, l1 = open_both(p0, p1, keyed, p0.address)
        sent = sample(7)
        got = l1.recv(sent.shape, sent.dtype)
        assert l0.send(sent).result(WAIT_S) is None and same_bytes(got.result(WAIT_S), sent)
        del squatter
    assert link_threads() == []


def test_a_store_client_lists_a_keyed_link_and_takes_its_other_rank() -> None:
    """The keyed id keeps a squatter from joining a link before both owners, but not after the first: any
    client of the TCPStore can list its keys (``TCPStore.list_keys``), read the id there once one owner joined,
    and join the other rank first. The owner then sends its KV to that client, and the real peer is refused.
    docs/SECURITY.md ("The data plane") says so: only a trusted network keeps store clients out."""
    keyed = ChannelAuth(shared_secret=SECRET).link_id(A, B, SESSION)
    with DataPlane() as p0, DataPlane() as p1, DataPlane() as p2:
        host, port = split_address(p0.address)
        outsider = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=WAIT_S))
        with ThreadPoolExecutor(3) as pool:
            f0 = pool.submit(p0.open_link, keyed, 0, p0.address, "cpu", WAIT_S)
            listed: list[str] = []
            deadline = time.monotonic() + WAIT_S
            while not listed and time.monotonic() < deadline:  # what the owner of rank 0 wrote, names and all
                listed = [key.split("/")[1] for key in outsider.list_keys() if key.endswith("/joined/0")]
            assert listed == [keyed]
            squatter = pool.submit(p2.open_link, listed[0], 1, p0.address, "cpu", WAIT_S)
            l0, taken = f0.result(WAIT_S), squatter.result(WAIT_S)
            with pytest.raises(ValueError, match="link rank 1 already joined"):
                p1.open_link(keyed, 1, p0.address, "cpu", WAIT_S)
            sent = sample(3)
            got = taken.recv(sent.shape, sent.dtype)
            assert l0.send(sent).result(WAIT_S) is None and same_bytes(got.result(WAIT_S), sent)
        del outsider
    assert link_threads() == []


def test_garbage_on_the_data_plane_ports_breaks_nothing() -> None:
    """Random bytes to every port the planes listen on (their TCPStores, gloo's listeners):
    the process lives, an open link still carries data, and a new link still opens."""
    before = set(listening_sockets())
    with DataPlane() as p0, DataPlane() as p1:
        l0, l1 = open_both(p0, p1, "g-before", p0.address)
        ports = [port for inode, (_, port) in listening_sockets().items() if inode not in before]
        assert len(ports) >= 3, ports  # two stores, at least one gloo listener
        rng = random.Random(9)
        for port in ports:
            for size in (1, 7, 64, 4096, 65536) * 4:
                with socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as sock:
                    sock.sendall(rng.randbytes(size))
        sent = sample(11)
        got = l1.recv(sent.shape, sent.dtype)
        assert l0.send(sent).result(WAIT_S) is None and same_bytes(got.result(WAIT_S), sent)
        m0, m1 = open_both(p0, p1, "g-after", p1.address)
        back = m0.recv((3,), torch.int64)
        m1.send(torch.tensor([1, 2, 3]))
        assert back.result(WAIT_S).tolist() == [1, 2, 3]
    assert link_threads() == []



def test_a_hook_run_ahead_that_fails_after_the_pipe_stopped_ends_the_run_quietly() -> None:
    """A link closed from under the look-ahead (stop() took its queue) must not make the poster raise."""
    pipe = Pipe("ahead-stop", lambda op: Completed(), lambda op: None, lambda op, exc: None, 8, 1 << 30)
    try:
        def hook(seq: int) -> Callable[[], torch.Tensor]:
            def run() -> torch.Tensor:
                if seq == 1:
                    pipe.stop()  # what a close on another thread does meanwhile
                    raise OSError("no wire buffer left")
                return torch.empty(4)
            return run

        ops = [Op(f"op {seq}", torch.empty(4, device="meta"), Future(), WAIT_S, before_send=hook(seq),
                  fill=lambda out: None) for seq in range(3)]
        with pipe._gate:  # noqa: SLF001 - only the gate holder looks ahead; the poster must not take the ops
            for op in ops:
                pipe.submit(op, wake=False)
            ahead = pipe.prepare_ahead(True, BATCH - 1, 1 << 20)
        assert ahead == [ops[0]] and ops[0].ahead and ops[0].described and ops[0].tensor.device.type == "cpu"
        with pytest.raises(TransferError, match="op 1: before_send failed, not sent.*no wire buffer left"):
            ops[1].future.result(WAIT_S)
        assert not ops[2].ahead  # the run ended at the failed hook
    finally:
        pipe.stop()
        assert pipe.join(WAIT_S)
