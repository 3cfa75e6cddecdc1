"""What DataPlane and LoopbackTransport share: ``open_link``'s checks and bookkeeping, and closing."""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from typing import ClassVar

import torch

from .._timeout import check_timeout
from ..errors import ClosedError
from ._base import DEFAULT_MAX_IN_FLIGHT, DEFAULT_MAX_IN_FLIGHT_BYTES, check_link_args, check_window
from ._link import Backend, Link

__all__ = ["LinkOpener"]


class LinkOpener(ABC):
    """Opens links (a subclass supplies each link's backend) and keeps the open ones until they close.

    ``kind`` names the subclass in error messages ("data plane", "loopback
    transport"); ``address`` is what peers pass as ``store_addr`` to reach it.
    """

    kind: ClassVar[str]

    def __init__(self, address: str) -> None:
        self._address = address
        self._lock = threading.Lock()
        self._links: dict[str, Link | None] = {}  # None: being opened
        self._closed = False

    @property
    def address(self) -> str:
        return self._address

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
        cancel: threading.Event | None = None,
    ) -> Link:
        """Connect with the peer by ``timeout_s`` and return our end of the link.

        Blocks until the peer has called ``open_link`` too (same ``link_id`` and
        ``store_addr``, the other ``link_rank``); raises :class:`TransferTimeout`
        naming the link id and store address when it does not by the deadline.
        ``op_timeout_s`` (default ``timeout_s``) is the default deadline of each
        send and receive. ``cancel``: once set, a rendezvous still waiting for the peer ends
        (:class:`TransferError`) instead of waiting out the deadline (the caller gave up on the link).
        """
        # Every argument Link() checks is checked here, before we meet the peer: a refusal after that
        # would leave the peer with a link whose other end never exists.
        dev = check_link_args(link_id, link_rank, device, timeout_s)
        self._check_peer(link_id, link_rank, store_addr)
        op_timeout = timeout_s if op_timeout_s is None else op_timeout_s
        check_timeout("op_timeout_s", op_timeout)
        check_window(max_in_flight, max_in_flight_bytes)
        deadline = time.monotonic() + timeout_s
        with self._lock:
            if self._closed:
                raise ClosedError(f"{self.kind} {self._address} is closed")
            if link_id in self._links:
                raise ValueError(f"link id {link_id!r} is already open on {self.kind} {self._address}")
            self._links[link_id] = None
        try:
            backend = self._connect(link_id, link_rank, store_addr, dev, deadline, op_timeout, cancel)
        except BaseException:
            with self._lock:
                self._links.pop(link_id, None)
            raise
        try:
            link = Link(
                link_id, link_rank, dev, backend,
                timeout_s=op_timeout, max_in_flight=max_in_flight, max_in_flight_bytes=max_in_flight_bytes,
                peer=store_addr, on_close=self._forget,
            )
        except BaseException:  # checked above, so unexpected (a CUDA stream, a thread): the peer must learn now
            backend.abort()
            backend.release()
            with self._lock:
                self._links.pop(link_id, None)
            raise
        with self._lock:
            if not self._closed:
                self._links[link_id] = link
                return link
            self._links.pop(link_id, None)
        link.close()
        raise ClosedError(f"{self.kind} {self._address} was closed while link {link_id!r} was opening")

    def close(self) -> None:
        """Close every link; later ``open_link`` calls raise ClosedError. Idempotent."""
        with self._lock:
            self._closed = True
            links = [link for link in self._links.values() if link is not None]
        for link in links:
            link.close()

    @abstractmethod
    def _check_peer(self, link_id: str, link_rank: int, store_addr: str) -> None:
        """Raise what :meth:`_connect` would refuse at once (a bad address, a reused id), before anything is held."""

    @abstractmethod
    def _connect(self, link_id: str, link_rank: int, store_addr: str, device: torch.device, deadline: float,
                 op_timeout_s: float, cancel: threading.Event | None) -> Backend:
        """Meet the peer by ``deadline`` (a time.monotonic() value), or until ``cancel`` is set, and return the new
        link's backend."""

    def _forget(self, link: Link) -> None:
        with self._lock:
            if self._links.get(link.link_id) is link:
                del self._links[link.link_id]
