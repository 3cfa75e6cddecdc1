"""Handshakes with remote engine ranks and the one data link per pair of ranks.

The side that needs a peer first (a consumer that pulls, a producer that
pushes) is the initiator: it connects its channel, sends its
:class:`Handshake` with a fresh ``session`` nonce, and the responder answers
with its own handshake echoing the nonce, after checking compatibility (a
mismatch fails on both sides with both values named). Both then open the
same link: its id is derived from the two peer ids and the nonce, the
responder's TCPStore is the rendezvous, and the smaller peer id is link rank
0. A link is used in both directions; the n-th send in one direction matches
the n-th receive on the other side.

A peer lost (``drop``) takes what was agreed with it before the loss: each
:class:`Peer` carries the channel's ``loss_seq`` from when it was made (an
initiator's read before its handshake went out; a responder's handshake is
older than any loss the dispatcher reports after it), so a loss reported late
never takes a handshake made after it. A cached peer is not used once the
channel lost it, heard another incarnation under its id, or when the caller
names another address than the one we connected to (it restarted elsewhere).

The caller's address is believed only when it is not stale: each peer id's
lives (the incarnations its handshakes carried, and where) are remembered, and
a request that names a life since replaced by another (its incarnation, or,
with none given, the address of a replaced life while the current one is
alive elsewhere) fails at once (:class:`PeerLostError` naming both) instead
of moving the channel back to where the peer id no longer is: that reset the
live peer and failed everything in flight with it.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Executor, Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field

from msgspec.structs import replace

from .._peers import lost_there
from ..channel import Channel, ReplyThen
from ..errors import (ClosedError, HandshakeError, PeerClosedError, PeerLostError, PeerResetError, ProtocolError,
                      TransferTimeout)
from ..protocol import INCARNATION_RANDOM_BITS, Handshake, Message, check_compatible
from ..transport import LinkBase, LinkFactory
from ..transport._pipe import settle
from ._config import peer_id
from ._tasks import submit_task

__all__ = ["OnOpen", "Peer", "PeerLinks"]

log = logging.getLogger("ncclkv.engine")

MAX_LIVES_PEERS = 4096  # peer ids whose lives are remembered (see _Lives), the least recently changed forgotten first
MAX_SUPERSEDED_LIVES = 16  # replaced lives remembered per peer id, the oldest forgotten first

# What runs once a link is open: (the link, None), or (None, why it never will be) (see PeerLinks.when_open).
OnOpen = Callable[[LinkBase | None, BaseException | None], None]


@dataclass(slots=True)
class Peer:
    """A remote rank we shook hands with, and our link to it."""

    peer_id: str
    remote: Handshake
    link: Future[LinkBase] | None  # None: control only (no tensors flow between these two ranks yet)
    link_id: str | None = None
    # The channel's loss_seq it was made under (-1: as the responder, older than every loss reported after it):
    # a loss reported with a higher count ends it, one with a count up to this came before it.
    stamp: int = -1
    address: str | None = None  # the control address we reached it at (None: as the responder)
    # Announcement sequence numbers on its link (see "The ordering rule"): the next one our producer side sends,
    # and the next one our consumer side must hear. Here, not in maps by link id, so they go with the link: a
    # map's entry removed when the link went could be written again by an announcement racing the removal.
    sent_seq: int = 0
    heard_seq: int = 0
    # Set once this handshake is dropped, discarded or closed (its link is closed as soon as it opens): the
    # link's rendezvous still waiting for the peer ends then, instead of holding its thread up to deadline_s.
    cancel: threading.Event = field(default_factory=threading.Event)


@dataclass(slots=True, eq=False)
class _Waiting:
    """The continuations waiting for one link to open, in arrival order (see ``PeerLinks.when_open``)."""

    peer: Peer
    queue: deque[OnOpen] = field(default_factory=deque)
    error: BaseException | None = None  # the link was dropped or closed: each one still queued fails with this
    running: bool = False  # a thread is running them (only one at a time: their order is the link's order)


@dataclass(slots=True, eq=False)
class _Lives:
    """The lives of one peer id that we shook hands with: the current one (the latest handshake's incarnation,
    and the address it was reached at) and the ones it replaced (incarnation -> address), oldest first."""

    incarnation: int
    address: str
    superseded: OrderedDict[int, str] = field(default_factory=OrderedDict)


@dataclass(slots=True, eq=False)
class _Gate:
    """Serializes our handshakes with one peer; ``users``: the ensure() calls holding or awaiting it. ``address``
    and ``incarnation``: what the ensure() holding it shakes hands with (None: free; 0: the life not known)."""

    lock: threading.Lock
    users: int = 0
    address: str | None = None
    incarnation: int = 0
    taken_over: str | None = None  # the address of a handshake with a later life that took over (_handshaking)
    # Held by the ensure() holding the gate while it checks the gate and moves the channel; shared with the gate
    # that takes this one over, so a taker moves only once a move it came in the middle of is done.
    moving: threading.Lock = field(default_factory=threading.Lock)


class PeerLinks:
    """Peers by peer id; thread-safe. ``local`` is our handshake (its session is replaced per pair).

    ``link_opener`` runs the links we open as the responder; no task on it may wait for a link.
    """

    def __init__(self, local: Handshake, channel: Channel, data_plane: LinkFactory, link_opener: Executor,
                 device: str, deadline_s: float) -> None:
        self._local = local
        self._channel = channel
        self._data_plane = data_plane
        self._link_opener = link_opener
        self._device = device
        self._deadline_s = deadline_s
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # a handshake was installed, or a gate went (known())
        self._peers: dict[str, Peer] = {}  # the link each side sends on now
        # Every open link by id: when both sides start a handshake at once, each
        # may send on a different one, so a receiver finds the link an
        # announcement names, not just the newest.
        self._links: dict[str, Peer] = {}
        self._connecting: dict[str, _Gate] = {}  # only peers with an ensure() in progress
        self._waiting: dict[str, _Waiting] = {}  # link id -> what waits for that link to open (when_open)
        self._lives: OrderedDict[str, _Lives] = OrderedDict()  # peer id -> its lives we shook hands with
        self._closed = False

    def get(self, peer_id: str) -> Peer | None:
        with self._lock:
            return self._peers.get(peer_id)

    def replaced_at(self, peer_id: str, address: str, incarnation: int = 0) -> bool:
        """Whether a life of ``peer_id`` we shook hands with was at ``address`` and a later life, which we shook
        hands with at another address, replaced it: what is sent there reaches a dead life (or a restart there, which
        a reference naming that address was not made for). ``incarnation``: the life the reference names (0: not
        known); one later than every life we shook hands with is a restart at ``address``, not a replaced life."""
        with self._lock:
            lives = self._lives.get(peer_id)
            return (lives is not None and address != lives.address and address in lives.superseded.values()
                    and (not incarnation or incarnation in lives.superseded or incarnation < lives.incarnation))

    def known(self, peer_id: str) -> Peer | None:
        """``get``, but first let a handshake we started with ``peer_id`` get its reply (up to the deadline).

        When both sides start a handshake at once, the peer may install ours
        first and send a request before our own ``ensure`` has read its reply.
        Only that reply is waited for, never the link it opens (the dispatcher
        calls this): the peer answered as it installed our handshake, before
        it could send under it, so the reply is already on its way.
        """
        with self._lock:
            peer = self._peers.get(peer_id)
            if peer is not None or peer_id not in self._connecting:
                return peer

        def answered(timeout_s: float) -> bool:
            with self._changed:
                return self._changed.wait_for(
                    lambda: peer_id in self._peers or peer_id not in self._connecting or self._closed, timeout_s)
        self._channel.clock.wait(answered, self._deadline_s)
        return self.get(peer_id)

    def ensure(self, peer_id: str, control_addr: str, need_link: bool, incarnation: int = 0) -> Peer:
        """Shake hands with ``peer_id`` (and open a link if ``need_link``) unless done; blocks up to the deadline.

        A peer we connected to at another address than ``control_addr``, or that only reached us and named
        another one in its handshake (``Channel.connected_address``), moved (restarted elsewhere under its id):
        it is dropped, and the channel connects to ``control_addr`` instead. ``incarnation``: the life of
        the peer id the caller's reference names (``EngineRef.incarnation``; 0: not known). A reference to a
        life we saw replaced is stale: :class:`PeerLostError` at once, naming both lives, and nothing of the
        live one is touched (see :meth:`_stale`)."""
        with self._lock:
            self._check_open()
            stale = self._stale(peer_id, control_addr, incarnation)
            peer = self._peers.get(peer_id)
            if stale is None and peer is not None and self._current(peer, control_addr, need_link):
                return peer
        if stale is not None:
            raise PeerLostError(stale)
        with self._handshaking(peer_id, control_addr, incarnation) as gate:
            with self._lock:  # a handshake of another caller may have replaced the life named meanwhile
                stale = self._stale(peer_id, control_addr, incarnation)
                peer = self._peers.get(peer_id)
                if stale is None and peer is not None and self._current(peer, control_addr, need_link):
                    return peer
            if stale is not None:
                raise PeerLostError(stale)
            if not self._channel.clock.wait(lambda s: gate.moving.acquire(timeout=s), self._deadline_s):
                raise TransferTimeout(f"handshake with {peer_id!r}: a move of the channel by another handshake with it "
                                      f"still in progress after {self._deadline_s}s")
            try:  # not in the middle of a handshake's move with an earlier life, whose gate this one took over
                self._check_gate(peer_id, gate, control_addr)
                moved_from = self._channel.connected_address(peer_id)
                if moved_from is not None and moved_from != control_addr:
                    self.drop(peer_id, f"{peer_id!r} is at {control_addr!r} now, no longer at {moved_from!r}")
                session = uuid.uuid4().hex
                self._channel.connect(peer_id, control_addr)  # replaces the channel's path to it when it moved
                stamp = self._channel.loss_seq  # after connect(): a loss it reported is older than this handshake
            finally:
                gate.moving.release()
            hello = replace(self._local, session=session, open_link=need_link)
            # Only where we shake hands: a later life's handshake may have moved the channel since (_handshaking),
            # and our hello there would make the later life take this abandoned handshake for its current one.
            reply = self._channel.request(peer_id, hello, self._deadline_s, at=control_addr)
            if not isinstance(reply, Handshake) or reply.session != session:
                raise HandshakeError(f"peer {peer_id!r} answered the handshake with {type(reply).__name__}")
            check_compatible(self._local, reply)
            # Its hello may have gone where the channel moved since: the gate is checked as it installs (_install).
            if not need_link:
                return self._install(peer_id, reply, None, None, stamp, control_addr, gate)
            link: Future[LinkBase] = Future()
            link.set_running_or_notify_cancel()  # not cancellable: close() and drop() close what it brings instead
            link_id = self._link_id(peer_id, session)
            peer = self._install(peer_id, reply, link, link_id, stamp, control_addr, gate)
            try:
                opened = self._open_link(peer_id, reply.data_addr, session)
            except BaseException as err:
                settle(link, error=err)
                self._discard(peer)  # only ours: a link the peer opened meanwhile stays
                raise
            settle(link, result=opened)  # runs the closing callback of a drop() or close() that came meanwhile
            with self._lock:
                closed, current = self._closed, self._links.get(link_id) is peer
            if closed or not current:
                opened.close()  # idempotent: the callback may have closed it already
                if closed:
                    raise ClosedError(f"engine peers were closed while link {link_id!r} to {peer_id!r} was opening")
                raise PeerLostError(f"peer {peer_id!r} was dropped while link {link_id!r} to it was opening")
            return peer

    def on_handshake(self, sender: str, remote: Handshake) -> Handshake | ReplyThen:
        """Responder side (dispatcher thread): check, reply at once, then open the link in the background.

        The link opens only once the reply is with ZMQ: the peer joins the rendezvous after reading
        it, and a stall of this process while we wait there must not hold the reply back too."""
        self._check_open()
        if sender != peer_id(remote.engine_id, remote.rank):
            raise HandshakeError(f"handshake from {sender!r} names engine {remote.engine_id!r} rank {remote.rank}")
        try:
            check_compatible(self._local, remote)
        except HandshakeError as err:
            log.error("refused handshake from %s: %s", sender, err)
            raise
        if not remote.open_link:
            self._install(sender, remote, None, None)
            return replace(self._local, session=remote.session, open_link=False)
        link: Future[LinkBase] = Future()
        peer = self._install(sender, remote, link, self._link_id(sender, remote.session))

        def open_link() -> None:
            if not link.set_running_or_notify_cancel():  # close() came first: nothing to open
                return
            try:
                if not self._channel.flush():
                    raise TransferTimeout(f"handshake reply to {sender!r} not sent within {self._deadline_s}s")
                opened = self._open_link(sender, self._data_plane.address, remote.session)
            except BaseException as err:  # recorded in the future, seen by whoever waits for the link
                # dropped or closed meanwhile: its drop was logged, and nothing waits for this link any more
                log.log(logging.INFO if peer.cancel.is_set() else logging.ERROR, "link to %s failed to open: %s",
                        sender, err)
                settle(link, error=err)
                return
            settle(link, result=opened)  # a drop() or close() that came meanwhile closes it (its callback)

        def not_sent(why: BaseException) -> None:
            # The peer never read our reply: it will not come to the rendezvous, so no open waits there for it.
            log.info("handshake reply to %s not sent (%s: %s): link %s not opened", sender, type(why).__name__, why,
                     peer.link_id)
            settle(link, error=why)
            self._discard(peer)  # only this one: a link of an earlier handshake with the peer stays

        reply = replace(self._local, session=remote.session, open_link=True)
        # open_link settles the link whatever fails in it; should anything escape, the link's waiters see it.
        return ReplyThen(reply, lambda: submit_task(self._link_opener, f"link open to {sender}",
                                                    lambda err: settle(link, error=err), open_link), not_sent)

    def request(self, peer_id: str, control_addr: str, message: Message, need_link: bool, what: str,
                incarnation: int = 0, check: Callable[[Peer], None] | None = None) -> Peer:
        """Shake hands with ``peer_id`` if needed (:meth:`ensure`, ``incarnation`` as there) and send it the request
        ``message``; return once it is answered, with the handshake it went under (``what`` names it in the log).
        ``check(peer)`` runs between the two: what it raises goes to the caller, nothing sent.

        Refused for want of a handshake, or failed by a reset of the peer (it had lost us, it restarted, it moved:
        :class:`PeerResetError`), the request goes once more under a new handshake."""
        for attempt in (1, 2):
            peer = None
            try:
                peer = self.ensure(peer_id, control_addr, need_link, incarnation)
                if check is not None:
                    check(peer)
                self._channel.request(peer_id, message, self._deadline_s)
                return peer
            except PeerResetError as err:
                if attempt == 2:
                    raise
                log.info("%s to %s: %s; shaking hands again", what, peer_id, err)
                if peer is not None:
                    self.forget(peer, err)
        raise AssertionError("unreachable")

    def link(self, peer_id: str) -> LinkBase:
        """Our link to ``peer_id``, waiting up to the deadline for it to open."""
        peer = self.get(peer_id)
        if peer is None:
            raise PeerLostError(f"no handshake with {peer_id!r} (lost or never connected)")
        if peer.link is None:
            raise ProtocolError(f"no data link with {peer_id!r}: its handshake asked for control only")
        if not self._settled(peer.link):
            raise TransferTimeout(f"link to {peer_id!r} not open after {self._deadline_s}s")
        return peer.link.result()

    def link_peer(self, peer_id: str, link_id: str) -> Peer:
        """The handshake whose link ``link_id`` to ``peer_id`` is kept here, open or opening (an announcement names
        the link its tensor rides on); :meth:`when_open` waits for it."""
        with self._lock:
            peer = self._links.get(link_id)
        if peer is None or peer.peer_id != peer_id or peer.link is None:
            raise ProtocolError(f"{peer_id!r} names link {link_id!r}, which is not open between us")
        return peer

    def kept(self, link_id: str) -> Peer | None:
        """The handshake whose link ``link_id`` is kept here (open or opening); None once it was dropped."""
        with self._lock:
            return self._links.get(link_id)

    def when_open(self, peer: Peer, then: OnOpen) -> None:
        """Call ``then(link, None)`` once ``peer``'s link is open, or ``then(None, error)`` once it cannot be: it
        failed to open (its error: a TransferTimeout naming the link after the open's deadline_s), or it was
        dropped or closed first (PeerLostError, ClosedError). Never waits.

        Handlers on the channel's dispatcher call this instead of waiting for a link: one peer's link slow to
        open would hold every other peer's messages behind it, past their own deadlines. Per link, the calls
        run in the order they were made, one at a time (the n-th announced tensor is the n-th receive posted):
        at once on this thread when the link is open and nothing waits for it, else on the thread that settles
        or drops the link, after those queued before. ``then`` must not wait for another link."""
        if peer.link is None or peer.link_id is None:
            then(None, ProtocolError(f"no data link with {peer.peer_id!r}: its handshake asked for control only"))
            return
        link_id = peer.link_id
        first, gone = False, None
        with self._lock:
            if self._links.get(link_id) is not peer:  # dropped or closed already
                gone = self._gone_error(peer)
            waiting = self._waiting.get(link_id)
            if waiting is None and peer.link.done():
                pass  # settled and nothing queued: run it here, now
            elif waiting is None:
                waiting = self._waiting[link_id] = _Waiting(peer, error=gone)  # gone: nothing else will run it
                first = True
            if waiting is not None:
                waiting.queue.append(then)
        if waiting is None:
            self._run(peer, gone, then)
        elif first:
            if waiting.error is not None:
                self._run_waiting(waiting)
            else:  # on the thread that settles it (ensure()'s, or the link opener's), or here if it just did
                peer.link.add_done_callback(lambda _: self._run_waiting(waiting))

    def _retire(self, peers: Sequence[Peer], reason: BaseException | str | None = None) -> None:
        """Close the links of ``peers``, already out of ``_links`` (one still opening once it opens), fail what
        waits for them to open (``when_open``: at once, not when the open ends)."""
        for peer in peers:
            peer.cancel.set()  # an open still meeting the peer ends now (_open_link)
            with self._lock:
                waiting = self._waiting.get(peer.link_id) if peer.link_id is not None else None
                if waiting is not None and waiting.peer is peer and waiting.error is None:
                    waiting.error = self._gone_error(peer, reason)
            if waiting is not None:
                self._run_waiting(waiting)
            _close_link(peer)

    def drop(self, peer_id: str, reason: BaseException | str, before: int | None = None,
             at: str | None = None) -> None:
        """Forget ``peer_id`` and close every link to it, a link still opening once it opens; the next ``ensure``
        shakes hands anew. ``before``: only what was agreed under a lower ``loss_seq`` (a loss reported with
        that count: a handshake made after it stays); ``at``: only a handshake made with the life at that
        address, or as the responder (one made with the peer id at another address is another life's)."""
        def stale(peer: Peer) -> bool:
            return (peer.peer_id == peer_id and (before is None or peer.stamp < before)
                    and lost_there(at, peer.address))

        with self._lock:
            current = self._peers.get(peer_id)
            if current is not None and stale(current):
                del self._peers[peer_id]
            gone = [p for p in self._links.values() if stale(p)]
            for peer in gone:
                del self._links[peer.link_id]  # type: ignore[arg-type]
        if gone:  # a peer that closed on purpose (it said Bye) is no failure
            log.log(logging.INFO if isinstance(reason, PeerClosedError) else logging.WARNING,
                    "dropping peer %s: %s", peer_id, reason)
        self._retire(gone, reason)

    def forget(self, peer: Peer, reason: BaseException | str) -> None:
        """Forget this one handshake (the peer refused a request sent under it: it holds none with us), and
        close its link; a newer one with the same peer stays."""
        log.info("forgetting handshake with %s: %s", peer.peer_id, reason)
        self._discard(peer)

    def close(self) -> None:
        """Forget every peer and close every link, a link still opening once it opens; later calls raise ClosedError."""
        with self._lock:
            self._closed = True
            peers = list(self._links.values())
            self._peers, self._links = {}, {}
            waiting = list(self._waiting.values())
            for entry in waiting:
                entry.error = entry.error or ClosedError(
                    f"engine peers were closed while link {entry.peer.link_id!r} to {entry.peer.peer_id!r} was opening")
            self._changed.notify_all()  # known() waits no longer
        for entry in waiting:
            self._run_waiting(entry)
        for peer in peers:
            peer.cancel.set()  # an open still meeting the peer ends now (_open_link)
            if peer.link is not None:
                peer.link.cancel()  # a responder's open not started yet never starts
            _close_link(peer)

    def _install(self, peer_id: str, remote: Handshake, link: Future[LinkBase] | None, link_id: str | None,
                 stamp: int = -1, address: str | None = None, gate: _Gate | None = None) -> Peer:
        """Make this handshake the current one with ``peer_id``; ``gate``: the one our ensure() holds, checked
        under the lock the takeover is made under (:meth:`_check_gate`): a handshake with a later life that took
        it over and installed meanwhile is never replaced by ours with the earlier life.

        A control-only handshake never replaces a usable link of the same
        incarnation. A replaced link stays open while it is healthy: the peer
        may still be sending on it (both sides started a handshake at once); a
        broken one is closed, and so is one with another incarnation of the
        peer id (that process is gone: nothing will come on it).
        """
        peer = Peer(peer_id, remote, link, link_id, stamp, address)
        stale: list[Peer] = []
        with self._lock:
            self._check_open()
            if gate is not None:
                self._check_gate(peer_id, gate, address or remote.control_addr)
            self._record_life(peer_id, remote.incarnation, address or remote.control_addr)
            old = self._peers.get(peer_id)
            if (link is None and old is not None and old.link is not None and _usable(old, True)
                    and not _other_life(old, remote)):
                return old
            self._peers[peer_id] = peer
            self._changed.notify_all()  # known() waits for this
            if link_id is not None:
                self._links[link_id] = peer
            for other in [p for p in self._links.values() if p.peer_id == peer_id and p is not peer]:
                if not _usable(other, True) or _other_life(other, remote):
                    del self._links[other.link_id]  # type: ignore[arg-type]
                    stale.append(other)
        self._retire(stale)
        return peer

    def _discard(self, peer: Peer) -> None:
        """Forget one handshake whose link failed to open, and nothing else."""
        with self._lock:
            if self._peers.get(peer.peer_id) is peer:
                del self._peers[peer.peer_id]
            if peer.link_id is not None and self._links.get(peer.link_id) is peer:
                del self._links[peer.link_id]
        self._retire([peer])  # its link failed: nothing to close, but what is kept per link id goes

    @contextlib.contextmanager
    def _handshaking(self, peer_id: str, address: str, incarnation: int) -> Iterator[_Gate]:
        """Hold the gate of our handshakes with ``peer_id`` (at ``address``, naming its life ``incarnation``; 0: not
        known); it is forgotten once no ensure() needs it.

        A gate held for a handshake at another address with an earlier life of the peer id (both incarnations
        known) is not waited for: that life is gone (a peer id has one life at a time, and incarnations grow
        with their start time), and its handshake may wait ``deadline_s`` there. This one takes a new gate,
        and its move of the channel (once a move of the old attempt under way is done: ``_Gate.moving``)
        fails the old attempt's request (``PeerResetError`` at the old address); the
        old attempt moves and installs nothing after that (:meth:`_check_gate`), and those that waited behind it
        wait for this one. Without both incarnations the order of the two lives is not known: the gate is
        waited for."""
        with self._lock:
            gate, held = self._enter_gate(peer_id, address, incarnation)

        def acquire(timeout_s: float) -> bool:
            nonlocal gate
            if not gate.lock.acquire(timeout=timeout_s):
                return False
            with self._lock:
                if gate.taken_over is None:
                    gate.address, gate.incarnation = address, incarnation
                    return True
                # Taken over while we waited (by a handshake with a later life): wait for that one instead.
                gate.lock.release()
                self._leave_gate(peer_id, gate)
                gate, now_held = self._enter_gate(peer_id, address, incarnation)
                return now_held

        try:
            if not held and not self._channel.clock.wait(acquire, self._deadline_s):
                raise TransferTimeout(f"handshake with {peer_id!r} still in progress after {self._deadline_s}s")
            try:
                yield gate
            finally:
                with self._lock:
                    gate.address, gate.incarnation = None, 0
                gate.lock.release()
        finally:
            with self._lock:
                self._leave_gate(peer_id, gate)

    def _enter_gate(self, peer_id: str, address: str, incarnation: int) -> tuple[_Gate, bool]:
        """Under the lock: the gate an ensure() at ``address``, naming life ``incarnation``, waits for (see
        :meth:`_handshaking`), counted as its user; and whether it holds it already (it was free)."""
        gate = self._connecting.get(peer_id)
        if (gate is not None and gate.address is not None and gate.address != address
                and 0 < gate.incarnation < incarnation):
            log.info("handshake with %s at %s (incarnation %#x) goes before the one in progress at %s, with the "
                     "earlier incarnation %#x", peer_id, address, incarnation, gate.address, gate.incarnation)
            gate.taken_over = address
            gate = self._connecting[peer_id] = _Gate(threading.Lock(), moving=gate.moving)
        if gate is None:
            gate = self._connecting[peer_id] = _Gate(threading.Lock())
        gate.users += 1
        held = gate.lock.acquire(blocking=False)
        if held:
            gate.address, gate.incarnation = address, incarnation
        return gate, held

    def _leave_gate(self, peer_id: str, gate: _Gate) -> None:
        """Under the lock: one user of ``gate`` less; the gate is forgotten with its last user."""
        gate.users -= 1
        if gate.users == 0 and self._connecting.get(peer_id) is gate:
            del self._connecting[peer_id]
            self._changed.notify_all()  # known() waits no longer

    @staticmethod
    def _check_gate(peer_id: str, gate: _Gate, address: str) -> None:
        """:class:`PeerResetError` (its ``address``: ``address``) if a handshake with a later life of ``peer_id``
        took over our gate (see :meth:`_handshaking`): ours must neither move the channel back nor install what
        came from where the channel moved since."""
        if gate.taken_over is None:
            return
        raise PeerResetError(f"handshake with {peer_id!r} at {address!r} abandoned: one with a later life of it, "
                             f"at {gate.taken_over!r}, took over").stamped(address=address)

    def _run_waiting(self, waiting: _Waiting) -> None:
        """Run what waits for ``waiting.peer``'s link, in order, unless another thread is at it (it runs what
        comes meanwhile too): the link settled, or was dropped or closed (``waiting.error``)."""
        with self._lock:
            if waiting.running:
                return
            waiting.running = True
        while True:
            with self._lock:
                if not waiting.queue:
                    waiting.running = False
                    if self._waiting.get(waiting.peer.link_id) is waiting:  # type: ignore[arg-type]
                        del self._waiting[waiting.peer.link_id]  # type: ignore[arg-type]
                    return
                then, error = waiting.queue.popleft(), waiting.error
            self._run(waiting.peer, error, then)

    @staticmethod
    def _run(peer: Peer, gone: BaseException | None, then: OnOpen) -> None:
        """``then`` with ``peer``'s link: its error if it failed to open, else ``gone`` if it was dropped or closed
        (while it was opening, or since), else the open link."""
        assert peer.link is not None
        link: LinkBase | None = None
        error = gone
        if peer.link.cancelled():
            error = ClosedError(f"engine peers were closed before link {peer.link_id!r} to {peer.peer_id!r} opened")
        elif peer.link.done():
            error = peer.link.exception() or gone
            link = peer.link.result() if error is None else None
        assert link is not None or error is not None
        try:
            then(link, error)
        except Exception as err:  # noqa: BLE001 - one continuation's failure must not stop the link's others
            log.error("work waiting for link %s to %s failed: %s: %s", peer.link_id, peer.peer_id,
                      type(err).__name__, err, exc_info=err)

    def _gone_error(self, peer: Peer, reason: BaseException | str | None = None) -> BaseException:
        """What waited for ``peer``'s link fails with, once the link was dropped or closed before it opened."""
        if self._closed:
            return ClosedError(f"engine peers were closed while link {peer.link_id!r} to {peer.peer_id!r} was opening")
        why = "" if reason is None else f": {reason}"
        return PeerLostError(f"link {peer.link_id!r} to {peer.peer_id!r} was dropped{why}")

    def _link_id(self, peer_id: str, session: str) -> str:
        return self._channel.auth.link_id(self._channel.peer_id, peer_id, session)

    def _open_link(self, peer_id: str, store_addr: str, session: str) -> LinkBase:
        me = self._channel.peer_id
        link_rank = 0 if me < peer_id else 1
        link_id = self._link_id(peer_id, session)
        with self._lock:
            kept = self._links.get(link_id)
        if kept is None:  # dropped or closed before its open started: it would be closed as soon as it opened
            if self._closed:
                raise ClosedError(f"engine peers were closed before link {link_id!r} to {peer_id!r} opened")
            raise PeerLostError(f"link {link_id!r} to {peer_id!r} was dropped before it opened")
        log.debug("opening link %s to %s (rank %d, store %s)", link_id, peer_id, link_rank, store_addr)
        try:
            # Dropped or closed meanwhile (drop(), close()), it stops waiting for the peer: a peer lost between its
            # handshake and the rendezvous held one of the link opener's threads up to deadline_s, and a handful
            # of them every other peer's new links.
            link = self._data_plane.open_link(link_id, link_rank, store_addr, self._device, self._deadline_s,
                                              cancel=kept.cancel)
        except BaseException as err:
            if kept.cancel.is_set():
                raise self._gone_error(kept) from err
            raise
        log.debug("opened link %s to %s", link_id, peer_id)
        return link

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("engine peers are closed")

    def _record_life(self, peer_id: str, incarnation: int, address: str) -> None:
        """Under the lock: a handshake with ``peer_id``'s life ``incarnation`` (0: not known, nothing recorded),
        reached at ``address``. Another incarnation than the one recorded replaced it: that one is superseded."""
        if not incarnation:
            return
        lives = self._lives.get(peer_id)
        if lives is None:
            self._lives[peer_id] = _Lives(incarnation, address)
            while len(self._lives) > MAX_LIVES_PEERS:
                self._lives.popitem(last=False)
            return
        if lives.incarnation != incarnation:
            log.info("peer %s: incarnation %#x at %s replaced incarnation %#x at %s", peer_id, incarnation, address,
                     lives.incarnation, lives.address)
            lives.superseded.pop(incarnation, None)  # never there (new per channel), but never both at once
            lives.superseded[lives.incarnation] = lives.address
            while len(lives.superseded) > MAX_SUPERSEDED_LIVES:
                lives.superseded.popitem(last=False)
            lives.incarnation = incarnation
            self._lives.move_to_end(peer_id)
        lives.address = address

    def _stale(self, peer_id: str, control_addr: str, incarnation: int) -> str | None:
        """Under the lock: why a request naming ``peer_id`` at ``control_addr``, life ``incarnation`` (0: not
        known), names a life of the peer id that another replaced, or the current life at another address than
        the one where it is alive; None when it does not (the current life where it is, one never heard of, i.e.
        a restart or move we have yet to meet, or nothing to tell by).

        With an incarnation, only it counts: a replaced one is stale wherever it is named. Without one, a
        replaced life's address is stale while the current life is alive at another address (the channel hears
        it there, under that incarnation): a peer id has one life at a time, so a process restarted at that old
        address would have ended the current one, which the channel tells within ``deadline_s``."""
        lives = self._lives.get(peer_id)
        if lives is None:
            return None
        if incarnation == lives.incarnation:
            if not incarnation or control_addr == lives.address or not self._hears(peer_id, lives):
                return None
            # A life has one address (a channel never moves; a process that does restarts, with a new
            # incarnation): the reference's address is wrong. Moving there would drop the live peer, and every
            # transfer on it, for one bad request.
            return (f"reference to {peer_id!r} names its current life (incarnation {incarnation:#x}) at "
                    f"{control_addr!r}, but that life is alive at {lives.address!r}, where we reached it: the "
                    f"reference's address is wrong (edited, or another name of the host); the request is not sent, "
                    f"and the live peer is left alone")
        if incarnation:
            if incarnation in lives.superseded:
                was_at = lives.superseded[incarnation]
            elif incarnation < lives.incarnation and self._hears(peer_id, lives):
                # Never met, and started before the life alive now (incarnations grow with their start time): an
                # earlier life, restarted since. Not a restart to come, which would have the larger incarnation.
                return (f"stale reference to {peer_id!r}: it names {control_addr!r} (incarnation {incarnation:#x}, "
                        f"started {_started(incarnation)}), a life of that peer id earlier than incarnation "
                        f"{lives.incarnation:#x} (started {_started(lives.incarnation)}), alive at {lives.address!r}; "
                        f"the request is not sent (it cannot be held by the current life, and moving to the old "
                        f"address would reset it)")
            else:
                return None
        else:
            if control_addr == lives.address or control_addr not in lives.superseded.values():
                return None
            if not self._hears(peer_id, lives):
                return None
            was_at = control_addr
        named = f"incarnation {incarnation:#x}" if incarnation else "no incarnation"
        return (f"stale reference to {peer_id!r}: it names {control_addr!r} ({named}), a life of that peer id "
                f"(at {was_at!r}) replaced since by incarnation {lives.incarnation:#x} at {lives.address!r}; "
                f"the request is not sent (it cannot be held by the current life, and moving back would reset it)")

    def _hears(self, peer_id: str, lives: _Lives) -> bool:
        """Under the lock: whether the channel hears the current life of ``peer_id``, where we met it."""
        return (self._channel.peer_alive(peer_id) and self._channel.connected_address(peer_id) == lives.address
                and self._channel.peer_incarnation(peer_id) == lives.incarnation)

    def _current(self, peer: Peer, control_addr: str, need_link: bool) -> bool:
        """Under the lock: whether ``ensure`` may use ``peer`` as it is: usable, not lost by the channel (the
        dispatcher may not have dropped it yet), of the incarnation the channel hears now, and reached at
        ``control_addr`` when we connected to it ourselves."""
        if not _usable(peer, need_link) or not self._channel.peer_alive(peer.peer_id):
            return False
        heard = self._channel.peer_incarnation(peer.peer_id)
        if heard and peer.remote.incarnation and heard != peer.remote.incarnation:
            return False
        address = self._channel.connected_address(peer.peer_id)
        return address is None or address == control_addr

    # Waits run on the channel's clock: a pause of this whole process does not expire them (_handshaking's too).
    def _settled(self, link: Future[LinkBase]) -> bool:
        if link.done():  # the usual case, once per announced tensor: no waiter set up for it
            return True
        return self._channel.clock.wait(lambda s: not wait_futures([link], timeout=s).not_done, self._deadline_s)


def _other_life(peer: Peer, remote: Handshake) -> bool:
    """Whether ``peer`` was made with another incarnation of the peer id than ``remote``'s (0: not known)."""
    return bool(peer.remote.incarnation and remote.incarnation and peer.remote.incarnation != remote.incarnation)


def _usable(peer: Peer, need_link: bool) -> bool:
    if peer.link is None:
        return not need_link
    if not peer.link.done():
        return True
    if peer.link.cancelled() or peer.link.exception() is not None:
        return False
    link = peer.link.result()
    return not link.closed and link.broken is None


def _close_link(peer: Peer) -> None:
    """Close ``peer``'s link now, or once it opens if it is still opening (it would otherwise outlive every
    reference to it, with its threads and connection, until the data plane closes)."""
    if peer.link is not None:
        peer.link.add_done_callback(_close_opened)


def _close_opened(link: Future[LinkBase]) -> None:
    if not link.cancelled() and link.exception() is None:
        link.result().close()


def _started(incarnation: int) -> str:
    """When the channel of ``incarnation`` started (UTC), for messages."""
    ms = incarnation >> INCARNATION_RANDOM_BITS
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(ms / 1000)) + f".{ms % 1000:03d} UTC"
