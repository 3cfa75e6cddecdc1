"""Rank discovery under torchrun, srun, Open MPI, MPICH/Hydra or a plain environment.

:func:`discover` reads the launcher's variables from a mapping (``os.environ``
by default) and returns one :class:`LaunchInfo`. When several launchers are
nested (torchrun inside an srun step, mpiexec inside an sbatch script) the
innermost one wins: torchrun, then Open MPI, then MPICH, then plain
RANK/WORLD_SIZE (Slurm never sets them: a process given both inside a Slurm
step or batch script was placed by them), then Slurm. ``srun --mpi=pmi2``
sets MPICH's PMI_RANK/PMI_SIZE too; it counts as Slurm (whose variables also
say where the task sits on its node). So do RANK/WORLD_SIZE that equal the srun
step's own SLURM_PROCID/SLURM_STEP_NUM_TASKS (pyxis/enroot's PyTorch hook sets
them in every task): Slurm's variables also give the node's task count, the
GPUs bound to the task and the step. A Slurm world is the srun step's
(SLURM_STEP_NUM_TASKS), never the job's SLURM_NTASKS: a process of the batch
script itself (no SLURM_STEP_NUM_TASKS) is refused ("launch with srun").
"""

from __future__ import annotations

import itertools
import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = [
    "LOCAL_SIZE_VARS", "LaunchInfo", "derived_master_port", "discover", "first_slurm_host", "free_port",
    "slurm_hostlist", "slurm_node_count", "slurm_tasks_per_node",
]

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
    # Under another launcher whose MASTER_PORT was derived from the Slurm job (none exported), that step's.
    step_id: int = 0
    # Slurm's SLURM_JOB_ID; under Open MPI its PMIx namespace (PMIX_NAMESPACE, one per mpiexec run); under another
    # launcher (or Open MPI without a namespace) whose MASTER_PORT was derived from the Slurm job, that job's id;
    # None elsewhere: in the rendezvous keys and the identity the hosting rank publishes, so that a rank of another
    # job or run that meets this job's store (derived ports collide; two mpiexec runs of one batch script derive
    # one) is refused at once.
    job_id: str | None = None

    @property
    def is_master(self) -> bool:
        return self.rank == 0


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago (bind to 0, read it back)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def _hostlist_items(nodelist: str) -> list[list[str | list[str]]]:
    """A Slurm hostlist cut into its comma-separated items, each a sequence of literal text and bracket groups (a
    bracket group as its numbers, zero padding kept): ``gpu[1-2]-ib,cpu1`` -> [["gpu", ["1", "2"], "-ib"], ["cpu1"]]."""
    text = nodelist.strip()
    items: list[list[str | list[str]]] = []
    parts: list[str | list[str]] = []
    literal, pos = "", 0
    while pos < len(text):
        char = text[pos]
        if char == "[":
            end = text.find("]", pos)
            if end < 0:
                raise ValueError(f"cannot read Slurm node list {nodelist!r}: '[' at {pos} is never closed")
            numbers: list[str] = []
            for item in text[pos + 1:end].split(","):
                match = _RANGE.match(item.strip())
                if not match:
                    raise ValueError(f"cannot read Slurm node list {nodelist!r}: {item!r} is not N or N-M")
                low, high = match.group(1), match.group(2) or match.group(1)
                if int(high) < int(low):
                    raise ValueError(f"cannot read Slurm node list {nodelist!r}: range {item!r} runs backwards")
                width = len(low)
                numbers.extend(str(number).zfill(width) for number in range(int(low), int(high) + 1))
            if literal:
                parts.append(literal)
                literal = ""
            parts.append(numbers)
            pos = end + 1
        elif char == "]":
            raise ValueError(f"cannot read Slurm node list {nodelist!r}: ']' at {pos} closes nothing")
        elif char == ",":
            if literal:
                parts.append(literal)
                literal = ""
            if not parts:
                raise ValueError(f"cannot read Slurm node list {nodelist!r}: an empty host at {pos}")
            items.append(parts)
            parts = []
            pos += 1
        else:
            literal += char
            pos += 1
    if literal:
        parts.append(literal)
    if not parts:
        raise ValueError(f"cannot read a host from Slurm node list {nodelist!r}")
    items.append(parts)
    return items


