"""Stopping on SIGINT and SIGTERM without leaving child processes behind: :class:`Stopped`, :func:`stop_on_signals`,
:func:`signals_deferred`.

The engines and ranks a command starts may run in their own sessions, where
neither the terminal's Ctrl-C nor a process-group SIGTERM (``timeout``, CI,
systemd) reaches them: the parent has to stop them. Inside
:func:`stop_on_signals` the first SIGINT or SIGTERM raises :class:`Stopped`
(so ``finally`` blocks run their clean-up) and later ones are ignored, so that
clean-up, which is bounded, is never cut short. :func:`signals_deferred`
holds both signals back across a step that must not be split: starting a
child and keeping its handle, or killing the children.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

__all__ = ["STOP_SIGNALS", "Stopped", "signals_deferred", "stop_on_signals"]

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Stopped(BaseException):  # noqa: N818 - like KeyboardInterrupt: not an error, so not caught as one
    """A signal asked the command to stop; ``exit_code`` is what a shell reports for it (130, 143)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


@contextmanager
def stop_on_signals() -> Iterator[None]:
    """Inside: the first SIGINT or SIGTERM raises :class:`Stopped`, later ones are ignored; the previous
    handlers are back afterwards. Outside the main thread (where Python delivers no signal) it changes nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: FrameType | None) -> None:
        for other in STOP_SIGNALS:
            signal.signal(other, signal.SIG_IGN)
        raise Stopped(signum)

    previous = {signum: signal.signal(signum, stop) for signum in STOP_SIGNALS}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


@contextmanager
def signals_deferred() -> Iterator[None]:
    """SIGINT and SIGTERM wait until the block has ended (then their handlers run as usual)."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
