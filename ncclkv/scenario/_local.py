"""Run every rank of a scenario as a local process, the way torchrun would: ``run_local``.

Used by ``ncclkv demo`` and the scale benchmark. Each rank gets the plain
launcher variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, a free
MASTER_PORT) and one OpenMP thread; its output goes to an anonymous temporary
file (no folder, so nothing is left behind however the run ends), read back
when all ranks ended. At the deadline, or on any exception (such as
:class:`ncclkv.demo.Stopped` on a signal), every rank still running is killed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .._signals import kill_and_reap, signals_deferred
from ..launch import free_port
from ._registry import EXIT_PEER_FAILURE

__all__ = ["EXIT_TIMEOUT", "LocalRun", "run_local"]

EXIT_TIMEOUT = 124  # as timeout(1): the run passed its deadline and was killed


@dataclass(frozen=True, slots=True)
class LocalRun:
    """Every rank's exit code and output (stdout and stderr together), by rank."""

    codes: tuple[int, ...]
    outputs: tuple[str, ...]
    seconds: float

    @property
    def returncode(self) -> int:
        """0 when every rank succeeded, else the first failing rank's code (124: the deadline passed), one
        other than EXIT_PEER_FAILURE first: that one only reports another rank's failure."""
        failed = [code for code in self.codes if code != 0]
        return next((code for code in failed if code != EXIT_PEER_FAILURE), failed[0] if failed else 0)

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    def failure_text(self, tail_chars: int = 2000) -> str:
        """The end of each rank's output, headed by its rank and exit code: what to show when a run failed."""
        return "\n".join(f"--- rank {rank} (exit {code}) ---\n{text[-tail_chars:]}"
                         for rank, (code, text) in enumerate(zip(self.codes, self.outputs)) if text.strip() or code)


# Variables ncclkv.launch.discover() reads, from any launcher.
_LAUNCHER_PREFIXES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "TORCHELASTIC_",
                      "MASTER_ADDR", "MASTER_PORT", "OMPI_COMM_WORLD_", "PMI_", "MPI_LOCAL", "SLURM_")


def run_local(world_size: int, args: Sequence[str], timeout_s: float, *, kind: str = "transfer",
              env: Mapping[str, str] | None = None) -> LocalRun:
    """Start ``python -m ncclkv.scenario --kind KIND ARGS`` once per rank, wait for all (``timeout_s`` in all).

    ``env`` (default: this process's environment) is each rank's base
    environment; the launcher variables are set on top of it.
    """
    if world_size < 1 or not timeout_s > 0:
        raise ValueError(f"need world_size >= 1 and timeout_s > 0, got {world_size}, {timeout_s}")
    inherited = os.environ if env is None else env
    # Every launcher variable is ours: one inherited from an enclosing job (or
    # left behind by a library, as vLLM sets LOCAL_WORLD_SIZE) would be read too.
    base = {key: value for key, value in inherited.items() if not key.startswith(_LAUNCHER_PREFIXES)}
    base.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(world_size),
                 "LOCAL_WORLD_SIZE": str(world_size), "OMP_NUM_THREADS": "1"})
    command = [sys.executable, "-m", "ncclkv.scenario", "--kind", kind, *args]
    started = time.monotonic()
    files = [tempfile.TemporaryFile("w+") for _ in range(world_size)]  # noqa: SIM115 - closed below
    procs: list[subprocess.Popen[bytes]] = []
    codes: list[int] = []
    try:
        for rank, out in enumerate(files):
            with signals_deferred():  # no rank without its handle kept
                procs.append(subprocess.Popen(command, env={**base, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                                              stdout=out, stderr=subprocess.STDOUT))
        deadline = started + timeout_s
        for proc in procs:
            try:
                codes.append(proc.wait(timeout=max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                codes.append(EXIT_TIMEOUT)
    finally:
        kill_and_reap(procs, lambda proc: proc.kill())
        texts = []
        for out in files:
            out.seek(0)
            texts.append(out.read())
            out.close()
    return LocalRun(tuple(codes), tuple(texts), time.monotonic() - started)