def first_slurm_host(nodelist: str) -> str:
    """The first host of a Slurm hostlist such as ``gpu[03-05,9],cpu1`` (gpu03) or ``rack[1-2]-n[01-02]-ib``
    (rack1-n01-ib)."""
    first = _hostlist_items(nodelist)[0]
    return "".join(part if isinstance(part, str) else part[0] for part in first)


def slurm_hostlist(nodelist: str) -> list[str]:
    """Every host of a Slurm hostlist, in its order: ``gpu[03-04],cpu1`` -> ["gpu03", "gpu04", "cpu1"]."""
    hosts: list[str] = []
    for parts in _hostlist_items(nodelist):
        choices = [[part] if isinstance(part, str) else part for part in parts]
        hosts.extend("".join(combo) for combo in itertools.product(*choices))
    return hosts


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


def _is_slurm_task_env(env: Mapping[str, str]) -> bool:
    """RANK and WORLD_SIZE (both set) are this srun task's own SLURM_PROCID and SLURM_STEP_NUM_TASKS.

    pyxis/enroot's PyTorch hook sets RANK=$SLURM_PROCID, WORLD_SIZE=$SLURM_NTASKS, LOCAL_RANK=$SLURM_LOCALID
    (and MASTER_ADDR/MASTER_PORT) in every task: read as plain RANK/WORLD_SIZE, the node's task count, the GPUs
    Slurm bound to the task and the step id were lost. Values that disagree with a step of several tasks are
    refused naming both (WORLD_SIZE=$SLURM_NTASKS is the job's count under ``srun --preserve-env``); in a
    one-task step (``srun --pty bash``) they place processes started by hand, as outside Slurm.
    """
    if not (env.get("SLURM_STEP_ID") and env.get("SLURM_PROCID") and env.get("SLURM_STEP_NUM_TASKS")):
        return False  # not inside an srun step
    given = (_int_var(env, "RANK"), _int_var(env, "WORLD_SIZE"))
    step = (_int_var(env, "SLURM_PROCID"), _int_var(env, "SLURM_STEP_NUM_TASKS"))
    if given == step:
        if env.get("LOCAL_RANK") and env.get("SLURM_LOCALID") and (
                _int_var(env, "LOCAL_RANK") != _int_var(env, "SLURM_LOCALID")):
            raise ValueError(
                f"LOCAL_RANK={env['LOCAL_RANK']!r} disagrees with this srun task's SLURM_LOCALID="
                f"{env['SLURM_LOCALID']!r} (RANK and WORLD_SIZE are the step's SLURM_PROCID and "
                f"SLURM_STEP_NUM_TASKS): unset LOCAL_RANK or make it the task's")
        return True
    if step[1] == 1:
        return False
    raise ValueError(
        f"RANK={given[0]} WORLD_SIZE={given[1]} disagree with this srun step's SLURM_PROCID={step[0]} "
        f"SLURM_STEP_NUM_TASKS={step[1]} (SLURM_STEP_ID={env['SLURM_STEP_ID']}); a container hook (pyxis/enroot "
        f"sets WORLD_SIZE=$SLURM_NTASKS, the job's task count under srun --preserve-env) or a wrapper set them "
        f"for another world: unset RANK and WORLD_SIZE to run as the step's tasks, or start the processes of a "
        f"task with torchrun (its variables win)")


def _stale_openmpi(env: Mapping[str, str]) -> None:
    """ValueError when Open MPI's variables were inherited by an srun step started from an mpiexec rank
    (``mpiexec -n 1 srun -n 2 ...``): every task then reads the one mpiexec rank's OMPI_COMM_WORLD_RANK/SIZE."""
    rank, size = env.get("OMPI_COMM_WORLD_RANK"), env.get("OMPI_COMM_WORLD_SIZE")
    reasons = []
    pmix = env.get("PMIX_RANK")
    if pmix is not None and rank is not None and pmix.strip() != rank.strip():
        reasons.append(f"PMIX_RANK={pmix} (this process's PMIx rank) is not OMPI_COMM_WORLD_RANK={rank}")
    if env.get("SLURM_STEP_ID") and env.get("SLURM_STEP_NUM_TASKS") and size:
        tasks, world = _int_var(env, "SLURM_STEP_NUM_TASKS"), _int_var(env, "OMPI_COMM_WORLD_SIZE")
        if tasks > world:
            reasons.append(f"this srun step (SLURM_STEP_ID={env['SLURM_STEP_ID']}) has SLURM_STEP_NUM_TASKS={tasks} "
                           f"tasks, more than OMPI_COMM_WORLD_SIZE={world}")
    if reasons:
        raise ValueError(
            f"openmpi: OMPI_COMM_WORLD_RANK={rank} OMPI_COMM_WORLD_SIZE={size} are stale: {'; '.join(reasons)} "
            f"(an srun step started from an mpiexec rank inherits that rank's Open MPI variables, "
            f"SLURM_PROCID={env.get('SLURM_PROCID')}): start the ranks with srun alone (with the OMPI_COMM_WORLD_* "
            f"and PMIX_* variables unset) or with mpiexec alone")


