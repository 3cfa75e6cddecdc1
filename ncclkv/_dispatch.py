"""The dispatcher thread of a :class:`ncclkv.channel.Channel`: runs the user's handlers.

Handlers run here, not on the I/O thread, so they may call ``send`` and
``request`` (whose replies the I/O thread resolves). Messages are handled one
at a time in arrival order.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import NamedTuple

from ._peers import Counters
from .errors import NcclKVError, PeerLostError, ProtocolError
from .protocol import MAX_TEXT_CHARS, Envelope, ErrorCode, ErrorMsg, Message

__all__ = ["Dispatcher", "MessageHandler", "PeerLostHandler", "ReplyThen"]

log = logging.getLogger("ncclkv.channel")


class ReplyThen(NamedTuple):
    """A handler's reply plus work to start once the reply is queued: e.g. a rendezvous the peer
    can join only after it read the reply (started earlier, it could hold this process up first).

    ``unsent`` runs instead of ``then`` when the reply did not go out (the protocol refused it and an error
    reply went instead, the peer was lost, the channel closed, the send failed), with why: the peer never
    read it, so no work that waits for it may start."""

    reply: Message
    then: Callable[[], None]
    unsent: Callable[[BaseException], None] | None = None


MessageHandler = Callable[[str, Message], Message | ReplyThen | None]
# peer id, why (PeerClosedError: it said Bye; PeerResetError: it is there, but what it held about us or we about it
# is gone), the error's loss_seq set
PeerLostHandler = Callable[[str, PeerLostError], None]
SendReply = Callable[[str, Message, int], object]


class Dispatcher:
    """Calls ``on_message`` / ``on_peer_lost`` on its own thread and sends handlers' replies.

    A handler's returned body goes back as the reply; an exception is logged,
    counted in ``handler_errors`` and answered with an :class:`ErrorMsg`
    (except to an incoming ``ErrorMsg``: two peers must not ping-pong errors).
    Without ``on_message`` every message except an ``ErrorMsg`` is answered
    ``ErrorMsg(code="unsupported")``. Whatever else fails on one message (a
    reply that cannot be encoded, an exception that cannot be rendered) is
    logged, counted and answered the same way; the thread goes on. If it ends
    anyway, unless stopped (a ``SystemExit`` in a handler), it calls ``on_ended``
    and :attr:`running` turns False.
    """

    def __init__(
        self,
        *,
        name: str,
        peer_id: str,
        on_message: MessageHandler | None,
        on_peer_lost: PeerLostHandler | None,
        send_reply: SendReply,
        counters: Counters,
        on_ended: Callable[[], None],
    ) -> None:
        self._peer_id = peer_id
        self._on_message = on_message
        self._on_peer_lost = on_peer_lost
        self._send_reply = send_reply
        self._counters = counters
        self._on_ended = on_ended
        self._ended = threading.Event()  # set as the thread ends, whether stopped or not
        self._inbox: queue.SimpleQueue[tuple[str, Envelope | PeerLostError | None]] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def put_message(self, envelope: Envelope) -> None:
        self._inbox.put((envelope.sender, envelope))

    def put_lost(self, peer_id: str, error: PeerLostError) -> None:
        self._inbox.put((peer_id, error))

    @property
    def running(self) -> bool:
        """False once the thread ended, or was told to: then no message is handled any more."""
        return not self._ended.is_set() and not self._stop.is_set()

    def stop(self, timeout_s: float) -> bool:
        """Stop after the current handler; True if the thread ended (or is the caller: a handler closing its channel)."""
        self._stop.set()
        self._inbox.put(("", None))  # wake the loop now rather than at its next poll
        if threading.current_thread() is self._thread:
            return True
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    sender, envelope = self._inbox.get(timeout=0.2)
                except queue.Empty:
                    continue
                if self._stop.is_set():
                    return
                try:
                    if isinstance(envelope, PeerLostError):
                        self._call_peer_lost(sender, envelope)
                    elif envelope is not None:
                        self._dispatch(sender, envelope)
                except Exception as exc:  # one message must not end the thread: the rank would look alive, yet deaf
                    self._survive(sender, envelope, exc)
        except BaseException:  # no Exception (those are survived above): e.g. SystemExit raised in a handler
            log.critical("channel %r: dispatcher thread ended unexpectedly; the channel stops serving",
                         self._peer_id, exc_info=True)
            raise
        finally:
            self._ended.set()
            if not self._stop.is_set():
                self._on_ended()

    def _survive(self, sender: str, envelope: Envelope | PeerLostError | None, exc: Exception) -> None:
        """After anything that escaped handling one message: log and count it, and answer a request that got no
        reply (the reply, or the error reply, failed) with an ErrorMsg, so the requester need not time out."""
        self._counters.handler_errors += 1
        what = type(envelope.body).__name__ if isinstance(envelope, Envelope) else "a peer loss"
        log.exception("channel %r: handling %s from %r failed; the dispatcher goes on", self._peer_id, what, sender)
        if not isinstance(envelope, Envelope) or isinstance(envelope.body, ErrorMsg):
            return
        request_id = getattr(envelope.body, "request_id", None)
        try:
            self._reply(sender, envelope.msg_id, _error_reply(exc, request_id), request_id)
        except Exception:
            log.exception("channel %r: could not report the failure to %r", self._peer_id, sender)

    def _call_peer_lost(self, peer_id: str, error: PeerLostError) -> None:
        if self._on_peer_lost is None:
            return
        try:
            self._on_peer_lost(peer_id, error)
        except Exception:
            self._counters.handler_errors += 1
            log.exception("channel %r: on_peer_lost(%r) failed", self._peer_id, peer_id)

    def _dispatch(self, sender: str, envelope: Envelope) -> None:
        body = envelope.body
        request_id = getattr(body, "request_id", None)
        if self._on_message is None:
            if isinstance(body, ErrorMsg):
                log.warning("channel %r: error from %r and no handler: %s", self._peer_id, sender, body)
                return
            text = f"peer {self._peer_id!r} has no message handler"
            self._reply(sender, envelope.msg_id, ErrorMsg(request_id, ErrorCode.UNSUPPORTED, text), request_id)
            return
        follow_up: ReplyThen | None = None
        try:
            reply = self._on_message(sender, body)
            if isinstance(reply, ReplyThen):
                follow_up, reply = reply, reply.reply
        except Exception as exc:
            self._counters.handler_errors += 1
            log.exception("channel %r: handler failed on %s from %r", self._peer_id, type(body).__name__, sender)
            reply = None if isinstance(body, ErrorMsg) else _error_reply(exc, request_id)
        unsent: BaseException | None = None
        if reply is not None:
            try:
                unsent = self._reply(sender, envelope.msg_id, reply, request_id)
            except BaseException as exc:  # whatever else stops the reply: the follow-up learns it was not sent
                if follow_up is not None:
                    self._follow(sender, follow_up, exc)
                raise
        if follow_up is not None:
            self._follow(sender, follow_up, unsent)

    def _follow(self, sender: str, follow_up: ReplyThen, unsent: BaseException | None) -> None:
        """Run ``follow_up.then`` once its reply went out, else (``unsent``: why not) ``follow_up.unsent``."""
        try:
            if unsent is None:
                follow_up.then()
            elif follow_up.unsent is not None:
                follow_up.unsent(unsent)
        except Exception:
            self._counters.handler_errors += 1
            log.exception("channel %r: follow-up of the reply to %r failed", self._peer_id, sender)

    def _reply(self, sender: str, msg_id: int, reply: Message, request_id: str | None) -> BaseException | None:
        """Send ``reply``; None once it is queued, else why it was not (an error reply may have gone instead)."""
        try:
            self._send_reply(sender, reply, msg_id)
            return None
        except (ProtocolError, TypeError) as exc:  # the handler returned a body the peer would refuse
            self._counters.handler_errors += 1
            log.error("channel %r: handler reply to %r refused: %s", self._peer_id, sender, exc)
            text = f"reply refused by the protocol: {exc}"[:MAX_TEXT_CHARS]
            refused: BaseException = exc
            reply = ErrorMsg(request_id, ErrorCode.INTERNAL, text)
        except (NcclKVError, ValueError) as exc:  # peer lost or channel closed meanwhile
            log.warning("channel %r: could not reply to %r: %s", self._peer_id, sender, exc)
            return exc
        try:
            self._send_reply(sender, reply, msg_id)
        except (NcclKVError, ValueError) as exc:
            log.warning("channel %r: could not report the refused reply to %r: %s", self._peer_id, sender, exc)
        return refused


def _error_reply(exc: Exception, request_id: str | None) -> ErrorMsg:
    """``ErrorMsg.from_exception``, or, for an exception whose text cannot be rendered (its ``__str__`` raised),
    an ``internal`` error naming only its type: the requester must hear of the failure either way."""
    try:
        return ErrorMsg.from_exception(exc, request_id)
    except Exception:
        return ErrorMsg(request_id, ErrorCode.INTERNAL, f"{type(exc).__name__} (its text could not be rendered)")
