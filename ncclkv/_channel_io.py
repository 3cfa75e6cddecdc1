"""The one thread that touches a channel's ZMQ sockets.

ZMQ sockets are not thread-safe, so every socket of a channel (its ROUTER,
its DEALERs, and its context) is created, used and closed on this thread.
Callers hand it work through a queue and wake it through a socketpair.

Routing: a peer we ``connect()`` to is reached through our DEALER (routing id
= our peer id) and answers through its ROUTER; a peer that connected to us is
reached through our ROUTER by its routing id. A peer keeps the path it has
while it is alive, so everything sent to it travels on one ordered pipe.

Authentication (:mod:`ncclkv.auth`): with CURVE the ROUTER is a CURVE server
guarded by a ZAP thread (started before the bind, joined on close) and every
DEALER a CURVE client; a peer we connected to is bound to the server key it
proved, and the ROUTER drops frames under its id from any other client key.
With a shared secret every frame is sealed on the way out (naming the path:
from a DEALER or from the ROUTER) and opened on the way in, before decoding,
and a frame that fails is dropped unanswered. Hostile input costs bounded
work: rejection replies and warning lines are token-bucketed, and frames over
twice ``max_frame_bytes`` make ZMQ drop the connection before buffering them.
"""

from __future__ import annotations

import logging
import queue
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import zmq

from ._auth import FrameGate, HandshakeWatch, ZapGuard, configure_curve_client
from ._clock import ActiveClock
from ._peers import MAX_LOST_PEERS, Budget, Counters, LossKind, PeerTable
from .auth import ChannelAuth
from .errors import ProtocolError, TransferTimeout
from .protocol import MAX_TEXT_CHARS, Bye, Envelope, ErrorCode, ErrorMsg, Handshake, Heartbeat, Reset, encode

__all__ = ["IoLoop"]

log = logging.getLogger("ncclkv.channel")

_BATCH = 256  # frames read from one socket per poll, so no socket starves the others
_ZAP_JOIN_S = 2.0
_MAX_SOCKETS = 8192  # ZMQ's default, 1023, held ~1000 peers; the descriptor limit (ulimit -n) is the real bound
_REPLACED_WHY = (": a late frame of a dead process, or two live processes share the peer id (each engine needs an "
                 "engine_id of its own)")  # the end of a refusal of a replaced life's frame (see IoLoop._handle)
_BYE_LINGER_MS = 200  # on close: how long the Byes (and frames queued before them) may take to leave
# ERROR lines about two live processes under one peer id: each flip between them would log one, and fail requests
_DUPLICATE_LOGS_PER_S, _DUPLICATE_LOG_BURST = 0.1, 3.0

# kind, peer id, address (a reconnect's: with the one it moved from) / frame / flush event, server key
_Command = tuple[str, str, str | tuple[str, str] | bytes | threading.Event, bytes | None]


@dataclass(slots=True)
class _Link:
    dealer: zmq.Socket | None = None  # set when we connected to the peer
    routing_id: bytes | None = None  # set when the peer connected to us
    client_key: str | None = None  # CURVE: the key (Z85) of the client on that connection
    address: str = ""  # where the dealer connects
    watch: HandshakeWatch | None = None  # the dealer's ZMQ handshakes, until one succeeded (its own sockets)


