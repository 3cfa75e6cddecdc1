"""The data plane of one engine rank: a TCPStore server and the links opened through it or others."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from .._env import env_settings
from ..errors import ClosedError, TransferTimeout
from ._base import DEFAULT_MAX_IN_FLIGHT, DEFAULT_MAX_IN_FLIGHT_BYTES, check_link_args, join_address, split_address
from ._group import open_group
from ._link import Link

__all__ = ["DataPlane"]


def _listen(host: str) -> tuple[int, int]:
    """A listening socket on ``host`` and a free port: (fd, port). TCPStore would listen on all interfaces."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server((host, 0), family=family, backlog=128)
    port = sock.getsockname()[1]
    return sock.detach(), port


class DataPlane:
    """Hosts a TCPStore on ``bind_host`` (a free port) and opens links to peers.

    ``address`` ("host:port") travels in the control handshake; the two ends of
    a link call :meth:`open_link` with the same ``link_id`` and ``store_addr``
    (either end's address) and opposite ``link_rank``. ``bind_host`` must be an
    address the peers can reach: gloo also binds its own sockets to it.
    """

    def __init__(self, bind_host: str | None = None) -> None:
        settings = env_settings()
        self._bind_host = bind_host or settings.bind_host
        fd, port = _listen(self._bind_host)
        try:
            self._server: dist.TCPStore | None = dist.TCPStore(
                self._bind_host, port, is_master=True, timeout=timedelta(seconds=settings.deadline_s),
                wait_for_workers=False, master_listen_fd=fd, use_libuv=True,
            )
        except Exception:
            with contextlib.suppress(OSError):
                os.close(fd)
            raise
        self._address = join_address(self._bind_host, port)
        self._lock = threading.Lock()
        self._links: dict[str, Link | None] = {}  # None: being opened
        self._gloo_device: object | None = None
        self._clients: dict[str, dist.Store] = {}  # store address -> our connection to it
        self._client_gates: dict[str, threading.Lock] = {}
        self._closed = False

    @property
    def address(self) -> str:
        return self._address

    @property
    def bind_host(self) -> str:
        return self._bind_host

    def links(self) -> list[Link]:
        with self._lock:
            return [link for link in self._links.values() if link is not None]

    def open_link(
        self,
        link_id: str,
        link_rank: int,
        store_addr: str,
        device: torch.device | str,
        timeout_s: float,
        *,
        op_timeout_s: float | None = None,
        max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
        max_in_flight_bytes: int = DEFAULT_MAX_IN_FLIGHT_BYTES,
    ) -> Link:
        """Connect a 2-rank group with the peer by ``timeout_s`` and return our end of it.

        Blocks until the peer has called ``open_link`` too; raises
        :class:`TransferTimeout` naming the link id and store address when it
        does not by the deadline. ``op_timeout_s`` (default ``timeout_s``) is
        the default deadline of each send and receive.
        """
        dev = check_link_args(link_id, link_rank, device, timeout_s)
        split_address(store_addr)
        op_timeout = timeout_s if op_timeout_s is None else op_timeout_s
        if not op_timeout > 0:
            raise ValueError(f"op_timeout_s must be > 0, got {op_timeout_s!r}")
        deadline = time.monotonic() + timeout_s
        with self._lock:
            if self._closed:
                raise ClosedError(f"data plane {self._address} is closed")
            if link_id in self._links:
                raise ValueError(f"link id {link_id!r} is already open on data plane {self._address}")
            self._links[link_id] = None
        try:
            client = self._client(store_addr, deadline)
            backend = open_group(link_id, link_rank, store_addr, client, dev, deadline, op_timeout, self._gloo)
        except BaseException:
            with self._lock:
                self._links.pop(link_id, None)
                # The peer (or its store) may be gone: the next link to it connects afresh.
                self._clients.pop(store_addr, None)
            raise
        link = Link(
            link_id, link_rank, dev, backend,
            timeout_s=op_timeout, max_in_flight=max_in_flight, max_in_flight_bytes=max_in_flight_bytes,
            peer=store_addr, on_close=self._forget,
        )
        with self._lock:
            if not self._closed:
                self._links[link_id] = link
                return link
        link.close()
        raise ClosedError(f"data plane {self._address} was closed while link {link_id!r} was opening")

    def close(self) -> None:
        """Close every link, then the store server. Idempotent."""
        with self._lock:
            self._closed = True
            links = [link for link in self._links.values() if link is not None]
        for link in links:
            link.close()
        with self._lock:
            self._clients.clear()
        self._server = None  # the server and its socket go with the last reference

    def __enter__(self) -> DataPlane:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"DataPlane({self._address}, {len(self.links())} links{', closed' if self._closed else ''})"

    def _client(self, store_addr: str, deadline: float) -> dist.Store:
        """One long-lived connection per store address, shared by every link rendezvous through it.

        A c10d TCPStore client connect takes 5 s now and then (about 3 in 100
        here, torch 2.13), so connecting once per peer store rather than once
        per link keeps that off the link-opening path. Our own store is
        reached through the server object, which is also a client. Sharing is
        safe: the rendezvous polls instead of blocking the connection, and
        each peer's own end uses its own connection (see ``open_group``).
        """
        if store_addr == self._address:
            assert self._server is not None
            return self._server
        with self._lock:
            gate = self._client_gates.setdefault(store_addr, threading.Lock())
        if not gate.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise TransferTimeout(f"data plane {self._address}: connecting to store {store_addr} took too long")
        try:
            client = self._clients.get(store_addr)
            if client is None:
                host, port = split_address(store_addr)
                left = timedelta(seconds=max(0.001, deadline - time.monotonic()))
                try:
                    client = dist.TCPStore(host, port, is_master=False, timeout=left)
                except Exception as exc:  # torch raises DistError subclasses and plain RuntimeErrors
                    raise TransferTimeout(f"data plane {self._address}: cannot reach store {store_addr}: "
                                          f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from exc
                with self._lock:
                    self._clients[store_addr] = client
            return client
        finally:
            gate.release()

    def _gloo(self) -> object:
        # One gloo device (listening socket + event loop) per data plane, shared by its links.
        with self._lock:
            if self._gloo_device is None:
                self._gloo_device = dist.ProcessGroupGloo.create_device(hostname=self._bind_host, lazy_init=False)
            return self._gloo_device

    def _forget(self, link: Link) -> None:
        with self._lock:
            if self._links.get(link.link_id) is link:
                del self._links[link.link_id]
