"""Authentication of the control channel (CURVE with a ZAP allow-list, HMAC shared secret), its
configuration from files and environment, and where the channel listens by default."""

from __future__ import annotations

import contextlib
import grp
import os
import pwd
import re
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import pytest
import zmq
import zmq.auth
from zmq.utils.monitor import recv_monitor_message

from ncclkv import errors
from ncclkv._auth import HANDSHAKE_FAILURES_TO_SUSPECT, MAC_OVERHEAD, REFUSED_NOTICE, FrameAuth, FrameGate
from ncclkv._env import env_settings
from ncclkv._peers import Counters
from ncclkv.auth import (
    AuthenticationError,
    ChannelAuth,
    CurveConfig,
    load_channel_auth,
    load_curve_files,
    load_shared_secret,
)
from ncclkv.channel import THREAD_PREFIX, Channel
from ncclkv.launch import free_port
from ncclkv.layout import KVGeometry, ParallelLayout
from ncclkv.protocol import (
    Ack,
    Announce,
    Envelope,
    Handshake,
    HandshakeAck,
    Heartbeat,
    Message,
    Ready,
    RouteMsg,
    decode,
    encode,
)

from _channel_helpers import channel_threads, raw_dealer, wait_until

SECRET = b"0123456789abcdef0123456789abcdef"
FAST = dict(heartbeat_s=0.05, deadline_s=2.0)
WAIT_S = 10.0  # for wait_until
NO_ANSWER_S = 0.5  # how long an unauthenticated peer waits in vain (an authenticated one is answered in ms)
HELLO = Handshake.create("decode-0", "consumer", 0, ParallelLayout(1, 1), KVGeometry(2, 2, 64), "tcp://h:1", "h:2")
pytestmark = pytest.mark.usefixtures("no_channel_thread_left")
ANNOUNCE = Announce("req", 0, RouteMsg(0, 0, (0, 1), (0, 1), (0, 4)), (2, 4, 1, 64), "bfloat16", 1024, 0, "kv-0")


class Server:
    """A channel that records what its handler sees and answers handshakes and Ready."""

    def __init__(self, auth: ChannelAuth, **kwargs: object) -> None:
        self.seen: list[tuple[str, Message]] = []
        self.channel = Channel("server", on_message=self.handle, auth=auth, **FAST, **kwargs)  # type: ignore[arg-type]

    def handle(self, sender: str, body: Message) -> Message | None:
        self.seen.append((sender, body))
        if isinstance(body, Handshake):
            return HandshakeAck("prefill-0", 0, True, "")
        return Ack(body.request_id, None) if isinstance(body, Ready) else None


class Channels:
    """Makes the test's channels and closes them all at the end."""

    def __init__(self) -> None:
        self.made: list[Channel] = []

    def server(self, auth: ChannelAuth, **kwargs: object) -> Server:
        server = Server(auth, **kwargs)
        self.made.append(server.channel)
        return server

    def client(self, peer_id: str, auth: ChannelAuth, **kwargs: object) -> Channel:
        self.made.append(Channel(peer_id, auth=auth, **FAST, **kwargs))  # type: ignore[arg-type]
        return self.made[-1]


@pytest.fixture
def make() -> Iterator[Channels]:
    channels = Channels()
    yield channels
    for channel in reversed(channels.made):
        channel.close()


def assert_refused(client: Channel, server: Server) -> None:
    """The client's handshake is never answered and its announce never reaches the handler."""
    client.connect("server", server.channel.address)
    client_send_ok = True
    try:
        client.send("server", ANNOUNCE)
    except errors.PeerLostError:
        client_send_ok = False  # a DEALER whose handshakes fail has no pipe left: the peer is lost
    with pytest.raises((errors.TransferTimeout, errors.PeerLostError)):
        client.request("server", HELLO, timeout_s=NO_ANSWER_S)
    assert server.seen == [] and server.channel.stats.received == 0, (client_send_ok, server.seen)


# -- CURVE ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Certificates in zmq.auth's format: server, client, an intruder; and an allowed-clients dir."""
    root = tmp_path_factory.mktemp("certs")
    paths = {}
    for name in ("server", "client", "intruder"):
        public, secret = zmq.auth.create_certificates(root, name)
        paths[name], paths[f"{name}_secret"] = Path(public), Path(secret)
        paths[f"{name}_secret"].chmod(0o600)  # zmq.auth writes it as the umask has it; others must not read it
    allowed = root / "allowed"
    allowed.mkdir()
    for name in ("server", "client"):
        (allowed / f"{name}.key").write_bytes(paths[name].read_bytes())
    paths["allowed"] = allowed
    return paths


def curve(certs: dict[str, Path], name: str, server: str = "server") -> ChannelAuth:
    return ChannelAuth(curve=load_curve_files(certs[f"{name}_secret"], certs[server], certs["allowed"]))


def test_curve_peers_with_allowed_keys_talk_both_ways(make: Channels, certs: dict[str, Path]) -> None:
    server = make.server(curve(certs, "server"))
    client = make.client("decode-0", curve(certs, "client"),
                  on_message=lambda sender, body: Ack(body.request_id, 7) if isinstance(body, Ready) else None)
    assert f"{THREAD_PREFIX}-zap[server]" in channel_threads()
    client.connect("server", server.channel.address)
    assert client.request("server", HELLO, timeout_s=10) == HandshakeAck("prefill-0", 0, True, "")
    assert server.channel.request("decode-0", Ready("back"), timeout_s=10) == Ack("back", 7)  # and back
    client.send("server", ANNOUNCE)
    assert client.request("server", Ready("r"), timeout_s=10) == Ack("r", None)
    assert [type(body) for _, body in server.seen] == [Handshake, Announce, Ready]
    assert server.channel.stats.auth_failures == 0


@pytest.mark.parametrize("who", ["no keys", "key not allowed", "wrong server key"])
def test_curve_refuses_unauthenticated_peers(make: Channels, certs: dict[str, Path], who: str) -> None:
    server = make.server(curve(certs, "server"))
    auth = {
        "no keys": ChannelAuth(),
        "key not allowed": curve(certs, "intruder"),
        "wrong server key": curve(certs, "client", server="intruder"),  # the client cannot be fooled either
    }[who]
    assert_refused(make.client("decode-0", auth), server)
    if who == "key not allowed":
        wait_until(lambda: server.channel.stats.auth_failures >= 1, WAIT_S)  # the ZAP allow-list said no
    good = make.client("decode-1", curve(certs, "client"))  # meanwhile, an allowed client is served
    good.connect("server", server.channel.address)
    assert good.request("server", Ready("ok"), timeout_s=10) == Ack("ok", None)


