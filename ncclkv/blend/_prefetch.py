"""A background thread that produces per-layer values a bounded number of layers ahead."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

from .._timeout import check_timeout
from ..errors import ClosedError, TransferTimeout

__all__ = ["LayerPrefetcher"]

T = TypeVar("T")


class LayerPrefetcher(Generic[T]):
    """Runs ``prepare()`` once, then ``produce(layer)`` for layers ``0 .. num_layers-1`` in order.

    Layer ``l`` is produced only once some caller asked for a layer
    ``>= l - lookahead`` (so at most ``lookahead`` layers wait ahead of the
    consumer, plus any asked for and not yet taken). ``get(layer)`` blocks
    until that layer is ready, at most ``timeout_s``, and re-raises whatever
    ``prepare`` or ``produce`` raised. The thread stops after the last layer, on
    the first error, and on ``close()``. A consumer that is slow to ask (a
    forward that starts late, a long layer) is no error: when nothing new was
    asked for within ``deadline_s`` the thread ends quietly, and the next
    ``get`` starts a new one where it left off. So a prefetcher dropped without
    ``close()`` holds a thread (and through it its producer) at most
    ``deadline_s`` longer. It is joined by ``close()`` and after the last layer
    is taken.
    """

    def __init__(self, name: str, num_layers: int, produce: Callable[[int], T], *,
                 prepare: Callable[[], None] | None = None, lookahead: int = 2, deadline_s: float = 10.0) -> None:
        if isinstance(lookahead, bool) or not isinstance(lookahead, int) or lookahead < 1:
            raise ValueError(f"lookahead must be an int >= 1, got {lookahead!r}")
        self.name = name
        self.num_layers = num_layers
        self.lookahead = lookahead
        self.deadline_s = check_timeout("deadline_s", deadline_s)
        self._produce = produce
        self._prepare = prepare
        self._cond = threading.Condition()
        self._asked = -1
        self._next = 0  # the next layer to produce (a restarted thread goes on from here)
        self._ready: dict[int, T] = {}
        self._taken: set[int] = set()
        self._error: BaseException | None = None
        self._stop = False
        self._running = False
        self._thread: threading.Thread
        with self._cond:
            self._start()

    @property
    def alive(self) -> bool:
        """Whether the thread is running now (one that ended idle is started again by ``get``)."""
        return self._thread.is_alive()

    def get(self, layer: int, timeout_s: float | None = None) -> T:
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < self.num_layers:
            raise ValueError(f"{self.name}: layer must be an int in [0, {self.num_layers}), got {layer!r}")
        timeout = self.deadline_s if timeout_s is None else check_timeout("timeout_s", timeout_s)
        with self._cond:
            if layer in self._taken:
                raise ValueError(f"{self.name}: layer {layer} was already taken")
            if self._asked < layer:
                self._asked = layer
                self._cond.notify_all()
            if not self._running and not self._stop and self._error is None and self._next < self.num_layers:
                self._start()  # the last one ended idle: go on producing
            self._cond.wait_for(lambda: layer in self._ready or self._error is not None or self._stop, timeout)
            if layer in self._ready:
                value = self._ready.pop(layer)
                self._taken.add(layer)
                finished = len(self._taken) == self.num_layers
            elif self._error is not None:
                raise self._error
            elif self._stop:
                raise ClosedError(f"{self.name} is closed")
            else:
                raise TransferTimeout(f"{self.name}: layer {layer} not ready within {timeout:g} s")
        if finished:
            self._join()
        return value

    def close(self) -> None:
        """Stop the thread, drop what it produced, and join it (idempotent)."""
        with self._cond:
            self._stop = True
            self._ready.clear()
            self._cond.notify_all()
        self._join()

    def _start(self) -> None:
        """Start a producing thread (call holding ``_cond``, with none running)."""
        self._running = True
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()

    def _join(self) -> None:
        thread = self._thread
        if threading.current_thread() is thread:
            return
        # Bounded: the thread checks _stop between layers; one produce() is all it may still finish.
        thread.join(self.deadline_s)
        if thread.is_alive():
            raise TransferTimeout(f"{self.name}: thread did not stop within {self.deadline_s:g} s")

    def _run(self) -> None:
        try:
            if self._prepare is not None:
                self._prepare()
                self._prepare = None  # ran: a thread started again after an idle end goes on without it
            while True:
                with self._cond:
                    layer = self._next
                    if layer >= self.num_layers:
                        self._running = False
                        return
                    asked = self._cond.wait_for(lambda: self._stop or layer <= self._asked + self.lookahead,
                                                self.deadline_s)
                    if self._stop or not asked:
                        # Not asked within deadline_s: end quietly (no error), get() starts a new thread.
                        self._running = False
                        return
                value = self._produce(layer)
                with self._cond:
                    if self._stop:
                        self._running = False
                        return
                    self._ready[layer] = value
                    self._next = layer + 1
                    self._cond.notify_all()
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, raised by get()
            with self._cond:
                self._error = exc
                self._running = False
                self._cond.notify_all()
