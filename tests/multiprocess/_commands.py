"""The command loop of a spawned test child: what the engine workers and the transport peers share."""

from __future__ import annotations

from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any

__all__ = ["commands"]


def commands(conn: Connection, idle_s: float) -> Iterator[tuple[str, dict[str, Any]]]:
    """The ``(name, kwargs)`` commands the parent sends, until it sends None or is silent for ``idle_s``.

    The idle limit ends a child whose parent vanished without a word.
    """
    while conn.poll(idle_s):
        command = conn.recv()
        if command is None:
            return
        name, kwargs = command
        yield name, kwargs