@pytest.mark.parametrize("who", ["key not allowed", "server without CURVE", "no keys", "wrong server key"])
def test_curve_mismatched_keys_fail_typed_naming_address_and_why_long_before_the_deadline(
        certs: dict[str, Path], who: str) -> None:
    """The client's CURVE handshake fails (its monitor says how, or a ZMQ server keeps ending it): the request fails
    with a PeerAuthError naming the address and the key or setting, within seconds of a 30 s deadline. A wrong server
    key shows to the client only as handshakes the server ends (EPIPE), as a forwarder with nothing behind does (next
    test): certain once a probe read a ZMTP signature at that address. Before, a wrong server key failed only at
    deadline_s, a PeerLostError "nothing heard", naming the key as a suspect; the ZAP refusal was a PeerLostError."""
    auth, server_auth, told = {
        "key not allowed": (curve(certs, "intruder"), curve(certs, "server"),
                            r"refused our CURVE key \S+ \(ZAP status 400\): it is not among its allowed clients "
                            r"\(NCCLKV_CURVE_ALLOWED_KEYS"),
        # Whichever side sees the mechanisms differ first: our monitor says so, or the server ends the handshakes
        "server without CURVE": (curve(certs, "client"), ChannelAuth(),
                                 r"does not use CURVE \(PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH\)|ended our last \d+ "
                                 r"ZMQ handshakes \(\w+\), none succeeded, while a ZMQ server answers there: it cannot "
                                 r"open our CURVE hello, so the server key we were given for it \(\S+\) is not its key, "
                                 r"or it does not use CURVE"),
        # Whichever side sees the mechanisms differ first: our monitor says so, or the server ends it
        "no keys": (ChannelAuth(), curve(certs, "server"),
                    r"uses CURVE while this channel does not \(PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH\)|ended our last "
                    r"\d+ ZMQ handshakes \(\w+\), none succeeded, while a ZMQ server answers there: it uses CURVE "
                    r"while this channel does not"),
        "wrong server key": (curve(certs, "client", server="intruder"), curve(certs, "server"),
                             r"ended our last \d+ ZMQ handshakes \(EPIPE\), none succeeded, while a ZMQ server answers "
                             r"there: it cannot open our CURVE hello, so the server key we were given for it \(\S+\) "
                             r"is not its key, or it does not use CURVE \(NCCLKV_CURVE_SERVER_KEY"),
    }[who]
    deadline_s = 30.0
    with Channel("server", auth=server_auth, heartbeat_s=0.5, deadline_s=deadline_s) as server, \
            Channel("decode-0", auth=auth, heartbeat_s=0.5, deadline_s=deadline_s) as client:
        client.connect("server", server.address)
        started = time.monotonic()
        with pytest.raises(errors.PeerAuthError, match=told) as failed:
            client.request("server", HELLO)  # waits up to deadline_s
        elapsed = time.monotonic() - started
        assert f"authentication failed: {server.address!r} " in str(failed.value)
        assert elapsed < deadline_s / 6, f"{who}: PeerAuthError after {elapsed:.1f}s of a {deadline_s}s deadline"
        with pytest.raises(errors.PeerAuthError, match=told):  # and every later call, until connect() again
            client.send("server", HELLO)
        assert server.stats.received == 0


def test_curve_peer_behind_a_forwarder_is_not_lost_while_it_starts() -> None:
    """A TCP forwarder (docker's proxy, kubectl port-forward, ssh -L) accepts our connection and closes it while
    nothing listens behind it: to the client that is a handshake ended by the other side, as for a wrong server key.
    Before, 3 of them in a row lost the peer within 0.3 s; now it is reached once it is up."""
    keys = RankKeys()
    backend = free_port()
    refused = threading.Semaphore(0)
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def forward() -> None:  # accept; dial the backend; on refusal close the client; else pump both ways
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                client_sock, _ = listener.accept()
            except OSError:
                continue
            try:
                backend_sock = socket.create_connection(("127.0.0.1", backend))
            except OSError:
                client_sock.close()
                refused.release()
                continue
            for a, b in ((client_sock, backend_sock), (backend_sock, client_sock)):
                threading.Thread(target=_pump, args=(a, b), daemon=True).start()

    forwarder = threading.Thread(target=forward, daemon=True)
    forwarder.start()
    client = Channel("decode-0", auth=keys.auth("r1"), heartbeat_s=0.2, deadline_s=60.0)
    try:
        client.connect("server", f"tcp://127.0.0.1:{listener.getsockname()[1]}")
        for _ in range(2 * HANDSHAKE_FAILURES_TO_SUSPECT):  # the client tried, and was cut off, that many times
            assert refused.acquire(timeout=WAIT_S)
        with Channel("server", auth=keys.auth("r0"), bind_host="127.0.0.1", port=backend,
                     on_message=lambda sender, body: HandshakeAck("x", 0, True, "")) as server:
            assert client.request("server", HELLO, timeout_s=WAIT_S) == HandshakeAck("x", 0, True, "")
            assert server.stats.received == 1
    finally:
        client.close()
        stop.set()
        forwarder.join(WAIT_S)
        listener.close()


def _pump(source: socket.socket, sink: socket.socket) -> None:
    try:
        while data := source.recv(65536):
            sink.sendall(data)
    except OSError:
        pass
    for sock in (source, sink):
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)


@pytest.mark.parametrize(
    ("keys", "event"),
    [("none", zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL), ("intruder", zmq.EVENT_HANDSHAKE_FAILED_AUTH)],
    ids=["no keys", "key not allowed"],
)
def test_curve_raw_socket_never_gets_a_byte_through(make: Channels, certs: dict[str, Path],
                                                   keys: str, event: int) -> None:
    """A raw DEALER sending a well-formed handshake under its own name: the ZMQ handshake fails
    (seen on its monitor), so the frame never reaches the decoder, let alone the handler."""
    server = make.server(curve(certs, "server"))
    context = zmq.Context()
    raw = context.socket(zmq.DEALER)
    monitor = raw.get_monitor_socket(event)
    try:
        raw.setsockopt(zmq.LINGER, 0)
        raw.setsockopt(zmq.ROUTING_ID, b"decode-0")
        if keys == "intruder":
            public, secret = zmq.auth.load_certificate(certs["intruder_secret"])
            raw.curve_publickey, raw.curve_secretkey = public, secret
            raw.curve_serverkey = zmq.auth.load_certificate(certs["server"])[0]
        raw.connect(server.channel.address)
        raw.send(encode(Envelope("decode-0", 1, None, HELLO)))
        assert monitor.poll(10_000) and recv_monitor_message(monitor)["event"] == event
        assert not raw.poll(int(NO_ANSWER_S * 1000))
        assert server.seen == [] and server.channel.stats.received == 0 and server.channel.stats.rejected == 0
    finally:
        raw.disable_monitor()
        monitor.close(linger=0)
        raw.close(linger=0)
        context.term()


