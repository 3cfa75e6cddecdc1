"""ncclkv.transport when things go wrong: callbacks, refused hooks, bad timeouts and windows, peers that clash."""

from __future__ import annotations

import os
import re
import threading
import time
import contextlib
from contextlib import closing
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from ncclkv._env import env_settings
from ncclkv._timeout import MAX_TIMEOUT_S
from ncclkv.errors import CapacityError, ClosedError, HandshakeError, ShapeMismatchError, TransferError, TransferTimeout
from ncclkv.transport import DataPlane, Link, LoopbackHub, LoopbackTransport, loopback_pair
from ncclkv.transport import _opener
from ncclkv.transport._base import split_address
from ncclkv.transport._pipe import Completed

from link_probes import open_both, sleepy_poster

WAIT_S = 10.0


class _PostsAtOnce:
    """A backend whose posts complete at once and whose abort only says it was called."""

    name = "fake"

    def __init__(self) -> None:
        self.aborted = threading.Event()

    def post_send(self, tensor: torch.Tensor) -> Completed:
        return Completed()

    def post_recv(self, tensor: torch.Tensor) -> Completed:
        return Completed()

    def framing(self) -> None:
        return None

    def abort(self) -> None:
        self.aborted.set()

    def release(self) -> None:
        return None


def test_a_done_callback_may_call_into_the_link_when_a_close_lands_during_the_post() -> None:
    """close() stops the pipe while the poster is inside a send's post; that send's future then fails with
    ClosedError, and its callback (which takes the link's locks, as the engine's do) must run without the
    pipe's lock held, or the poster deadlocks on itself."""
    backend = _PostsAtOnce()
    link = Link("cb-close", 0, torch.device("cpu"), backend, timeout_s=2.0)
    in_fill, go_on = threading.Event(), threading.Event()

    def fill(out: torch.Tensor) -> None:
        in_fill.set()
        assert go_on.wait(WAIT_S)

    sent = link.send(torch.empty(4), fill=fill)  # a send with a fill goes to the poster
    assert in_fill.wait(WAIT_S)
    seen: list[int] = []
    called = threading.Event()

    def on_done(_future: Any) -> None:
        seen.append(link.stats().in_flight_sends)
        called.set()

    sent.add_done_callback(on_done)
    closer = threading.Thread(target=link.close, name="test-closer", daemon=True)
    closer.start()
    assert backend.aborted.wait(WAIT_S)  # close() stopped the pipes before it aborted the backend
    go_on.set()  # the post completes after the stop
    assert called.wait(WAIT_S), "the send's callback never ran: the poster holds the pipe's lock"
    with pytest.raises(ClosedError, match="seq 0.*the link is closed"):
        sent.result(WAIT_S)
    closer.join(WAIT_S)
    assert not closer.is_alive() and seen == [0]


@pytest.mark.parametrize("backend", ["loopback", "gloo"])
def test_closing_the_link_from_the_callback_of_the_op_that_broke_it_ends_it_at_once(backend: str) -> None:
    """The failing op's future was settled before the link stopped its pipes: a callback that closed the link
    found it closed already, joined threads nobody had told to end (timeout_s + 2 s for each pipe), and never
    released the backend (on gloo its process group and sockets stayed, a second close() returned at once)."""
    op_timeout_s = 0.5
    with contextlib.ExitStack() as stack:
        if backend == "loopback":
            peer, link = loopback_pair("cb-fail-close", timeout_s=op_timeout_s)
        else:
            p0, p1 = stack.enter_context(DataPlane()), stack.enter_context(DataPlane())
            peer, link = open_both(p0, p1, "cb-fail-close", p0.address, op_timeout_s=op_timeout_s)
        stack.callback(peer.close)
        closed_in: list[float] = []
        done = threading.Event()

        def close_from_callback(_future: Any) -> None:
            start = time.monotonic()
            link.close()
            closed_in.append(time.monotonic() - start)
            done.set()

        received = link.recv((4,), torch.float32)  # the peer never sends: it times out and breaks the link
        received.add_done_callback(close_from_callback)
        with pytest.raises(TransferError, match=r"within 0\.5 s"):  # gloo: no frame header within; loopback: not done
            received.result(WAIT_S)
        assert done.wait(WAIT_S)
        assert closed_in[0] < op_timeout_s, f"close() in the callback took {closed_in[0]:.2f} s"
        if backend == "gloo":
            assert link._backend._pg is None  # released: the process group and its sockets are gone


