"""The test side of tests/multiprocess/_engine_workers.py: spawned engine processes, reused across tests.

Spawning a process that imports torch costs seconds on the 2 shared cores, so
a session keeps a :class:`Pool` of idle children; each test builds fresh
engine ranks in them and closes them afterwards (checking no ncclkv thread
is left). A child a test kills or stops is replaced by a fresh process
(:meth:`Pool.replace`, or at the latest when the test ends). Every wait here
has a deadline, a child's failure surfaces with its own traceback, and every
child is reaped (SIGKILL if it does not stop when asked).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import signal
import time
from typing import Any

from ncclkv.engine import EngineRef
from ncclkv.layout import KVGeometry, ParallelLayout
from ncclkv.paged import CacheLayout

from _engine_workers import serve

__all__ = ["WAIT_S", "Pool", "Proc", "WorkerError", "blocks", "build_engine"]

WAIT_S = 30.0  # generous on busy cores: a hang still ends here, long before pytest's timeout
SPAWN_S = 90.0  # a fresh child imports torch; many may start at once
CTX = mp.get_context("spawn")


class WorkerError(AssertionError):
    """A command failed in a child; the message holds the child's traceback."""


class Proc:
    """One spawned child running :func:`_engine_workers.serve`."""

    def __init__(self, tag: str) -> None:
        self.tag = tag
        self.conn, child = CTX.Pipe()
        self.notes = CTX.Queue()
        self.gate = CTX.Event()
        self.proc = CTX.Process(target=serve, args=(child, self.notes, self.gate), name=tag, daemon=True)
        self.proc.start()
        child.close()
        self._pid: int | None = None
        self.busy: str | None = None  # the command whose reply has not been read yet
        self.stopped = False

    @property
    def pid(self) -> int:
        if self._pid is None:
            kind, self._pid = self._read("ready", SPAWN_S)
            assert kind == "ready"
        return self._pid

    def submit(self, command: str, **kwargs: Any) -> None:
        """Start ``command`` in the child; read its reply with :meth:`result`."""
        assert self.pid and self.busy is None, f"{self.tag} is still running {self.busy!r}"
        self.conn.send((command, kwargs))
        self.busy = command

    def result(self, timeout_s: float = WAIT_S) -> Any:
        command, self.busy = self.busy, None
        kind, payload = self._read(command or "?", timeout_s)
        if kind == "error":
            raise WorkerError(f"{self.tag} (pid {self._pid}) failed in {command!r}:\n{payload}")
        return payload

    def call(self, command: str, timeout_s: float = WAIT_S, **kwargs: Any) -> Any:
        self.submit(command, **kwargs)
        return self.result(timeout_s)

    def note(self, timeout_s: float = WAIT_S) -> tuple[Any, ...]:
        try:
            return self.notes.get(timeout=timeout_s)
        except queue.Empty:
            raise TimeoutError(f"{self.tag}: no note within {timeout_s}s (alive: {self.proc.is_alive()})") from None

    def signal(self, signum: int) -> float:
        """Send ``signum``; return the time.monotonic() it was sent at."""
        os.kill(self.pid, signum)
        if signum == signal.SIGSTOP:
            self.stopped = True
        elif signum == signal.SIGCONT:
            self.stopped = False
        return time.monotonic()

    def kill(self) -> float:
        at = time.monotonic()
        if self.proc.is_alive():
            self.proc.kill()  # SIGKILL, also for a SIGSTOPped child
        self.proc.join(WAIT_S)
        assert not self.proc.is_alive(), f"{self.tag} survived SIGKILL"
        return at

    def stop(self) -> None:
        """End the child: politely if it is idle, else by SIGKILL; always reaped."""
        try:
            if self.proc.is_alive() and not self.stopped and self.busy is None:
                self.conn.send(None)
                self.proc.join(10)
        except OSError:
            pass
        finally:
            self.kill()
            self.conn.close()
            self.notes.close()
            self.notes.join_thread()

    def _read(self, what: str, timeout_s: float) -> tuple[str, Any]:
        deadline = time.monotonic() + timeout_s
        while not self.conn.poll(min(1.0, max(0.0, deadline - time.monotonic()))):
            if not self.proc.is_alive():
                raise WorkerError(f"{self.tag} died (exit code {self.proc.exitcode}) before answering {what!r}")
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{self.tag}: no answer to {what!r} within {timeout_s}s")
        try:
            return self.conn.recv()
        except EOFError:
            raise WorkerError(f"{self.tag} closed its pipe before answering {what!r} "
                              f"(exit code {self.proc.exitcode})") from None


class Pool:
    """``size`` children, started together; index with ``pool[i]``."""

    def __init__(self, size: int) -> None:
        self._count = 0
        self.procs = [self._spawn() for _ in range(size)]
        for proc in self.procs:
            assert proc.pid

    def __getitem__(self, index: int) -> Proc:
        return self.procs[index]

    def replace(self, index: int) -> Proc:
        """Kill child ``index`` (if not already) and start a fresh one in its place; returns the fresh one."""
        self.procs[index].stop()
        self.procs[index] = self._spawn()
        return self.procs[index]

    def reset(self) -> dict[str, list[str]]:
        """Close every engine in every child (replacing children that cannot answer); return threads left.

        Replacements are waited for, so their start-up does not compete for the cores with the next test.
        """
        left: dict[str, list[str]] = {}
        for index, proc in enumerate(self.procs):
            try:
                if proc.stopped or not proc.proc.is_alive():
                    raise WorkerError(f"{proc.tag} is stopped or dead")
                if proc.busy is not None:  # a test failed mid-command: open its gate, give it a moment
                    proc.gate.set()
                    proc.result(WAIT_S)
                names = proc.call("close_all")
                proc.gate.clear()
                while not proc.notes.empty():
                    proc.notes.get_nowait()
            except (WorkerError, TimeoutError, OSError, queue.Empty) as err:
                left[proc.tag] = [f"replaced: {err}"[:300]] if proc.proc.is_alive() and not proc.stopped else []
                self.replace(index)
                continue
            if names:
                left[proc.tag] = names
        for proc in self.procs:
            assert proc.pid
        return {tag: names for tag, names in left.items() if names}

    def close(self) -> None:
        for proc in self.procs:
            proc.stop()

    def __enter__(self) -> Pool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _spawn(self) -> Proc:
        self._count += 1
        return Proc(f"engine-proc-{self._count}")


def build_engine(procs: list[Proc], engine_id: str, layout: ParallelLayout, geometry: KVGeometry,
                 cache_layout: CacheLayout, block_size: int, role: str, **config: Any) -> EngineRef:
    """Build rank i of ``engine_id`` in ``procs[i]`` (all at once); the addresses come back over the pipes."""
    assert len(procs) == layout.world_size
    for rank, proc in enumerate(procs):
        proc.submit("build", key=engine_id, engine_id=engine_id, rank=rank, layout=layout, geometry=geometry,
                    cache_layout=cache_layout, block_size=block_size, role=role, **config)
    return EngineRef(engine_id, layout, tuple(proc.result() for proc in procs))


def blocks(num_tokens: int, block_size: int, first_id: int) -> tuple[int, ...]:
    """Block ids for ``num_tokens``, deliberately out of order: first_id + k - 1 down to first_id."""
    count = -(-num_tokens // block_size)
    return tuple(range(first_id + count - 1, first_id - 1, -1))