class RankKeys:
    """Per-rank CURVE keys: a fresh key pair for each of r0, r1, r2, every rank's public key allowed."""

    def __init__(self) -> None:
        self.pairs = {name: zmq.curve_keypair() for name in ("r0", "r1", "r2")}
        self.allowed = frozenset(public for public, _ in self.pairs.values())

    def public(self, name: str) -> bytes:
        return self.pairs[name][0]

    def auth(self, name: str) -> ChannelAuth:
        """Rank ``name``'s own key pair, expecting r0's public key of the servers it connects to."""
        public, secret = self.pairs[name]
        return ChannelAuth(curve=CurveConfig(public, secret, self.public("r0"), self.allowed))


def test_curve_binds_a_connected_peer_id_to_its_key(make: Channels) -> None:
    """Per-rank keys: the server (r0's keys) connected to r1 with r1's key, so r2, an allowed client too,
    cannot send under r1's id to its ROUTER; an id it never connected to is bound to no key (SECURITY.md)."""
    keys = RankKeys()
    server = make.server(keys.auth("r0"))
    r1 = make.client("r1", keys.auth("r1"), on_message=lambda sender, body: None)
    server.channel.connect("r1", r1.address, server_key=keys.public("r1"))
    r1.connect("server", server.channel.address)
    assert r1.request("server", Ready("real"), timeout_s=10) == Ack("real", None)
    forger = make.client("r1", keys.auth("r2"))  # r2's key pair, r1's name
    forger.connect("server", server.channel.address)
    forger.send("server", Ready("forged"))
    wait_until(lambda: server.channel.stats.auth_failures >= 1, WAIT_S)
    unbound = make.client("r9", keys.auth("r2"))
    unbound.connect("server", server.channel.address)
    assert unbound.request("server", Ready("unbound"), timeout_s=10) == Ack("unbound", None)
    assert [(sender, body) for sender, body in server.seen] == [("r1", Ready("real")), ("r9", Ready("unbound"))]


def test_curve_binding_a_peer_an_impostor_reached_us_as_stops_answering_the_impostor(make: Channels) -> None:
    """r2's key, r1's name, reaching the server first; the server then connects to r1 with r1's key: its
    request goes to the real r1, not back on the impostor's connection, and the impostor is refused."""
    keys = RankKeys()
    server = make.server(keys.auth("r0"))
    impostor = make.client("r1", keys.auth("r2"), on_message=lambda sender, body: Ack(body.request_id, 666))
    impostor.connect("server", server.channel.address)
    assert impostor.request("server", Ready("first"), timeout_s=10) == Ack("first", None)
    real = make.client("r1", keys.auth("r1"), on_message=lambda sender, body: Ack(body.request_id, 1))
    server.channel.connect("r1", real.address, server_key=keys.public("r1"))
    assert server.channel.request("r1", Ready("for-r1"), timeout_s=10) == Ack("for-r1", 1)
    assert server.channel.stats.auth_failures >= 1
    impostor.send("server", Ready("again"))
    wait_until(lambda: server.channel.stats.auth_failures >= 2, WAIT_S)
    assert [body for _, body in server.seen] == [Ready("first")]


def test_curve_and_secret_a_frame_refused_for_its_key_is_not_answered_as_a_bad_mac(make: Channels) -> None:
    """CURVE per-rank keys and a shared secret. The server was given a wrong key for r1 (r2's) when it connected:
    r1's frames to its ROUTER, with good MACs, are refused for their CURVE key, and dropped unanswered (SECURITY.md).
    The refusal notice, which says our frames fail its MAC, made r1 lose the server at once blaming the shared
    secret, which both hold alike; the server's own loss of r1 names the key it was given."""
    keys = RankKeys()

    def both(name: str) -> ChannelAuth:
        return ChannelAuth(curve=keys.auth(name).curve, shared_secret=SECRET)

    server = make.server(both("r0"))
    r1 = make.client("r1", both("r1"), on_message=lambda sender, body: None)
    server.channel.connect("r1", r1.address, server_key=keys.public("r2"))  # the wrong key
    r1.connect("server", server.channel.address)
    with pytest.raises(errors.TransferTimeout):
        r1.request("server", Ready("real"), timeout_s=NO_ANSWER_S)
    assert server.channel.stats.auth_failures >= 1 and server.seen == []
    wait_until(lambda: not server.channel.peer_alive("r1"), WAIT_S)
    with pytest.raises(errors.PeerAuthError, match="server key we were given for it"):
        server.channel.send("r1", Ready("probe"))


def test_curve_and_secret_together_and_a_failed_bind_leaves_no_thread(make: Channels,
                                                                     certs: dict[str, Path]) -> None:
    both = ChannelAuth(curve=curve(certs, "server").curve, shared_secret=SECRET)
    server = make.server(both)
    client = make.client("decode-0", ChannelAuth(curve=curve(certs, "client").curve, shared_secret=SECRET))
    client.connect("server", server.channel.address)
    assert client.request("server", HELLO, timeout_s=10) == HandshakeAck("prefill-0", 0, True, "")
    port = int(server.channel.address.rsplit(":", 1)[1])
    threads = sorted(channel_threads())
    with pytest.raises(zmq.ZMQError):
        Channel("second", port=port, auth=both)  # the ZAP thread it started is joined before the error
    assert sorted(channel_threads()) == threads


# -- shared secret (HMAC) ------------------------------------------------------------------

def test_hmac_peers_talk_and_heartbeat(make: Channels) -> None:
    server = make.server(ChannelAuth(shared_secret=SECRET))
    client = make.client("decode-0", ChannelAuth(shared_secret=SECRET))
    client.connect("server", server.channel.address)
    assert client.request("server", HELLO, timeout_s=10) == HandshakeAck("prefill-0", 0, True, "")
    client.send("server", ANNOUNCE)
    assert client.request("server", Ready("r"), timeout_s=10) == Ack("r", None)
    # Heartbeats are sealed too: both sides measure a round trip.
    wait_until(lambda: None not in (client.last_rtt("server"), server.channel.last_rtt("decode-0")), WAIT_S)
    assert [type(body) for _, body in server.seen] == [Handshake, Announce, Ready]
    assert server.channel.stats.auth_failures == 0 and server.channel.stats.rejected == 0


@pytest.mark.parametrize("who", ["no secret", "wrong secret"])
def test_hmac_refuses_unauthenticated_peers(make: Channels, who: str) -> None:
    server = make.server(ChannelAuth(shared_secret=SECRET))
    auth = ChannelAuth() if who == "no secret" else ChannelAuth(shared_secret=SECRET[::-1])
    assert_refused(make.client("decode-0", auth), server)
    wait_until(lambda: server.channel.stats.auth_failures >= 2, WAIT_S)  # the announce and the handshake, dropped
    assert server.channel.stats.rejected == server.channel.stats.auth_failures and server.seen == []