@pytest.mark.parametrize("framed", [False, True], ids=["plain", "framed"])
def test_a_hook_run_ahead_whose_result_is_refused_breaks_the_link(framed: bool) -> None:
    """Run ahead of its turn (while the send before it is filled), the hook returned, so it may have
    announced its tensor: its refused result breaks the link as at its turn, and the poster lives on."""
    a, b = loopback_pair(f"refused-ahead-{framed}", timeout_s=WAIT_S, framed=framed)
    with a, b:
        shapes = [(2,), (3,), (2,)]  # the second hook returns the wrong shape
        with sleepy_poster(a):  # all queued before the first is posted: the first's post runs the second's hook
            sends = [a.send(torch.empty(2, device="meta"), before_send=lambda shape=shape: torch.empty(shape),
                            fill=lambda out: out.fill_(1.0)) for shape in shapes]
            got = [b.recv((2,), torch.float32) for _ in shapes]  # while b is whole: the break may come any time
        with pytest.raises(ShapeMismatchError, match=r"seq 1.*before_send returned \(3,\) torch.float32 on cpu"):
            sends[1].result(WAIT_S)
        with pytest.raises(TransferError, match="seq 2.*the link broke"):
            sends[2].result(WAIT_S)
        with pytest.raises((TransferError, ClosedError)):
            sends[0].result(WAIT_S)  # the break came while it was being posted
        for receive in got:
            with pytest.raises((TransferError, ClosedError)):
                receive.result(WAIT_S)
        assert isinstance(a.broken, ShapeMismatchError)


class _Unrenderable(Exception):
    """An exception whose text cannot be rendered: its __str__ and __repr__ raise."""

    def __str__(self) -> str:
        raise ValueError("no text for you")

    __repr__ = __str__


@pytest.mark.parametrize(("error", "kind", "message"), [
    (OSError("control channel down"), TransferError, "seq 1.*before_send failed.*control channel down"),
    # A wire buffer refused (CapacityError) is still a CapacityError to whoever waits for the send.
    (CapacityError("wire buffers: 8 bytes asked, 0 free"), CapacityError,
     "seq 1.*before_send failed, not sent.*8 bytes asked, 0 free"),
    # Rendering its text raised on the poster: the thread ended, this send never failed and no later one was posted.
    (_Unrenderable(), TransferError, r"seq 1.*before_send failed, not sent: _Unrenderable \(its text could not be"),
], ids=["foreign", "ours", "unrenderable"])
def test_a_hook_that_raises_fails_its_send_alone_typed(error: Exception, kind: type[Exception], message: str) -> None:
    """The sends around it land and the link stays whole; the send's error keeps the hook's type when it is
    one of ours, and is a TransferError otherwise (naming only the type of an error whose text cannot be
    rendered)."""
    a, b = loopback_pair(f"typed-hook-{type(error).__name__}", timeout_s=WAIT_S)
    with a, b:
        def refuse() -> None:
            raise error

        first = a.send(torch.ones(2))
        skipped = a.send(torch.full((2,), 2.0), before_send=refuse)
        third = a.send(torch.full((2,), 3.0))
        r0, r1 = b.recv((2,), torch.float32), b.recv((2,), torch.float32)
        with pytest.raises(kind, match=message):
            skipped.result(WAIT_S)
        assert r0.result(WAIT_S).tolist() == [1.0, 1.0] and r1.result(WAIT_S).tolist() == [3.0, 3.0]
        assert first.result(WAIT_S) is None and third.result(WAIT_S) is None
        assert a.broken is None and a.stats().tensors_sent == 2


