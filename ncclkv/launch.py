"""Rank discovery under torchrun, srun, Open MPI, MPICH/Hydra or a plain environment.

:func:`discover` reads the launcher's variables from a mapping (``os.environ``
by default) and returns one :class:`LaunchInfo`. When several launchers are
nested (torchrun inside an srun step, mpiexec inside an sbatch script) the
innermost one wins: torchrun, then Open MPI, then MPICH, then plain
RANK/WORLD_SIZE (Slurm never sets them: a process given both inside a Slurm
step or batch script was placed by them), then Slurm. ``srun --mpi=pmi2``
sets MPICH's PMI_RANK/PMI_SIZE too; it counts as Slurm (whose variables also
say where the task sits on its node).
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["LaunchInfo", "derived_master_port", "discover", "first_slurm_host", "free_port", "slurm_tasks_per_node"]

# Ports derived from a Slurm job id land here: above the well-known and
# registered-service ranges and below Linux's default ephemeral range.
_DERIVED_PORT_BASE = 20000
_DERIVED_PORT_SPAN = 12000
# Prime to the span: the steps of one job (up to the span's count) all derive different ports.
_DERIVED_PORT_STEP_STRIDE = 1009


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
    # GPUs Slurm gave this task for itself alone (srun/sbatch --gpus-per-task): each
    # task then sees only its own GPUs, so fewer than the node's ranks. None: the
    # launcher did not give each task its own (or is not Slurm).
    gpus_per_task: int | None = None
    # Which start of the job this is: torchrun's TORCHELASTIC_RESTART_COUNT (0 first, +1 per elastic restart),
    # 0 under every other launcher. torchrun's agent store outlives its workers, so whatever an attempt
    # wrote there is still there in the next one: keys must carry the attempt (StoreRendezvous does).
    attempt: int = 0
    # Slurm's SLURM_STEP_ID (0 elsewhere): steps of one job given the same MASTER_PORT keep their keys apart.
    step_id: int = 0

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


def _is_slurm_pmi(env: Mapping[str, str]) -> bool:
    """PMI_RANK/PMI_SIZE come from srun's own PMI plugin (``--mpi=pmi2``), not from Hydra."""
    if "MPI_LOCALRANKID" in env:  # Hydra (MPICH, Intel MPI) sets it; Slurm's PMI plugins do not
        return False
    # The srun step's own rank and size: a batch script's mpiexec children inherit the
    # batch step's SLURM_PROCID=0, but it has no SLURM_STEP_NUM_TASKS.
    procid, tasks = env.get("SLURM_PROCID"), env.get("SLURM_STEP_NUM_TASKS")
    return procid is not None and procid == env.get("PMI_RANK") and tasks is not None and tasks == env.get("PMI_SIZE")


def _detect(env: Mapping[str, str]) -> str:
    if "TORCHELASTIC_RUN_ID" in env:
        return "torchrun"
    if "OMPI_COMM_WORLD_RANK" in env or "OMPI_COMM_WORLD_SIZE" in env:
        return "openmpi"
    if "PMI_RANK" in env or "PMI_SIZE" in env:
        return "slurm" if _is_slurm_pmi(env) else "mpich"
    # Slurm never sets RANK/WORLD_SIZE: a process given both inside a Slurm step or batch script (started
    # by hand, or by a tool that sets them, in an sbatch script or `srun --pty bash`) was placed by them,
    # and the step's SLURM_PROCID (0 for the batch step and an interactive shell) is not its rank.
    if "RANK" in env and "WORLD_SIZE" in env:
        return "env"
    if "SLURM_PROCID" in env and ("SLURM_NTASKS" in env or "SLURM_NPROCS" in env or "SLURM_STEP_NUM_TASKS" in env):
        return "slurm"
    if "RANK" in env or "WORLD_SIZE" in env:
        return "env"  # one of the two: discover() names the missing one
    return "single"


# launcher -> (rank, world size, local rank, local world size) variable names
_VARS: dict[str, tuple[str, str, str | None, str | None]] = {
    "torchrun": ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),
    "env": ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),
    "openmpi": ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
    "mpich": ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    "slurm": ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", None),
}