# The server's secret, the client's, and what the client is told, in both directions (each side dials the other).
MISMATCHED = {
    "client has none": (SECRET, None, "it has a shared secret and this channel has none",
                        r"answers with frames that fail authentication \(.*\): its shared secret differs from ours, "
                        r"or it has none"),
    "server has none": (None, SECRET, r"answers with frames that fail authentication \(.*\): its shared secret "
                                      r"differs from ours, or it has none",
                        "it has a shared secret and this channel has none"),
    "secrets differ": (SECRET, SECRET[::-1], "its shared secret differs from ours",
                       "its shared secret differs from ours"),
}


@pytest.mark.parametrize("case", list(MISMATCHED))
def test_hmac_mismatched_secrets_lose_the_peer_at_once_naming_why(case: str) -> None:
    """Each side dials the other: its first frames are refused there, the refusal (or the other's unauthenticated
    answer) comes back on the connection it opened, and the request fails with a PeerAuthError naming the secrets.
    The deadline is long and the request's timeout shorter, so without that answer it would time out instead."""
    server_secret, client_secret, client_told, server_told = MISMATCHED[case]
    timing = dict(heartbeat_s=0.5, deadline_s=120.0)
    channels = [Channel(name, auth=ChannelAuth(shared_secret=secret) if secret else ChannelAuth(),
                        on_message=lambda sender, body: HandshakeAck("x", 0, True, ""), **timing)  # type: ignore[arg-type]
                for name, secret in (("server", server_secret), ("decode-0", client_secret))]
    server, client = channels
    try:
        for caller, callee, told in ((client, server, client_told), (server, client, server_told)):
            caller.connect(callee.peer_id, callee.address)
            with pytest.raises(errors.PeerAuthError, match=rf"'{re.escape(callee.address)}' .*{told}") as lost:
                caller.request(callee.peer_id, HELLO, timeout_s=30)
            assert "NCCLKV_SHARED_SECRET" in str(lost.value)
            assert not caller.peer_alive(callee.peer_id)
        # Only the frames' gate refused anything: no handler saw a message.
        assert server.stats.received == 0 and client.stats.received == 0
    finally:
        for channel in channels:
            channel.close()


def test_hmac_drops_replays_alterations_and_misattributed_frames(make: Channels) -> None:
    server = make.server(ChannelAuth(shared_secret=SECRET))
    context = zmq.Context()
    socks = {}
    try:
        for name in ("legit", "mallory"):
            socks[name] = context.socket(zmq.DEALER)
            socks[name].setsockopt(zmq.LINGER, 0)
            socks[name].setsockopt(zmq.ROUTING_ID, name.encode())
            socks[name].connect(server.channel.address)
        legit = FrameAuth(SECRET, "legit", 300.0)  # a peer that knows the secret, driven by hand

        def sealed(request_id: str, receiver: bytes = b"server") -> bytes:
            return legit.seal(receiver, encode(Envelope("legit", 1, None, Ready(request_id))), from_router=False)

        first = sealed("first")
        altered = bytearray(sealed("altered"))
        altered[-2] ^= 0x01
        with mock.patch("ncclkv._auth.time.time_ns", return_value=time.time_ns() - 3600 * 10**9):
            stale = FrameAuth(SECRET, "mallory", 300.0).seal(b"server", encode(Envelope("mallory", 1, None, Ready("stale"))),
                                                             from_router=False)
        socks["legit"].send(first)
        socks["legit"].send(first)  # replayed
        socks["legit"].send(bytes(altered))
        socks["legit"].send(sealed("redirected", receiver=b"elsewhere"))
        socks["mallory"].send(sealed("misattributed"))  # legit's frame, sent under another name
        socks["mallory"].send(stale)  # an old capture, to a receiver that never heard from mallory
        socks["mallory"].send(encode(Envelope("mallory", 1, None, Ready("plain"))))  # no MAC at all
        socks["legit"].send(sealed("last"))  # FIFO per connection: when it lands, legit's earlier frames did
        wait_until(lambda: len(server.seen) >= 2 and server.channel.stats.auth_failures >= 6, WAIT_S)
        assert [body.request_id for _, body in server.seen] == ["first", "last"]  # type: ignore[union-attr]
        assert server.channel.stats.auth_failures == 6 and server.channel.stats.received == 2
        # Each frame failing its MAC is answered by the fixed notice alone (sent by the I/O thread at once, so not
        # in order with the Acks, which the dispatcher sends); a stale or replayed one, which only a holder of the
        # secret can have made, is not answered at all. legit's sealed replies include heartbeats now.
        replies: list[Message | bytes] = []
        while len(replies) < 4:
            assert socks["legit"].poll(5000), replies
            frame = socks["legit"].recv()
            body = frame if frame == REFUSED_NOTICE else decode(legit.open(b"server", frame, via_router=False)).body
            replies += [] if isinstance(body, Heartbeat) else [body]
        assert [reply for reply in replies if reply != REFUSED_NOTICE] == [Ack("first", None), Ack("last", None)]
        assert replies.count(REFUSED_NOTICE) == 2  # the altered and the redirected frame; not the replay
        for _ in range(2):  # mallory learns nothing but that its frames were refused (not its stale capture)
            assert socks["mallory"].poll(5000) and socks["mallory"].recv() == REFUSED_NOTICE
        assert not socks["mallory"].poll(int(NO_ANSWER_S * 1000))
    finally:
        for sock in socks.values():
            sock.close(linger=0)
        context.term()


class _Sent:
    """A stand-in for the socket FrameGate answers on: it records what was sent."""

    def __init__(self) -> None:
        self.frames: list[bytes] = []

    def send(self, frame: bytes, flags: int = 0) -> None:
        self.frames.append(frame)

    def send_multipart(self, parts: list[bytes], flags: int = 0) -> None:
        self.frames.append(parts[-1])


def _gate(lost: list[tuple[str, str]]) -> FrameGate:
    return FrameGate(peer_id="server", max_frame_bytes=1 << 20, auth=ChannelAuth(shared_secret=SECRET),
                     counters=Counters(), next_msg_id=iter(range(1, 10**6)).__next__,
                     wrong_answer=lambda peer, what, kind: lost.append((peer, what)))