def _detect(env: Mapping[str, str]) -> str:
    if "TORCHELASTIC_RUN_ID" in env:
        return "torchrun"
    if "OMPI_COMM_WORLD_RANK" in env or "OMPI_COMM_WORLD_SIZE" in env:
        return "openmpi"
    if "PMI_RANK" in env or "PMI_SIZE" in env:
        return "slurm" if _is_slurm_pmi(env) else "mpich"
    # Slurm never sets RANK/WORLD_SIZE: a process given both inside a Slurm step or batch script (started
    # by hand, or by a tool that sets them, in an sbatch script or `srun --pty bash`) was placed by them,
    # and the step's SLURM_PROCID (0 for the batch step and an interactive shell) is not its rank. Unless they
    # are the srun step's own (a container hook copies them in, pyxis/enroot's does): then it is Slurm's task.
    if "RANK" in env and "WORLD_SIZE" in env:
        return "slurm" if _is_slurm_task_env(env) else "env"
    # The batch script's own step has SLURM_PROCID=0 too: discover() refuses it by name.
    if "SLURM_PROCID" in env:
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
    # The srun step's task count: SLURM_NTASKS is the job's under srun --preserve-env (and in the batch script).
    "slurm": ("SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_LOCALID", None),
}

# The variable that says how many of the job's ranks run on this node, per launcher: _VARS' local size column,
# and for Slurm its per-node list.
LOCAL_SIZE_VARS: dict[str, str] = {name: names[3] or "SLURM_STEP_TASKS_PER_NODE" for name, names in _VARS.items()}


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


def slurm_node_count(env: Mapping[str, str]) -> tuple[str, int] | None:
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


def _slurm_host_var(env: Mapping[str, str], name: str) -> str:
    try:
        return first_slurm_host(env[name])
    except ValueError as exc:
        raise ValueError(f"slurm: {name}: {exc}") from None


def _slurm_master_host(env: Mapping[str, str], rank: int) -> str:
    """The node of the step's task 0: the first node of the step (of the job, in a batch script's own step).

    A heterogeneous step's SLURM_STEP_NODELIST is sorted by name, while its task 0 is het group 0's first task:
    the first node of SLURM_JOB_NODELIST_HET_GROUP_0 when the step runs there. Rank 0 checks that it runs on
    the node derived (SLURMD_NODENAME): otherwise every other rank would wait for a store nobody serves.
    """
    step_var = "SLURM_STEP_NODELIST" if env.get("SLURM_STEP_NODELIST") else "SLURM_JOB_NODELIST"
    host, source = _slurm_host_var(env, step_var), f"{step_var}={env[step_var]!r}"
    het_var = "SLURM_JOB_NODELIST_HET_GROUP_0"
    if env.get(het_var):
        group0 = _slurm_host_var(env, het_var)
        try:
            step_hosts = slurm_hostlist(env[step_var])
        except ValueError as exc:
            raise ValueError(f"slurm: {step_var}: {exc}") from None
        if group0 in step_hosts:
            host, source = group0, f"{het_var}={env[het_var]!r} (het group 0, where task 0 runs)"
    node = env.get("SLURMD_NODENAME")
    if rank == 0 and node and node != host:
        raise ValueError(
            f"slurm: rank 0 runs on SLURMD_NODENAME={node!r}, but MASTER_ADDR would be {host!r}, the first node of "
            f"{source}: the other ranks would look for the store there; export MASTER_ADDR (the address of rank "
            f"0's node) for every task")
    return host