_TASKS_ITEM = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


def slurm_tasks_per_node(text: str) -> list[int]:
    """Slurm's compressed tasks-per-node list, one count per node: ``"2(x3),1"`` -> ``[2, 2, 2, 1]``."""
    counts: list[int] = []
    for item in text.split(","):
        match = _TASKS_ITEM.match(item.strip())
        if not match:
            raise ValueError(f"cannot read tasks per node from {text!r}: {item!r} is not N or N(xM)")
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts


def _slurm_local_size(env: Mapping[str, str]) -> int | None:
    """This node's task count, or None when the variables do not say which entry is this node's."""
    # The step's list where srun set one; a batch script's own step has only the job's.
    if env.get("SLURM_STEP_TASKS_PER_NODE"):
        list_var, nodes_var = "SLURM_STEP_TASKS_PER_NODE", "SLURM_STEP_NUM_NODES"
    elif env.get("SLURM_TASKS_PER_NODE"):
        list_var, nodes_var = "SLURM_TASKS_PER_NODE", "SLURM_NNODES"
    else:
        return None
    try:
        counts = slurm_tasks_per_node(env[list_var])
    except ValueError as exc:
        raise ValueError(f"{list_var}: {exc}") from None
    if len(set(counts)) == 1:
        return counts[0]  # every node runs as many: which one this is does not matter
    # Uneven ("4,2"): SLURM_NODEID indexes the list only if it covers exactly the step's nodes.
    if not env.get("SLURM_NODEID") or not env.get(nodes_var) or _int_var(env, nodes_var) != len(counts):
        return None
    node = _int_var(env, "SLURM_NODEID")
    if node >= len(counts):
        raise ValueError(f"slurm: SLURM_NODEID={node} is outside {list_var}={env[list_var]!r} ({len(counts)} nodes)")
    return counts[node]


_PER_TASK_GPU_BIND = re.compile(r"(?:^|[;/])gpu:(?:verbose,)?per_task:(\d+)")


def _slurm_gpus_per_task(env: Mapping[str, str]) -> int | None:
    """GPUs Slurm gave this task alone (see LaunchInfo.gpus_per_task), or None."""
    bind = env.get("SLURMD_TRES_BIND")
    if bind is not None:
        # slurmd's record of the step's binding: "gpu:per_task:1" (22.05), "gres/gpu:per_task:1" (later);
        # --gpus-per-task implies it, and --gpu-bind=none/closest/map_gpu replace it (tasks may share).
        match = _PER_TASK_GPU_BIND.search(bind)
        return int(match.group(1)) if match else None
    text = env.get("SLURM_GPUS_PER_TASK")  # sbatch sets it; srun alone does not
    if not text:
        return None
    # "[type:]N[,[type:]N...]": without a binding each task still owns its count,
    # and sees every GPU of its node's tasks (one per local rank, at least).
    total = 0
    for item in text.split(","):
        match = re.match(r"^(?:[^:]+:)?(\d+)$", item.strip())
        if not match:
            raise ValueError(f"SLURM_GPUS_PER_TASK={text!r} is not [type:]count[,[type:]count...]")
        total += int(match.group(1))
    return total or None


def _slurm_node_count(env: Mapping[str, str]) -> tuple[str, int] | None:
    """(variable, nodes) of the Slurm step this process runs in, else of its job; None outside Slurm."""
    for name in ("SLURM_STEP_NUM_NODES", "SLURM_NNODES"):
        if env.get(name):
            return name, _int_var(env, name)
    return None


def derived_master_port(job_id: int, step_id: int = 0) -> int:
    """The MASTER_PORT every rank of step ``step_id`` of Slurm job ``job_id`` derives when none is set (the same
    on every node). Steps of one job get ports of their own: two P/D sets started in one allocation would
    otherwise meet on one port, and the second one's ranks join the first one's store and links."""
    return _DERIVED_PORT_BASE + (job_id + step_id * _DERIVED_PORT_STEP_STRIDE) % _DERIVED_PORT_SPAN


