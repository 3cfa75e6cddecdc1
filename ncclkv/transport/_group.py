"""A 2-rank torch.distributed group made on the fly, without any default process group.

gloo for CPU devices and NCCL for CUDA devices; only the lines that pick the
backend differ. Operations are posted on the group object itself
(``pg.send([t], peer, 0)``): ``dist.send(..., group=pg)`` rejects a group that
was not registered through ``init_process_group``.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from ..errors import HandshakeError, NcclKVError, TransferError, TransferTimeout
from ._framing import FRAME_TAG, Framing
from ._sender import DeferredSend, SendThread

__all__ = ["TorchBackend", "open_group"]

_log = logging.getLogger(__name__)

_TAG = 0  # NCCL has no tags; gloo gets the same semantics: one ordered stream per direction
_ABORT_TAG = 1  # never used for data, see TorchBackend.abort
_NCCL_WATCHDOG_MARGIN_S = 60.0
_JOIN_S = 2.0  # the send thread only posts (never waits on the peer): it ends at once once stopped
# How torch (2.13), gloo and NCCL say time ran out: "Wait timeout", "wait timeout after 300ms, keys: ...", "Socket
# Timeout", "Connect timeout", "Timed out waiting ...", "has timed out after", "collective operation timeout".
# Whole words: "RuntimeError" (the text of an exception without a message), "runtime" or "lifetime" are none.
_TIMEOUT_WORDS = re.compile(r"\btimed?[ -]?outs?\b", re.IGNORECASE)


class _WorkPending:
    def __init__(self, work: dist.Work) -> None:
        self._work = work

    def wait(self, timeout_s: float) -> None:
        # Blocks the calling thread (also for NCCL, since a timeout is given).
        if self._work.wait(timedelta(seconds=timeout_s)) is False:
            raise TimeoutError(f"work not done within {timeout_s:g} s")


class TorchBackend:
    """Posts single sends and receives to the peer of a 2-rank process group."""

    def __init__(self, pg: dist.ProcessGroup, link_rank: int, device: torch.device, store: dist.Store,
                 name: str = "ncclkv-gloo") -> None:
        self._pg = pg
        self._peer = 1 - link_rank
        self._device = device
        self._store = store  # NCCL may still read it (lazily made communicators)
        # gloo writes a payload on the posting thread: data sends get a thread of their own (see _sender)
        self._sender = None if device.type == "cuda" else SendThread(f"{name}-send", self._post_data)

    @property
    def name(self) -> str:
        return "nccl" if self._device.type == "cuda" else "gloo"

    def post_send(self, tensor: torch.Tensor) -> _WorkPending | DeferredSend:
        if self._sender is not None:
            return self._sender.submit(tensor)
        return self._post_data(tensor)

    def _post_data(self, tensor: torch.Tensor) -> _WorkPending:
        return _WorkPending(self._pg.send([tensor], self._peer, _TAG))

    def post_recv(self, tensor: torch.Tensor) -> _WorkPending:
        return _WorkPending(self._pg.recv([tensor], self._peer, _TAG))

    def framing(self) -> Framing | None:
        # gloo ends the process on a send longer than its receive (see _framing);
        # NCCL checks nothing and has no tags to carry headers on.
        if self._device.type == "cuda":
            return None
        return Framing(self._post_header_send, self._post_header_recv)

    def _post_header_send(self, header: torch.Tensor) -> _WorkPending:
        return _WorkPending(self._pg.send([header], self._peer, FRAME_TAG))

    def _post_header_recv(self, header: torch.Tensor) -> _WorkPending:
        return _WorkPending(self._pg.recv([header], self._peer, FRAME_TAG))

    def release(self) -> None:
        if self._sender is not None:
            self._sender.stop()
            if not self._sender.join(_JOIN_S):
                _log.warning("a gloo send thread did not end within %g s", _JOIN_S)
        self._pg = self._store = None  # type: ignore[assignment]

    def abort(self) -> None:
        if self._sender is not None:  # sends not posted yet fail instead of going out
            self._sender.stop()
        try:
            if self._device.type == "cuda":
                self._pg.abort()
                return
            # gloo's abort() and shutdown() leave posted operations blocked (torch
            # 2.13), but a wait that times out closes the pair, which fails every
            # operation on it at once, here and at the peer ("closed by peer").
            self._pg.recv([torch.empty(1)], self._peer, _ABORT_TAG).wait(timedelta(milliseconds=1))
        except Exception:  # noqa: BLE001 - aborting a broken group may raise anything; it is aborted either way
            pass


def _gpu_uuid(device: torch.device) -> str:
    """The GPU's UUID: the same for every process that sees it, whatever CUDA_VISIBLE_DEVICES numbers it."""
    return f"GPU-{torch.cuda.get_device_properties(device).uuid}"


