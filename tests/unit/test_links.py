"""ncclkv.engine._links.PeerLinks with a stand-in channel and data plane: links that finish opening after
the peer was dropped or the engine closed, and the per-peer handshake gates; and, on real ZMQ channels and a
real gloo data plane, a responder's handshake reply that is not sent."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import Any

import pytest
from msgspec.structs import replace

from ncclkv.auth import ChannelAuth
from ncclkv.channel import Channel, ReplyThen
from ncclkv.engine._links import PeerLinks
from ncclkv.errors import (ClosedError, PeerLostError, PeerResetError, ProtocolError, TransferError,
                           TransferTimeout)
from ncclkv.layout import KVGeometry, ParallelLayout
from ncclkv.protocol import Ack, Handshake, Message, Ready
from ncclkv.transport import DataPlane

from _channel_helpers import wait_until

WAIT_S = 10.0
_MOVE_S = 1.0  # what a handshake takes here, on a busy machine: far more than it needs
ME, PEER = "local.r0", "remote.r0"


def handshake(engine_id: str) -> Handshake:
    return Handshake.create(engine_id, "both", 0, ParallelLayout(1, 1), KVGeometry(2, 2, 64), "tcp://h:1", "h:2")


class _Clock:
    def wait(self, attempt: Callable[[float], bool], timeout_s: float) -> bool:
        return attempt(timeout_s)


class _Channel:
    """Answers every handshake at once with the peer's, echoing the session."""

    peer_id = ME
    auth = ChannelAuth()
    clock = _Clock()
    loss_seq = 0  # no peer is ever lost here

    def __init__(self) -> None:
        self.refuse: BaseException | None = None
        self.addresses: dict[str, str] = {}
        self.sent: list[tuple[str | None, str]] = []  # where each hello went, and its session

    def connect(self, peer_id: str, address: str) -> None:
        self.addresses[peer_id] = address

    def connected_address(self, peer_id: str) -> str | None:
        return self.addresses.get(peer_id)

    def peer_alive(self, peer_id: str) -> bool:
        return True

    def peer_incarnation(self, peer_id: str) -> int:
        return 0  # none heard: never compared

    def request(self, peer_id: str, hello: Handshake, timeout_s: float, *, at: str | None = None) -> Handshake:
        if self.refuse is not None:
            raise self.refuse
        self.check_at(peer_id, at)
        self.sent.append((self.addresses.get(peer_id), hello.session))
        return replace(handshake("remote"), session=hello.session)

    def check_at(self, peer_id: str, at: str | None) -> None:
        """As Channel.request(at=): nothing is sent where the path leads elsewhere."""
        if at is not None and self.addresses.get(peer_id, at) != at:
            raise PeerResetError(f"not sent: {peer_id!r} is reached at {self.addresses[peer_id]!r}, not {at!r}")

    def flush(self) -> bool:
        return True


class _Link:
    def __init__(self, link_id: str) -> None:
        self.link_id = link_id
        self.broken = None
        self.closed_event = threading.Event()

    @property
    def closed(self) -> bool:
        return self.closed_event.is_set()

    def close(self) -> None:
        self.closed_event.set()


class _DataPlane:
    """open_link blocks until ``release`` is set; ``opening`` says one is under way; ``opened``: what it made."""

    address = "h:2"

    def __init__(self) -> None:
        self.opening, self.release = threading.Event(), threading.Event()
        self.opened: list[_Link] = []

    def open_link(self, link_id: str, link_rank: int, store_addr: str, device: str, timeout_s: float, *,
                  cancel: threading.Event | None = None) -> _Link:
        self.opening.set()
        assert self.release.wait(WAIT_S)
        self.opened.append(_Link(link_id))
        return self.opened[-1]


@pytest.fixture
def parts() -> Iterator[tuple[PeerLinks, _Channel, _DataPlane, ThreadPoolExecutor]]:
    channel, plane = _Channel(), _DataPlane()
    with ThreadPoolExecutor(2) as pool:
        peers = PeerLinks(handshake("local"), channel, plane, pool, "cpu", WAIT_S)  # type: ignore[arg-type]
        yield peers, channel, plane, pool
        plane.release.set()
        peers.close()


def ensure_in_background(peers: PeerLinks, pool: ThreadPoolExecutor) -> Future[Any]:
    return pool.submit(peers.ensure, PEER, "tcp://remote:1", True)