def test_a_stale_or_replayed_frame_with_a_good_mac_is_neither_noticed_nor_a_loss() -> None:
    """Only a holder of the secret can have made it: a restarted peer's first frames queued old, or two lives of one
    id overlapping a moment. Answering it with the notice made honest peers with the same secret lose each other."""
    lost: list[tuple[str, str]] = []
    gate, sock = _gate(lost), _Sent()
    peer = FrameAuth(SECRET, "peer", 300.0)
    hello = encode(Envelope("peer", 1, None, Ready("r")))
    for from_router in (False, True):  # the peer's DEALER -> our ROUTER, and its ROUTER -> our DEALER
        routing_id = None if from_router else b"peer"
        frame = peer.seal(b"server", hello, from_router=from_router)
        assert gate.admit(sock, routing_id, b"peer", [frame]) is not None
        assert gate.admit(sock, routing_id, b"peer", [frame]) is None  # replayed
    with mock.patch("ncclkv._auth.time.time_ns", return_value=time.time_ns() - 3600 * 10**9):
        old = FrameAuth(SECRET, "late", 300.0).seal(b"server", hello, from_router=True)
    assert gate.admit(sock, None, b"late", [old]) is None  # a first frame an hour old, on our DEALER
    assert sock.frames == [] and lost == []
    # A bad MAC on our DEALER is still a loss, naming both causes a MAC failure can have.
    assert gate.admit(sock, None, b"peer", [FrameAuth(SECRET[::-1], "peer", 300.0).seal(b"server", hello,
                                                                                      from_router=True)]) is None
    assert len(lost) == 1 and lost[0][0] == "peer" and "its shared secret differs from ours" in lost[0][1]
    assert "or the channel at that address is not 'peer' (each frame's MAC names its receiver)" in lost[0][1]


def test_a_message_of_many_parts_is_buffered_whole_before_it_is_refused(make: Channels) -> None:
    """MAXMSGSIZE bounds each part of a ZMQ message, not their number, and ZMQ delivers a message only once its last
    part came: one message of many parts, each under the frame limit, from a host without the secret is held whole
    (here 10 MB, with a 64 KiB limit) before the channel can count and refuse it. docs/SECURITY.md ("Hostile input",
    "Not covered") says so: without CURVE that is volume any host that reaches the port can send."""
    server = make.server(ChannelAuth(shared_secret=SECRET), max_frame_bytes=1 << 16)
    held: list[tuple[int, int]] = []
    admit = server.channel._io._gate.admit

    def spy(sock: zmq.Socket, routing_id: bytes | None, origin: bytes, payload: list[bytes], *rest: object) -> object:
        held.append((len(payload), sum(len(part) for part in payload)))
        return admit(sock, routing_id, origin, payload, *rest)  # type: ignore[arg-type]

    server.channel._io._gate.admit = spy  # type: ignore[method-assign]
    with raw_dealer(server.channel.address, b"outsider") as raw:
        raw.send_multipart([b"x" * 50_000] * 200)  # each part well under 2 * 64 KiB + 1 KiB
        wait_until(lambda: server.channel.stats.rejected == 1, WAIT_S)
    assert held == [(200, 10_000_000)] and server.channel.stats.auth_failures == 1 and server.seen == []


def test_a_flood_of_unauthenticated_frames_does_not_silence_the_answers_to_authentic_ones() -> None:
    """The notices have a bucket of their own: before, an outsider's junk used up the one that answers peers."""
    gate, sock = _gate([]), _Sent()
    started = time.monotonic()
    for _ in range(1000):
        gate.admit(sock, b"outsider", b"outsider", [b"junk" * 20])
    notices, elapsed = len(sock.frames), time.monotonic() - started
    assert 0 < notices <= 100 + 50 * elapsed + 1  # a burst of 100 and what refilled since
    assert set(sock.frames) == {REFUSED_NOTICE}
    peer = FrameAuth(SECRET, "peer", 300.0)
    for index in range(10):  # authentic, but naming another sender: answered, each one
        gate.admit(sock, b"peer", b"peer", [peer.seal(b"server", encode(Envelope("other", index, None, Ready("r"))),
                                                      from_router=False)])
    answers = [decode(peer.open(b"server", frame, via_router=False)).body for frame in sock.frames[notices:]]
    assert len(answers) == 10 and all("names sender 'other'" in body.text for body in answers), answers


def test_frame_auth_seal_and_open() -> None:
    alice, bob = FrameAuth(SECRET, "alice", 300.0), FrameAuth(SECRET, "bob", 300.0)
    frames = [alice.seal(b"bob", b"payload %d" % i, from_router=False) for i in range(3)]  # alice's DEALER -> bob's ROUTER
    assert all(len(f) == MAC_OVERHEAD + 9 for f in frames)
    assert [bob.open(b"alice", f, via_router=True) for f in frames] == [b"payload 0", b"payload 1", b"payload 2"]
    with pytest.raises(AuthenticationError, match="replayed or reordered"):
        bob.open(b"alice", frames[1], via_router=True)
    # alice's ROUTER -> bob's DEALER: another path, which keeps its own order
    assert bob.open(b"alice", alice.seal(b"bob", b"x", from_router=True), via_router=False) == b"x"
    for bad in (frames[0][:10], b"", frames[0][:-1] + b"?"):
        with pytest.raises(AuthenticationError):
            FrameAuth(SECRET, "bob", 300.0).open(b"alice", bad, via_router=True)
    with pytest.raises(AuthenticationError, match="bad MAC"):
        FrameAuth(SECRET[::-1], "bob", 300.0).open(b"alice", alice.seal(b"bob", b"x", from_router=False), via_router=True)


@pytest.mark.parametrize("from_router", [False, True], ids=["dealer-frame-to-dealer", "router-frame-to-router"])
def test_frame_auth_refuses_a_frame_moved_to_the_other_path(from_router: bool) -> None:
    """Each path keeps its own replay state, so the MAC names the path: a frame captured on one path
    opens on it once, and never on the other one, where its stamp could still look new."""
    alice, bob = FrameAuth(SECRET, "alice", 300.0), FrameAuth(SECRET, "bob", 300.0)
    frame = alice.seal(b"bob", b"hello", from_router=from_router)
    with pytest.raises(AuthenticationError, match="bad MAC.*other path"):
        bob.open(b"alice", frame, via_router=from_router)  # the wrong path, before the right one saw it
    assert bob.open(b"alice", frame, via_router=not from_router) == b"hello"
    with pytest.raises(AuthenticationError, match="bad MAC.*other path"):
        bob.open(b"alice", frame, via_router=from_router)  # and after