# -- timeouts and windows that a link cannot take ----------------------------------------------

BAD_TIMEOUTS = [float("inf"), float("nan"), -float("inf"), 0, -1.0, MAX_TIMEOUT_S * 2]


@pytest.mark.parametrize("bad", BAD_TIMEOUTS, ids=repr)
def test_a_timeout_a_wait_cannot_take_is_refused_where_it_is_given(bad: float) -> None:
    match = re.escape(f"timeout_s must be a finite number of seconds > 0 (at most {MAX_TIMEOUT_S:g}), got {bad!r}")
    with pytest.raises(ValueError, match=match):
        loopback_pair("bad-timeout", timeout_s=bad)
    with pytest.raises(ValueError, match=match):
        Link("bad-timeout", 0, torch.device("cpu"), _PostsAtOnce(), timeout_s=bad)
    a, b = loopback_pair("per-call", timeout_s=WAIT_S)
    with a, b:
        with pytest.raises(ValueError, match=rf"link 'per-call': {match}"):
            a.send(torch.ones(2), timeout_s=bad)
        with pytest.raises(ValueError, match=rf"link 'per-call': {match}"):
            b.recv((2,), torch.float32, timeout_s=bad)
        assert a.broken is None and b.broken is None and a.stats().next_send_seq == 0
    hub = LoopbackHub()
    for transport in (LoopbackTransport(hub), DataPlane()):
        with closing(transport):
            with pytest.raises(ValueError, match=match):
                transport.open_link("t", 0, transport.address, "cpu", bad)
            with pytest.raises(ValueError, match=f"op_{match}"):
                transport.open_link("t", 0, transport.address, "cpu", 1.0, op_timeout_s=bad)
            assert transport.links() == []
    with pytest.raises(TypeError, match="timeout_s must be a number of seconds, got str '1'"):
        loopback_pair("text", timeout_s="1")  # type: ignore[arg-type]


def test_the_longest_timeout_is_taken_by_a_gloo_link() -> None:
    """MAX_TIMEOUT_S is below where gloo's waits overflow (8e9 s timed out at once)."""
    with DataPlane() as p0, DataPlane() as p1:
        l0, l1 = open_both(p0, p1, "longest", p0.address, WAIT_S, op_timeout_s=MAX_TIMEOUT_S)
        got = l1.recv((3,), torch.float32)
        assert l0.send(torch.arange(3.0)).result(WAIT_S) is None and got.result(WAIT_S).tolist() == [0.0, 1.0, 2.0]


def test_open_link_refuses_a_bad_window_before_it_meets_the_peer() -> None:
    """Refused at once: no placeholder left behind, the id unused, and the peer never met a link that is not."""
    hub = LoopbackHub()
    with closing(LoopbackTransport(hub)) as left, closing(LoopbackTransport(hub)) as right:
        start = time.monotonic()
        with pytest.raises(ValueError, match="max_in_flight must be an int >= 1, got 0"):
            left.open_link("w1", 0, right.address, "cpu", WAIT_S, max_in_flight=0)
        with pytest.raises(ValueError, match="max_in_flight_bytes must be an int >= 1, got -5"):
            left.open_link("w1", 0, right.address, "cpu", WAIT_S, max_in_flight_bytes=-5)
        assert time.monotonic() - start < WAIT_S / 2 and left.links() == []
        l0, l1 = open_both(left, right, "w1", right.address, WAIT_S)  # the same id still opens
        l0.send(torch.ones(1))
        assert l1.recv((1,), torch.float32).result(WAIT_S).tolist() == [1.0]