def _own_free_port(addr: str, launcher: str, derived_from: str | None = None) -> int:
    """A free port on ``addr`` for a world of one rank, which hosts its own store there (:func:`free_port`); a
    ValueError naming MASTER_ADDR (or, ``derived_from`` given, where ``addr`` came from when MASTER_ADDR is not
    set) when ``addr`` is not an address of this host, or no address at all."""
    try:
        return free_port(addr if addr != "localhost" else "127.0.0.1")
    except OSError as exc:
        what, advice = f"MASTER_ADDR={addr!r}", "unset MASTER_ADDR, or set it to an address of this host"
        if derived_from is not None:  # nobody set MASTER_ADDR: name where the address came from
            what, advice = f"{addr!r} ({derived_from}; MASTER_ADDR is not set)", "set MASTER_ADDR to an address of this host"
        raise ValueError(f"{launcher}: {what} is not an address of this host ({exc}), and this one rank would host "
                         f"its own rendezvous store there: {advice}") from None


def _master_port(env: Mapping[str, str]) -> int:
    """MASTER_PORT (set), checked to be a TCP port: every launcher's, a lone process's included."""
    port = _int_var(env, "MASTER_PORT")
    if not 0 < port < 65536:
        raise ValueError(f"MASTER_PORT={port} is not a TCP port")
    return port


def _master(env: Mapping[str, str], launcher: str, rank: int, world_size: int, local_size: int | None,
            local_size_name: str) -> tuple[str, int]:
    addr = env.get("MASTER_ADDR")
    if not addr:
        if launcher == "slurm" and (env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")):
            addr = _slurm_master_host(env, rank)
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
        return addr, _master_port(env)
    if world_size == 1:
        derived = None if env.get("MASTER_ADDR") else (
            "derived from the Slurm node list" if launcher == "slurm" else "derived: every rank runs on this node")
        return addr, _own_free_port(addr, launcher, derived)
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
        port = _master_port(env) if env.get("MASTER_PORT") else _own_free_port(addr, "single")
        return LaunchInfo("single", 0, 1, 0, 1, addr, port)

    rank_var, size_var, local_var, local_size_var = _VARS[launcher]
    world_var = size_var
    if launcher == "slurm" and not env.get("SLURM_STEP_NUM_TASKS"):
        # The batch script's own step (sbatch, or a salloc shell): SLURM_PROCID=0 and the job's SLURM_NTASKS, but
        # no process started here is one of those tasks (the others would wait out the deadline for them). srun
        # sets SLURM_STEP_NUM_TASKS (and SLURM_STEP_ID) in every task it starts.
        job_tasks = (f" (SLURM_NTASKS={env['SLURM_NTASKS']!r} counts the job's tasks, not the processes started here)"
                     if env.get("SLURM_NTASKS") else "")
        raise ValueError(
            f"slurm: SLURM_PROCID={env['SLURM_PROCID']!r} is set but SLURM_STEP_NUM_TASKS is not: this is the batch "
            f"script (or salloc shell) itself, not a task of an srun step{job_tasks}; launch with srun "
            f"(launch/srun_pd.sh) or another launcher")
    if launcher == "openmpi":
        _stale_openmpi(env)
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
        nodes = slurm_node_count(env)
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

    addr, port = _master(env, launcher, rank, world_size, local_size, size_name)
    store_hosted = launcher == "torchrun" and env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    # torchrun numbers its attempts (elastic restarts); its agent store keeps the earlier attempts' keys.
    attempt = _int_var(env, "TORCHELASTIC_RESTART_COUNT") if launcher == "torchrun" and env.get(
        "TORCHELASTIC_RESTART_COUNT") else 0
    # Only a Slurm task owns its GPUs: under torchrun or mpiexec inside a job, the
    # processes of one task would share them.
    gpus_per_task = _slurm_gpus_per_task(env) if launcher == "slurm" else None
    step_id = _slurm_step_id(env) if launcher == "slurm" else 0
    job_id = str(_int_var(env, "SLURM_JOB_ID")) if launcher == "slurm" and env.get("SLURM_JOB_ID") else None
    if launcher == "openmpi":  # every mpiexec run its own, shared by its ranks: runs on one port tell each other apart
        job_id = env.get("PMIX_NAMESPACE") or None
    if job_id is None and launcher != "slurm" and world_size > 1 and not env.get("MASTER_PORT") and env.get(
            "SLURM_JOB_ID"):
        # The port was derived from the Slurm job and step (_master): so is the identity, or a rank of a job whose
        # derived port collides (J and J+12000) would join this job's store as one of its own.
        job_id, step_id = str(_int_var(env, "SLURM_JOB_ID")), _slurm_step_id(env)
    return LaunchInfo(launcher, rank, world_size, local_rank, local_size, addr, port, store_hosted, gpus_per_task,
                      attempt, step_id, job_id)
