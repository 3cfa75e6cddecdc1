"""The link interface the engine programs against, and argument checks shared by its implementations."""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

# Links check their timeouts by the rule every ncclkv timeout follows; ncclkv._timeout alone exports it.
from .._timeout import check_timeout

__all__ = [
    "DEFAULT_MAX_IN_FLIGHT",
    "DEFAULT_MAX_IN_FLIGHT_BYTES",
    "LinkBase",
    "LinkFactory",
    "LinkStats",
    "check_link_args",
    "check_window",
    "join_address",
    "split_address",
]

# Posted operations per link direction. Deep windows matter: gloo writes a
# send's payload only after the peer's receive is posted, and with 8 posted
# 1 MiB tensors a gloo link reached about 0.55 of raw send/recv, with 64-128
# about 0.9 (benchmarks/bench_transfer.py). The byte bound keeps deadlines,
# which count from posting, meaningful for large tensors.
DEFAULT_MAX_IN_FLIGHT = 64
DEFAULT_MAX_IN_FLIGHT_BYTES = 256 << 20

_LINK_ID = re.compile(r"[A-Za-z0-9._:@+-]{1,200}")


@dataclass(frozen=True, slots=True)
class LinkStats:
    """A snapshot of one link's counters.

    ``next_send_seq`` / ``next_recv_seq`` count the calls made on this end (the
    seq a new call gets); ``tensors_*`` / ``bytes_*`` count completed transfers.
    """

    link_id: str
    tensors_sent: int
    bytes_sent: int
    tensors_received: int
    bytes_received: int
    next_send_seq: int
    next_recv_seq: int
    in_flight_sends: int
    in_flight_recvs: int


@runtime_checkable
class LinkBase(Protocol):
    """Ordered asynchronous point-to-point between the two ranks of a link.

    The n-th ``send`` posted on one end matches the n-th ``recv`` on the
    other, and the futures of posted operations complete in call order (per
    direction). A send whose ``before_send`` hook raises is never posted: its
    future fails at once, possibly ahead of earlier sends, and the sends
    after it keep their places. When the link breaks or closes, every
    pending future fails.
    """

    @property
    def link_id(self) -> str: ...

    @property
    def link_rank(self) -> int: ...

    @property
    def device(self) -> torch.device: ...

    @property
    def closed(self) -> bool: ...

    @property
    def broken(self) -> BaseException | None: ...

    def send(
        self,
        tensor: torch.Tensor,
        *,
        ready_event: object | None = None,
        before_send: Callable[[], torch.Tensor | None] | None = None,
        fill: Callable[[torch.Tensor], None] | None = None,
        timeout_s: float | None = None,
    ) -> Future[None]: ...

    def post_queued_sends(self, limit: int) -> None: ...

    def recv(
        self,
        shape: Sequence[int],
        dtype: torch.dtype,
        *,
        out: torch.Tensor | None = None,
        timeout_s: float | None = None,
    ) -> Future[torch.Tensor]: ...

    def stats(self) -> LinkStats: ...

    def close(self) -> None: ...


@runtime_checkable
class LinkFactory(Protocol):
    """What the engine needs to open links: :class:`DataPlane` or :class:`LoopbackTransport`."""

    @property
    def address(self) -> str: ...

    def open_link(
        self,
        link_id: str,
        link_rank: int,
        store_addr: str,
        device: torch.device | str,
        timeout_s: float,
        *,
        cancel: threading.Event | None = None,
    ) -> LinkBase: ...

    def close(self) -> None: ...


def split_address(address: str) -> tuple[str, int]:
    """``"host:port"`` or ``"[v6]:port"`` -> ``(host, port)``; ValueError otherwise."""
    host, sep, port_text = address.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"store address must be 'host:port', got {address!r}")
    return host, int(port_text)


def join_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def check_link_args(link_id: str, link_rank: int, device: torch.device | str, timeout_s: float) -> torch.device:
    """Validate ``open_link`` arguments; return the device as a ``torch.device``."""
    if not isinstance(link_id, str) or not _LINK_ID.fullmatch(link_id):
        raise ValueError(f"link_id must be 1-200 chars of [A-Za-z0-9._:@+-], got {link_id!r}")
    # An int only: 1.0 == 1, but the rendezvous keys spell the rank ("joined/1.0"), so a float met no peer.
    if isinstance(link_rank, bool) or not isinstance(link_rank, int) or link_rank not in (0, 1):
        raise ValueError(f"link_rank must be 0 or 1, got {link_rank!r}")
    check_timeout("timeout_s", timeout_s)
    dev = torch.device(device)
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"links carry cpu or cuda tensors, got device {dev}")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def check_window(max_in_flight: int, max_in_flight_bytes: int) -> None:
    """Refuse a send/receive window that is not a positive int (ops, bytes)."""
    if isinstance(max_in_flight, bool) or not (isinstance(max_in_flight, int) and max_in_flight >= 1):
        raise ValueError(f"max_in_flight must be an int >= 1, got {max_in_flight!r}")
    if isinstance(max_in_flight_bytes, bool) or not (isinstance(max_in_flight_bytes, int) and max_in_flight_bytes >= 1):
        raise ValueError(f"max_in_flight_bytes must be an int >= 1, got {max_in_flight_bytes!r}")