def test_a_loss_of_the_peers_life_at_another_address_leaves_the_handshake_made_at_its_new_one(parts: Any) -> None:
    """The peer restarted at another address and we shook hands there; the dead life's loss, reported since (its
    count above the handshake's), names the dead address: the handshake stays. One naming the new address, or
    none, ends it."""
    peers, _, _, _ = parts
    live = peers.ensure(PEER, "tcp://remote:2", need_link=False)
    peers.drop(PEER, "lost at the dead address (test)", before=live.stamp + 1, at="tcp://remote:1")
    assert peers.get(PEER) is live
    peers.drop(PEER, "lost at its address (test)", before=live.stamp + 1, at="tcp://remote:2")
    assert peers.get(PEER) is None
    again = peers.ensure(PEER, "tcp://remote:2", need_link=False)
    peers.drop(PEER, "lost (test)", before=again.stamp + 1)
    assert peers.get(PEER) is None


def test_closing_while_the_initiator_opens_its_link_is_a_closed_error_and_closes_the_link(parts: Any) -> None:
    peers, _, plane, pool = parts
    ensured = ensure_in_background(peers, pool)
    assert plane.opening.wait(WAIT_S)
    peers.close()
    plane.release.set()
    with pytest.raises(ClosedError, match=f"closed while link .* to '{PEER}' was opening"):
        ensured.result(WAIT_S)
    assert len(plane.opened) == 1 and plane.opened[0].closed


def test_dropping_the_peer_while_the_initiator_opens_its_link_is_peer_lost_and_closes_the_link(parts: Any) -> None:
    peers, _, plane, pool = parts
    ensured = ensure_in_background(peers, pool)
    assert plane.opening.wait(WAIT_S)
    peers.drop(PEER, "peer lost (heartbeat)")
    plane.release.set()
    with pytest.raises(PeerLostError, match=f"'{PEER}' was dropped while link .* was opening"):
        ensured.result(WAIT_S)
    assert len(plane.opened) == 1 and plane.opened[0].closed
    assert peers.get(PEER) is None


@pytest.mark.parametrize("how", ["drop", "close"])
def test_a_link_the_responder_is_opening_is_closed_once_it_opens_after_a_drop_or_close(parts: Any, how: str) -> None:
    peers, _, plane, _ = parts
    remote = replace(handshake("remote"), session="s" * 32, open_link=True)
    reply = peers.on_handshake(PEER, remote)
    assert isinstance(reply, ReplyThen)
    reply.then()  # what the dispatcher does once the reply is with ZMQ: the open starts on the link opener
    assert plane.opening.wait(WAIT_S)
    link_future = peers.get(PEER).link
    if how == "drop":
        peers.drop(PEER, "peer lost (heartbeat)")
    else:
        peers.close()
    plane.release.set()
    assert link_future.result(WAIT_S) is plane.opened[0]
    assert plane.opened[0].closed_event.wait(WAIT_S), "the link opened after its peer was forgotten stays open"


def test_a_handshake_gate_lives_only_while_a_handshake_is_under_way(parts: Any) -> None:
    peers, channel, plane, pool = parts
    ensured = ensure_in_background(peers, pool)
    assert plane.opening.wait(WAIT_S)
    assert set(peers._connecting) == {PEER}  # noqa: SLF001 - the gate of the handshake in flight
    plane.release.set()
    peer = ensured.result(WAIT_S)
    assert peer.link.result(WAIT_S) is plane.opened[0] and not plane.opened[0].closed
    assert peers._connecting == {}  # noqa: SLF001
    channel.refuse = TransferTimeout("no answer")
    with pytest.raises(TransferTimeout, match="no answer"):
        peers.ensure("other.r0", "tcp://other:1", True)
    assert peers._connecting == {}  # noqa: SLF001 - a failed handshake leaves none either


class _HeldChannel(_Channel):
    """Holds each handshake sent while the channel's path to the peer leads to ``held_at`` until ``release``."""

    def __init__(self, held_at: str) -> None:
        super().__init__()
        self.held_at = held_at
        self.holding, self.release = threading.Event(), threading.Event()

    def request(self, peer_id: str, hello: Handshake, timeout_s: float, *, at: str | None = None) -> Handshake:
        self.check_at(peer_id, at)  # sent, then its answer held: the request is in flight
        if self.addresses.get(peer_id) == self.held_at:
            self.holding.set()
            assert self.release.wait(WAIT_S)
        return super().request(peer_id, hello, timeout_s)