def test_a_link_that_cannot_be_built_after_the_rendezvous_aborts_its_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """Link() failing after we met the peer (a CUDA stream, a thread): the peer's link breaks now, not at its
    deadline, and nothing of ours is left behind."""
    def flaky(link_id: str, link_rank: int, *args: Any, **kwargs: Any) -> Link:
        if link_rank == 0:
            raise RuntimeError("no stream left")
        return Link(link_id, link_rank, *args, **kwargs)

    monkeypatch.setattr(_opener, "Link", flaky)
    hub = LoopbackHub()
    with closing(LoopbackTransport(hub)) as left, closing(LoopbackTransport(hub)) as right:
        with ThreadPoolExecutor(2) as pool:
            f0 = pool.submit(left.open_link, "b1", 0, right.address, "cpu", WAIT_S)
            f1 = pool.submit(right.open_link, "b1", 1, right.address, "cpu", WAIT_S)
            with pytest.raises(RuntimeError, match="no stream left"):
                f0.result(WAIT_S)
            peer = f1.result(WAIT_S)
        start = time.monotonic()
        with pytest.raises(TransferError, match="closed by link rank 0"):
            peer.recv((1,), torch.float32).result(WAIT_S)
        assert time.monotonic() - start < WAIT_S / 2
        assert left.links() == [] and "b1" not in left._links  # noqa: SLF001 - the placeholder is gone


class _WatchedCondition(threading.Condition):
    """The hub's condition, saying when someone first waits on it."""

    def __init__(self) -> None:
        super().__init__()
        self.waiting = threading.Event()

    def wait(self, timeout: float | None = None) -> bool:
        self.waiting.set()
        return super().wait(timeout)


def test_two_loopback_ends_claiming_one_rank_both_fail_at_once() -> None:
    hub = LoopbackHub()
    hub._cond = _WatchedCondition()  # noqa: SLF001 - to know the first end waits before the second comes
    with closing(LoopbackTransport(hub)) as first, closing(LoopbackTransport(hub)) as second, \
            closing(LoopbackTransport(hub)) as host:
        with ThreadPoolExecutor(1) as pool:
            start = time.monotonic()
            waiting = pool.submit(first.open_link, "same", 0, host.address, "cpu", WAIT_S)
            assert hub._cond.waiting.wait(WAIT_S)  # noqa: SLF001
            message = rf"link 'same' \(link rank 0, store {host.address}\): both ends claim link rank 0"
            with pytest.raises(ValueError, match=message):
                second.open_link("same", 0, host.address, "cpu", WAIT_S)
            with pytest.raises(ValueError, match=message):
                waiting.result(WAIT_S)
            assert time.monotonic() - start < WAIT_S / 2  # not at its deadline
        with pytest.raises(ValueError, match="already used"):
            host.open_link("same", 1, host.address, "cpu", WAIT_S)
        assert first.links() == [] and second.links() == []


# -- the data plane's store connections and keys ------------------------------------------------


def test_a_store_connection_keeps_the_store_timeout_not_its_first_links_deadline() -> None:
    with DataPlane() as p0, DataPlane() as p1:
        open_both(p0, p1, "first", p0.address, 1.0)
        client = p1._clients[p0.address]  # noqa: SLF001 - the shared connection is what this is about
        assert client.timeout == timedelta(seconds=env_settings().deadline_s)
        assert p1._client_gates == {}  # noqa: SLF001 - a gate lives only while its store is being connected
    assert p0._gloo_device is None and p1._gloo_device is None  # noqa: SLF001 - close() let it go


def _peer_keys(address: str, link_id: str, gpu: str, backend: str) -> dist.PrefixStore:
    """Link rank 0's keys for ``link_id`` in the store at ``address``, set by hand as a peer's open would (it joined,
    its GPU and backend), and nothing after them; returns the link's view of that store."""
    host, port = split_address(address)
    peer = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=WAIT_S))
    keys = dist.PrefixStore(f"ncclkv/{link_id}", peer)
    keys.add("joined/0", 1)
    keys.set("gpu/0", gpu)
    keys.set("backend/0", backend)
    return keys