def test_hmac_frame_captured_on_one_path_does_not_replay_on_the_other(make: Channels) -> None:
    """B answers A through B's ROUTER (A connected to B); a host without the secret that captured such a
    frame and sends it to A's ROUTER under B's routing id gets nothing dispatched, and B stays bound to
    its deadline (replayed heartbeats would otherwise keep a dead peer alive)."""
    seen: list[tuple[str, Message]] = []
    captured: list[bytes] = []
    a = make.client("A", ChannelAuth(shared_secret=SECRET), on_message=lambda sender, body: seen.append((sender, body)))
    b = make.client("B", ChannelAuth(shared_secret=SECRET), on_message=lambda sender, body: None)
    gate = a._io._gate
    admit = gate.admit

    def spy(sock: zmq.Socket, routing_id: bytes | None, origin: bytes, payload: list[bytes], *rest: object) -> object:
        if routing_id is None:  # what reaches A's DEALER: what a sniffer on the wire sees
            captured.append(bytes(payload[0]))
        return admit(sock, routing_id, origin, payload, *rest)  # type: ignore[arg-type]

    gate.admit = spy  # type: ignore[method-assign]
    a.connect("B", b.address)
    a.send("B", Ready("hello"))  # B learns A through its ROUTER, and answers on that connection
    wait_until(lambda: b.peer_alive("A"), WAIT_S)
    b.send("A", Ready("req-1"))
    wait_until(lambda: len(seen) == 1, WAIT_S)
    frame = next(f for f in captured if b"req-1" in f)
    with raw_dealer(a.address, b"B") as raw:
        raw.send(frame)
        wait_until(lambda: a.stats.auth_failures == 1, WAIT_S)
        assert seen == [("B", Ready("req-1"))] and a.stats.received == 1


def test_hmac_a_recent_capture_replays_once_to_a_restarted_receiver(make: Channels) -> None:
    """Replay state lasts one receiver life: a restarted receiver (same peer id and secret) has no stamp of the
    sender yet, so a frame captured less than max_clock_skew_s ago is taken once more, as the sender's, while the
    life that saw it refuses it. docs/SECURITY.md ("Shared secret") says so: a window, not a guarantee."""
    auth = ChannelAuth(shared_secret=SECRET)
    server = make.server(auth)
    captured: list[bytes] = []
    admit = server.channel._io._gate.admit

    def spy(sock: zmq.Socket, routing_id: bytes | None, origin: bytes, payload: list[bytes], *rest: object) -> object:
        if routing_id is not None and origin == b"A":  # what a sniffer on the wire sees
            captured.append(bytes(payload[0]))
        return admit(sock, routing_id, origin, payload, *rest)  # type: ignore[arg-type]

    server.channel._io._gate.admit = spy  # type: ignore[method-assign]
    a = make.client("A", auth)
    a.connect("server", server.channel.address)
    assert a.request("server", Ready("req-1"), timeout_s=WAIT_S) == Ack("req-1", None)
    frame = next(f for f in captured if b"req-1" in f)
    with raw_dealer(server.channel.address, b"A") as raw:  # to the life that saw it: a replay, refused
        raw.send(frame)
        wait_until(lambda: server.channel.stats.auth_failures == 1, WAIT_S)
    assert [body for _, body in server.seen] == [Ready("req-1")]
    server.channel.close()
    restarted = make.server(auth)
    with raw_dealer(restarted.channel.address, b"A") as raw:
        raw.send(frame)
        wait_until(lambda: restarted.seen != [], WAIT_S)
    assert restarted.seen == [("A", Ready("req-1"))] and restarted.channel.stats.auth_failures == 0


# -- configuration --------------------------------------------------------------------------

def test_auth_from_environment(certs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    secret_file = tmp_path / "secret"
    secret_file.write_bytes(SECRET + b"\n")
    secret_file.chmod(0o600)
    env = {"NCCLKV_CURVE_SECRET_FILE": str(certs["client_secret"]), "NCCLKV_CURVE_PUBLIC_FILE": str(certs["server"]),
           "NCCLKV_CURVE_ALLOWED_DIR": str(certs["allowed"]), "NCCLKV_SHARED_SECRET_FILE": str(secret_file)}
    auth = load_channel_auth(env_settings(env))
    client_public = zmq.auth.load_certificate(certs["client"])[0]
    assert auth.curve is not None and auth.curve.public_key == client_public
    assert auth.curve.server_key == zmq.auth.load_certificate(certs["server"])[0]
    assert auth.curve.allowed_clients == frozenset(zmq.auth.load_certificates(certs["allowed"]))
    assert auth.shared_secret == SECRET and auth.enabled
    assert SECRET.decode() not in repr(auth) and auth.curve.secret_key.decode() not in repr(auth)
    assert auth.describe() == f"curve(public={client_public.decode()}, 2 allowed) + hmac-sha256"

    public, secret = zmq.curve_keypair()
    by_value = load_channel_auth(env_settings({"NCCLKV_CURVE_SECRET_KEY": secret.decode(),
                                               "NCCLKV_SHARED_SECRET": SECRET.decode()}))
    assert by_value.curve == CurveConfig(public, secret, public, frozenset({public}))  # one deployment-wide pair
    assert SECRET.decode() not in repr(env_settings({"NCCLKV_SHARED_SECRET": SECRET.decode()}))
    assert load_channel_auth(env_settings({})) == ChannelAuth() and not ChannelAuth().enabled

    monkeypatch.setenv("NCCLKV_SHARED_SECRET", SECRET.decode())
    with Channel("from-env") as channel:  # auth=None reads the environment
        assert channel.auth.shared_secret == SECRET


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"NCCLKV_SHARED_SECRET": "short"}, "has 5 bytes; use at least 32"),
        ({"NCCLKV_SHARED_SECRET": "x" * 32, "NCCLKV_SHARED_SECRET_FILE": "/nonexistent"}, "not both"),
        ({"NCCLKV_SHARED_SECRET_FILE": "/nonexistent/secret"}, "does not exist"),
        ({"NCCLKV_CURVE_ALLOWED_DIR": "/tmp"}, "no CURVE secret key"),
        ({"NCCLKV_CURVE_SECRET_KEY": "not a key"}, "40-character Z85"),
        ({"NCCLKV_CURVE_SECRET_FILE": "{server}"}, "holds no secret-key"),
        ({"NCCLKV_CURVE_SECRET_FILE": "{server_secret}", "NCCLKV_CURVE_ALLOWED_DIR": "{empty}"}, "holds no *.key"),
        ({"NCCLKV_CURVE_SECRET_FILE": "{server_secret}", "NCCLKV_CURVE_SERVER_KEY": "x" * 40}, "go with"),
    ],
)
def test_bad_auth_configuration_is_refused(certs: dict[str, Path], tmp_path: Path, env: dict[str, str], message: str) -> None:
    (tmp_path / "empty").mkdir()
    names = {k: str(v) for k, v in certs.items()} | {"empty": str(tmp_path / "empty")}
    with pytest.raises(ValueError, match=message.replace("*", r"\*")):
        load_channel_auth(env_settings({k: v.format(**names) for k, v in env.items()}))


