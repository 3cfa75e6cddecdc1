"""The wire side of :mod:`ncclkv.auth`, and the gate every incoming frame passes.

:class:`FrameGate` admits a frame only if it is authentic (shared-secret
mode), decodes under the size limit, and names the sender it came from;
everything else is counted, logged and (if authentic) answered, with logs and
answers token-bucketed so that a flood of bad frames costs bounded work.
:class:`FrameAuth` seals and opens frames; :class:`ZapGuard` runs CURVE's ZAP
handler. All of it runs on the channel's I/O thread, except the ZAP
callback, which runs on the ZAP thread and only reads a frozenset and bumps
its own counter.

Sealed frame (shared-secret mode)::

    stamp (8 bytes, big-endian) | HMAC-SHA256 (32 bytes) | payload

The MAC covers a version label, the path (sent from the sender's DEALER or
from its ROUTER), the sender id, the receiver id, the stamp and the payload,
so a frame cannot be re-attributed, redirected, moved to the other path or
altered. The stamp is the sender's wall clock in ns, forced to increase by at
least one per frame; the receiver keeps the last stamp per (sender, path) and
refuses anything not newer (a replay). Frames on one path are FIFO, so a
legitimate stamp is always newer; the two paths keep separate stamps, which
is why the MAC must name the path. A sender seen for the first time must be
within ``max_clock_skew_s`` of the receiver's clock, so an old capture cannot
be replayed to a receiver that restarted.

A frame that fails its MAC check on our ROUTER is answered only by
:data:`REFUSED_NOTICE`, fixed bytes that carry nothing of the frame or of this
channel (token-bucketed, apart from the answers to authentic frames). A channel
that gets it, or any frame failing its MAC, on a DEALER it opened to a peer's
address loses that peer at once, naming the likely cause: the peers' shared
secrets differ (or one has none), or the channel there is another peer, so
nothing either sends will ever be taken. A frame refused only for its stamp
(stale or replayed, with a good MAC) is neither answered nor a reason to lose
anyone: only a holder of the secret made it. An outsider gains no power from
that: only the process at the address we dialled (or one that can write into
that TCP stream, which could as well cut it) can answer there.

With CURVE, a peer this channel connected to proved the server key it was
given; its DEALER holds the same key pair, so frames reaching the ROUTER under
that peer's id must come from a client with that key (``FrameGate.admit``).
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping

import zmq
from zmq.auth import Authenticator
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import recv_monitor_message

from ._peers import Budget, Counters, LossKind
from .auth import AuthenticationError, ChannelAuth, CurveConfig
from .errors import ProtocolError
from .protocol import MAX_TEXT_CHARS, Envelope, ErrorCode, ErrorMsg, decode, encode

__all__ = ["HANDSHAKE_FAILURES_TO_SUSPECT", "MAC_OVERHEAD", "REFUSED_NOTICE", "WARNING_BURST", "WARNINGS_PER_S",
           "FrameAuth", "FrameGate", "HandshakeWatch", "ZapGuard", "configure_curve_client"]

log = logging.getLogger("ncclkv.channel")

_LABEL = b"ncclkv-hmac-sha256-v2"  # v2: the MAC names the path
_FROM_DEALER, _FROM_ROUTER = b"D", b"R"  # which of the sender's sockets sent the frame
_STAMP_BYTES = 8
_MAC_BYTES = 32
MAC_OVERHEAD = _STAMP_BYTES + _MAC_BYTES
_MAX_SENDERS = 1 << 16  # replay state kept for this many (sender, path) pairs, least recent dropped first
ZAP_DOMAIN = "ncclkv"
# Our ROUTER's only answer to a frame that fails authentication. Shorter than a MAC header and not an envelope,
# so no channel takes it for a message; the same bytes whatever came in, so it tells the sender nothing else.
REFUSED_NOTICE = b"ncclkv: frame not authenticated"
# Replies to rejected frames, and warning lines about them: a flood of bad frames costs at most this.
_REPLIES_PER_S, _REPLY_BURST = 50.0, 100.0
# Every warning a peer can trigger at will (bad frames, refused keys, unexpected replies in ncclkv.channel).
WARNINGS_PER_S, WARNING_BURST = 1.0, 5.0


class _StaleFrame(AuthenticationError):
    """A frame with a good MAC refused for its stamp (a replay, reordered, or too far from our clock): only a
    holder of the secret made it, so it is no sign that the secrets differ. Honest peers send one when a
    restarted process's first frames are queued old, or two lives of one id overlap a moment: neither noticed
    nor a reason to lose the sender."""


class _WrongKey(AuthenticationError):
    """A frame to our ROUTER from a CURVE client whose key is not the one the peer id it names is bound to. Its MAC
    is not what failed, so it gets no notice (that would tell the sender our shared secrets differ): dropped."""


class _RefusedThere(AuthenticationError):
    """The notice on our DEALER: the peer we dialled refused our frames as not authenticated."""


def _ident(name: bytes) -> bytes:
    if len(name) > 255:  # Channel refuses such ids; not an assert, which -O would drop
        raise ValueError(f"peer ids are at most 255 UTF-8 bytes, got {len(name)}")
    return bytes([len(name)]) + name


class FrameAuth:
    """HMAC-SHA256 seal/open of frames for one channel (I/O thread only)."""

    def __init__(self, secret: bytes, me: str, max_clock_skew_s: float) -> None:
        self._secret = secret
        self._me = _ident(me.encode())
        self._max_skew_ns = int(max_clock_skew_s * 1e9)
        self._last_sent = 0
        self._last_seen: OrderedDict[tuple[bytes, bool], int] = OrderedDict()

    def _mac(self, path: bytes, sender: bytes, receiver: bytes, stamp: bytes, payload: bytes) -> bytes:
        mac = hmac.new(self._secret, _LABEL, hashlib.sha256)
        for part in (path, sender, receiver, stamp, payload):
            mac.update(part)
        return mac.digest()

    def seal(self, receiver: bytes, payload: bytes, *, from_router: bool) -> bytes:
        """``payload`` as a frame for peer ``receiver`` (its peer id, UTF-8), sent from our ROUTER or a DEALER."""
        self._last_sent = max(self._last_sent + 1, time.time_ns())
        stamp = self._last_sent.to_bytes(_STAMP_BYTES, "big")
        path = _FROM_ROUTER if from_router else _FROM_DEALER
        return stamp + self._mac(path, self._me, _ident(receiver), stamp, payload) + payload

    def open(self, sender: bytes, frame: bytes, via_router: bool) -> bytes:
        """The payload of ``frame`` from ``sender``, received on our ROUTER (``via_router``) or a DEALER;
        :class:`AuthenticationError` if it is not authentic, not new, or sealed for the other path."""
        if len(frame) < MAC_OVERHEAD:
            raise AuthenticationError(f"frame of {len(frame)} bytes is shorter than a MAC header ({MAC_OVERHEAD})")
        stamp, mac, payload = frame[:_STAMP_BYTES], frame[_STAMP_BYTES:MAC_OVERHEAD], frame[MAC_OVERHEAD:]
        path = _FROM_DEALER if via_router else _FROM_ROUTER  # our ROUTER hears the peer's DEALER, and vice versa
        if len(sender) > 255 or not hmac.compare_digest(mac, self._mac(path, _ident(sender), self._me, stamp, payload)):
            raise AuthenticationError("bad MAC: not signed with the shared secret, altered, or sent on the other path")
        value = int.from_bytes(stamp, "big")
        key = (sender, via_router)
        last = self._last_seen.get(key)
        if last is None:
            skew_ns = abs(value - time.time_ns())
            if skew_ns > self._max_skew_ns:
                raise _StaleFrame(
                    f"first frame's stamp is {skew_ns / 1e9:.1f}s from this host's clock (max_clock_skew_s="
                    f"{self._max_skew_ns / 1e9:g}): a stale replay, or unsynchronised clocks"
                )
        elif value <= last:
            raise _StaleFrame(f"replayed or reordered frame: stamp {value} is not after {last}")
        self._last_seen[key] = value
        self._last_seen.move_to_end(key)
        if len(self._last_seen) > _MAX_SENDERS:
            self._last_seen.popitem(last=False)
        return payload


class _AllowList:
    """The ZAP credentials provider: admits exactly the configured client keys, counts denials."""

    def __init__(self, allowed: frozenset[bytes], peer_id: str) -> None:
        self._allowed = allowed
        self._peer_id = peer_id
        self._warnings = Budget(WARNINGS_PER_S, WARNING_BURST)  # a refused client retries every 100 ms
        self.denied = 0  # written by the ZAP thread only

    def callback(self, domain: str, key: bytes) -> bool:
        if key in self._allowed:
            return True
        self.denied += 1
        if self._warnings.take(time.monotonic()):
            log.warning("channel %r: refused CURVE client key %s (not an allowed client; %d refused so far)",
                        self._peer_id, key.decode("ascii", "replace"), self.denied)
        return False


class ZapGuard:
    """The ZAP handler thread of one channel's context, and the CURVE server options of its ROUTER.

    Created, started and stopped on the I/O thread (its pipe socket belongs there).
    """

    def __init__(self, context: zmq.Context, curve: CurveConfig, peer_id: str) -> None:
        self._curve = curve
        self._allow = _AllowList(curve.allowed_clients, peer_id)
        self._auth = ThreadAuthenticator(context, log=logging.getLogger("ncclkv.channel.zap"))
        self._thread_name = f"ncclkv-channel-zap[{peer_id}]"

    @property
    def denied(self) -> int:
        return self._allow.denied

    def start(self) -> None:
        """Start the ZAP handler; must run before any CURVE server socket binds."""
        self._auth.start()
        self._auth.thread.name = self._thread_name
        self._auth.configure_curve_callback(domain=ZAP_DOMAIN, credentials_provider=self._allow)

    def configure_server(self, sock: zmq.Socket) -> None:
        sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)  # fail closed if the ZAP handler is gone
        sock.setsockopt_string(zmq.ZAP_DOMAIN, ZAP_DOMAIN)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self._curve.secret_key)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self._curve.public_key)
        sock.setsockopt(zmq.CURVE_SERVER, 1)

    def stop(self, timeout_s: float) -> bool:
        """Stop and join the ZAP thread within ``timeout_s``, then close its sockets; True if it ended.

        Not ``ThreadAuthenticator.stop``: that joins without a deadline, and
        if the thread is already gone it blocks sending to a pipe with no peer.
        """
        thread: threading.Thread | None = self._auth.thread
        if thread is not None and thread.is_alive():
            try:
                self._auth.pipe.send(b"TERMINATE", zmq.NOBLOCK)
            except zmq.ZMQError as exc:
                log.error("could not signal the ZAP thread to stop: %s", exc)
            thread.join(timeout_s)
            if thread.is_alive():
                return False
        if self._auth.pipe is not None:
            self._auth.pipe.close(linger=0)
            self._auth.pipe = None
        self._auth.thread = None
        Authenticator.stop(self._auth)  # closes the ZAP socket
        return True


def configure_curve_client(sock: zmq.Socket, auth: ChannelAuth, server_key: bytes | None) -> None:
    """Make ``sock`` (a DEALER) a CURVE client of ``server_key`` (default: the configured one)."""
    curve = auth.curve
    assert curve is not None
    sock.setsockopt(zmq.CURVE_SECRETKEY, curve.secret_key)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, curve.public_key)
    sock.setsockopt(zmq.CURVE_SERVERKEY, server_key or curve.server_key)


# What a DEALER's monitor reports of its handshakes (HandshakeWatch).
_HANDSHAKE_EVENTS = (zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
                     | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
_PROTOCOL_ERRORS = {getattr(zmq, name): name for name in dir(zmq) if name.startswith("PROTOCOL_ERROR_")}
# Handshakes ended by the server this many times in a row make our keys a suspect, named if the peer is lost. Not a
# loss by themselves: a TCP forwarder (docker's proxy, kubectl port-forward, ssh -L, a sidecar) ends them just the
# same while nothing listens behind it, for as long as a peer takes to start or restart. A probe tells the two apart.
HANDSHAKE_FAILURES_TO_SUSPECT = 3
# What every ZMTP 3 peer sends first, before it reads a byte: 0xFF, 8 bytes of padding, 0x7F (rfc.zeromq.org/spec/23).
_ZMTP_SIGNATURE_BYTES = 10
# What a loss for mismatched settings tells the operator to fix.
_SAME_SETTINGS = "every rank needs the same NCCLKV_CURVE_* settings"
_SAME_SECRET = "NCCLKV_SHARED_SECRET or NCCLKV_SHARED_SECRET_FILE must be set alike on every rank"


class HandshakeWatch:
    """The ZMQ handshakes of one of our DEALERs until the first one succeeds, read from its monitor socket (I/O
    thread only; it registers its sockets with the I/O thread's poller, and unregisters them on close). A refusal
    that is certain loses the peer at once (:meth:`read`): a ZAP refusal of our CURVE key, one side without CURVE,
    or handshakes that keep being ended by a server that speaks ZMQ.

    That last one is how a wrong server key shows: the server cannot open our CURVE hello and drops the connection
    without a word (its own monitor says ``PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC``; ours only that the other side
    ended it, EPIPE), and ZMQ reconnects. A TCP forwarder with nothing behind it ends them just the same. So once
    :data:`HANDSHAKE_FAILURES_TO_SUSPECT` in a row were ended, a probe (a ``ZMQ_STREAM`` socket that only reads)
    connects to the address: a ZMQ server sends its ZMTP signature first thing, a forwarder with nothing behind
    closes. After a signature came from there, that many handshakes more ended in a row (none succeeded) are a
    refusal for certain; without one, the server is a suspect (:attr:`suspect`), named should the peer be lost at
    ``deadline_s``, and probed again after as many more. Closed after the first success, so a healthy peer costs
    no monitor or probe sockets (two more descriptors each)."""

    def __init__(self, dealer: zmq.Socket, poller: zmq.Poller, address: str, public_key: bytes | None,
                 server_key: bytes | None) -> None:
        """``address``: where ``dealer`` connects; ``public_key``, ``server_key``: this channel's CURVE keys for
        that server, None without CURVE."""
        self.socket = dealer.get_monitor_socket(_HANDSHAKE_EVENTS)  # before connect(): no event missed
        self._dealer = dealer
        self._poller = poller
        self._address = address
        self._public_key = None if public_key is None else public_key.decode("ascii")
        self._server_key = None if server_key is None else server_key.decode("ascii")
        self._failures = 0  # in a row (since a ZMTP signature was read there, once one was)
        self._probe: zmq.Socket | None = None  # reads what the address sends first, while the handshakes fail
        self._probe_heard = b""
        self._probe_connected = False  # its ZMQ_STREAM notice of the connection came
        self._zmtp_there = False  # a probe read a ZMTP signature there
        self.suspect: str | None = None  # why the handshakes may keep failing, once they failed often enough
        self.succeeded = False  # a handshake succeeded: the watch can go
        poller.register(self.socket, zmq.POLLIN)

    @property
    def sockets(self) -> tuple[zmq.Socket, ...]:
        """The sockets whose readiness calls for :meth:`read`: the monitor, and the probe while there is one."""
        return (self.socket,) if self._probe is None else (self.socket, self._probe)

    def read(self) -> str | None:
        """Take the events and probe bytes waiting: why the server refuses us when that is certain, else None."""
        self._read_probe()
        while self.socket.get(zmq.EVENTS) & zmq.POLLIN:  # asked, not zmq.Again: see IoLoop._drain
            event = recv_monitor_message(self.socket, zmq.NOBLOCK)
            kind, value = event["event"], event["value"]
            if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.succeeded, self._failures, self.suspect = True, 0, None
            elif kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:  # its ZAP handler said no
                return (f"refused our CURVE key {self._public_key} (ZAP status {value}): it is not among its allowed "
                        f"clients (NCCLKV_CURVE_ALLOWED_KEYS, or CurveConfig.allowed_clients)")
            elif kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:  # it speaks ZMTP, not as we do: ZMQ gives up on it
                name = _PROTOCOL_ERRORS.get(value, str(value))
                if value != zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
                    return f"broke our ZMQ handshake ({name})"
                if self._server_key is None:
                    return f"uses CURVE while this channel does not ({name}): {_SAME_SETTINGS}"
                return f"does not use CURVE ({name}): {_SAME_SETTINGS}"
            else:  # ended by the other side (ZMQ reconnects)
                self._failures += 1
                if self._failures < HANDSHAKE_FAILURES_TO_SUSPECT:
                    continue
                if self._zmtp_there:
                    return self._refused(value)
                self.suspect = self._suspect(value)
                if self._probe is None and self._failures % HANDSHAKE_FAILURES_TO_SUSPECT == 0:
                    self._start_probe()
        return None

    def _refused(self, value: int) -> str:
        ended = (f"ended our last {self._failures} ZMQ handshakes ({errno.errorcode.get(value, value)}), none "
                 f"succeeded, while a ZMQ server answers there")
        if self._server_key is None:
            return f"{ended}: it uses CURVE while this channel does not ({_SAME_SETTINGS})"
        # A server without CURVE ends them the same way when it reads our greeting before we read its (which
        # would name the mechanism mismatch): both stay possible here.
        return (f"{ended}: it cannot open our CURVE hello, so the server key we were given for it ({self._server_key}) "
                f"is not its key, or it does not use CURVE (NCCLKV_CURVE_SERVER_KEY, or connect()'s server_key; "
                f"{_SAME_SETTINGS})")

    def _suspect(self, value: int) -> str:
        # errno's table, not strerror(): see IoLoop._drain on strerror's lock
        ended = (f"its last {self._failures} ZMQ handshakes were ended by the other side "
                 f"({errno.errorcode.get(value, value)}), none succeeded")
        forwarder = "or nothing listens behind a forwarder at that address"
        if self._server_key is None:
            return f"{ended}: it may use CURVE while this channel does not ({_SAME_SETTINGS}), {forwarder}"
        return (f"{ended}: the server key we were given for it ({self._server_key}) may not be its key "
                f"(NCCLKV_CURVE_SERVER_KEY, or connect()'s server_key), {forwarder}")

    def _start_probe(self) -> None:
        probe: zmq.Socket | None = None
        try:
            probe = self._dealer.context.socket(zmq.STREAM)
            probe.setsockopt(zmq.LINGER, 0)
            probe.connect(self._address)
        except zmq.ZMQError as exc:  # out of sockets, say: it stays a suspect, lost at deadline_s as before
            log.debug("cannot probe %r for a ZMQ server: %s", self._address, exc)
            if probe is not None:
                probe.close(linger=0)
            return
        self._poller.register(probe, zmq.POLLIN)
        self._probe, self._probe_heard, self._probe_connected = probe, b"", False

    def _read_probe(self) -> None:
        """Whether a ZMTP signature came from there; the probe closed once that is known (it sent one, it sent
        something else, or it closed: ZMQ_STREAM's second empty message)."""
        probe = self._probe
        while probe is not None and probe.get(zmq.EVENTS) & zmq.POLLIN:
            data = probe.recv_multipart(zmq.NOBLOCK)[-1]  # [connection id, bytes]
            if not data and not self._probe_connected:
                self._probe_connected = True
                continue
            self._probe_heard += data
            if data and len(self._probe_heard) < _ZMTP_SIGNATURE_BYTES:
                continue
            heard = self._probe_heard
            if len(heard) >= _ZMTP_SIGNATURE_BYTES and heard[0] == 0xFF and heard[9] == 0x7F:
                self._zmtp_there, self._failures = True, 0  # count the handshakes ended from now on
            self._close_probe()
            return

    def _close_probe(self) -> None:
        if self._probe is not None:
            self._poller.unregister(self._probe)
            self._probe.close(linger=0)
            self._probe = None

    def close(self) -> None:
        self._close_probe()
        self._poller.unregister(self.socket)
        self._dealer.disable_monitor()
        self.socket.close(linger=0)


class _Misaddressed(ProtocolError):
    """An authentic frame on our DEALER to one peer id that names another sender: that address is the other's."""

    def __init__(self, sender: str, text: str) -> None:
        super().__init__(text)
        self.sender = sender


class FrameGate:
    """Admission of incoming frames, and sealing of outgoing ones, for one channel (I/O thread only)."""

    def __init__(
        self,
        *,
        peer_id: str,
        max_frame_bytes: int,
        auth: ChannelAuth,
        counters: Counters,
        next_msg_id: Callable[[], int],
        peer_keys: Mapping[str, str] | None = None,
        wrong_answer: Callable[[str, str, LossKind], None] | None = None,
    ) -> None:
        self._peer_id = peer_id
        # (peer id, what answered there, how): our DEALER to that peer heard from another channel ("lost"), or from
        # one whose frames and ours cannot authenticate each other ("auth"). Nothing sent there will be taken: the
        # peer is lost.
        self._wrong_answer = wrong_answer
        # CURVE: peer id -> the Z85 public key it proved as a server (read on the I/O thread only).
        self._peer_keys: Mapping[str, str] = {} if peer_keys is None else peer_keys
        self._max_frame_bytes = max_frame_bytes
        self._sealer = FrameAuth(auth.shared_secret, peer_id, auth.max_clock_skew_s) if auth.shared_secret else None
        self._counters = counters
        self._next_msg_id = next_msg_id
        self._replies = Budget(_REPLIES_PER_S, _REPLY_BURST)
        self._notices = Budget(_REPLIES_PER_S, _REPLY_BURST)  # REFUSED_NOTICE, to frames failing authentication
        self._warnings = Budget(WARNINGS_PER_S, WARNING_BURST)

    def seal(self, receiver: bytes, frame: bytes, *, from_router: bool) -> bytes:
        return frame if self._sealer is None else self._sealer.seal(receiver, frame, from_router=from_router)

    def admit(self, sock: zmq.Socket, routing_id: bytes | None, origin: bytes, payload: list[bytes],
              client_key: str | None = None) -> Envelope | None:
        """The envelope of a good frame from ``origin``; None for a bad one, which was counted,
        logged and answered on ``sock`` (see :meth:`reject`). On a DEALER, one that shows the peer at that
        address cannot be talked to (another peer's, or its frames and ours fail authentication) is reported
        to ``wrong_answer``.

        ``client_key``: the CURVE key (Z85) of the client that sent a frame to our ROUTER."""
        name = origin.decode("utf-8", "replace")  # checked against both the CURVE binding and the envelope
        try:
            envelope = decode(self._open(name, origin, routing_id, payload, client_key), self._max_frame_bytes)
            if envelope.sender != name:
                if routing_id is None:  # on our DEALER to ``name``: the address we reach it at is another's
                    raise _Misaddressed(envelope.sender, f"frame names sender {envelope.sender!r} but came on our "
                                                         f"connection to {name!r}")
                raise ProtocolError(f"frame names sender {envelope.sender!r} but came from {name!r}")
        except AuthenticationError as exc:  # a ProtocolError too: caught first, as only the notice answers it
            self._counters.auth_failures += 1
            self.reject(sock, routing_id, origin, exc, authentic=False, renamed=_renamed_by_zmq(origin))
            if routing_id is None and self._wrong_answer is not None and not isinstance(exc, _StaleFrame):
                self._wrong_answer(name, self._unauthenticated_answer(name, exc), "auth")
            return None
        except ProtocolError as exc:
            self.reject(sock, routing_id, origin, exc, renamed=_renamed_by_zmq(origin))
            if isinstance(exc, _Misaddressed) and self._wrong_answer is not None:
                self._wrong_answer(name, f"answers as {exc.sender!r}, not as {name!r}: the address given for "
                                         f"{name!r} is another peer's", "lost")
            return None
        return envelope

    def _open(self, name: str, origin: bytes, routing_id: bytes | None, payload: list[bytes],
              client_key: str | None) -> bytes:
        """The encoded envelope in ``payload``, authenticated if auth is on; raises
        :class:`AuthenticationError` for a frame that may not come from ``origin``, and
        :class:`ProtocolError` for a malformed but authentic one."""
        if client_key is not None:
            expected = self._peer_keys.get(name)
            if expected is not None and client_key != expected:  # an allowed client claiming another peer's id
                raise _WrongKey(f"CURVE client key {client_key} is not {expected}, the key of peer {name!r}")
        if routing_id is None and payload == [REFUSED_NOTICE]:  # the peer we dialled cannot authenticate our frames
            raise _RefusedThere(REFUSED_NOTICE.decode())
        if len(payload) != 1:  # with a shared secret it cannot be authenticated: dropped like a bad MAC
            error = ProtocolError if self._sealer is None else AuthenticationError
            raise error(f"expected 1 payload frame, got {len(payload)}")
        if self._sealer is None:
            return payload[0]
        return self._sealer.open(origin, payload[0], via_router=routing_id is not None)

    def _unauthenticated_answer(self, name: str, exc: AuthenticationError) -> str:
        """Why a frame on our DEALER to peer ``name`` failed authentication, for the loss of that peer."""
        # Every MAC names its receiver: a channel there under another peer id fails it too, whatever the secrets.
        not_it = f"or the channel at that address is not {name!r} (each frame's MAC names its receiver)"
        if isinstance(exc, _RefusedThere):
            if self._sealer is None:
                return (f"refused our frames as not authenticated: it has a shared secret and this channel has none "
                        f"({_SAME_SECRET})")
            return (f"refused our frames as not authenticated: its shared secret differs from ours ({_SAME_SECRET}), "
                    f"{not_it}")
        return (f"answers with frames that fail authentication ({exc}): its shared secret differs from ours, or it "
                f"has none ({_SAME_SECRET}), {not_it}")

    def reject(
        self, sock: zmq.Socket, routing_id: bytes | None, origin: bytes, exc: ProtocolError, authentic: bool = True,
        renamed: bool = False, code: ErrorCode = ErrorCode.PROTOCOL, incarnation: int = 0,
    ) -> None:
        """Count and log a bad frame; if ``authentic``, tell its sender why on the socket it came in on; if not,
        and it came to our ROUTER under an id of its own in shared-secret mode, answer :data:`REFUSED_NOTICE`
        (not to a frame refused only for its stamp, whose MAC was good, nor for its CURVE key: the notice says
        that our secrets differ).

        ``renamed``: it came in under a routing id ZMQ made up. Most often that is a peer's old connection, renamed
        by our ROUTER when the peer reset its path to us (ROUTER_HANDOVER), whose last frames still arrive: no
        sign of an intruder, so INFO, with that explanation (else it read as spoofing after every reset).

        ``code`` and ``incarnation``: the answer's (``replaced_life`` and the life refused; else ``protocol``)."""
        self._counters.rejected += 1
        now = time.monotonic()
        if renamed:
            self._warn(now, "channel %r: rejected a frame from %r, a connection without an id of its own (most "
                            "likely an old connection of a peer that reconnected under the same id): %s", origin, exc,
                       level=logging.INFO)
        else:
            self._warn(now, "channel %r: rejected a frame from %r: %s", origin, exc)
        if not authentic and (routing_id is None or renamed or self._sealer is None
                              or isinstance(exc, _StaleFrame | _WrongKey)):
            return  # the one answer to an unauthenticated frame: the notice, to a connection that named itself
        # Notices draw on a bucket of their own: a flood of junk must not silence the answers peers get
        if not (self._replies if authentic else self._notices).take(now):
            return
        if authentic:
            # <= 4 UTF-8 bytes a char: the reply fits any max_frame_bytes >= 1024
            text = str(exc)[: min(MAX_TEXT_CHARS, (self._max_frame_bytes - 512) // 4)]
            envelope = Envelope(self._peer_id, self._next_msg_id(), None,
                                ErrorMsg(None, code, text, incarnation=incarnation))
            frame = self.seal(origin, encode(envelope, self._max_frame_bytes), from_router=routing_id is not None)
        else:
            frame = REFUSED_NOTICE
        try:
            if routing_id is None:
                sock.send(frame, zmq.NOBLOCK)
            else:
                sock.send_multipart([routing_id, frame], zmq.NOBLOCK)
        except zmq.ZMQError as send_exc:
            log.debug("channel %r: could not report the rejection: %s", self._peer_id, send_exc)

    def count_failure(self, origin: bytes) -> None:
        """A frame whose handling raised (a bug): counted as rejected, logged with its traceback."""
        self._counters.rejected += 1
        if self._warnings.take(time.monotonic()):
            log.exception("channel %r: failed to handle a frame from %r", self._peer_id, origin)

    def _warn(self, now: float, fmt: str, origin: bytes, exc: BaseException, level: int = logging.WARNING) -> None:
        if self._warnings.take(now):
            unlogged = self._warnings.take_refused()
            more = f" ({unlogged} more rejected frames not logged)" if unlogged else ""
            log.log(level, fmt + "%s", self._peer_id, origin, exc, more)


def _renamed_by_zmq(origin: bytes) -> bool:
    """Whether ``origin`` is a routing id libzmq made up (a zero byte and a 32-bit counter): what a ROUTER names a
    connection it renamed, or one that set no id. Never a channel's own (peer ids are text, never starting with NUL);
    a client claiming such an id is refused all the same, only logged lower."""
    return len(origin) == 5 and origin[0] == 0