def test_a_handshake_refusal_keeps_the_store_connection() -> None:
    """The peer's store answered (it says nccl where we are gloo): the connection is fine, keep it."""
    with DataPlane() as p0, DataPlane() as p1:
        squatted = _peer_keys(p0.address, "mixed", "GPU-x", "nccl")
        with pytest.raises(HandshakeError, match="this end uses gloo on cpu, the peer uses nccl"):
            p1.open_link("mixed", 1, p0.address, "cpu", WAIT_S)
        kept = p1._clients.get(p0.address)  # noqa: SLF001
        assert kept is not None
        with pytest.raises(ValueError, match="already joined"):
            p1.open_link("mixed", 1, p0.address, "cpu", WAIT_S)
        assert p1._clients.get(p0.address) is kept  # noqa: SLF001
        del squatted


def test_a_gloo_link_leaves_only_its_joined_keys_of_ours_in_the_store() -> None:
    """gpu/ and backend/ are read by the peer before its group starts, so once ours is up they go; joined/
    stays, since it is what refuses an id used before."""
    with DataPlane() as p0, DataPlane() as p1:
        l0, l1 = open_both(p0, p1, "keys", p0.address, WAIT_S)
        store = p0._server  # noqa: SLF001
        assert store is not None
        for rank in (0, 1):
            assert not store.check([f"ncclkv/keys/gpu/{rank}"]) and not store.check([f"ncclkv/keys/backend/{rank}"])
            assert store.check([f"ncclkv/keys/joined/{rank}"])
        l0.send(torch.ones(2))
        assert l1.recv((2,), torch.float32).result(WAIT_S).tolist() == [1.0, 1.0]


def test_a_peer_stalled_in_its_rendezvous_does_not_hold_another_peers_link_through_our_store() -> None:
    """A responder meets every initiator in its own store through one connection (the server object). A peer that
    published its backend and then stopped (SIGSTOP, a crash) before its gloo group set its address left our end in
    gloo's blocking store wait, which holds that connection for its whole length: every other peer's link opening
    through our store waited behind it, up to the stalled link's deadline."""
    with DataPlane(deadline_s=60) as responder, DataPlane(deadline_s=60) as healthy:
        # The stalled peer's keys: it stops there, its gloo group never sets its address.
        stalled = _peer_keys(responder.address, "stalled", "", "gloo")
        with ThreadPoolExecutor(3) as pool:
            waiting = pool.submit(responder.open_link, "stalled", 1, responder.address, "cpu", 8.0)
            deadline = time.monotonic() + WAIT_S
            while not stalled.check(["0/1"]):  # our end's gloo group published its address: it waits in gloo now
                assert time.monotonic() < deadline and not waiting.done(), "our end never reached gloo's rendezvous"
                time.sleep(0.01)
            ends = (pool.submit(healthy.open_link, "healthy", 0, responder.address, "cpu", 30.0),
                    pool.submit(responder.open_link, "healthy", 1, responder.address, "cpu", 30.0))
            links = [end.result(40.0) for end in ends]
            assert not waiting.done(), "the healthy peer's link opened only once the stalled one's wait had ended"
            links[0].send(torch.ones(2))
            assert links[1].recv((2,), torch.float32).result(WAIT_S).tolist() == [1.0, 1.0]
            with pytest.raises(TransferTimeout, match="'stalled'"):
                waiting.result(20.0)
        del stalled


