"""Rank discovery under torchrun, srun, Open MPI, MPICH/Hydra or a plain environment.

:func:`discover` reads the launcher's variables from a mapping (``os.environ``
by default) and returns one :class:`LaunchInfo`. When several launchers are
nested (torchrun inside an srun step, mpiexec inside an sbatch script) the
innermost one wins: torchrun, then Open MPI, then MPICH, then Slurm.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["LaunchInfo", "derived_master_port", "discover", "first_slurm_host", "free_port"]

# Ports derived from a Slurm job id land here: above the well-known and
# registered-service ranges and below Linux's default ephemeral range.
_DERIVED_PORT_BASE = 20000
_DERIVED_PORT_SPAN = 12000


@dataclass(frozen=True, slots=True)
class LaunchInfo:
    """Where this process sits in its job."""

    launcher: str  # "torchrun" | "openmpi" | "mpich" | "slurm" | "env" | "single"
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int | None  # None: the launcher does not say
    master_addr: str
    master_port: int
    # The launcher itself serves a TCPStore at master_addr:master_port (torchrun's
    # agent store): every rank, rank 0 included, connects to it as a client.
    store_hosted: bool = False

    @property
    def is_master(self) -> bool:
        return self.rank == 0


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago (bind to 0, read it back)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def first_slurm_host(nodelist: str) -> str:
    """The first host of a Slurm hostlist such as ``gpu[03-05,9],cpu1``."""
    match = re.match(r"^([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not match or not match.group(1):
        raise ValueError(f"cannot read a host from Slurm node list {nodelist!r}")
    prefix, ranges = match.group(1), match.group(2)
    if ranges is None:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first


def _int_var(env: Mapping[str, str], name: str) -> int:
    text = env[name]
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{name}={text!r} is not an integer") from None
    if value < 0:
        raise ValueError(f"{name}={text!r} is negative")
    return value


def _require(env: Mapping[str, str], launcher: str, names: tuple[str, ...]) -> None:
    missing = [name for name in names if not env.get(name)]
    if missing:
        present = [name for name in names if env.get(name)]
        raise ValueError(f"{launcher} launch is missing {', '.join(missing)} (found {', '.join(present) or 'none'})")


def _detect(env: Mapping[str, str]) -> str:
    if "TORCHELASTIC_RUN_ID" in env:
        return "torchrun"
    if "OMPI_COMM_WORLD_RANK" in env or "OMPI_COMM_WORLD_SIZE" in env:
        return "openmpi"
    if "PMI_RANK" in env or "PMI_SIZE" in env:
        return "mpich"
    if "SLURM_PROCID" in env and ("SLURM_NTASKS" in env or "SLURM_NPROCS" in env or "SLURM_STEP_NUM_TASKS" in env):
        return "slurm"
    if "RANK" in env or "WORLD_SIZE" in env:
        return "env"
    return "single"


# launcher -> (rank, world size, local rank, local world size) variable names
_VARS: dict[str, tuple[str, str, str | None, str | None]] = {
    "torchrun": ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),
    "env": ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),
    "openmpi": ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
    "mpich": ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    "slurm": ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", None),
}


def _slurm_local_size(env: Mapping[str, str]) -> int | None:
    # SLURM_TASKS_PER_NODE looks like "4(x2),3"; the node's own count is in
    # SLURM_STEP_TASKS_PER_NODE / SLURM_TASKS_PER_NODE only for homogeneous steps.
    text = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    if not text:
        return None
    match = re.match(r"^(\d+)(?:\(x\d+\))?$", text)
    return int(match.group(1)) if match else None


def derived_master_port(job_id: int) -> int:
    """The MASTER_PORT every rank of Slurm job ``job_id`` derives when none is set (the same on every node)."""
    return _DERIVED_PORT_BASE + job_id % _DERIVED_PORT_SPAN


def _master(env: Mapping[str, str], launcher: str, world_size: int, all_local: bool) -> tuple[str, int]:
    addr = env.get("MASTER_ADDR")
    if not addr:
        if launcher == "slurm" and env.get("SLURM_STEP_NODELIST", env.get("SLURM_JOB_NODELIST")):
            addr = first_slurm_host(env.get("SLURM_STEP_NODELIST") or env["SLURM_JOB_NODELIST"])
        elif all_local:
            addr = "127.0.0.1"
        else:
            raise ValueError(f"{launcher} job of world_size={world_size} spans several nodes and MASTER_ADDR is not set")
    if env.get("MASTER_PORT"):
        port = _int_var(env, "MASTER_PORT")
        if not 0 < port < 65536:
            raise ValueError(f"MASTER_PORT={port} is not a TCP port")
        return addr, port
    if world_size == 1:
        return addr, free_port(addr if addr != "localhost" else "127.0.0.1")
    if env.get("SLURM_JOB_ID"):
        # Every rank of the job must agree without talking: derive from the job id.
        return addr, derived_master_port(_int_var(env, "SLURM_JOB_ID"))
    raise ValueError(f"{launcher} job of world_size={world_size} needs MASTER_PORT (ranks cannot agree on a free port)")


def discover(environ: Mapping[str, str] | None = None) -> LaunchInfo:
    """Describe this process's place in its job from the launcher's variables.

    Raises ValueError naming the variables that are missing, malformed or in
    conflict (rank outside the world, local rank outside the node, ...).
    """
    env = os.environ if environ is None else environ
    launcher = _detect(env)
    if launcher == "single":
        addr = env.get("MASTER_ADDR") or "127.0.0.1"
        port = _int_var(env, "MASTER_PORT") if env.get("MASTER_PORT") else free_port(addr)
        return LaunchInfo("single", 0, 1, 0, 1, addr, port)

    rank_var, size_var, local_var, local_size_var = _VARS[launcher]
    world_var = size_var
    if launcher == "slurm" and not env.get(size_var):
        world_var = "SLURM_NPROCS" if env.get("SLURM_NPROCS") else "SLURM_STEP_NUM_TASKS"
    _require(env, launcher, (rank_var, world_var))
    rank, world_size = _int_var(env, rank_var), _int_var(env, world_var)
    if world_size < 1 or rank >= world_size:
        raise ValueError(f"{launcher}: {rank_var}={rank} is outside {world_var}={world_size}")

    local_rank = _int_var(env, local_var) if local_var and env.get(local_var) else None
    local_size = _int_var(env, local_size_var) if local_size_var and env.get(local_size_var) else None
    if launcher == "slurm":
        local_size = _slurm_local_size(env)
    if launcher == "torchrun":
        _require(env, launcher, (local_var, local_size_var))  # torchrun always sets both
    if local_rank is None:
        if local_size is not None and local_size != world_size:
            raise ValueError(f"{launcher}: {local_size_var}={local_size} is set but {local_var} is missing")
        # No local information at all: the whole job is on this node.
        local_rank, local_size = rank, world_size
    if local_size is not None:
        if local_rank >= local_size:
            raise ValueError(f"{launcher}: {local_var}={local_rank} is outside local size {local_size}")
        if local_size > world_size:
            raise ValueError(f"{launcher}: local size {local_size} exceeds {world_var}={world_size}")
    # No check of local_rank against rank: Open MPI 5 numbers a node's ranks in
    # mapping order (by package), so local rank 2 may be global rank 1.

    addr, port = _master(env, launcher, world_size, all_local=local_size == world_size)
    store_hosted = launcher == "torchrun" and env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    return LaunchInfo(launcher, rank, world_size, local_rank, local_size, addr, port, store_hosted)