@pytest.fixture
def held() -> Iterator[tuple[PeerLinks, _HeldChannel, ThreadPoolExecutor]]:
    channel = _HeldChannel("tcp://remote:1")
    with ThreadPoolExecutor(2) as pool:
        peers = PeerLinks(handshake("local"), channel, _DataPlane(), pool, "cpu", WAIT_S)  # type: ignore[arg-type]
        yield peers, channel, pool
        channel.release.set()
        peers.close()


def test_a_handshake_with_a_later_life_elsewhere_does_not_wait_for_one_with_an_earlier_life(held: Any) -> None:
    """The peer id restarted at another address (a later incarnation) while our handshake with its earlier life
    goes unanswered: the new one took a turn only after the old one's deadline_s (or failed 'still in progress').
    It goes at once; the old one, answered after the channel moved, installs nothing (its reply may come from
    the new address) and fails as reset."""
    peers, channel, pool = held
    old = pool.submit(peers.ensure, PEER, "tcp://remote:1", False, 1)
    assert channel.holding.wait(WAIT_S)
    new = peers.ensure(PEER, "tcp://remote:2", False, 2)
    assert peers.get(PEER) is new and new.address == "tcp://remote:2"
    channel.release.set()
    with pytest.raises(PeerResetError, match="abandoned: one with a later life of it, at 'tcp://remote:2'"):
        old.result(WAIT_S)
    assert peers.get(PEER) is new and channel.connected_address(PEER) == "tcp://remote:2"
    assert peers._connecting == {}  # noqa: SLF001


@pytest.mark.parametrize(("old_life", "new_life"), [(0, 0), (1, 0), (0, 2), (2, 1)])
def test_a_handshake_elsewhere_not_known_to_be_with_a_later_life_waits_its_turn(held: Any, old_life: int,
                                                                                new_life: int) -> None:
    """Without both incarnations, or with an earlier one, the order of the two lives is not known (or the new
    request names the earlier): it waits for the handshake in progress, as before, then moves the channel."""
    peers, channel, pool = held
    old = pool.submit(peers.ensure, PEER, "tcp://remote:1", False, old_life)
    assert channel.holding.wait(WAIT_S)
    new = pool.submit(peers.ensure, PEER, "tcp://remote:2", False, new_life)
    tick = threading.Event()  # never set: a wait of one poll interval
    for _ in range(int(WAIT_S / 0.005)):  # until it waits at the same gate (no blocking variant to wait on)
        with peers._lock:  # noqa: SLF001
            if peers._connecting[PEER].users == 2:  # noqa: SLF001
                break
        tick.wait(0.005)
    assert peers._connecting[PEER].users == 2 and not new.done()  # noqa: SLF001
    channel.release.set()
    assert old.result(WAIT_S).address == "tcp://remote:1"
    assert new.result(WAIT_S).address == "tcp://remote:2" and peers.get(PEER).address == "tcp://remote:2"


class _LivesChannel(_Channel):
    """Answers each handshake with the life of the peer id at the address the channel's path leads to."""

    def __init__(self, lives: dict[str, int]) -> None:
        super().__init__()
        self.lives = lives

    def request(self, peer_id: str, hello: Handshake, timeout_s: float, *, at: str | None = None) -> Handshake:
        reply = super().request(peer_id, hello, timeout_s, at=at)
        return replace(reply, incarnation=self.lives[self.addresses[peer_id]])


class _PreemptedChannel(_LivesChannel):
    """The first request made while the path leads to ``held_at`` is held at its entry (its thread preempted
    between PeerLinks' move of the channel and its hello) until ``release``."""

    def __init__(self, lives: dict[str, int], held_at: str) -> None:
        super().__init__(lives)
        self.held_at = held_at
        self.holding, self.release = threading.Event(), threading.Event()

    def request(self, peer_id: str, hello: Handshake, timeout_s: float, *, at: str | None = None) -> Handshake:
        if self.addresses.get(peer_id) == self.held_at and not self.holding.is_set():
            self.holding.set()
            assert self.release.wait(WAIT_S)
        return super().request(peer_id, hello, timeout_s, at=at)


def test_the_hello_of_a_handshake_a_later_life_took_over_never_reaches_the_later_life(parts: Any) -> None:
    """The handshake with the earlier life moved the channel to its address and, before its hello went, one with
    the later life took the gate over, moved the channel to its own address and installed. The earlier hello,
    sent then, went where the channel led: to the later life, which installed that handshake (whose link no one
    here opens) over the current one as the responder. PeerLinks asks the channel to send it only to the address
    it shakes hands at (Channel.request(at=)): it is not sent, and the attempt fails as reset."""
    peers, _, _, pool = parts
    channel = _PreemptedChannel({"tcp://remote:1": 1, "tcp://remote:2": 2}, "tcp://remote:1")
    peers._channel = channel  # noqa: SLF001
    old = pool.submit(peers.ensure, PEER, "tcp://remote:1", False, 1)
    assert channel.holding.wait(WAIT_S)
    new = peers.ensure(PEER, "tcp://remote:2", False, 2)
    channel.release.set()
    with pytest.raises(PeerResetError):
        old.result(WAIT_S)
    assert peers.get(PEER) is new
    assert [address for address, _ in channel.sent] == ["tcp://remote:2"], channel.sent