def test_bad_auth_values_are_refused(certs: dict[str, Path], tmp_path: Path) -> None:
    public, secret = zmq.curve_keypair()
    other_public, _ = zmq.curve_keypair()
    with pytest.raises(ValueError, match="does not belong"):
        CurveConfig(other_public, secret, public, frozenset({public}))
    with pytest.raises(ValueError, match="allowed_clients is empty"):
        CurveConfig(public, secret, public, frozenset())
    for skew in (float("inf"), float("nan"), 0.0):  # inf would admit a capture of any age after a restart
        with pytest.raises(ValueError, match=f"max_clock_skew_s must be a finite number > 0, got {skew}"):
            ChannelAuth(shared_secret=SECRET, max_clock_skew_s=skew)
    with pytest.raises(TypeError, match="auth must be a ChannelAuth"):
        Channel("x", auth="secret")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="no CURVE auth"):
        with Channel("x", auth=ChannelAuth()) as channel:
            channel.connect("y", "tcp://127.0.0.1:9", server_key=public)
    short = tmp_path / "short"
    short.write_bytes(b"abc")
    short.chmod(0o600)
    with pytest.raises(ValueError, match="has 3 bytes"):
        load_shared_secret(short)


def _foreign_group(path: Path) -> int | None:
    """A group ``path`` can be given that is not its owner's own (None: this user may give it none)."""
    owner_group = pwd.getpwuid(path.stat().st_uid).pw_gid
    candidates = [g.gr_gid for g in grp.getgrall()] if os.geteuid() == 0 else os.getgroups()
    return next((gid for gid in candidates if gid != owner_group), None)


@pytest.mark.parametrize("case", ["directory 777", "directory 1777", "directory group-writable", "key file 666",
                                  "key file group-writable", "directory of another user"])
def test_allowed_keys_others_could_change_are_refused(certs: dict[str, Path], tmp_path: Path, case: str) -> None:
    """Anyone who can add or rewrite a *.key in the allowed-clients directory is admitted: an intruder drops its
    certificate there. Before, the directory was read whatever its modes, and the intruder's key was allowed."""
    allowed = tmp_path / "allowed"
    shutil.copytree(certs["allowed"], allowed)
    shutil.copy(certs["intruder"], allowed / "intruder.key")  # what someone who can write there does
    target = allowed if case.startswith("directory") else allowed / "client.key"
    if case.endswith("777"):
        target.chmod(0o1777 if case.endswith("1777") else 0o777)
    elif case == "key file 666":
        target.chmod(0o666)
    elif case.endswith("group-writable"):
        gid = _foreign_group(target)
        if gid is None:
            pytest.skip("this user can give a file no group but its own")
        os.chown(target, -1, gid)
        target.chmod(target.stat().st_mode | 0o020)
    else:
        if os.geteuid() != 0:
            pytest.skip("only root can give a directory to another user")
        os.chown(target, 65534, -1)
    mode = target.stat().st_mode & 0o7777
    with pytest.raises(errors.InsecureFileError) as refused:
        load_curve_files(certs["server_secret"], certs["server"], allowed)
    assert refused.value.path == str(target) and refused.value.mode == mode, refused.value
    assert repr(str(target)) in str(refused.value) and f"mode 0o{mode:03o}" in str(refused.value), refused.value
    assert ("owned by another user" if case.endswith("another user") else "writable by") in str(refused.value)


def test_allowed_keys_only_their_owner_can_change_are_read(certs: dict[str, Path], tmp_path: Path) -> None:
    allowed = tmp_path / "allowed"
    shutil.copytree(certs["allowed"], allowed)
    allowed.chmod(0o755)
    for key in allowed.iterdir():
        key.chmod(0o644)
    config = load_curve_files(certs["server_secret"], certs["server"], allowed)
    assert config.allowed_clients == frozenset(zmq.auth.load_certificates(certs["allowed"]))
    # Group-writable is the owner's alone when the group is the owner's private one (umask 002).
    own = pwd.getpwuid(allowed.stat().st_uid)
    if not _private_group_here(own):
        pytest.skip(f"the owner's group {own.pw_gid} has other members")
    os.chown(allowed, -1, own.pw_gid)
    allowed.chmod(0o775)
    assert load_curve_files(certs["server_secret"], certs["server"], allowed) == config


def test_an_allowed_directory_whose_name_is_a_glob_pattern_is_read_itself(certs: dict[str, Path], tmp_path: Path) -> None:
    """The allowed-clients directory's *.key are found by a glob of the directory's path: a name with [ ] * ?
    in it is a pattern. Before, "allowed[1]" read the keys of "allowed1" (a directory whose modes no one
    checked: here 0777, with the intruder's key in it) and none of its own, or, with no such sibling, was
    refused as holding no *.key certificate."""
    allowed = tmp_path / "allowed[1]"
    shutil.copytree(certs["allowed"], allowed)
    allowed.chmod(0o700)
    expected = frozenset(zmq.auth.load_certificate(key)[0] for key in allowed.iterdir())
    assert load_curve_files(certs["server_secret"], None, allowed).allowed_clients == expected
    sibling = tmp_path / "allowed1"
    sibling.mkdir()
    sibling.chmod(0o777)
    shutil.copy(certs["intruder"], sibling / "intruder.key")
    assert load_curve_files(certs["server_secret"], None, allowed).allowed_clients == expected


@pytest.mark.parametrize("entry", ["allowed *.key directory", "allowed *.key dangling symlink", "allowed *.key fifo",
                                   "server-key certificate fifo"])
def test_a_certificate_that_is_no_file_is_refused_naming_it(certs: dict[str, Path], tmp_path: Path, entry: str) -> None:
    """Every *.key in the allowed-clients directory is read as a certificate: a directory or a symlink to nothing
    there is refused with a ValueError naming it, and a FIFO is not opened (open() waits for a writer for ever).
    Before, a directory escaped as IsADirectoryError, a dangling symlink as FileNotFoundError of a path that is
    there, and a FIFO hung the load (and the engine's start) without a deadline."""
    allowed = tmp_path / "allowed"
    shutil.copytree(certs["allowed"], allowed)
    path = allowed / "old.key" if entry.startswith("allowed") else tmp_path / "server.key"
    if entry.endswith("directory"):
        path.mkdir(mode=0o700)
    elif entry.endswith("symlink"):
        path.symlink_to(tmp_path / "gone" / "old.key")
    else:
        os.mkfifo(path, 0o600)
    outcome: dict[str, object] = {}

    def load() -> None:
        try:
            outcome["config"] = (load_curve_files(certs["server_secret"], None, allowed) if path.parent == allowed
                                 else load_curve_files(certs["server_secret"], path))
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            outcome["error"] = exc

    loader = threading.Thread(target=load, daemon=True)
    loader.start()
    loader.join(WAIT_S)
    if loader.is_alive():  # let it go: a writer ends the read it waits in
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        loader.join(WAIT_S)
        pytest.fail(f"loading with {entry} still waited after {WAIT_S}s")
    error = outcome.get("error")
    assert isinstance(error, ValueError) and not isinstance(error, OSError), repr(error)
    assert f"{str(path)!r} is not a file" in str(error), error


