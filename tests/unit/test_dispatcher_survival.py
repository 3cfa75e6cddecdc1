"""The channel's dispatcher thread on real ZMQ sockets: whatever one message does, the thread goes on, or, if it
ends anyway, the channel says so (ClosedError) and its peers drop it instead of timing out request by request."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest

from ncclkv import errors
from ncclkv.channel import Channel
from ncclkv.protocol import Ack, Done, Message, Ready

from _channel_helpers import wait_until

pytestmark = pytest.mark.usefixtures("no_channel_thread_left")

WAIT_S = 5.0  # every wait below is bounded by this; an answer that takes it is a failure
LONG_DEADLINE = dict(heartbeat_s=0.2, deadline_s=30.0)  # a reply that relied on a peer deadline would time out


class _Unprintable(RuntimeError):
    """An exception whose text cannot be rendered: ``ErrorMsg.from_exception`` fails on it."""

    def __str__(self) -> str:
        raise ValueError("__str__ failed")


def _cyclic() -> list[object]:
    loop: list[object] = []
    loop.append(loop)  # encoding recurses until RecursionError, which encode() does not turn into a ProtocolError
    return loop


def _handler(sender: str, body: Message) -> Message | None:
    if not isinstance(body, Ready):
        return None
    if body.request_id == "runtime":
        raise RuntimeError("handler bug on 'runtime'")
    if body.request_id == "unprintable":
        raise _Unprintable()
    if body.request_id == "unencodable":
        return Ack(body.request_id, _cyclic())  # type: ignore[arg-type]
    return Ack(body.request_id, None)


@pytest.mark.parametrize("request_id, match", [
    ("runtime", r"'internal' for request 'runtime': RuntimeError: handler bug on 'runtime'"),
    ("unprintable", r"'internal' for request 'unprintable': _Unprintable"),
    ("unencodable", r"'internal' for request 'unencodable': .*maximum recursion depth"),
])
def test_a_failing_message_gets_a_typed_error_reply_and_the_next_one_is_handled(
    make_channel: Callable[..., Channel], request_id: str, match: str,
) -> None:
    server = make_channel("server", on_message=_handler, **LONG_DEADLINE)
    client = make_channel("client", **LONG_DEADLINE)
    client.connect("server", server.address)
    # WAIT_S, far under the peers' deadline_s: only a reply, not a loss or a deadline, ends this wait in time
    with pytest.raises(errors.TransferError, match=match):
        client.request("server", Ready(request_id), timeout_s=WAIT_S)
    assert server.stats.handler_errors == 1
    assert client.request("server", Ready("next"), timeout_s=WAIT_S) == Ack("next", None)
    assert client.request("server", Ready("again"), timeout_s=WAIT_S) == Ack("again", None)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the SystemExit, re-raised
def test_a_dispatcher_that_ends_anyway_closes_the_channel_to_callers_and_peers(
    make_channel: Callable[..., Channel],
) -> None:
    """SystemExit is no Exception: the guard lets it end the thread, and the channel must not look alive after."""
    lost: list[errors.PeerLostError] = []
    client_lost = threading.Event()
    holding, release = threading.Event(), threading.Event()

    def on_lost(peer_id: str, error: errors.PeerLostError) -> None:
        lost.append(error)
        client_lost.set()

    def exits(sender: str, body: Message) -> Message | None:
        if isinstance(body, Done):
            raise SystemExit(3)
        return Ack(body.request_id, None) if isinstance(body, Ready) else None  # type: ignore[union-attr]

    def holds(sender: str, body: Message) -> Message | None:  # keeps the server's request waiting
        holding.set()
        release.wait(WAIT_S)
        return None

    server = make_channel("server", on_message=exits, **LONG_DEADLINE)
    client = make_channel("client", on_message=holds, on_peer_lost=on_lost, **LONG_DEADLINE)
    client.connect("server", server.address)
    assert client.request("server", Ready("before"), timeout_s=WAIT_S) == Ack("before", None)
    waiting: list[BaseException] = []

    def server_request() -> None:
        try:
            server.request("client", Ready("held"), timeout_s=WAIT_S)
        except BaseException as exc:  # noqa: BLE001 - checked below
            waiting.append(exc)

    requester = threading.Thread(target=server_request)
    requester.start()
    try:
        assert holding.wait(WAIT_S), "the client's handler never got the server's request"
        client.send("server", Done("r", 1, 1))
        # The peer hears a Bye, long before its 30 s deadline (its I/O thread drops it; its handler is held).
        wait_until(lambda: not client.peer_alive("server"), WAIT_S)
        requester.join(WAIT_S)
        assert not requester.is_alive()
    finally:
        release.set()
        requester.join(WAIT_S)
    assert client_lost.wait(WAIT_S), "the peer's on_peer_lost was not told that the channel stopped serving"
    assert isinstance(lost[0], errors.PeerClosedError)
    assert len(waiting) == 1 and isinstance(waiting[0], errors.ClosedError), waiting
    assert "stopped serving while waiting for a reply: its dispatcher thread ended" in str(waiting[0])
    with pytest.raises(errors.ClosedError, match=r"channel 'server' stopped serving: its dispatcher thread ended"):
        server.send("client", Ready("after"))
    server.close()  # still joins what is left, and is idempotent
    server.close()