class IoLoop:
    """Owns the context and sockets; runs the poll loop, heartbeats and liveness checks."""

    def __init__(
        self,
        *,
        peer_id: str,
        bind_endpoint: str,
        max_frame_bytes: int,
        heartbeat_s: float,
        deadline_s: float,
        peers: PeerTable,
        counters: Counters,
        deliver: Callable[[Envelope], None],
        lost: Callable[..., None],  # peer id, reason, how, address lost at[, incarnation lost: a restart, left it]
        auth: ChannelAuth,
        clock: ActiveClock,
        incarnation: int,
    ) -> None:
        self._peer_id = peer_id
        self._incarnation = incarnation  # in our heartbeats (the first frame on every new path) and echoes
        self._bind_endpoint = bind_endpoint
        self._max_frame_bytes = max_frame_bytes
        self._heartbeat_s = heartbeat_s
        self._deadline_s = deadline_s
        self._peers = peers
        self._counters = counters
        self._deliver = deliver
        self._lost = lost
        self._auth = auth
        self._clock = clock  # liveness runs on time this process could run; it sets the loop's tick
        # CURVE: peer id -> the key (Z85) it proved as a server when we connected; its DEALER holds the same pair.
        # Kept after a loss, so a lost peer's id stays bound; grows only with the ids connect() was called for.
        self._keys: dict[str, str] = {}
        self._gate = FrameGate(
            peer_id=peer_id, max_frame_bytes=max_frame_bytes, auth=auth, counters=counters,
            next_msg_id=peers.next_msg_id, peer_keys=self._keys, wrong_answer=self._wrong_answer,
        )
        self._zap: ZapGuard | None = None
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._wake_rx, self._wake_tx = socket.socketpair()
        self._wake_rx.setblocking(False)
        self._wake_tx.setblocking(False)
        self._wake_pending = False
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        self._links: dict[str, _Link] = {}
        self._reading_before_loss = False  # _send is reading after a lost route: no nested read
        # Peers we declared lost (silent, unreachable) that may still hold state about us, with the incarnation
        # they had and why: the first frame we send one again, or the first we hear from that same incarnation,
        # is answered by a Reset first (it then drops that state and shakes hands anew). The Reset names that
        # incarnation: sent on a new path (a DEALER we open to the peer id's address), it may reach another life,
        # which ignores it (see _handle). Oldest first, bounded.
        self._reset_due: OrderedDict[str, tuple[int, str]] = OrderedDict()
        self._hb_seq = 0
        self.address = ""
        # Peer ids whose routing id on our ROUTER a replaced life holds (ZMQ gives it to the connection made last):
        # a refused frame of that life came on it. Its plain frames there (no incarnation: requests, replies, a
        # Reset, a Bye) are that life's, never the live one's, and are refused too, until a life not replaced
        # greets on it (every channel's new path starts with a heartbeat naming its life). Oldest first, bounded.
        self._held_by_replaced: OrderedDict[str, int] = OrderedDict()
        self._duplicate_logs = Budget(_DUPLICATE_LOGS_PER_S, _DUPLICATE_LOG_BURST)
        self._thread = threading.Thread(target=self._run, name=f"ncclkv-channel-io[{peer_id}]", daemon=True)

    # -- called from other threads -------------------------------------------------
    def start(self, timeout_s: float) -> str:
        self._thread.start()
        if not self._ready.wait(timeout_s):
            # No owner will ever stop it: stop it now (it leaves at its first turn, if it ever gets there).
            stopped = self.stop(timeout_s)
            still = "" if stopped else "; it has not stopped yet, and will once it starts"
            raise TransferTimeout(f"channel I/O thread did not start within {timeout_s}s{still}")
        if self._start_error is not None:
            self._thread.join(timeout_s)
            raise self._start_error
        return self.address

    @property
    def running(self) -> bool:
        return self._thread.is_alive() and not self._stop.is_set()

    @property
    def curve_denied(self) -> int:
        """CURVE clients the ZAP handler refused so far."""
        zap = self._zap
        return 0 if zap is None else zap.denied

    def submit_send(self, peer_id: str, frame: bytes) -> None:
        self._submit(("send", peer_id, frame, None))

    def submit_connect(self, peer_id: str, address: str, server_key: bytes | None = None,
                       replace: str = "") -> None:
        """Open a DEALER to ``peer_id`` unless it has a path; ``replace``: the address it moved from (its path there
        is dropped first)."""
        if replace:
            self._submit(("reconnect", peer_id, (address, replace), server_key))
        else:
            self._submit(("connect", peer_id, address, server_key))

    def submit_flush(self) -> threading.Event:
        """An event set once every frame submitted before this call was handed to ZMQ."""
        done = threading.Event()
        self._submit(("flush", "", done, None))
        return done

    def stop(self, timeout_s: float) -> bool:
        """Stop the loop and wait for it; True if the thread ended within ``timeout_s``."""
        self._stop.set()
        self._wake()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)
        stopped = not self._thread.is_alive()
        if stopped:
            self._wake_rx.close()
            self._wake_tx.close()
        return stopped

    def _submit(self, command: _Command) -> None:
        self._commands.put(command)
        if not self._wake_pending:  # the loop clears the flag before it drains the queue
            self._wake_pending = True
            self._wake()

    def _wake(self) -> None:
        try:
            self._wake_tx.send(b"\x01")
        except (BlockingIOError, OSError):
            pass  # buffer full means a wake-up is already pending; closed means we are stopping

    # -- the I/O thread --------------------------------------------------------------
    def _run(self) -> None:
        context = zmq.Context()
        # A DEALER per peer, a monitor pair while a handshake is due, and a probe while they keep failing
        context.set(zmq.MAX_SOCKETS, _MAX_SOCKETS)
        self._router = context.socket(zmq.ROUTER)
        self._poller = zmq.Poller()
        try:
            self._open(context)
        except BaseException as exc:  # reported to start(), which raises it in the caller
            self._start_error = exc
            self._router.close(linger=0)
            self._terminate(context)
            self._ready.set()
            return
        self._ready.set()
        try:
            self._loop()
        except Exception:
            log.exception("channel %r: I/O thread failed; the channel stops serving", self._peer_id)
            for peer_id in list(self._links):  # fail their requests now rather than at their deadlines
                self._declare_lost(peer_id, "the channel's I/O thread failed")
        finally:
            self._clock.stop()
            linger_ms = 0
            if self._stop.is_set():  # closing, not failing: send what send() accepted, tell the peers, let it leave
                try:  # the last turn may have drained the queue before the caller's last frames came
                    self._run_commands(False)
                except Exception:  # the sockets must still close
                    log.exception("channel %r: failed to send the frames queued at close", self._peer_id)
                if self._links:
                    self._say_bye()
                    linger_ms = _BYE_LINGER_MS
            for peer_id in list(self._links):
                self._drop_link(peer_id, linger_ms)
            self._router.close(linger=linger_ms)
            self._terminate(context)

    def _terminate(self, context: zmq.Context) -> None:
        """Stop the ZAP thread, then end the context (every socket is closed: with linger 0, or at most
        ``_BYE_LINGER_MS`` after the Byes, so this waits no longer)."""
        if self._zap is not None and not self._zap.stop(_ZAP_JOIN_S):
            log.error("channel %r: ZAP thread did not stop within %ss; destroying its sockets", self._peer_id, _ZAP_JOIN_S)
            context.destroy(linger=0)
            return
        context.term()

    def _open(self, context: zmq.Context) -> None:
        self._configure(self._router)
        self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # unknown routing id -> error, not a silent drop
        self._router.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted peer takes its id over
        if self._auth.curve is not None:  # the ZAP handler must exist before the first connection
            self._zap = ZapGuard(context, self._auth.curve, self._peer_id)
            self._zap.start()
            self._zap.configure_server(self._router)
        self._router.bind(self._bind_endpoint)
        self.address = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
        self._poller.register(self._router, zmq.POLLIN)
        self._poller.register(self._wake_rx, zmq.POLLIN)

    def _configure(self, sock: zmq.Socket) -> None:
        sock.setsockopt(zmq.LINGER, 0)
        # Frames up to twice the limit reach decode() and get a typed rejection; larger ones
        # make ZMQ drop the connection before buffering them.
        sock.setsockopt(zmq.MAXMSGSIZE, 2 * self._max_frame_bytes + 1024)
        sock.setsockopt(zmq.SNDHWM, 0)  # never drop or block; a lost peer's queued frames go with its socket
        sock.setsockopt(zmq.RCVHWM, 0)

    def _loop(self) -> None:
        next_beat = self._clock.now()
        while not self._stop.is_set():
            ready = dict(self._poller.poll(timeout=self._clock.tick_s * 1000))
            turn = self._clock.tick()
            if turn.paused_s:
                log.warning("channel %r: this process did not run for %.1fs; not counted against peers' deadlines",
                            self._peer_id, turn.paused_s)
            # Every turn, not only on a wake-up: a queued command never waits for another submit.
            self._run_commands(self._wake_rx.fileno() in ready)  # zmq.Poller reports a plain socket by its fd
            if self._router in ready:
                self._drain(self._router, None)
            for peer_id, link in list(self._links.items()):
                # a link dropped while draining an earlier socket has a closed dealer: skip it
                if link.dealer is not None and link.dealer in ready and self._links.get(peer_id) is link:
                    self._drain(link.dealer, peer_id)
                watch = link.watch
                if watch is not None and any(s in ready for s in watch.sockets) and self._links.get(peer_id) is link:
                    self._watch(peer_id, link, watch)
            if turn.now >= next_beat:
                self._beat()
                next_beat = turn.now + self._heartbeat_s
            for peer_id, reason in self._peers.overdue(turn.now, self._deadline_s):
                link = self._links.get(peer_id)
                suspect = link.watch.suspect if link is not None and link.watch is not None else None
                self._lose(peer_id, reason if suspect is None else f"{reason}; {suspect}")

    def _run_commands(self, woken: bool) -> None:
        # Read the wake-up bytes BEFORE clearing the flag: a submit that saw the
        # flag set wrote no byte, but its command is in the queue read below.
        # Only when the poll said so: see _drain on why this loop raises no OSError.
        if woken:
            try:
                self._wake_rx.recv(4096)
            except BlockingIOError:
                pass
        self._wake_pending = False
        while True:
            try:
                kind, peer_id, arg, server_key = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(arg, threading.Event):  # "flush": everything before it is with ZMQ now
                arg.set()
            elif isinstance(arg, tuple):  # "reconnect": it moved, its old path leads to no one, it holds nothing of ours
                address, moved_from = arg
                self._counters.peers_lost += int(peer_id in self._links)  # else counted when it was lost
                self._reset_due.pop(peer_id, None)
                self._drop_link(peer_id)
                # Whoever answers there is taken as it is (not as a restart), its deadline from now; after
                # the old path is gone, so nothing more of the old one is read.
                self._peers.renew(peer_id, self._clock.now(), moved_from, address)
                self._connect(peer_id, address, server_key)
            elif kind == "connect":
                self._connect(peer_id, str(arg), server_key)
            else:
                self._send(peer_id, bytes(arg), counted=True)

    def _connect(self, peer_id: str, address: str, server_key: bytes | None) -> None:
        if self._auth.curve is not None:  # bound first: frames under this id from another key are refused
            key = (server_key or self._auth.curve.server_key).decode("ascii")
            self._keys[peer_id] = key
            link = self._links.get(peer_id)
            if link is not None and link.dealer is None and link.client_key != key:
                # It reached us first from another allowed key: not that peer. Stop answering there.
                log.warning("channel %r: %r reached us with CURVE key %s, not %s: connecting to it instead",
                            self._peer_id, peer_id, link.client_key, key)
                self._counters.auth_failures += 1
                del self._links[peer_id]
                self._peers.forget_incarnation(peer_id)  # the impostor's, not the peer's: no restart to report
        if peer_id in self._links:  # already reachable: keep its path, so its frames stay in order
            return
        dealer: zmq.Socket | None = None
        watch: HandshakeWatch | None = None
        try:  # any failure (too many sockets, an address ZMQ refuses) loses this peer, never the I/O thread
            dealer = self._router.context.socket(zmq.DEALER)
            self._configure(dealer)
            dealer.setsockopt(zmq.ROUTING_ID, self._peer_id.encode())  # the peer's ROUTER knows us by name
            curve = self._auth.curve
            if curve is not None:
                configure_curve_client(dealer, self._auth, server_key)
            watch = HandshakeWatch(dealer, self._poller, address, None if curve is None else curve.public_key,
                                   None if curve is None else server_key or curve.server_key)
            dealer.connect(address)
        except Exception as exc:
            if watch is not None:
                watch.close()
            if dealer is not None:
                dealer.close(linger=0)
            self._declare_lost(peer_id, f"cannot connect to {address!r}: {type(exc).__name__}: {exc}")
            return
        self._poller.register(dealer, zmq.POLLIN)
        self._links[peer_id] = _Link(dealer=dealer, address=address, watch=watch)
        self._greet(peer_id)

    def _send(self, peer_id: str, frame: bytes, counted: bool = False) -> None:
        # Before anything else of ours. Whichever life is at the other end (on a path we just opened we have not
        # heard it yet): the Reset names the one we lost, and only that one acts on it.
        if self._reset_due and peer_id in self._reset_due and peer_id in self._links:
            self._send_reset(peer_id)
        self._post(peer_id, frame, counted)

    def _post(self, peer_id: str, frame: bytes, counted: bool = False) -> None:
        """Hand ``frame`` to ZMQ on ``peer_id``'s path; a peer that cannot be reached is lost."""
        link = self._links.get(peer_id)
        if link is None:  # lost between the caller's check and now; its requests were failed
            log.debug("channel %r: dropped a frame to lost peer %r", self._peer_id, peer_id)
            return
        if counted:  # before the send: the peer may answer before this thread runs again
            self._counters.sent += 1
        try:
            self._write(peer_id, link, frame)
        except zmq.ZMQError as exc:
            if counted:
                self._counters.sent -= 1
            if exc.errno == zmq.EHOSTUNREACH and link.dealer is None and not self._reading_before_loss:
                # No route any more: read what the peer sent before it went (each turn runs its commands
                # before it reads), so a Bye queued there makes it lost as closed, not as a failed send;
                # a peer still there (a frame read may have come on a new connection) gets the frame again,
                # and is lost by that send if it fails too. Not nested.
                self._reading_before_loss = True
                try:
                    self._drain(self._router, None)
                    if peer_id in self._links:
                        self._send(peer_id, frame, counted)
                finally:
                    self._reading_before_loss = False
                return
            if exc.errno == zmq.EAGAIN and link.dealer is not None:  # SNDHWM 0: only a dealer with no pipe left
                # ZMQ gives a connection up for good after a handshake that cannot succeed, or a frame over its limit.
                # Its monitor may say which for certain, in an event not read yet: that one is the loss to report.
                refused = link.watch.read() if link.watch is not None else None
                if refused is not None:
                    self._wrong_answer(peer_id, refused, "auth")
                    return
                handshake = ("a peer without CURVE, or one that refused our key" if self._auth.curve is not None else
                             "a peer that uses CURVE while this channel does not")
                self._declare_lost(peer_id, f"send failed: ZMQ dropped our connection to {link.address!r} ({exc}) "
                                            f"for good: its handshake failed ({handshake}), or a frame from it was "
                                            f"over our limit (max_frame_bytes={self._max_frame_bytes})")
                return
            self._declare_lost(peer_id, f"send failed: {exc}")
        except Exception as exc:  # a bug with this one frame: lose its peer, keep serving the others
            if counted:
                self._counters.sent -= 1
            log.exception("channel %r: cannot send a frame to %r", self._peer_id, peer_id)
            self._declare_lost(peer_id, f"send failed: {type(exc).__name__}: {exc}")

    def _write(self, peer_id: str, link: _Link, frame: bytes) -> None:
        """Seal ``frame`` and hand it to ZMQ on the peer's path; raises ``zmq.ZMQError``."""
        frame = self._gate.seal(peer_id.encode(), frame, from_router=link.dealer is None)
        if link.dealer is not None:
            link.dealer.send(frame, zmq.NOBLOCK)
        else:
            assert link.routing_id is not None
            self._router.send_multipart([link.routing_id, frame], zmq.NOBLOCK)

    def _say_bye(self) -> None:
        """Closing: a Bye to every peer with a path, so it drops us now rather than at a failed send or
        its deadline. A peer gone already is skipped quietly: there is no one left to tell."""
        for peer_id, link in list(self._links.items()):
            try:
                self._write(peer_id, link, self._frame(Bye(), None))
            except zmq.ZMQError:
                log.debug("channel %r: no Bye to %r: it is gone", self._peer_id, peer_id)
            except Exception:  # a bug: the other peers still get theirs, and the sockets still close
                log.exception("channel %r: cannot send a Bye to %r", self._peer_id, peer_id)

    def _drain(self, sock: zmq.Socket, dealer_peer: str | None) -> None:
        # Ask the socket whether a frame is there instead of reading until zmq.Again: building
        # that exception (and any OSError) calls strerror(), which takes a process-wide glibc lock
        # while this thread holds the GIL. Seen in a vLLM engine: this thread waited there for that
        # lock, GIL held, for a whole deadline, and every Python thread of the engine stopped with it.
        # With CURVE the ROUTER's frames carry the client's key (User-Id, from our ZAP handler's reply).
        with_key = dealer_peer is None and self._auth.curve is not None
        for _ in range(_BATCH):
            if not sock.get(zmq.EVENTS) & zmq.POLLIN:
                return
            client_key: str | None = None
            try:
                if with_key:
                    frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    client_key = frames[-1].get("User-Id")
                    parts = [frame.bytes for frame in frames]
                else:
                    parts = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if dealer_peer is None:
                routing_id, payload, origin = parts[0], parts[1:], parts[0]
            else:
                routing_id, payload, origin = None, parts, dealer_peer.encode()
            try:
                self._handle(sock, routing_id, origin, payload, client_key)
            except Exception:  # a bug handling one frame must not stop the channel
                self._gate.count_failure(origin)
            if sock.closed:  # that frame dropped this dealer's peer (a Bye, a failed echo): nothing more to read
                return

    def _handle(self, sock: zmq.Socket, routing_id: bytes | None, origin: bytes, payload: list[bytes],
                client_key: str | None = None) -> None:
        envelope = self._gate.admit(sock, routing_id, origin, payload, client_key)
        if envelope is None:  # rejected: counted, logged, answered if authentic
            return
        sender, body = envelope.sender, envelope.body
        # Each life of a peer id starts every path to us with a heartbeat naming it (see _greet).
        incarnation = body.incarnation if isinstance(body, Heartbeat | Handshake) else 0
        on_route = routing_id is not None  # on our ROUTER: under the sender's own id (FrameGate.admit checks it)
        held = self._held_by_replaced.get(sender) if on_route and self._held_by_replaced else None
        if held is not None and not incarnation:  # the replaced life's plain frame: refused too (see __init__)
            if not isinstance(body, ErrorMsg):  # never answer an error with one
                self._gate.reject(sock, routing_id, origin, ProtocolError(
                    f"{sender!r} incarnation {held:#x} was replaced (its frames on this connection are refused)"
                    f"{_REPLACED_WHY}"), code=ErrorCode.REPLACED_LIFE, incarnation=held)
            return
        current = (self._peers.replaced_life(sender, incarnation, self._clock.now(), self._deadline_s) if incarnation
                   else None)
        if held is not None and current is None:  # a life not replaced took the routing id back
            del self._held_by_replaced[sender]
        if current is not None:  # refused, answered: a second process under the id hears why (replaced_life, naming it)
            at = self._address(sender) if current else None
            by = (f"by {current:#x}, which speaks under that id now{'' if at is None else f' from {at!r}'}" if current
                  else "by the life we moved the id to")
            self._gate.reject(sock, routing_id, origin, ProtocolError(
                f"{sender!r} incarnation {incarnation:#x} was replaced {by}{_REPLACED_WHY}"),
                # Only a later life heard under the id is another process for certain: the life a connect() moved the
                # id away from (none heard at the new address yet) is still ours, the move may be what is wrong.
                code=ErrorCode.REPLACED_LIFE if current else ErrorCode.PROTOCOL,
                incarnation=incarnation if current else 0)
            if current:
                self._replaced_heard(sender, incarnation, current, body, on_route)
            return
        said = self._peers.said_at(sender) if incarnation else ""  # where the life it may replace said it is
        replaced = self._peers.heard(sender, self._clock.now(), incarnation)
        if replaced:  # before anything of the new one is handled: the earlier one is lost
            self._restarted(sender, replaced, incarnation, via_router=routing_id is not None, said_at=said)
        link = self._links.get(sender)
        if routing_id is not None and (link is None or link.dealer is None):
            # Answer on the connection it came in on.
            self._links[sender] = _Link(routing_id=routing_id, client_key=client_key)
            if link is None:  # a new path: it learns who we are before anything else from us
                self._greet(sender)
            if isinstance(body, Handshake):  # where this life is: connect() elsewhere means it moved
                self._peers.said(sender, body.incarnation, body.control_addr)
        due = self._reset_due.get(sender) if self._reset_due else None
        if due is not None:
            # The life we dropped is back (a frame naming no life comes on a path it had: another life would
            # have greeted first): it must drop what it holds about us too, before anything else from us.
            if incarnation in (0, due[0]):
                self._send_reset(sender)
            else:  # another life: it holds nothing of ours
                del self._reset_due[sender]
        if (isinstance(body, ErrorMsg) and body.code is ErrorCode.REPLACED_LIFE and envelope.reply_to is None
                and body.incarnation == self._incarnation):
            # The sender refuses this life as one of our peer id that a later one replaced: that one is another live
            # process (a dead life never reads this). Nothing we send there is taken while it runs. Decided by the
            # code and the incarnation it names; its text is only for the humans reading the loss.
            self._declare_lost(sender, self._duplicate(sender, body.text), "duplicate")
            return
        if isinstance(body, Bye):
            if self._peers.mark_lost(sender, "it closed its channel", "closed"):  # later calls: PeerClosedError
                self._lose(sender, "it closed its channel", "closed")
            return
        if isinstance(body, Reset):
            if body.incarnation != self._incarnation:
                # Meant for another life of our peer id (an earlier process, which the sender lost): we never gave
                # the sender anything that Reset would take back, so our handshake and links with it stay.
                self._counters.stale_resets += 1
                log.info("channel %r: ignored a Reset from %r for incarnation %#x (ours is %#x): it had lost an "
                         "earlier life of our peer id (%s)", self._peer_id, sender, body.incarnation,
                         self._incarnation, body.reason)
                return
            self._counters.peers_lost += 1
            reason = f"it had declared us lost ({body.reason}) and dropped what it held about us"
            log.warning("channel %r: peer %r reset: %s", self._peer_id, sender, reason)
            self._lost(sender, reason, "reset", self._address(sender))
            return
        if isinstance(body, Heartbeat):
            if envelope.reply_to is None:  # echo (naming us), so the sender can measure the round trip
                self._send(sender, self._frame(Heartbeat(body.seq, body.sent_ns, self._incarnation), envelope.msg_id))
            else:
                self._peers.echoed(sender, self._clock.now())
                rtt_s = (time.monotonic_ns() - body.sent_ns) / 1e9
                if rtt_s >= 0:
                    self._peers.set_rtt(sender, rtt_s)
            return
        self._counters.received += 1
        self._deliver(envelope)

    def _replaced_heard(self, peer_id: str, incarnation: int, current: int, body: Heartbeat | Handshake,
                        on_route: bool) -> None:
        """A frame of ``peer_id``'s life ``incarnation``, which ``current`` replaced, was refused. Heard more than a
        heartbeat interval after that, while ``current`` is alive, it is no late frame of a dead process: two live
        processes use the peer id. Logged at ERROR (rate-limited), naming both lives and where each is; if it came
        on our ROUTER under the id, ZMQ gave it our route for the id: what we send the id goes to it, so the id is
        lost as a duplicate (DuplicatePeerIdError on what waited, and on our requests until a life not replaced
        greets us again). Its plain frames on that route are refused from then on (also while the id is lost:
        else the first one would make the replaced life the id's again)."""
        since = self._peers.replaced_for(peer_id, self._clock.now())
        if since is not None and since <= self._heartbeat_s:  # may be a late frame of a dead one, just replaced
            return
        if on_route:
            self._held_by_replaced.pop(peer_id, None)
            self._held_by_replaced[peer_id] = incarnation
            while len(self._held_by_replaced) > MAX_LOST_PEERS:
                self._held_by_replaced.popitem(last=False)
        if since is None:  # the live one is lost (or was never heard since a move): nothing to tell apart now
            return
        where = body.control_addr if isinstance(body, Handshake) else None
        live_at = self._address(peer_id)
        why = (f"two live processes use the peer id {peer_id!r} (each engine needs an engine_id of its own): "
               f"incarnation {incarnation:#x}{'' if where is None else f' at {where!r}'}, which {current:#x}"
               f"{'' if live_at is None else f' at {live_at!r}'} replaced {since:.1f}s ago, is heard again")
        link = self._links.get(peer_id)
        if on_route and link is not None and link.dealer is None:  # our path to the id leads to the replaced one
            self._declare_lost(peer_id, f"{why}, and took our route to the peer id: what we send it goes there",
                               "duplicate")
        elif self._duplicate_logs.take(time.monotonic()):
            log.error("channel %r: %s; its frames are refused", self._peer_id, why)

    def _duplicate(self, peer_id: str, refusal: str) -> str:
        """Why ``peer_id`` is lost: its ``refusal`` (``replaced_life``, naming this life) says another live process
        under our peer id replaced us there; its text, which names that one, is quoted."""
        where = self._address(peer_id)
        said = refusal[:-len(_REPLACED_WHY)] if refusal.endswith(_REPLACED_WHY) else refusal
        return (f"{'it' if where is None else repr(where)} refuses our frames: it took another process under our peer "
                f"id for a restart of ours ({said}); two live processes use the peer id {self._peer_id!r}: this one, "
                f"incarnation {self._incarnation:#x} at {self.address!r}, and that one (each engine needs an "
                f"engine_id of its own)")

    def _frame(self, body: Heartbeat | Bye | Reset, reply_to: int | None) -> bytes:
        envelope = Envelope(self._peer_id, self._peers.next_msg_id(), reply_to, body)
        return encode(envelope, self._max_frame_bytes)

    def _greet(self, peer_id: str) -> None:
        """A heartbeat naming our incarnation, first on a new path to ``peer_id``: whatever we send it next
        (a reply, a Reset) comes from a life it knows, so it tells a restart of ours before it handles them."""
        self._post(peer_id, self._frame(self._heartbeat(), None))

    def _heartbeat(self) -> Heartbeat:
        self._hb_seq += 1
        return Heartbeat(self._hb_seq, time.monotonic_ns(), self._incarnation)

    def _send_reset(self, peer_id: str) -> None:
        """Tell ``peer_id``, which we declared lost, to drop what it holds about us (see ``_reset_due``)."""
        incarnation, reason = self._reset_due.pop(peer_id)
        log.info("channel %r: %r (incarnation %#x, if that one is there) is told to drop what it holds about us "
                 "(we had lost it: %s)", self._peer_id, peer_id, incarnation, reason)
        self._post(peer_id, self._frame(Reset(reason[:MAX_TEXT_CHARS], incarnation), None))

    def _restarted(self, peer_id: str, old: int, new: int, via_router: bool, said_at: str = "") -> None:
        """``peer_id`` speaks with another incarnation: the earlier one is lost (its requests fail, its
        handshake goes), reported before the new one's first frame is handled. A frame of the new one that came
        to our ROUTER while we reach the peer id by a DEALER (to the dead one's address): answer it there.
        ``said_at``: where the earlier one said it is, if it only reached us (the new one's frame cleared it)."""
        self._counters.peers_lost += 1
        self._reset_due.pop(peer_id, None)
        reason = f"it restarted: incarnation {old:#x} is gone, {new:#x} speaks under its id now"
        log.warning("channel %r: peer %r lost: %s", self._peer_id, peer_id, reason)
        link, address = self._links.get(peer_id), self._address(peer_id) or said_at or None
        left = via_router and link is not None and link.dealer is not None  # our DEALER's address leads to no one now
        if left:
            self._drop_link(peer_id)
        self._lost(peer_id, reason, "reset", address, old, left)

    def _beat(self) -> None:
        beat = self._heartbeat()
        for peer_id in list(self._links):
            if peer_id in self._links:  # a failed send may have dropped it meanwhile
                self._send(peer_id, self._frame(beat, None))

    def _watch(self, peer_id: str, link: _Link, watch: HandshakeWatch) -> None:
        """Read ``peer_id``'s ZMQ handshakes: lost at once when refused for certain; the watch closed once one
        succeeded (what is left to go wrong there shows as for any peer)."""
        refused = watch.read()
        if refused is not None:
            self._wrong_answer(peer_id, refused, "auth")
        elif watch.succeeded:
            watch.close()
            link.watch = None

    def _wrong_answer(self, peer_id: str, what: str, kind: LossKind) -> None:
        """Our DEALER to ``peer_id`` heard from another peer's channel (a reference with ranks or engines mixed up:
        ``kind`` "lost"), or from one whose frames and ours fail authentication (shared secrets that differ), or its
        server refuses our handshake for certain ("auth", :class:`~ncclkv.errors.PeerAuthError`): nothing we send
        there will be taken. Lost now, naming the address and ``what`` answered there, not after ``deadline_s``."""
        link = self._links.get(peer_id)
        address = repr(link.address) if link is not None and link.address else "its address"
        failed = "authentication failed: " if kind == "auth" else ""
        self._declare_lost(peer_id, f"{failed}{address} {what}", kind)

    def _declare_lost(self, peer_id: str, reason: str, kind: LossKind = "lost") -> None:
        """Lose a peer whose send or connect failed (unless it was lost already)."""
        if self._peers.mark_lost(peer_id, reason, kind):
            self._lose(peer_id, reason, kind)
        else:
            self._drop_link(peer_id)

    def _lose(self, peer_id: str, reason: str, kind: LossKind = "lost") -> None:
        """Tear down a peer already marked lost in the table and report it once (``closed``: it said Bye)."""
        address = self._address(peer_id)
        self._drop_link(peer_id)
        self._counters.peers_lost += 1
        # A duplicate is a config mistake (two engines given one engine_id): ERROR.
        level = {"closed": logging.INFO, "duplicate": logging.ERROR}.get(kind, logging.WARNING)
        if kind == "duplicate" and not self._duplicate_logs.take(time.monotonic()):
            level = logging.WARNING  # rate-limited: each flip between the two processes loses it once more
        log.log(level, "channel %r: peer %r lost: %s", self._peer_id, peer_id, reason)
        incarnation = self._peers.incarnation(peer_id)
        if kind in ("closed", "duplicate"):  # gone on purpose, or it holds nothing of ours: nothing to reset
            self._reset_due.pop(peer_id, None)
        elif incarnation:  # it may only be stopped or cut off, and come back holding what we drop now
            self._reset_due.pop(peer_id, None)
            self._reset_due[peer_id] = (incarnation, reason)
            while len(self._reset_due) > MAX_LOST_PEERS:
                self._reset_due.popitem(last=False)
        self._lost(peer_id, reason, kind, address)

    def _address(self, peer_id: str) -> str | None:
        """Where the life of ``peer_id`` a loss is of is: where our DEALER reaches it, or, when it only reached
        us, where its handshake said it is; None when neither is known. Without it, the loss would be taken for
        every life of the peer id, one restarted at another address included (``lost_there``)."""
        link = self._links.get(peer_id)
        if link is None:
            return None
        if link.dealer is not None:
            return link.address or None
        return self._peers.said_at(peer_id, lost_too=True) or None

    def _drop_link(self, peer_id: str, linger_ms: int = 0) -> None:
        link = self._links.pop(peer_id, None)
        if link is not None and link.watch is not None:
            link.watch.close()
        if link is not None and link.dealer is not None:
            self._poller.unregister(link.dealer)
            link.dealer.close(linger=linger_ms)