@pytest.mark.parametrize("where", ["before the peer joined", "in gloo's rendezvous", "loopback"])
def test_a_rendezvous_cancelled_while_it_waits_for_the_peer_ends_at_once(where: str) -> None:
    """``open_link(cancel=...)``: the engine sets it when it drops the peer (or closes) while the link opens. A
    responder's open waited out its deadline for a peer lost after its handshake, holding one of the engine's
    link-opener threads; now it ends as the event is set, with a TransferError that says so."""
    cancel = threading.Event()
    with contextlib.ExitStack() as stack:
        if where == "loopback":
            hub = LoopbackHub()
            plane: Any = stack.enter_context(closing(LoopbackTransport(hub)))
        else:
            plane = stack.enter_context(DataPlane(deadline_s=60))
        with ThreadPoolExecutor(1) as pool:
            opening = pool.submit(plane.open_link, "cancelled", 1, plane.address, "cpu", 30.0, cancel=cancel)
            deadline = time.monotonic() + WAIT_S
            if where == "in gloo's rendezvous":  # the peer published its backend, and stopped before gloo's keys
                stalled = _peer_keys(plane.address, "cancelled", "", "gloo")
                while not stalled.check(["0/1"]):  # our end's gloo group published its address: it waits in gloo
                    assert time.monotonic() < deadline and not opening.done(), "our end never reached gloo"
                    time.sleep(0.01)
            else:
                while None not in plane._links.values():  # noqa: SLF001 - our end is meeting the peer
                    assert time.monotonic() < deadline and not opening.done(), "our end never began its rendezvous"
                    time.sleep(0.01)
            cancelled_at = time.monotonic()
            cancel.set()
            with pytest.raises(TransferError, match="rendezvous cancelled") as caught:
                opening.result(WAIT_S)
            took = time.monotonic() - cancelled_at
        assert not isinstance(caught.value, TransferTimeout)
        assert took < 2.0, f"the cancelled open ended {took:.2f}s after the cancel (its deadline: 30 s)"
        assert plane.links() == [] and not plane._links  # noqa: SLF001 - nothing kept of it


@pytest.mark.parametrize("ended_by", ["cancel", "its deadline"])
def test_a_rendezvous_cancelled_in_gloos_wait_leaves_no_address_for_a_peer_that_comes_later(
        monkeypatch: pytest.MonkeyPatch, ended_by: str) -> None:
    """Our end is cancelled (or reaches its deadline) while gloo's rendezvous waits for the peer's address (ours
    published); the peer, late, comes after that. Before, it found our address, connected to our gloo listener
    and got an open link to nothing (its operations waited out their deadlines, never 'closed by peer'), and our
    process kept that connection (one descriptor per such open). Now the failed end takes its address back: the
    late peer never connects, and its open fails at its deadline."""
    from ncclkv.transport import _group

    make_group, cancelled = _group._make_group, threading.Event()

    def late(store: Any, link_rank: int, *args: Any, **kwargs: Any) -> Any:
        if link_rank == 0:  # the peer: it saw our backend, and starts its gloo group only once we were cancelled
            assert cancelled.wait(WAIT_S)
        return make_group(store, link_rank, *args, **kwargs)

    monkeypatch.setattr(_group, "_make_group", late)

    def fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    with DataPlane(deadline_s=60) as ours, DataPlane(deadline_s=60) as theirs, ThreadPoolExecutor(2) as pool:
        host, port = split_address(ours.address)
        probe = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=WAIT_S))
        outcomes, before = [], 0
        for i in range(3):
            if i == 1:
                before = fds()  # after one round: gloo's device and listener are up
            cancel, link_id = threading.Event(), f"late{i}"
            mine = pool.submit(ours.open_link, link_id, 1, ours.address, "cpu",
                               30.0 if ended_by == "cancel" else 1.5, cancel=cancel)
            peer = pool.submit(theirs.open_link, link_id, 0, ours.address, "cpu", 4.0)
            deadline = time.monotonic() + WAIT_S
            while not probe.check([f"ncclkv/{link_id}/0/1"]):  # our gloo group published its address
                assert time.monotonic() < deadline and not mine.done(), "our end never reached gloo"
                time.sleep(0.005)
            if ended_by == "cancel":
                cancel.set()
                with pytest.raises(TransferError, match="rendezvous cancelled"):
                    mine.result(WAIT_S)
            else:
                with pytest.raises(TransferTimeout):
                    mine.result(WAIT_S)
            assert not probe.check([f"ncclkv/{link_id}/0/1"]), "our end's address is still there"
            cancelled.set()
            try:
                peer.result(WAIT_S).close()
                outcomes.append("opened")
            except TransferTimeout:
                outcomes.append("timed out")
            cancelled.clear()
        time.sleep(0.5)
        assert outcomes == ["timed out"] * 3, outcomes
        assert fds() <= before, f"{fds() - before} descriptors more after 2 failed opens"