def _slurm_step_id(env: Mapping[str, str]) -> int:
    """SLURM_STEP_ID of an srun step; 0 where it is not set (a batch script, another launcher)."""
    return _int_var(env, "SLURM_STEP_ID") if env.get("SLURM_STEP_ID") else 0


def _master(env: Mapping[str, str], launcher: str, world_size: int, local_size: int | None,
            local_size_name: str) -> tuple[str, int]:
    addr = env.get("MASTER_ADDR")
    if not addr:
        if launcher == "slurm" and env.get("SLURM_STEP_NODELIST", env.get("SLURM_JOB_NODELIST")):
            addr = first_slurm_host(env.get("SLURM_STEP_NODELIST") or env["SLURM_JOB_NODELIST"])
        elif local_size == world_size:
            addr = "127.0.0.1"
        elif local_size is None:
            # A local rank without the node's size: whether every rank is on this node is unknown.
            why = (f"{local_size_name}={env[local_size_name]!r} does not say this node's rank count"
                   if env.get(local_size_name) else f"{local_size_name} is not set")
            raise ValueError(
                f"{launcher}: MASTER_ADDR is not set and {why}, so whether all {world_size} ranks run on this "
                f"node is unknown: set {local_size_name} (on one node: {local_size_name}={world_size}) or MASTER_ADDR"
            )
        else:
            raise ValueError(
                f"{launcher} job of world_size={world_size} spans several nodes ({local_size_name}={local_size}) "
                f"and MASTER_ADDR is not set"
            )
    if env.get("MASTER_PORT"):
        port = _int_var(env, "MASTER_PORT")
        if not 0 < port < 65536:
            raise ValueError(f"MASTER_PORT={port} is not a TCP port")
        return addr, port
    if world_size == 1:
        return addr, free_port(addr if addr != "localhost" else "127.0.0.1")
    if env.get("SLURM_JOB_ID"):
        # Every rank of the job must agree without talking: derive from the job id.
        return addr, derived_master_port(_int_var(env, "SLURM_JOB_ID"), _slurm_step_id(env))
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
    # Slurm's node size comes from a list, not one variable: name the step's in messages.
    size_name = local_size_var or "SLURM_STEP_TASKS_PER_NODE"
    if local_rank is None:
        if local_size is not None and local_size != world_size:
            raise ValueError(f"{launcher}: {size_name}={local_size} is set but {local_var} is missing")
        nodes = _slurm_node_count(env)
        if world_size > 1 and nodes is not None and nodes[1] > 1:
            # Taking every rank as local would pick the wrong GPU and 127.0.0.1 as MASTER_ADDR.
            raise ValueError(
                f"{launcher}: {local_var} is not set and {nodes[0]}={nodes[1]} says the job spans several nodes: "
                f"cannot take all {world_size} ranks as local; start them with a launcher that sets "
                f"{local_var} and {size_name} (or set both)"
            )
        # No local information at all: the whole job is on this node.
        local_rank, local_size = rank, world_size
    if local_size is not None:
        if local_rank >= local_size:
            raise ValueError(f"{launcher}: {local_var}={local_rank} is outside local size {local_size}")
        if local_size > world_size:
            raise ValueError(f"{launcher}: local size {local_size} exceeds {world_var}={world_size}")
    # No check of local_rank against rank: Open MPI 5 numbers a node's ranks in
    # mapping order (by package), so local rank 2 may be global rank 1.

    addr, port = _master(env, launcher, world_size, local_size, size_name)
    store_hosted = launcher == "torchrun" and env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    # torchrun numbers its attempts (elastic restarts); its agent store keeps the earlier attempts' keys.
    attempt = _int_var(env, "TORCHELASTIC_RESTART_COUNT") if launcher == "torchrun" and env.get(
        "TORCHELASTIC_RESTART_COUNT") else 0
    # Only a Slurm task owns its GPUs: under torchrun or mpiexec inside a job, the
    # processes of one task would share them.
    gpus_per_task = _slurm_gpus_per_task(env) if launcher == "slurm" else None
    step_id = _slurm_step_id(env) if launcher == "slurm" else 0
    return LaunchInfo(launcher, rank, world_size, local_rank, local_size, addr, port, store_hosted, gpus_per_task,
                      attempt, step_id)
