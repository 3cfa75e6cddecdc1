"""The child side of :class:`ncclkv.demo.EngineProcess`: one ``vllm.LLM`` serving the parent's requests.

Run as ``python -m ncclkv.demo._engine_child FD`` where FD is the child end of
a socketpair. Messages (tuples, pickled by ``multiprocessing.connection``):

parent -> child: ``("start", llm_kwargs)`` first, then any of
``("generate", prompts, max_tokens, params)``, ``("drain", max_steps, timeout_s)``,
``("metrics", prefix)``, ``("close",)``.
child -> parent: ``("ready", None)``, ``("result", rows)``, ``("drained", n)``,
``("metrics", {name: value})``, or ``("error", traceback_text)`` (then it exits).

A child whose parent stays silent for ``_IDLE_EXIT_S`` exits by itself. One
whose parent dies (SIGKILL included, which the parent cannot catch to close
its engines) kills its own process group, vLLM's workers with it, at once:
:func:`watch_parent` sees the socket's other end close even while vLLM holds
the main thread (building the engine, a long ``generate``), where the main
loop would notice only at its next read.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

__all__ = ["main", "watch_parent"]

_IDLE_EXIT_S = 900.0
_WATCH_POLL_MS = 60_000  # the watchdog's wait, renewed: it lives as long as the process


def watch_parent(fd: int) -> threading.Thread:
    """Start a daemon thread that ends this process (and its group, when it leads one) once the other end of
    the socket ``fd`` is closed: the parent exited or was killed. Reads nothing, so it never takes a message
    from the main loop; POLLRDHUP/POLLHUP say the peer is gone, whatever is still queued to read."""
    poller = select.poll()
    poller.register(fd, select.POLLRDHUP)  # POLLHUP and POLLERR are reported unasked

    def watch() -> None:
        while not any(events & (select.POLLRDHUP | select.POLLHUP | select.POLLERR)
                      for _, events in poller.poll(_WATCH_POLL_MS)):
            pass
        print("engine child: the parent is gone; exiting", file=sys.stderr, flush=True)
        sys.stdout.flush()
        if os.getpgid(0) == os.getpid():  # we lead our group (start_new_session): take vLLM's workers too
            os.killpg(os.getpid(), signal.SIGKILL)
        os._exit(1)

    thread = threading.Thread(target=watch, name="ncclkv-parent-watch", daemon=True)
    thread.start()
    return thread


def main(fd: int) -> int:
    conn = Connection(socket.socket(fileno=fd).detach())
    watch_parent(fd)
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
            elif msg[0] == "metrics":
                conn.send(("metrics", _metrics(llm, msg[1])))
            elif msg[0] == "generate":
                conn.send(("result", _generate(llm, *msg[1:])))
            else:
                raise RuntimeError(f"unknown message {msg[0]!r}")
    except (EOFError, BrokenPipeError):  # parent gone (killed): nobody to report to
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)  # at once: vLLM's orderly shutdown was seen to outlive a killed parent; its workers
        # follow through their death pipes
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
    rows = []
    for out in outputs:
        stats = out.metrics  # vLLM's RequestStateStats when stats are on, else None
        timed = stats is not None and getattr(stats, "first_token_ts", 0.0) > 0
        rows.append(dict(
            token_ids=list(out.outputs[0].token_ids),
            kv_transfer_params=out.kv_transfer_params,
            finish_reason=out.outputs[0].finish_reason,
            num_cached_tokens=out.num_cached_tokens or 0,
            ttft_s=float(stats.first_token_latency) if timed else None,
            queued_s=float(stats.scheduled_ts - stats.queued_ts) if timed and stats.scheduled_ts > 0 else None,
        ))
    return rows


def _drain(llm: Any, max_steps: int, timeout_s: float) -> int:
    # LLM -> LLMEngine -> InprocClient -> EngineCore; only the in-process engine has this.
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    deadline = time.monotonic() + timeout_s
    for _ in range(max_steps):
        if not scheduler.has_requests() or time.monotonic() > deadline:
            break
        llm.llm_engine.step()
    return len(scheduler.requests)


def _metrics(llm: Any, prefix: str) -> dict[str, float]:
    from vllm.v1.metrics.reader import Counter, Gauge, Histogram

    values: dict[str, float] = {}
    for metric in llm.get_metrics():
        if not metric.name.startswith(prefix):
            continue
        if isinstance(metric, Counter | Gauge):
            values[metric.name] = values.get(metric.name, 0.0) + float(metric.value)
        elif isinstance(metric, Histogram):
            for key, value in ((f"{metric.name}_sum", metric.sum), (f"{metric.name}_count", metric.count)):
                values[key] = values.get(key, 0.0) + float(value)
    return values


if __name__ == "__main__":
    # EngineProcess starts us with SIGINT and SIGTERM blocked (signals_deferred), a mask kept across exec and
    # passed on to vLLM's workers, which vLLM's shutdown terminates by SIGTERM.
    from ncclkv._signals import unblock_stop_signals

    unblock_stop_signals()
    sys.exit(main(int(sys.argv[1])))
