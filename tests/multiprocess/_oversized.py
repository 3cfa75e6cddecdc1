"""Child side of test_oversized_sender.py: bare links, raw sends, and a producer that sends more than it announced.

:class:`ExtProc` is a :class:`_engine_pool.Proc` whose child runs
:func:`serve_extended`: the engine commands of ``_engine_workers`` plus the
ones below, so one spawned child can host an engine rank and bare links.
Payloads are ``payload(seed, nbytes)`` on both sides, so a receiver checks
every byte without anything else crossing.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from datetime import timedelta
from typing import Any

import torch

import _engine_workers as workers
from _engine_pool import CTX, Proc
from ncclkv.protocol import Announce, Message
from ncclkv.transport import DataPlane, Link
from ncclkv.transport import _group
from ncclkv.transport._pipe import Op, Pipe

__all__ = ["ExtProc", "payload", "serve_extended"]

_planes: list[DataPlane] = []
_links: dict[str, Link] = {}
_restore: list[Callable[[], None]] = []  # undoes the hostile patches of this child


def payload(seed: int, nbytes: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)


def _outcome(fut: Future[Any], timeout_s: float, expect: torch.Tensor | None = None) -> str:
    """"ok", "corrupt" (a receive whose bytes differ) or "<ErrorType>: <message>"."""
    try:
        got = fut.result(timeout_s)
    except Exception as err:  # noqa: BLE001 - the outcome under test
        return f"{type(err).__name__}: {err}"
    if expect is not None and not torch.equal(got, expect):
        return "corrupt"
    return "ok"


# -- bare links ------------------------------------------------------------------------------


def plane_address(st: Any) -> str:
    if not _planes:
        _planes.append(DataPlane())
    return _planes[0].address


def open_link(st: Any, link_id: str, rank: int, store: str, timeout_s: float, op_timeout_s: float,
              framed: bool = True) -> None:
    """Open a link; ``framed=False`` stands in for a build without frame headers (the gloo default before them)."""
    plane_address(st)
    saved = _group.TorchBackend.framing
    if not framed:
        _group.TorchBackend.framing = lambda self: None  # type: ignore[method-assign,assignment]
    try:
        _links[link_id] = _planes[0].open_link(link_id, rank, store, "cpu", timeout_s, op_timeout_s=op_timeout_s)
    finally:
        _group.TorchBackend.framing = saved  # type: ignore[method-assign]


def transfer(st: Any, ops: list[tuple[str, str, int, int]], wait_s: float) -> list[str]:
    """Post every ``(kind, link_id, nbytes, seed)`` in order, then wait (``wait_s`` each); return the outcomes.

    kind: "send", "recv" (checks the bytes against ``payload(seed, nbytes)``),
    or "raw_send" (straight to the link's gloo group, bypassing the link and its frame headers).
    """
    waits: list[Callable[[], str]] = []
    for kind, link_id, nbytes, seed in ops:
        link = _links[link_id]
        if kind == "send":
            fut = link.send(payload(seed, nbytes))
            waits.append(lambda fut=fut: _outcome(fut, wait_s))
        elif kind == "recv":
            fut = link.recv((nbytes,), torch.uint8)
            waits.append(lambda fut=fut, n=nbytes, s=seed: _outcome(fut, wait_s, payload(s, n)))
        elif kind == "raw_send":
            backend = link._backend  # noqa: SLF001 - a hostile peer writes to the group directly
            work = backend._pg.send([payload(seed, nbytes)], backend._peer, 0)  # noqa: SLF001
            waits.append(lambda work=work: _raw_outcome(work, wait_s))
        else:
            raise ValueError(f"unknown kind {kind!r}")
    return [wait() for wait in waits]


def _raw_outcome(work: Any, timeout_s: float) -> str:
    try:
        work.wait(timedelta(seconds=timeout_s))
    except Exception as err:  # noqa: BLE001 - the outcome under test
        return f"{type(err).__name__}: {str(err).splitlines()[0]}"
    return "ok"


def link_state(st: Any, link_id: str) -> tuple[bool, str | None]:
    link = _links[link_id]
    return link.closed, None if link.broken is None else f"{type(link.broken).__name__}: {link.broken}"


def close_links(st: Any) -> list[str]:
    """Close every bare link and the data plane; return the ncclkv threads still alive."""
    for link in _links.values():
        link.close()
    _links.clear()
    for plane in _planes:
        plane.close()
    _planes.clear()
    return workers.thread_names()


# -- a producer engine that sends more than it announced -----------------------------------------


def oversize(st: Any, key: str, rid: str, layer: int, extra_tokens: int) -> None:
    """From now on, the tensor of (``rid``, ``layer``) goes out ``extra_tokens`` tokens longer than announced.

    The announcement (the engine's own, from the real buffer) is left alone;
    right after it, on the link's send thread, the op about to be posted gets
    a longer tensor, which its fill (the engine's gather into the announced
    buffer, then a copy) writes. The link describes what it posts honestly.
    """
    engine = st.sides[key].engine
    armed = threading.local()
    send = engine._channel.send  # noqa: SLF001
    run_hook = Pipe._run_hook  # noqa: SLF001 - looked up per op, so existing links see the patch

    def spy(peer_id: str, body: Message, reply_to: int | None = None) -> int:
        msg_id = send(peer_id, body, reply_to)
        if isinstance(body, Announce) and body.request_id == rid and body.layer == layer:
            armed.next_post = True  # on the link's send thread: its next post carries this tensor
        return msg_id

    def longer(self: Pipe, op: Op) -> bool:
        ran = run_hook(self, op)
        if ran and getattr(armed, "next_post", False):
            armed.next_post = False
            kv, tokens, fill = op.tensor, op.tensor.shape[1], op.fill
            grown = torch.zeros((kv.shape[0], tokens + extra_tokens, *kv.shape[2:]), dtype=kv.dtype)

            def fill_grown(out: torch.Tensor) -> None:  # the engine's gather fills the announced buffer
                if fill is not None:
                    fill(kv)
                out[:, :tokens] = kv
            op.tensor, op.fill = grown, fill_grown
        return ran

    engine._channel.send = spy  # noqa: SLF001
    Pipe._run_hook = longer  # type: ignore[method-assign]  # this child only
    _restore.append(lambda: setattr(engine._channel, "send", send))  # noqa: SLF001
    _restore.append(lambda: setattr(Pipe, "_run_hook", run_hook))


def honest(st: Any) -> None:
    while _restore:
        _restore.pop()()


def link_ids(st: Any, key: str) -> dict[str, str | None]:
    """peer id -> id of the link this engine rank uses with it now."""
    return {peer_id: peer.link_id for peer_id, peer in st.sides[key].engine._peers._peers.items()}  # noqa: SLF001


EXTRA: dict[str, Callable[..., Any]] = {f.__name__: f for f in (
    plane_address, open_link, transfer, link_state, close_links, oversize, honest, link_ids,
)}


def serve_extended(conn: Any, notes: Any, gate: Any) -> None:
    workers.COMMANDS.update(EXTRA)  # this child's command table only
    workers.serve(conn, notes, gate)


class ExtProc(Proc):
    """A :class:`Proc` whose child also knows :data:`EXTRA` (same attributes, same protocol)."""

    def __init__(self, tag: str) -> None:  # noqa: D107 - Proc.__init__ with another target
        self.tag = tag
        self.conn, child = CTX.Pipe()
        self.notes = CTX.Queue()
        self.gate = CTX.Event()
        self.proc = CTX.Process(target=serve_extended, args=(child, self.notes, self.gate), name=tag, daemon=True)
        self.proc.start()
        child.close()
        self._pid = None
        self.busy = None
        self.stopped = False