def test_a_handshake_with_an_earlier_life_answered_just_before_a_later_life_took_over_installs_nothing(
        parts: Any) -> None:
    """The handshake with the earlier life (at its old address) got its answer and passed its check of the gate;
    before it installed, one with the later life at another address took the gate over and installed. The
    earlier one then installed over it: the later life, alive, was recorded as replaced by the earlier one (each
    request naming it refused as stale), and its handshake dropped. Checked and installed at once now, it fails
    as reset, and the later life stays."""
    peers, _, _, pool = parts
    channel = _LivesChannel({"tcp://remote:1": 1, "tcp://remote:2": 2})
    peers._channel = channel  # noqa: SLF001
    checked, go_on = threading.Event(), threading.Event()
    install = peers._install  # noqa: SLF001

    def hooked(peer_id: str, remote: Handshake, *args: Any, **kwargs: Any) -> Any:
        if remote.incarnation == 1:  # the earlier life's answer, checked: just before it installs
            checked.set()
            assert go_on.wait(WAIT_S)
        return install(peer_id, remote, *args, **kwargs)

    peers._install = hooked  # noqa: SLF001
    old = pool.submit(peers.ensure, PEER, "tcp://remote:1", False, 1)
    assert checked.wait(WAIT_S)
    new = peers.ensure(PEER, "tcp://remote:2", False, 2)
    go_on.set()
    with pytest.raises(PeerResetError, match="abandoned: one with a later life of it, at 'tcp://remote:2'"):
        old.result(WAIT_S)
    assert peers.get(PEER) is new and new.remote.incarnation == 2
    assert peers.ensure(PEER, "tcp://remote:2", False, 2) is new  # not refused as stale
    assert peers._connecting == {}  # noqa: SLF001


class _MovingChannel(_LivesChannel):
    """Holds the first connect() to ``held_at`` (the earlier life's address) until ``release``."""

    def __init__(self, lives: dict[str, int], held_at: str) -> None:
        super().__init__(lives)
        self.held_at, self.moves = held_at, []
        self.holding, self.release = threading.Event(), threading.Event()

    def connect(self, peer_id: str, address: str) -> None:
        if address == self.held_at and not self.holding.is_set():
            self.holding.set()
            assert self.release.wait(WAIT_S)
        self.moves.append(address)
        super().connect(peer_id, address)


def test_a_handshake_with_an_earlier_life_past_its_check_of_the_gate_never_moves_the_channel_back(
        parts: Any) -> None:
    """The handshake with the earlier life passed its check of the gate and was about to move the channel to the
    old address when one with a later life at another address took the gate over. The later one moved the
    channel and installed; then the earlier one moved it back to the old address (a real channel resets the
    live peer there: what waited on it fails) and sent its hello there. Now the later one moves only once the
    earlier one's move is done: the channel ends at the later life's address, the earlier attempt fails as
    reset."""
    peers, _, _, pool = parts
    channel = _MovingChannel({"tcp://remote:1": 1, "tcp://remote:2": 2}, "tcp://remote:1")
    peers._channel = channel  # noqa: SLF001
    old = pool.submit(peers.ensure, PEER, "tcp://remote:1", False, 1)
    assert channel.holding.wait(WAIT_S)
    new = pool.submit(peers.ensure, PEER, "tcp://remote:2", False, 2)
    # Before, it was done at once (installed at the new address); now it waits for the move under way.
    wait_futures([new], timeout=_MOVE_S)
    channel.release.set()
    assert new.result(WAIT_S).address == "tcp://remote:2"
    with pytest.raises(PeerResetError, match="abandoned: one with a later life of it, at 'tcp://remote:2'"):
        old.result(WAIT_S)
    assert channel.connected_address(PEER) == "tcp://remote:2", channel.moves
    assert channel.moves[-1] == "tcp://remote:2" and peers.get(PEER) is new.result()
    assert peers._connecting == {}  # noqa: SLF001


# -- the responder's reply not sent: its link is not opened (real ZMQ channels, a real gloo data plane) -------