def test_the_receive_being_posted_when_another_op_breaks_the_link_fails_with_the_cause() -> None:
    """A framed receive's poster waits for the next header while the receive before it is in flight; that one
    passes its deadline and breaks the link, whose abort then ends the header wait. The receive being posted was
    neither queued nor in flight when the pipes stopped: it failed with ClosedError("the link was closed"),
    naming no cause, as if this end had been closed on purpose, where every other pending op gets a
    TransferError naming what broke the link."""
    a, b = loopback_pair("posting-when-broken", timeout_s=WAIT_S, framed=True)
    with a, b:
        filling, release = threading.Event(), threading.Event()

        def slow_fill(out: torch.Tensor) -> None:  # its header is out (nothing in flight: at once), its bytes never
            filling.set()
            release.wait(WAIT_S)

        first = b.recv((2,), torch.float32, timeout_s=0.5)  # posted once its header lands, then times out
        second = b.recv((2,), torch.float32)  # its poster waits for its header when the first breaks the link
        behind = b.recv((2,), torch.float32)  # queued behind it
        a.send(torch.empty(2), fill=slow_fill)
        assert filling.wait(WAIT_S)
        try:
            with pytest.raises(TransferTimeout, match=r"recv seq 0.*within 0\.5 s"):
                first.result(WAIT_S)
            with pytest.raises(TransferError, match=r"recv seq 2.*the link broke: .*recv seq 0"):
                behind.result(WAIT_S)
            error = second.exception(WAIT_S)
            assert isinstance(error, TransferError) and not isinstance(error, ClosedError), repr(error)
            assert re.search(r"recv seq 1.*the link broke: .*recv seq 0.*within 0\.5 s", str(error)), error
        finally:
            release.set()


def test_a_send_posted_after_another_send_broke_a_gloo_link_fails_with_the_cause() -> None:
    """The poster is inside a send's fill when the send before it, in flight, passes its deadline and breaks the
    link. The fill returns, the post goes to the stopped send thread, and the pipe found itself stopped: the send
    failed with ClosedError("the link is closed"), naming no cause, as if this end had been closed on purpose."""
    with DataPlane() as p0, DataPlane() as p1:
        a, b = open_both(p0, p1, "posted-after-break", p0.address)
        with a, b:
            filling, release = threading.Event(), threading.Event()

            def slow_fill(out: torch.Tensor) -> None:
                filling.set()
                release.wait(WAIT_S)

            first = a.send(torch.ones(2), timeout_s=0.5)  # the peer posts no receive: it times out
            second = a.send(torch.empty(2), fill=slow_fill)  # the poster holds it in its fill meanwhile
            assert filling.wait(WAIT_S)
            try:
                with pytest.raises(TransferTimeout, match=r"send seq 0.*within 0\.5 s"):
                    first.result(WAIT_S)
            finally:
                release.set()
            error = second.exception(WAIT_S)
            assert isinstance(error, TransferError) and not isinstance(error, ClosedError), repr(error)
            assert re.search(r"send seq 1.*the link broke: .*send seq 0.*within 0\.5 s", str(error)), error