def _left(deadline: float) -> timedelta:
    return timedelta(seconds=max(0.001, deadline - time.monotonic()))


def _make_group(
    store: dist.Store,
    link_rank: int,
    device: torch.device,
    deadline: float,
    op_timeout_s: float,
    gloo_device: Callable[[], object],
    cancel: threading.Event | None = None,
) -> dist.ProcessGroup:
    if device.type == "cuda":
        from torch.distributed import ProcessGroupNCCL

        options = ProcessGroupNCCL.Options()
        options.is_high_priority_stream = False
        # The watchdog's timeout may end the process: keep it well past our own deadlines.
        options._timeout = timedelta(seconds=op_timeout_s + _NCCL_WATCHDOG_MARGIN_S)
        pg = ProcessGroupNCCL(store, link_rank, 2, options)
        pg.eager_connect_single_device(device)  # meet the peer now, not at the first send
        return pg
    options = dist.ProcessGroupGloo._Options()
    options._timeout = _left(deadline)  # connecting to the peer; operations pass their own deadlines
    options._devices = [gloo_device()]
    options._threads = 1  # gloo's worker threads serve collectives; send/recv do not use them
    return dist.ProcessGroupGloo(_PollingStore(store, deadline, cancel), link_rank, 2, options)


class _PollingStore(dist.Store):
    """``store`` for gloo's rendezvous, its waits polled: a blocking TCPStore wait holds the connection for its
    whole length, and a responder meets every peer through one (its server object), so a peer that stopped before
    its gloo group set its address held every other peer's link opening through our store up to our deadline."""

    def __init__(self, store: dist.Store, deadline: float, cancel: threading.Event | None = None) -> None:
        super().__init__()
        self._store = store
        self._deadline = deadline
        self._cancel = cancel
        self._set: list[str] = []  # the keys gloo set through us (its address): taken back if the rendezvous fails

    def set(self, key: str, value: str | bytes) -> None:
        self._store.set(key, value)
        self._set.append(key)

    def get(self, key: str) -> bytes:
        self.wait([key], _left(self._deadline))
        return self._store.get(key)

    def add(self, key: str, value: int) -> int:
        return self._store.add(key, value)

    def check(self, keys: list[str]) -> bool:
        return self._store.check(keys)

    def delete_key(self, key: str) -> bool:
        return self._store.delete_key(key)

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        return self._store.compare_set(key, expected, desired)

    def num_keys(self) -> int:
        return self._store.num_keys()

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        deadline = self._deadline if timeout is None else \
            min(self._deadline, time.monotonic() + timeout.total_seconds())
        if not _poll(self._store, keys, deadline, self._cancel):
            # Cancelled or past the deadline: a peer that comes later must not find our address: it would connect
            # to our gloo listener (which keeps the connection) and get an open link to nothing. Without it, it
            # times out at its own deadline.
            for key in self._set:
                try:
                    self._store.delete_key(key)
                except Exception as exc:  # noqa: BLE001 - the rendezvous fails either way
                    _log.debug("could not take back store key %r of a failed rendezvous: %r", key, exc)
            if self._cancel is not None and self._cancel.is_set():
                raise _Cancelled(f"rendezvous cancelled while waiting for keys {keys}")
            raise TimeoutError(f"wait timeout after {timeout}, keys: {keys}")


class _Cancelled(Exception):
    """The rendezvous was cancelled (``open_group``'s ``cancel`` set) while it waited for the peer."""


def _poll(store: dist.Store, keys: list[str], deadline: float, cancel: threading.Event | None = None) -> bool:
    """Wait for ``keys`` without a blocking store wait: those hold the (shared) client for their whole length.
    False at ``deadline``, or once ``cancel`` is set."""
    pause = 0.0005
    while not store.check(keys):
        if time.monotonic() >= deadline or (cancel is not None and cancel.is_set()):
            return False
        time.sleep(pause)
        pause = min(pause * 2, 0.01)
    return True


