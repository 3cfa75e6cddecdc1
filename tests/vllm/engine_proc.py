"""The real-vLLM tests' engine harness; it lives in the package (``ncclkv.demo``), shared with ``ncclkv demo``.

:class:`EngineProcess` runs one ``vllm.LLM`` per child interpreter, pinned to
one core, and drives it with deadlines (see :mod:`ncclkv.demo._engine_proc`).
:class:`ParallelEngineOptions` starts one with TP/PP workers in their own processes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ncclkv.demo import EngineError, EngineOptions, EngineProcess, RequestResult

__all__ = ["EngineError", "EngineOptions", "EngineProcess", "ParallelEngineOptions", "RequestResult",
           "load_failures", "session_scheduling"]


@dataclass(frozen=True)
class ParallelEngineOptions(EngineOptions):
    """An engine with tp x pp workers in their own processes (vLLM's "mp" executor), one core each."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    enforce_eager: bool = True
    # Its workers spin on sched_yield: on 2 cores that starved the other engine for a whole deadline
    # (docs/VLLM_NOTES.md). The tests also give each engine a core of its own (cpu_affinity).
    sched_idle: bool = True

    def llm_kwargs(self) -> dict[str, Any]:
        return {**EngineOptions.llm_kwargs(self), "tensor_parallel_size": self.tensor_parallel_size,
                "pipeline_parallel_size": self.pipeline_parallel_size, "distributed_executor_backend": "mp",
                "enforce_eager": self.enforce_eager}

    def env(self) -> dict[str, str]:
        # One core per worker ("0|1"), from the engine's own cores; the default binding wants more
        # NUMA nodes than this machine has.
        cores = sorted(self.cpu_affinity or os.sched_getaffinity(0))
        world = self.tensor_parallel_size * self.pipeline_parallel_size
        return {**EngineOptions.env(self),
                "VLLM_CPU_OMP_THREADS_BIND": "|".join(str(cores[i % len(cores)]) for i in range(world))}


def load_failures(engine: EngineProcess) -> list[str]:
    """The connector's own warnings about failed loads in ``engine``'s log (vLLM then recomputes or fails the
    request: outputs alone cannot tell)."""
    return [line for line in engine.log_path.read_text(errors="replace").splitlines()
            if "ncclkv: load of" in line and "failed" in line]


def session_scheduling(engine: EngineProcess) -> list[tuple[int, frozenset[int]]]:
    """(policy, cores) of every process in ``engine``'s session: its child and the workers it spawned."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[3]) == engine.pid:  # field 6 of proc(5): the session id
                pid = int(stat.parent.name)
                found.append((os.sched_getscheduler(pid), frozenset(os.sched_getaffinity(pid))))
        except (OSError, IndexError, ValueError):  # gone meanwhile
            continue
    return found
