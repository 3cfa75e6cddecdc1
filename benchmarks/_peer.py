"""A spawned peer process that runs benchmark scenarios on command, over a multiprocessing pipe.

The parent calls :meth:`PeerProcess.start` with ``"module:function"`` and
keyword arguments; the child imports the function and calls
``function(endpoint, **kwargs)``, where ``endpoint`` talks back to the parent
over the same pipe (``send`` / ``expect``), and sends the return value as
``("result", value)``. A failure is sent as ``("error", traceback)`` and raised
in the parent by :meth:`Endpoint.expect`. Every wait has a deadline; a child
whose parent vanished stops after ``IDLE_S`` without commands.
"""

from __future__ import annotations

import gc
import importlib
import multiprocessing as mp
import traceback
from multiprocessing.connection import Connection
from typing import Any

__all__ = ["Endpoint", "PeerError", "PeerProcess"]

WAIT_S = 60.0  # default deadline of one expected message; generous on 2 busy cores
START_S = 120.0  # spawning imports torch
IDLE_S = 600.0
_CTX = mp.get_context("spawn")  # never fork a process that holds gloo and ZMQ threads


class PeerError(RuntimeError):
    """The peer process failed, or did not answer in time."""


class Endpoint:
    """One end of the command pipe: tagged messages ``(tag, payload)``."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn

    def send(self, tag: str, payload: Any = None) -> None:
        self._conn.send((tag, payload))

    def receive(self, timeout_s: float = WAIT_S) -> tuple[str, Any]:
        """The next message ``(tag, payload)``; PeerError for an ``error`` message or past the deadline."""
        if not self._conn.poll(timeout_s):
            raise PeerError(f"no message from the peer within {timeout_s:g} s")
        try:
            got, payload = self._conn.recv()
        except (EOFError, OSError) as err:
            raise PeerError(f"the peer process is gone ({type(err).__name__})") from None
        if got == "error":
            raise PeerError(f"the peer failed:\n{payload}")
        return got, payload

    def expect(self, tag: str, timeout_s: float = WAIT_S) -> Any:
        """The payload of the next message, which must carry ``tag``; PeerError otherwise or past the deadline."""
        if not self._conn.poll(timeout_s):
            raise PeerError(f"no {tag!r} message from the peer within {timeout_s:g} s")
        got, payload = self.receive(0)
        if got != tag:
            raise PeerError(f"expected {tag!r} from the peer, got {got!r}: {payload!r}")
        return payload


def _serve(conn: Connection) -> None:
    endpoint = Endpoint(conn)
    endpoint.send("started")
    while conn.poll(IDLE_S):
        command = conn.recv()
        if command is None:
            return
        target, kwargs = command
        try:
            module_name, _, func_name = target.partition(":")
            func = getattr(importlib.import_module(module_name), func_name)
            gc.freeze()  # the imports' heap, as in the parent (BenchContext)
            endpoint.send("result", func(endpoint, **kwargs))
        except BaseException:  # noqa: BLE001 - reported to the parent, which raises it
            endpoint.send("error", f"{target}: {traceback.format_exc()}")


class PeerProcess:
    """A child process serving scenarios; :meth:`close` stops it (and kills it past a deadline)."""

    def __init__(self) -> None:
        conn, child = _CTX.Pipe()
        self._proc = _CTX.Process(target=_serve, args=(child,), name="ncclkv-bench-peer", daemon=True)
        self._proc.start()
        child.close()
        self.endpoint = Endpoint(conn)
        self._conn = conn
        try:
            self.endpoint.expect("started", START_S)
        except BaseException:
            self.close()
            raise

    @property
    def alive(self) -> bool:
        return self._proc.is_alive()

    def start(self, target: str, **kwargs: Any) -> None:
        """Run ``target`` (``"module:function"``) in the child; its messages and result follow on :attr:`endpoint`."""
        self._conn.send((target, kwargs))

    def result(self, timeout_s: float = WAIT_S) -> Any:
        return self.endpoint.expect("result", timeout_s)

    def call(self, target: str, timeout_s: float = WAIT_S, **kwargs: Any) -> Any:
        """Run ``target`` and wait for its result."""
        self.start(target, **kwargs)
        return self.result(timeout_s)

    def close(self) -> None:
        if self._proc.is_alive():
            try:
                self._conn.send(None)
            except OSError:
                pass
            self._proc.join(10.0)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(10.0)
        self._conn.close()