def open_group(
    link_id: str,
    link_rank: int,
    store_addr: str,
    client: dist.Store,
    device: torch.device,
    deadline: float,
    op_timeout_s: float,
    gloo_device: Callable[[], object],
    cancel: threading.Event | None = None,
) -> TorchBackend:
    """Meet the peer through ``client`` (a connection to the TCPStore at ``store_addr``) and connect a 2-rank group.

    Both ends first publish their backend under the link's prefix and poll for
    the peer's, so a peer that never joins is a :class:`TransferTimeout` we
    control, a gloo end facing an NCCL end is a :class:`HandshakeError`, and
    the group's own (blocking) rendezvous starts only once the peer is there.
    Once ``cancel`` is set, the waits for the peer's keys (ours and gloo's)
    end: :class:`TransferError` ("cancelled"), not a wait to the deadline for
    a peer the caller gave up on (NCCL's own read of its unique id still
    blocks).

    Once a gloo group is up, each end deletes its own ``gpu`` and ``backend``
    keys: the peer read them before it started its group, and ours connects
    only with a peer that did (a store lives as long as its engine, and
    would otherwise keep them for every link). ``joined`` stays: it is what
    refuses a link id used before. gloo's own keys stay (its naming), and so
    do an NCCL end's (a non-blocking NCCL init may return before the peer
    joined).
    """
    peer = 1 - link_rank
    backend = "nccl" if device.type == "cuda" else "gloo"
    where = f"link {link_id!r} (link rank {link_rank}, store {store_addr})"
    timeout_s = deadline - time.monotonic()
    try:
        store = dist.PrefixStore(f"ncclkv/{link_id}", client)
        if store.add(f"joined/{link_rank}", 1) != 1:
            raise ValueError(f"{where}: link rank {link_rank} already joined; every link needs a new link_id")
        gpu = _gpu_uuid(device) if device.type == "cuda" else ""
        store.set(f"gpu/{link_rank}", gpu)  # before the backend: the peer reads both once it sees the backend
        store.set(f"backend/{link_rank}", backend)
        if not _poll(store, [f"backend/{peer}"], deadline, cancel):
            if cancel is not None and cancel.is_set():
                raise _cancelled(where, peer)
            raise TransferTimeout(f"{where}: peer (link rank {peer}) did not join within {timeout_s:.3g} s")
        peer_backend = store.get(f"backend/{peer}").decode()
        if peer_backend != backend:
            raise HandshakeError(f"{where}: this end uses {backend} on {device}, the peer uses {peer_backend}")
        if gpu and store.get(f"gpu/{peer}").decode() == gpu:
            # NCCL refuses two ranks of one communicator on one GPU, but only once both ends started it, and torch's
            # error gives the cause ("Last error: Duplicate GPU detected") after the line a TransferError keeps.
            raise HandshakeError(f"{where}: both ends are on the same GPU ({device}, {gpu}); NCCL needs one GPU "
                                 "per rank: give each rank its own device (CUDA_VISIBLE_DEVICES, LOCAL_RANK)")
        pg = _make_group(store, link_rank, device, deadline, op_timeout_s, gloo_device, cancel)
        if device.type != "cuda":
            _forget_own_keys(store, link_rank, where)
    except (NcclKVError, ValueError):
        raise
    except Exception as exc:  # torch raises DistError subclasses and plain RuntimeErrors
        text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if cancel is not None and cancel.is_set():
            raise _cancelled(where, peer) from exc
        if time.monotonic() >= deadline - 0.01 or _is_timeout(exc, text):
            raise TransferTimeout(f"{where}: peer (link rank {peer}) not connected within {timeout_s:.3g} s: {text}") from exc
        raise TransferError(f"{where}: cannot connect to peer (link rank {peer}): {text}") from exc
    return TorchBackend(pg, link_rank, device, store, f"ncclkv-link-{link_id}")


def _cancelled(where: str, peer: int) -> TransferError:
    return TransferError(f"{where}: rendezvous cancelled before the peer (link rank {peer}) joined")


def _is_timeout(exc: Exception, text: str) -> bool:
    """Whether ``exc`` (``text``: its first line) says time ran out; the caller also checks its own deadline."""
    return isinstance(exc, TimeoutError) or _TIMEOUT_WORDS.search(text) is not None


def _forget_own_keys(store: dist.Store, link_rank: int, where: str) -> None:
    """Delete this end's ``gpu`` and ``backend`` keys; only housekeeping, so a failure is logged, not raised."""
    for key in (f"gpu/{link_rank}", f"backend/{link_rank}"):
        try:
            store.delete_key(key)
        except Exception as exc:  # noqa: BLE001 - the link is up; a key left behind costs a few bytes
            _log.debug("%s: could not delete store key %r: %r", where, key, exc)
