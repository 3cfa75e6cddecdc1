"""Helpers for tests/launchers: bounded subprocesses in their own session, child environments, free ports."""

from __future__ import annotations

import re

import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["REPO", "VENV_BIN", "Finished", "SlurmCluster", "child_env", "ring_lines", "run", "unused_port"]

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent


@dataclass(frozen=True, slots=True)
class Finished:
    """A child process that ended (or was killed at its timeout)."""

    command: str
    returncode: int
    output: str  # stdout and stderr, interleaved
    elapsed_s: float
    timed_out: bool

    def describe(self) -> str:
        state = "timed out" if self.timed_out else f"exit {self.returncode}"
        return f"$ {self.command}\n({state} after {self.elapsed_s:.1f} s)\n{self.output[-6000:]}"


def run(command: Sequence[str], *, env: dict[str, str], timeout_s: float, cwd: Path = REPO) -> Finished:
    """Run ``command`` in its own session; on timeout kill that whole process group (by its id)."""
    started = time.monotonic()
    proc = subprocess.Popen(
        list(command), cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )
    timed_out = False
    try:
        output, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate(timeout=30)
    text = " ".join(command)
    return Finished(text, proc.returncode, output, time.monotonic() - started, timed_out)


SLURM_TIME_LIMIT = "3"  # minutes: Slurm ends a job that outlives the test's own timeout
SBATCH_TIMEOUT_S = 150


def sbatch_wait(script: Sequence[str], *, env: dict[str, str], out: Path) -> tuple[Finished, str]:
    """``sbatch --wait`` of ``script`` (its path and arguments), its output written to ``out``: how sbatch ended and
    what the job printed."""
    done = run(["sbatch", "--wait", f"--output={out}", f"--time={SLURM_TIME_LIMIT}", *script], env=env,
               timeout_s=SBATCH_TIMEOUT_S)
    return done, out.read_text() if out.exists() else "(no job output)"


def unused_port(port_range: tuple[int, int] | None = None) -> int:
    """A free TCP port outside the kernel's ephemeral range, so no outgoing connection or bind(0) takes it meanwhile:
    one from 20000 up to the range's start, else one above its end; a port bind(0) gives where the range leaves
    neither (1024-65535). ``port_range``: that range, (low, high); default: the kernel's
    (/proc/sys/net/ipv4/ip_local_port_range)."""
    if port_range is None:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as ports:
            low, high = (int(text) for text in ports.read().split()[:2])
    else:
        low, high = port_range
    # A container's range often starts at 1024 (or below 20000 + 64): nothing below it, then above it.
    for candidates in (range(20000, min(low, 32768)), range(high + 1, 65536)):
        for port in random.sample(candidates, min(64, len(candidates))):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                try:
                    sock.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def child_env(**extra: str) -> dict[str, str]:
    """This environment, with the venv's tools first on PATH and the repository importable."""
    env = dict(os.environ)
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    env["PYTHONUNBUFFERED"] = "1"
    env["NCCLKV_DEADLINE_S"] = "60"  # two shared cores: a rank may start many seconds after its peers
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        env.pop(name, None)  # from an outer launcher, if any: the child's launcher sets its own
    env.update(extra)
    return env


@dataclass(frozen=True, slots=True)
class SlurmCluster:
    """The one-node Slurm of the ``slurm`` fixture."""

    conf: Path
    workdir: Path
    env: dict[str, str]  # child_env() with SLURM_CONF; tests add a MASTER_PORT per job


def ring_lines(output: str) -> dict[int, str]:
    """Each rank's "ring rank R/N ... byte-exact ..." report line, by rank."""
    return {int(m.group(1)): m.group(0) for m in re.finditer(r"ring rank (\d+)/\d+ .*byte-exact.*", output)}
