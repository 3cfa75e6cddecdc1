"""A process holding one Channel, for tests that stop whole processes (SIGSTOP) to pause them."""

from __future__ import annotations

import multiprocessing.connection
import threading
from typing import Any

from ncclkv.channel import Channel
from ncclkv.errors import NcclKVError
from ncclkv.protocol import Ack, Message, Ready

HEARTBEAT_S = 0.2
DEADLINE_S = 4.0  # a peer starved of CPU for this long on a loaded host counts as lost
WAIT_S = 30.0  # every wait on the parent's events


def serve(conn: multiprocessing.connection.Connection, received: Any, release: Any) -> None:
    """B: answers a Ready with an Ack, but only once the parent sets ``release``."""

    def on_message(sender: str, body: Message) -> Message | None:
        received.set()
        if not release.wait(WAIT_S):
            raise TimeoutError("the parent never released the reply")
        return Ack("paused", None)

    with Channel("B", on_message=on_message, heartbeat_s=HEARTBEAT_S, deadline_s=DEADLINE_S) as channel:
        conn.send(channel.address)
        conn.recv()  # the parent says when to report
        conn.send({"peers_lost": channel.stats.peers_lost, "pauses": channel.clock.pauses})
        conn.recv()


def ask(conn: multiprocessing.connection.Connection, address: str) -> None:
    """A: connects to B and asks it one question; reports the outcome and what it saw."""
    with Channel("A", heartbeat_s=HEARTBEAT_S, deadline_s=DEADLINE_S) as channel:
        channel.connect("B", address)
        outcome: dict[str, Any] = {}

        def request() -> None:
            try:
                outcome["reply"] = type(channel.request("B", Ready("question"))).__name__
            except NcclKVError as err:
                outcome["error"] = f"{type(err).__name__}: {err}"

        thread = threading.Thread(target=request)
        thread.start()
        conn.send("asked")
        thread.join(WAIT_S)
        conn.recv()  # the parent says when to report
        conn.send({**outcome, "peers_lost": channel.stats.peers_lost, "pauses": channel.clock.pauses,
                   "b_alive": channel.peer_alive("B")})
        conn.recv()
