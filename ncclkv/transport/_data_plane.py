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
from .._timeout import check_timeout
from ..errors import ClosedError, HandshakeError, TransferTimeout
from ._base import join_address, split_address
from ._group import TorchBackend, open_group
from ._opener import LinkOpener

__all__ = ["DataPlane"]


def _listen(host: str) -> tuple[int, int]:
    """A listening socket on ``host`` and a free port: (fd, port). TCPStore would listen on all interfaces."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        sock = socket.create_server((host, 0), family=family, backlog=128)
    except OSError as err:  # EADDRNOTAVAIL, a name that does not resolve: name the setting, not only the socket
        raise ValueError(f"cannot listen on bind_host={host!r} (kv_connector_extra_config, NCCLKV_BIND_HOST or "
                         f"the engine's config): {err.strerror or err}; it must be an address of this host") from err
    port = sock.getsockname()[1]
    return sock.detach(), port


class DataPlane(LinkOpener):
    """Hosts a TCPStore on ``bind_host`` (a free port) and opens links to peers.

    ``address`` ("host:port") travels in the control handshake; the two ends of
    a link call :meth:`open_link` with the same ``link_id`` and ``store_addr``
    (either end's address) and opposite ``link_rank``. ``bind_host`` must be an
    address the peers can reach: gloo also binds its own sockets to it.
    ``deadline_s`` bounds the blocking store calls (the engine passes its
    ``EngineConfig.deadline_s``); both default to the environment (``NCCLKV_*``).
    """

    kind = "data plane"

    def __init__(self, bind_host: str | None = None, deadline_s: float | None = None) -> None:
        settings = env_settings()
        self._bind_host = bind_host or settings.bind_host
        # Blocking store calls (NCCL reads its unique id with a get) wait this long, on our store and on the
        # long-lived connections to peers' stores alike.
        deadline_s = settings.deadline_s if deadline_s is None else check_timeout("deadline_s", deadline_s)
        self._store_timeout = timedelta(seconds=deadline_s)
        fd, port = _listen(self._bind_host)
        try:
            self._server: dist.TCPStore | None = dist.TCPStore(
                self._bind_host, port, is_master=True, timeout=self._store_timeout,
                wait_for_workers=False, master_listen_fd=fd, use_libuv=True,
            )
        except Exception:
            with contextlib.suppress(OSError):
                os.close(fd)
            raise
        super().__init__(join_address(self._bind_host, port))
        self._gloo_device: object | None = None
        self._clients: dict[str, dist.Store] = {}  # store address -> our connection to it
        self._client_gates: dict[str, threading.Lock] = {}

    @property
    def bind_host(self) -> str:
        return self._bind_host

    def close(self) -> None:
        """Close every link, then the store server. Idempotent."""
        super().close()
        with self._lock:
            self._clients.clear()
            self._client_gates.clear()
            self._gloo_device = None  # its listening socket and loop go with the links' groups
        self._server = None  # the server and its socket go with the last reference

    def __enter__(self) -> DataPlane:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"DataPlane({self._address}, {len(self.links())} links{', closed' if self._closed else ''})"

    def _check_peer(self, link_id: str, link_rank: int, store_addr: str) -> None:
        split_address(store_addr)

    def _connect(self, link_id: str, link_rank: int, store_addr: str, device: torch.device, deadline: float,
                 op_timeout_s: float, cancel: threading.Event | None) -> TorchBackend:
        client = self._client(store_addr, deadline)
        try:
            return open_group(link_id, link_rank, store_addr, client, device, deadline, op_timeout_s, self._gloo,
                              cancel)
        except (HandshakeError, ValueError):  # the store answered: the peer is incompatible, or the id reused
            raise
        except BaseException:
            with self._lock:  # the peer (or its store) may be gone: the next link to it connects afresh
                if self._clients.get(store_addr) is client:
                    del self._clients[store_addr]
            raise

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
            server = self._server
            if server is None:
                raise ClosedError(f"data plane {self._address} is closed")
            return server
        with self._lock:
            client = self._clients.get(store_addr)
            if client is not None:
                return client
            gate = self._client_gates.setdefault(store_addr, threading.Lock())
        if not gate.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise TransferTimeout(f"data plane {self._address}: connecting to store {store_addr} took too long")
        try:
            with self._lock:
                client = self._clients.get(store_addr)
            if client is None:
                host, port = split_address(store_addr)
                # The connect is bounded by this link's deadline; the connection's later blocking calls
                # (other links' rendezvous) by the store timeout, not by what this link had left.
                left = timedelta(seconds=max(0.001, deadline - time.monotonic()))
                try:
                    client = dist.TCPStore(host, port, is_master=False, timeout=left)
                    client.set_timeout(self._store_timeout)
                except Exception as exc:  # torch raises DistError subclasses and plain RuntimeErrors
                    raise TransferTimeout(f"data plane {self._address}: cannot reach store {store_addr}: "
                                          f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from exc
                with self._lock:
                    if self._closed:  # close() cleared the cache: keep nothing alive past it
                        raise ClosedError(f"data plane {self._address} was closed while connecting to {store_addr}")
                    self._clients[store_addr] = client
            return client
        finally:
            gate.release()
            with self._lock:  # one gate per address being connected, not per address ever seen
                if self._client_gates.get(store_addr) is gate:
                    del self._client_gates[store_addr]

    def _gloo(self) -> object:
        # One gloo device (listening socket + event loop) per data plane, shared by its links.
        with self._lock:
            if self._closed:  # close() dropped ours: a link still opening must not make another
                raise ClosedError(f"data plane {self._address} was closed while a link was opening")
            if self._gloo_device is None:
                self._gloo_device = dist.ProcessGroupGloo.create_device(hostname=self._bind_host, lazy_init=False)
            return self._gloo_device