@pytest.mark.parametrize("target", ["allowed-clients directory", "shared secret file"])
def test_a_group_that_is_another_users_primary_group_is_not_the_owners_own(
    certs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, target: str
) -> None:
    """A group is the owner's private one only if no one else is in it, by /etc/group or as their primary group:
    /etc/group lists no one under a group that is users' primary group (SUSE's 'users', Debian's 'nogroup'), so
    every user whose primary group it is can write a group-writable file in it. Before, such a group with no one
    listed counted as the owner's own, and the colleague's writes were taken."""
    allowed = tmp_path / "allowed"
    shutil.copytree(certs["allowed"], allowed)
    shared = tmp_path / "shared"
    shared.write_bytes(SECRET)
    path = allowed if target.startswith("allowed") else shared
    own = pwd.getpwuid(path.stat().st_uid)
    if not _private_group_here(own):
        pytest.skip(f"the owner's group {own.pw_gid} has other members already")
    os.chown(path, -1, own.pw_gid)
    path.chmod(0o775 if path is allowed else 0o660)
    load = (lambda: load_curve_files(certs["server_secret"], certs["server"], allowed)) if path is allowed else (
        lambda: load_shared_secret(shared))
    load()  # the owner's own group: the owner's alone to write
    colleague = pwd.struct_passwd(("colleague", "x", max(u.pw_uid for u in pwd.getpwall()) + 1, own.pw_gid,
                                   "", "/", "/bin/sh"))
    everyone = pwd.getpwall()
    monkeypatch.setattr(pwd, "getpwall", lambda: [*everyone, colleague])  # a user in it by its primary group
    with pytest.raises(errors.InsecureFileError, match=rf"{target} '{re.escape(str(path))}' .* is writable by its "
                       rf"group") as refused:
        load()
    assert refused.value.path == str(path)


def _private_group_here(user: pwd.struct_passwd) -> bool:
    """Whether ``user``'s primary group has no other member on this system (listed or by primary group)."""
    return set(grp.getgrgid(user.pw_gid).gr_mem) <= {user.pw_name} and all(
        u.pw_uid == user.pw_uid for u in pwd.getpwall() if u.pw_gid == user.pw_gid)


@pytest.mark.parametrize(("mode", "problem"), [(0o644, "readable by others"), (0o604, "readable by others"),
                                               (0o602, "writable by others"), (0o620, "writable by its group")])
def test_secret_files_others_could_read_or_change_are_refused(
    certs: dict[str, Path], tmp_path: Path, mode: int, problem: str
) -> None:
    """Before, a secret readable by others was taken with a warning, and one others could write without one."""
    shared = tmp_path / "shared"
    shared.write_bytes(SECRET)
    curve_secret = tmp_path / "client.key_secret"
    shutil.copy(certs["client_secret"], curve_secret)
    for path in (shared, curve_secret):
        path.chmod(mode)
        if problem.endswith("its group"):
            gid = _foreign_group(path)
            if gid is None:
                pytest.skip("this user can give a file no group but its own")
            os.chown(path, -1, gid)
    with pytest.raises(errors.InsecureFileError, match=rf"shared secret file '{re.escape(str(shared))}' "
                       rf"\(mode 0o{mode:03o}, .*\) is {problem}") as refused:
        load_shared_secret(shared)
    assert (refused.value.path, refused.value.mode) == (str(shared), mode)
    with pytest.raises(errors.InsecureFileError, match=rf"CURVE secret certificate '{re.escape(str(curve_secret))}' "
                       rf"\(mode 0o{mode:03o}, .*\) is {problem}"):
        load_curve_files(curve_secret)
    with pytest.raises(errors.InsecureFileError, match="shared secret file"):
        load_channel_auth(env_settings({"NCCLKV_SHARED_SECRET_FILE": str(shared)}))


def test_secret_files_only_their_owner_can_read_are_read(certs: dict[str, Path], tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.write_bytes(SECRET)
    shared.chmod(0o400)
    assert load_shared_secret(shared) == SECRET
    if os.geteuid() != 0:
        return
    # Root's file, readable by a group (Kubernetes' fsGroup): the group is whom the owner meant to read it.
    gid = _foreign_group(shared)
    assert gid is not None
    os.chown(shared, 0, gid)
    shared.chmod(0o640)
    assert load_shared_secret(shared) == SECRET
    os.chown(shared, 65534, -1)  # another user's: it could change the secret
    with pytest.raises(errors.InsecureFileError, match="is owned by another user than this process's"):
        load_shared_secret(shared)



def test_a_secret_file_this_user_cannot_read_is_a_value_error_naming_it(tmp_path: Path) -> None:
    # A root-owned 0400 mount in a container that does not run as root; root reads any file, so the refusal of
    # the read is stood in for.
    shared = tmp_path / "shared"
    shared.write_bytes(SECRET)
    shared.chmod(0o400)
    with mock.patch.object(Path, "read_bytes", side_effect=PermissionError(13, "Permission denied")), \
            pytest.raises(ValueError, match=rf"cannot read shared secret file '{re.escape(str(shared))}': "
                                            r".*Permission denied"):
        load_shared_secret(shared)

# -- where the channel listens --------------------------------------------------------------

def _listening_addresses(port: int) -> set[str]:
    """Local addresses in LISTEN state on ``port``, from /proc/net/tcp{,6} (hex, as the kernel writes them)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.split(":")
            if state == "0A" and int(hex_port, 16) == port:
                found.add(address)
    return found


def test_default_channel_listens_on_loopback_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NCCLKV_BIND_HOST", raising=False)
    with Channel("local", auth=ChannelAuth()) as channel:
        host, port = channel.address.removeprefix("tcp://").rsplit(":", 1)
        assert host == "127.0.0.1"
        if Path("/proc/net/tcp").exists():
            assert _listening_addresses(int(port)) == {"0100007F"}  # 127.0.0.1, not 0.0.0.0
        outside = _non_loopback_address()
        if outside is not None:  # reachable on loopback, refused from the host's other address
            with pytest.raises(OSError):
                socket.create_connection((outside, int(port)), timeout=2).close()
        socket.create_connection(("127.0.0.1", int(port)), timeout=2).close()
    monkeypatch.setenv("NCCLKV_BIND_HOST", "0.0.0.0")  # all interfaces only when asked
    with Channel("wide", auth=ChannelAuth()) as channel:
        port = int(channel.address.rsplit(":", 1)[1])
        if Path("/proc/net/tcp").exists():
            assert _listening_addresses(port) == {"00000000"}


def _non_loopback_address() -> str | None:
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(("10.255.255.255", 1))  # no packet is sent: this only picks a route
            address = probe.getsockname()[0]
    except OSError:
        return None
    return None if address.startswith("127.") else address
