"""The ZMQ control channel: typed messages, request/reply with deadlines, heartbeats, liveness.

One :class:`Channel` per engine rank. It binds one ROUTER (:attr:`Channel.address`)
and holds one DEALER per peer it :meth:`~Channel.connect`\\ s to. Connecting on
ONE side is enough: the other side answers through its ROUTER on the same TCP
connection (connecting on both sides also works). A peer keeps the path it has
while it is alive, so frames to it are FIFO: messages sent from one thread to
one peer arrive in order, which the engine relies on to match announcements
with data-plane tensors.

Threads (all named ``ncclkv-channel-*``, all joined by :meth:`Channel.close`):

* the I/O thread owns the ZMQ context and every socket (ZMQ sockets are not
  thread-safe); callers enqueue frames and wake it, so :meth:`~Channel.send`
  never blocks on the network. It also sends heartbeats, echoes the peers'
  heartbeats (for RTT), declares peers lost, and resolves replies to
  :meth:`~Channel.request` at once, even while a handler is busy. A reply
  that no request waits for (it timed out, its peer was lost, or it was a
  ``send``) is counted in ``late_replies`` and dropped, never dispatched: two
  handlers that answer in kind would otherwise ping-pong it forever;
* the dispatcher thread calls ``on_message(sender, body)`` for every other
  message, in arrival order, and ``on_peer_lost(peer_id, error)`` (a
  :class:`PeerClosedError` for a peer that closed its channel and said so, a
  :class:`PeerAuthError` for one whose handshake or frames fail authentication
  (as soon as that is certain, not at ``deadline_s``), a
  :class:`DuplicatePeerIdError` for one that refuses this channel as a life of its peer id that another live
  process replaced there, a :class:`PeerLostError` for one that went silent); handlers may call
  ``send`` and ``request``. A returned body is sent as the reply; an exception
  is logged and answered with an :class:`ErrorMsg` (never for an incoming
  ``ErrorMsg``, so two peers cannot ping-pong errors). Should the thread end
  anyway (a handler raised ``SystemExit``), the channel stops serving: its
  peers get a ``Bye``, its calls raise :class:`ClosedError`.

Each channel has a new :attr:`Channel.incarnation` (:func:`new_incarnation`), in its heartbeats
(the first frame it sends on every new path) and handshakes: a peer id heard
with another one restarted, and its earlier life is reported lost at once
(:class:`PeerResetError`), before a frame of the new one is handled. A peer
this channel declared lost (silent for ``deadline_s``, unreachable) that is
heard again, or sent to again, gets a ``Reset`` first, naming the incarnation
that was lost: it was only stopped, and drops what it holds about us (its
``on_peer_lost`` is told, with a :class:`PeerResetError`). Another life under
that peer id (restarted, and connected to before a frame of it was heard)
ignores it: it holds nothing of ours. Every loss reported carries ``loss_seq``
(:attr:`Channel.loss_seq`), so a handler can tell what came before it.

Malformed frames are counted in :attr:`Channel.stats` ``.rejected``, logged,
and answered with an ``ErrorMsg(code="protocol")`` on the connection they came
in on; the channel keeps serving. Logs and answers about bad frames are rate
limited, so a flood of them costs bounded work. Each channel has its own
``zmq.Context``, terminated on close after every socket was closed. Close
sends the frames ``send`` accepted, then every peer a ``Bye``, so they drop
this channel at once (logged as expected, not as a failure), and gives all of
it up to 0.2 s to leave; so close does not hang.

Authentication (``auth=``, a :class:`ncclkv.auth.ChannelAuth`; default: from
the environment, off if nothing is set): CURVE keys and a ZAP handler thread
(``ncclkv-channel-zap``, joined on close) admit only allowed clients to the
ROUTER, and a peer id this channel connected to only from the key that peer
proved; a shared secret adds an HMAC to every frame and drops frames without a
valid one unanswered, before decoding. See docs/SECURITY.md.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

from ._auth import WARNING_BURST, WARNINGS_PER_S
from ._channel_io import IoLoop
from ._clock import ActiveClock
from ._dispatch import Dispatcher, MessageHandler, PeerLostHandler, ReplyThen
from ._env import WILDCARD_HOSTS, env_settings
from ._peers import Budget, Counters, LossKind, PeerTable, loss_error, lost_there
from ._timeout import check_timeout
from .auth import ChannelAuth, curve_key, load_channel_auth
from .errors import ClosedError, PeerLostError, PeerResetError, TransferTimeout
from .protocol import INCARNATION_RANDOM_BITS, Envelope, ErrorMsg, Message, encode

__all__ = ["THREAD_PREFIX", "Channel", "ChannelStats", "MessageHandler", "PeerLostHandler", "ReplyThen",
           "check_address", "new_incarnation"]

log = logging.getLogger("ncclkv.channel")

THREAD_PREFIX = "ncclkv-channel"

_JOIN_S = 5.0  # how long close() waits for each thread
_EXPIRED_KEEP = 4096  # msg ids of requests that ended unanswered, remembered to drop their late replies quietly


@dataclass(frozen=True, slots=True)
class ChannelStats:
    """A snapshot of a channel's counters (heartbeats are not counted as sent/received).

    ``rejected`` counts every frame refused (malformed, oversized, misnamed or
    unauthenticated); ``auth_failures`` the frames refused for a missing, bad
    or replayed MAC, the CURVE clients refused by the allow-list, and the
    frames from a CURVE client whose key is not the one bound to the peer id
    it claims. ``late_replies`` counts the replies no request waited for
    (dropped, never dispatched). ``stale_resets`` counts the ``Reset`` frames
    ignored because they named another incarnation than this channel's: meant
    for an earlier life of its peer id, which a peer had lost.
    """

    sent: int
    received: int
    rejected: int
    late_replies: int
    peers_lost: int
    handler_errors: int
    auth_failures: int = 0
    stale_resets: int = 0


@dataclass(slots=True)
class _Pending:
    peer_id: str
    address: str | None = None  # where the request went (None: the peer only reached us)
    done: threading.Event = field(default_factory=threading.Event)
    reply: Message | None = None
    error: BaseException | None = None


class Channel:
    """A ZMQ control endpoint named ``peer_id`` (see the module docstring for the model).

    ``bind_host``, ``heartbeat_s``, ``deadline_s`` and ``max_frame_bytes``
    default to :func:`ncclkv._env.env_settings`, ``auth`` to
    :func:`ncclkv.auth.load_channel_auth` (pass ``ChannelAuth()`` for none).
    ``port=0`` binds a free port.
    ``deadline_s`` is both the default request timeout and the silence after
    which a peer is declared lost; it must exceed ``heartbeat_s``.
    """

    def __init__(
        self,
        peer_id: str,
        *,
        bind_host: str | None = None,
        port: int = 0,
        on_message: MessageHandler | None = None,
        on_peer_lost: PeerLostHandler | None = None,
        heartbeat_s: float | None = None,
        deadline_s: float | None = None,
        max_frame_bytes: int | None = None,
        auth: ChannelAuth | None = None,
    ) -> None:
        settings = env_settings()
        self.auth = load_channel_auth(settings) if auth is None else auth
        if not isinstance(self.auth, ChannelAuth):
            raise TypeError(f"auth must be a ChannelAuth, got {type(self.auth).__name__}")
        # Checked as given (env_settings checked its own): a bool or a string is no number of seconds.
        self.heartbeat_s = settings.heartbeat_s if heartbeat_s is None else check_timeout("heartbeat_s", heartbeat_s)
        self.deadline_s = settings.deadline_s if deadline_s is None else check_timeout("deadline_s", deadline_s)
        self.max_frame_bytes = settings.max_frame_bytes if max_frame_bytes is None else int(max_frame_bytes)
        host = settings.bind_host if bind_host is None else bind_host
        _check_args(peer_id, port, self.heartbeat_s, self.deadline_s, self.max_frame_bytes)
        self.peer_id = peer_id
        # This channel's life under its peer id, in its heartbeats (the first frame on each path) and handshakes:
        # a peer that hears another one under our id takes this one as lost (a process restarted at once, even
        # at the same address, is told apart).
        self.incarnation = new_incarnation()
        self._lock = threading.Lock()
        self._closed = False
        self._addresses: dict[str, str] = {}  # peer id -> the address connect() last opened its DEALER to
        self._pending: dict[int, _Pending] = {}
        self._expired: OrderedDict[int, None] = OrderedDict()
        # Warnings about unexpected replies: a peer controls how many come. I/O thread only.
        self._reply_warnings = Budget(WARNINGS_PER_S, WARNING_BURST)
        self._peers = PeerTable()
        self._counters = Counters()
        # Deadlines here leave out the time this process could not run (see ncclkv._clock).
        self.clock = ActiveClock(min(self.heartbeat_s, self.deadline_s / 4, 0.1))
        # The dispatcher exists before the socket is bound: a frame may arrive at once.
        self._dispatcher = Dispatcher(
            name=f"{THREAD_PREFIX}-dispatch[{peer_id}]",
            peer_id=peer_id,
            on_message=on_message,
            on_peer_lost=on_peer_lost,
            send_reply=lambda sender, body, reply_to: self._send(sender, body, reply_to, None),
            counters=self._counters,
            on_ended=self._on_dispatcher_ended,
        )
        self._io = IoLoop(
            peer_id=peer_id,
            bind_endpoint=f"tcp://{host}:{port or '*'}",
            max_frame_bytes=self.max_frame_bytes,
            heartbeat_s=self.heartbeat_s,
            deadline_s=self.deadline_s,
            peers=self._peers,
            counters=self._counters,
            deliver=self._on_envelope,
            lost=self._on_lost,
            auth=self.auth,
            clock=self.clock,
            incarnation=self.incarnation,
        )
        try:
            self._address = self._io.start(timeout_s=_JOIN_S)
        except BaseException:
            self._closed = True
            self._dispatcher.stop(_JOIN_S)
            raise
        log.info("channel %r listening on %s, auth: %s", peer_id, self._address, self.auth.describe())
        if host in WILDCARD_HOSTS and not self.auth.enabled:
            log.warning("channel %r listens on all interfaces (bind_host=%r) without authentication: "
                        "any host that reaches it can talk to it; see docs/SECURITY.md", peer_id, host)

    # -- public API ----------------------------------------------------------------
    @property
    def address(self) -> str:
        """The bound endpoint, ``tcp://HOST:PORT`` (with a wildcard bind host, advertise a real one)."""
        return self._address

    @property
    def stats(self) -> ChannelStats:
        c = self._counters
        auth_failures = c.auth_failures + self._io.curve_denied
        return ChannelStats(c.sent, c.received, c.rejected, c.late_replies, c.peers_lost, c.handler_errors,
                            auth_failures, c.stale_resets)

    def connect(self, peer_id: str, address: str, *, server_key: bytes | str | None = None) -> None:
        """Open a DEALER to ``peer_id`` at ``address`` (``tcp://host:port``); a no-op if the peer is alive,
        unless this channel connected to it at another address before, or it only reached us and its
        handshake named another address.

        The peer counts as alive from now: if nothing is heard from it within
        ``deadline_s`` it is declared lost. Non-blocking; frames sent before
        the TCP connection is up are queued. A peer alive here that this
        channel connected to at another address, or that only reached us
        with a handshake naming another one, moved (a process restarted
        under its id): the old one is lost now (its waiting requests fail
        with :class:`PeerResetError`, ``on_peer_lost`` is told, the loss
        carrying the old address), and its path is replaced by a DEALER to
        ``address``. With CURVE, ``server_key`` is the
        peer's public key (Z85), default ``auth.curve.server_key``; a peer
        that cannot prove it holds the matching secret is never talked to,
        and from then on frames under ``peer_id`` are accepted on this
        channel's ROUTER only from a client with that key. If ``peer_id``
        already reached us from a client with another key, that connection
        is no longer answered: this one is opened instead.
        """
        self._check_open()
        _check_peer_id(peer_id)
        check_address(address)
        key = curve_key(server_key, "server_key") if server_key is not None else None
        if key is not None and self.auth.curve is None:
            raise ValueError(f"server_key given for peer {peer_id!r} but this channel has no CURVE auth")
        with self._lock:  # the path's switch is queued under it too: see below
            self._check_open()
            previous = self._reached_at_locked(peer_id)
            self._addresses[peer_id] = address
            self._peers.given_address(peer_id)
            if previous is not None and previous != address:
                self._peers.forget_said(peer_id)  # the path leads to ``address`` from now, for every request
                if self._peers.alive(peer_id):  # before the caller's next request: that one goes to the new address
                    # Reported before the switch, as before: ahead of whatever the new path brings.
                    self._report_loss(peer_id, *self._lose_locked(
                        peer_id, f"connect() to it at {address!r}: it moved (restarted?) from {previous!r}", "reset",
                        previous))
                self._peers.add(peer_id, self.clock.now())  # alive for the next request (renewed at the switch)
                # Queued as the address is recorded: a request another thread makes meanwhile, recorded at
                # ``address`` (and let through by its ``at``), is queued after the switch, never on the old path.
                self._io.submit_connect(peer_id, address, key, replace=previous)
            # With CURVE the I/O thread binds the key even to a live peer (one that reached us first).
            elif self._peers.add(peer_id, self.clock.now()) or self.auth.curve is not None:
                self._io.submit_connect(peer_id, address, key)

    def send(self, peer_id: str, body: Message, reply_to: int | None = None) -> int:
        """Queue ``body`` for ``peer_id`` and return its msg_id; thread-safe, never blocks.

        Raises ``ValueError`` for a peer never connected or heard from,
        :class:`PeerLostError` for a lost one (:class:`PeerAuthError` if it was
        lost for failing authentication), :class:`ProtocolError` for a
        body the peer would refuse (bad value, frame over ``max_frame_bytes``).
        """
        return self._send(peer_id, body, reply_to, None)

    def request(self, peer_id: str, body: Message, timeout_s: float | None = None, *, at: str | None = None) -> Message:
        """Send ``body`` and wait for the reply to it (``timeout_s`` defaults to ``deadline_s``).

        ``at``: the address the caller means to reach ``peer_id`` at. If the channel's path to it leads
        elsewhere now (:meth:`connected_address`: another caller moved it since, or None: another life of it
        reached us since, at an address not known), nothing is sent: :class:`PeerResetError`, its ``address`` ``at``.

        Raises :class:`TransferTimeout` past the deadline, :class:`PeerLostError`
        if the peer is lost meanwhile (:class:`PeerAuthError` as soon as its
        ZMQ handshake is refused for certain, naming its address and why; see
        docs/SECURITY.md), :class:`ClosedError` if the channel
        closes. An :class:`ErrorMsg` reply is raised as
        ``ErrorMsg.to_exception(peer_id)``: the ncclkv error of its code
        (``timeout`` -> TransferTimeout, ``capacity`` -> CapacityError, ...,
        other codes -> TransferError), naming the peer, code, request and text.
        """
        wait_s = self.deadline_s if timeout_s is None else check_timeout("timeout_s", timeout_s)
        pending = _Pending(peer_id)
        msg_id = self._send(peer_id, body, None, pending, at)
        if not self.clock.wait(pending.done.wait, wait_s):
            with self._lock:
                still_pending = self._pending.pop(msg_id, None) is not None
                if still_pending:
                    self._expire_locked((msg_id,))
            if still_pending:
                raise TransferTimeout(
                    f"no reply from peer {peer_id!r} to {type(body).__name__} (msg_id {msg_id}) within {wait_s}s"
                )
            # Another thread took the entry just now and is about to finish it: wait for that.
            if not pending.done.wait(_JOIN_S):
                raise TransferTimeout(f"the outcome of {type(body).__name__} (msg_id {msg_id}) to peer {peer_id!r} "
                                      f"was not recorded within {_JOIN_S}s")
        if pending.error is not None:
            raise pending.error
        assert pending.reply is not None
        return pending.reply

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every frame sent before this call is with ZMQ, whose own threads deliver it even
        while this process's Python threads cannot run; False after ``timeout_s`` (default ``deadline_s``)."""
        wait_s = self.deadline_s if timeout_s is None else check_timeout("timeout_s", timeout_s)
        with self._lock:  # as close() marks the channel closed: queued before the I/O thread's last turn
            self._check_open()
            done = self._io.submit_flush()
        return self.clock.wait(done.wait, wait_s)

    def peer_alive(self, peer_id: str) -> bool:
        """True if ``peer_id`` is known and was heard from within ``deadline_s``."""
        return self._peers.alive(peer_id)

    def peer_incarnation(self, peer_id: str) -> int:
        """The incarnation (another peer's :attr:`incarnation`) its frames carried last; 0 if none was heard."""
        return self._peers.incarnation(peer_id)

    def connected_address(self, peer_id: str) -> str | None:
        """Where this channel reaches ``peer_id``: for a peer that only reached us, the control address its
        handshake named (kept once it is lost, as the address given to :meth:`connect` is), else the address
        :meth:`connect` was last given for it (not once the life there restarted on a connection to us, or was lost
        and another life reached us: the new one only reached us); None if neither."""
        with self._lock:
            return self._reached_at_locked(peer_id, lost_too=True)

    def _reached_at_locked(self, peer_id: str, *, lost_too: bool = False) -> str | None:
        """Under ``self._lock``: where a request to ``peer_id`` goes: a peer that only reached us is where its
        handshake said (not where an earlier connect() was told), else where connect() was last told; None if
        neither (``lost_too``: the life lost last counts, see :meth:`connected_address`). Not where connect() was
        told while the life alive was first heard after the loss of the one there (it only reached us)."""
        said = self._peers.said_at(peer_id, lost_too=lost_too)
        if said or self._peers.came_after_loss(peer_id):
            return said or None
        return self._addresses.get(peer_id)

    @property
    def loss_seq(self) -> int:
        """How many peer losses this channel reported so far; each one's error carries its count as
        :attr:`~ncclkv.errors.PeerLostError.loss_seq`. Read it before starting something with a peer (a
        handshake): a loss reported later with a higher count happened after the start, and ends it."""
        return self._peers.loss_seq

    def last_rtt(self, peer_id: str) -> float | None:
        """The latest heartbeat round trip to ``peer_id`` in seconds (None before the first echo)."""
        return self._peers.rtt(peer_id)

    def close(self) -> None:
        """Stop and join both threads, close every socket; idempotent.

        Every frame ``send`` accepted goes out, then a ``Bye`` to each peer;
        they get up to 0.2 s to leave (the sockets' linger), after which the
        rest is dropped (linger 0 if the I/O thread had failed). Pending
        requests fail with :class:`ClosedError`, and so does any later
        ``connect``/``send``/``request``.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pending = self._take_pending_locked()
        for entry in pending:
            self._finish(entry, None, ClosedError(f"channel {self.peer_id!r} closed while waiting for a reply"))
        if not self._io.stop(_JOIN_S):
            log.error("channel %r: I/O thread did not stop within %ss", self.peer_id, _JOIN_S)
        if not self._dispatcher.stop(_JOIN_S):
            log.error("channel %r: a message handler is still running after %ss", self.peer_id, _JOIN_S)

    def __enter__(self) -> Channel:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"Channel({self.peer_id!r}, {self._address}, {state})"

    # -- internals -------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"channel {self.peer_id!r} is closed")
        # Before the I/O thread: a dispatcher that ended stops that one too, and is the cause to name.
        if not self._dispatcher.running:
            raise ClosedError(f"channel {self.peer_id!r} stopped serving: its dispatcher thread ended (see the log)")
        if not self._io.running:
            raise ClosedError(f"channel {self.peer_id!r} stopped serving: its I/O thread failed (see the log)")

    def _send(self, peer_id: str, body: Message, reply_to: int | None, pending: _Pending | None,
              at: str | None = None) -> int:
        self._check_open()
        self._peers.require_alive(peer_id)
        msg_id = self._peers.next_msg_id()
        frame = encode(Envelope(self.peer_id, msg_id, reply_to, body), self.max_frame_bytes)
        # Queued under the lock that close() takes to mark the channel closed: a frame accepted here is
        # in the queue before close() stops the I/O thread, whose last act is to send the queue. Neither
        # step can block (the submit only enqueues and writes a wake-up byte to a non-blocking socket).
        with self._lock:
            self._check_open()
            if pending is not None:
                # Rechecked under this lock: _on_lost marks the peer lost before it takes this lock to fail
                # its entries, so a loss since require_alive above is seen either here or by _on_lost.
                if not self._peers.alive(peer_id):
                    why, how = self._peers.loss(peer_id)
                    raise loss_error(how)(f"peer {peer_id!r} was lost before {type(body).__name__} could be sent: "
                                          f"{why or 'nothing heard within the deadline'}")
                pending.address = self._reached_at_locked(peer_id)
                if at is not None and pending.address != at:
                    # Checked under the lock connect() moves the path under: the frame would reach another life (None:
                    # one that only reached us since, at an address not known: a restart, or a life after a loss).
                    where = (f"at {pending.address!r} now (it moved)" if pending.address is not None else
                             "only on another life's connection to us now (it restarted, or was lost)")
                    raise PeerResetError(
                        f"{type(body).__name__} for peer {peer_id!r} at {at!r} not sent: the channel reaches it "
                        f"{where}").stamped(address=at)
                self._pending[msg_id] = pending
            self._io.submit_send(peer_id, frame)
        return msg_id

    def _take_pending_locked(self) -> list[_Pending]:
        """Under ``self._lock``: remove every waiting request, to be failed by the caller (outside the lock)."""
        pending, self._pending = self._pending, {}
        self._expire_locked(pending)
        return list(pending.values())

    def _on_dispatcher_ended(self) -> None:
        """On the dispatcher thread, ending while the channel is open: stop serving now. Left running, the I/O
        thread would keep answering heartbeats, so peers would never drop this rank, while no request to it is
        answered again; stopped, it says Bye and they drop it at once. Requests waiting here fail, and later calls
        raise ClosedError (``_check_open``); close() still joins what is left."""
        with self._lock:  # a request queued after this sees the dispatcher stopped in _check_open
            pending = self._take_pending_locked()
        error = f"channel {self.peer_id!r} stopped serving while waiting for a reply: its dispatcher thread ended"
        for entry in pending:
            self._finish(entry, None, ClosedError(error))
        if not self._io.stop(_JOIN_S):
            log.error("channel %r: I/O thread did not stop within %ss", self.peer_id, _JOIN_S)

    def _expire_locked(self, msg_ids: Iterable[int]) -> None:
        """Under ``self._lock``: remember request ids that ended unanswered, so their late replies are
        dropped quietly (the oldest forgotten past :data:`_EXPIRED_KEEP`)."""
        for msg_id in msg_ids:
            self._expired[msg_id] = None
        while len(self._expired) > _EXPIRED_KEEP:
            self._expired.popitem(last=False)

    @staticmethod
    def _finish(entry: _Pending, reply: Message | None, error: BaseException | None) -> None:
        entry.reply, entry.error = reply, error
        entry.done.set()

    def _on_envelope(self, envelope: Envelope) -> None:
        """On the I/O thread: resolve a reply to a pending request, drop any other reply, queue the rest
        for the handler."""
        if envelope.reply_to is None:
            self._dispatcher.put_message(envelope)
            return
        with self._lock:
            entry = self._pending.get(envelope.reply_to)
            if entry is not None and entry.peer_id == envelope.sender:
                del self._pending[envelope.reply_to]
            else:
                entry = None
            expired = envelope.reply_to in self._expired
        if entry is not None:
            body = envelope.body
            if isinstance(body, ErrorMsg):
                self._finish(entry, None, body.to_exception(envelope.sender))
            else:
                self._finish(entry, body, None)
            return
        # Never dispatched: a handler answering it would send a reply the peer cannot match either.
        self._counters.late_replies += 1
        if expired:  # its request timed out or failed: expected after a deadline or a loss
            log.debug("channel %r: late reply from %r to msg_id %s dropped", self.peer_id, envelope.sender,
                      envelope.reply_to)
        elif self._reply_warnings.take(self.clock.now()):  # a reply to a send(), e.g. an error; or a confused peer
            log.warning("channel %r: dropped a reply from %r to msg_id %s, which no request waits for: %s",
                        self.peer_id, envelope.sender, envelope.reply_to, envelope.body)

    def _on_lost(self, peer_id: str, reason: str, how: LossKind, address: str | None = None,
                 incarnation: int = 0, left: bool = False) -> None:
        """On the I/O thread (or in ``connect``, for a peer that moved): fail the requests waiting on ``peer_id``
        and schedule ``on_peer_lost``, with a :class:`PeerClosedError` (``how="closed"``: it said Bye), a
        :class:`PeerResetError` (``"reset"``: what it held about us, or we about it, is gone while it is there),
        a :class:`PeerAuthError` (``"auth"``: it cannot authenticate with us, for certain), a
        :class:`DuplicatePeerIdError` (``"duplicate"``: it refuses us, another live process under our peer id
        replaced us there) or a
        :class:`PeerLostError`, each carrying the loss's ``loss_seq`` and the ``address`` the life lost was
        reached at (None: not known), and the ``incarnation`` of the life lost when a new one replaced it (0: not
        that). ``left``: that new one spoke on a connection to us, and our DEALER to ``address`` is gone: the
        address connect() was given is no longer where the peer id is reached (else a connect() to where the new
        life is would take it for a life that moved away, and lose it)."""
        with self._lock:
            if left and address is not None and self._addresses.get(peer_id) == address:
                del self._addresses[peer_id]
            failed, lost = self._lose_locked(peer_id, reason, how, address, incarnation)
        self._report_loss(peer_id, failed, lost)

    def _report_loss(self, peer_id: str, failed: list[tuple[_Pending, PeerLostError]], lost: PeerLostError) -> None:
        """Fail the requests :meth:`_lose_locked` took, and schedule ``on_peer_lost`` (neither waits: under the lock
        or not)."""
        for entry, error in failed:
            self._finish(entry, None, error)
        self._dispatcher.put_lost(peer_id, lost)

    def _lose_locked(self, peer_id: str, reason: str, how: LossKind, address: str | None,
                     incarnation: int = 0) -> tuple[list[tuple[_Pending, PeerLostError]], PeerLostError]:
        """Under ``self._lock``: count the loss and take the requests it fails; returned with their errors, and the
        error for ``on_peer_lost``, for the caller to finish and schedule (see :meth:`_on_lost`)."""
        kind = loss_error(how)
        seq = self._peers.next_loss_seq()
        # Not a request that went to another address since (connect() to a restarted life): not the lost one's.
        mine = [k for k, v in self._pending.items() if v.peer_id == peer_id and lost_there(address, v.address)]
        entries = [self._pending.pop(k) for k in mine]
        self._expire_locked(mine)  # a peer that was only stalled may still answer
        failed = [(entry, kind(f"peer {peer_id!r} lost while waiting for a reply: {reason}").stamped(
            seq, address, incarnation)) for entry in entries]
        return failed, kind(f"peer {peer_id!r} lost: {reason}").stamped(seq, address, incarnation)


def new_incarnation() -> int:
    """A channel's incarnation: now in ms since the epoch, then ``INCARNATION_RANDOM_BITS`` random bits (63 bits
    until the year 2248). New per channel (two started in the same millisecond share one with odds of 1 in
    2**20), and a later life of a peer id has a larger one, so a reference to
    an earlier life than the one alive is told stale (``engine._links``) as long as the hosts' clocks are closer
    than the time between two lives (a process restart)."""
    return (time.time_ns() // 1_000_000) << INCARNATION_RANDOM_BITS | secrets.randbits(INCARNATION_RANDOM_BITS)


def check_address(address: object) -> None:
    """``tcp://host:port`` or ``ipc://path``, encodable for ZMQ; ValueError naming it (addresses come from
    other engines' kv_transfer_params: a bad one must fail its caller, not the channel's I/O thread)."""
    if not isinstance(address, str) or not address.startswith(("tcp://", "ipc://")) or address == "ipc://":
        raise ValueError(f"address must be tcp://host:port or ipc://path, got {address!r}")
    try:
        address.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"address {address!r} is not valid UTF-8") from None
    if address.startswith("tcp://"):
        host, colon, port = address[len("tcp://"):].rpartition(":")
        # ASCII digits: str.isdigit() takes others ('\u0663', which int() reads, ZMQ refuses; '\u00b2', which
        # int() refuses, naming only the digit)
        if not colon or not host or not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
            raise ValueError(f"address must be tcp://host:port with a port 1-65535, got {address!r}")
        if any(c.isspace() for c in host):  # ZMQ's connect refuses it (EINVAL)
            raise ValueError(f"address {address!r} has a space in its host")


def _check_peer_id(peer_id: str) -> None:
    """A peer id is a ZMQ routing id: at most 255 bytes, and one starting with NUL is reserved by ZMQ."""
    if not isinstance(peer_id, str) or not peer_id or peer_id.startswith("\x00") or len(peer_id.encode()) > 255:
        raise ValueError(f"peer_id must be a non-empty str of at most 255 UTF-8 bytes, not starting with NUL; got {peer_id!r}")


def _check_args(peer_id: str, port: int, heartbeat_s: float, deadline_s: float, max_frame_bytes: int) -> None:
    _check_peer_id(peer_id)
    if not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"port must be an int in [0, 65535] (0: a free port), got {port!r}")
    if not heartbeat_s < deadline_s:  # a peer would be declared lost between two of its heartbeats
        raise ValueError(f"heartbeat_s must be < deadline_s, got heartbeat_s={heartbeat_s}, deadline_s={deadline_s}")
    if max_frame_bytes < 1024:
        raise ValueError(f"max_frame_bytes must be >= 1024, got {max_frame_bytes}")
