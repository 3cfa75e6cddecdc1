"""Stopping on SIGINT and SIGTERM without leaving child processes behind: :class:`Stopped`, :func:`stop_on_signals`,
:func:`signals_deferred`, :func:`kill_and_reap` (``ncclkv demo``'s engines, the local ranks of
``ncclkv.scenario._local``).

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
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from types import FrameType
from typing import Any

__all__ = ["STOP_SIGNALS", "Stopped", "kill_and_reap", "signals_deferred", "stop_on_signals", "unblock_stop_signals"]

REAP_S = 10.0  # after the kill, how long to wait for the children to be gone (in all)

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
    """SIGINT and SIGTERM wait until the block has ended (then their handlers run as usual).

    The mask blocks them on this thread only (and in the children it starts): the kernel hands a process-directed
    signal to any other thread that lets it in (rich's spinner, ZMQ's), and Python then runs the handler on the main
    thread at once. So on the main thread the handlers are also swapped for one that only notes the signal; at the
    end the handlers are back, the mask too, and each noted signal is raised again."""
    on_main = threading.current_thread() is threading.main_thread()
    noted: list[int] = []
    handlers = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS} if on_main else {}
    # None: not Python's; SIG_IGN stays (nothing to note, and a child forked meanwhile keeps ignoring it).
    handlers = {signum: handler for signum, handler in handlers.items() if handler not in (None, signal.SIG_IGN)}

    def note(signum: int, frame: FrameType | None) -> None:
        if signum not in noted:
            noted.append(signum)

    old = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        for signum in handlers:
            signal.signal(signum, note)
        yield
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
        _raise_again(noted)  # after the mask: raise() delivers to this thread, and the handler runs here


def _raise_again(signums: list[int]) -> None:
    """Raise each signal in turn; a handler that raises (KeyboardInterrupt, Stopped) does not keep the later ones
    from running theirs (SIG_DFL's SIGTERM included): its exception goes on, a later one's names it as context."""
    for index, signum in enumerate(signums):
        try:
            signal.raise_signal(signum)
        except BaseException:
            _raise_again(signums[index + 1:])
            raise


def unblock_stop_signals() -> None:
    """Let SIGINT and SIGTERM in again: for the entry point of a child started inside :func:`signals_deferred`.

    A child keeps its parent's signal mask across exec, so a rank or engine started there runs with both signals
    blocked (and so would every process it starts) unless it unblocks them; one that arrived meanwhile is then
    delivered."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


def kill_and_reap(procs: Sequence[subprocess.Popen[Any]], kill: Callable[[subprocess.Popen[Any]], None]) -> None:
    """``kill`` each child still running, then wait for all of them (``REAP_S`` in all), with SIGINT and SIGTERM
    held back, so that a signal cannot leave one alive."""
    with signals_deferred():
        for proc in procs:
            if proc.poll() is None:
                with suppress(ProcessLookupError):
                    kill(proc)
        reap_by = time.monotonic() + REAP_S
        for proc in procs:
            with suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.0, reap_by - time.monotonic()))