_DEEP = KVGeometry(400, 2, 64)


def _deep_handshake(engine_id: str, layout: ParallelLayout) -> Handshake:
    return Handshake.create(engine_id, "both", 0, layout, _DEEP, "tcp://h:1", "h:2")


class _CountingOpener(ThreadPoolExecutor):
    """The link opener: counts the opens submitted to it (each takes a thread up to the open's deadline_s)."""

    def __init__(self) -> None:
        super().__init__(2)
        self.submitted = 0

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Future[Any]:
        self.submitted += 1
        return super().submit(fn, *args, **kwargs)


@pytest.mark.parametrize("why", ["refused by the protocol", "peer closed"])
def test_a_handshake_reply_that_is_not_sent_opens_no_link(why: str) -> None:
    """The responder's handshake reply did not go out: the protocol refused it (an error reply went instead), or
    the initiator closed before the dispatcher got to it. The follow-up that opens the responder's end still ran:
    an open took a link opener thread and waited at the rendezvous for a peer that never got the reply (up to
    deadline_s when the peer is alive, until its loss is dispatched else), the handshake kept as the current one
    meanwhile. Now nothing is opened, and the handshake, its link (failed with why) and what is kept for it go at
    once."""
    if why == "refused by the protocol":  # its reply, 1158 bytes with the envelope, is over its 1024-byte limit
        responder_engine, layout = "r" * 200, ParallelLayout(1, 400, (1,) * 400)
    else:
        responder_engine, layout = "responder", ParallelLayout(1, 1)
    local = _deep_handshake(responder_engine, layout)
    installed: list[Any] = []
    hold, held = threading.Event(), threading.Event()

    def on_message(sender: str, body: Message) -> Any:
        if isinstance(body, Handshake):
            reply = peers.on_handshake(sender, body)
            installed.append(peers.get(sender))
            return reply
        if body == Ready("hold"):  # holds the dispatcher: what comes next waits behind it
            held.set()
            assert hold.wait(WAIT_S)
        return Ack(body.request_id, None)  # type: ignore[union-attr]

    opener = _CountingOpener()
    plane = DataPlane("127.0.0.1", deadline_s=30.0)
    b = Channel(f"{responder_engine}.r0", on_message=on_message, bind_host="127.0.0.1", max_frame_bytes=1024,
                heartbeat_s=0.05, deadline_s=30.0,
                on_peer_lost=lambda lost, err: peers.drop(lost, err, before=err.loss_seq, at=err.address))
    a = Channel("initiator.r0", bind_host="127.0.0.1", heartbeat_s=0.05, deadline_s=30.0)
    peers = PeerLinks(replace(local, control_addr=b.address, data_addr=plane.address), b, plane, opener, "cpu",
                      30.0)
    try:
        a.connect(b.peer_id, b.address)
        hello = replace(_deep_handshake("initiator", ParallelLayout(1, 1)), control_addr=a.address, session="s" * 32,
                        open_link=True)
        if why == "refused by the protocol":
            with pytest.raises(TransferError, match="reply refused by the protocol"):
                a.request(b.peer_id, hello, WAIT_S)
            # Handled after the handshake, follow-up included (one dispatcher, in arrival order).
            assert a.request(b.peer_id, Ready("after"), WAIT_S) == Ack("after", None)
        else:
            a.send(b.peer_id, Ready("hold"))
            assert held.wait(WAIT_S)
            a.send(b.peer_id, hello)
            a.close()  # its Bye: the responder loses it before its dispatcher gets to the handshake
            wait_until(lambda: not b.peer_alive(a.peer_id), WAIT_S)
            hold.set()
            # The loss, dispatched after the handshake, drops it (if nothing did before).
            wait_until(lambda: bool(installed) and peers.get(a.peer_id) is None, WAIT_S)
        peer = installed[0]
        link_id = peer.link_id
        # Before, an open was started, and (refused) the handshake stayed the current one while it waited for the
        # peer (up to deadline_s: 30 s here).
        assert opener.submitted == 0, f"an open was started for a reply the peer never got: {peer.link}"
        assert peers.get(a.peer_id) is None and peers.kept(link_id) is None
        assert peer.link.done() and peer.cancel.is_set()
        error = peer.link.exception()
        assert isinstance(error, ProtocolError if why == "refused by the protocol" else PeerLostError), error
        assert plane.links() == []
    finally:
        hold.set()
        a.close()
        b.close()
        peers.close()
        opener.shutdown(wait=True, cancel_futures=True)
        plane.close()
