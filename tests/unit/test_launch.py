"""ncclkv.launch: each launcher's variables, nesting, and the errors that name them."""

from __future__ import annotations

import socket

import pytest

from ncclkv.launch import LaunchInfo, derived_master_port, discover, first_slurm_host, free_port, slurm_tasks_per_node

TORCHRUN = {
    "TORCHELASTIC_RUN_ID": "abc",
    "RANK": "5",
    "WORLD_SIZE": "8",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "4",
    "MASTER_ADDR": "node0",
    "MASTER_PORT": "29501",
}
SLURM = {
    "SLURM_PROCID": "6",
    "SLURM_NTASKS": "8",
    "SLURM_LOCALID": "2",
    "SLURM_TASKS_PER_NODE": "4(x2)",
    "SLURM_JOB_NODELIST": "gpu[07-08]",
    "SLURM_JOB_ID": "4242",
    "SLURM_STEP_NUM_TASKS": "8",  # an srun step's (the job's SLURM_NTASKS may be more)
    "SLURM_STEP_ID": "0",
}
OPENMPI = {
    "OMPI_COMM_WORLD_RANK": "3",
    "OMPI_COMM_WORLD_SIZE": "4",
    "OMPI_COMM_WORLD_LOCAL_RANK": "3",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
}
MPICH = {"PMI_RANK": "2", "PMI_SIZE": "3", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "1", "MASTER_ADDR": "h0", "MASTER_PORT": "4000"}
# Task 5 of `srun -N 2 -n 8 --mpi=pmi2` as Slurm 22.05 starts it (the variables as the real
# srun sets them in tests/launchers): PMI_RANK/PMI_SIZE, but no MPI_LOCALRANKID.
SRUN_PMI2 = {
    "PMI_RANK": "5", "PMI_SIZE": "8", "PMI_FD": "11", "PMI_JOBID": "4242.0", "SLURM_MPI_TYPE": "pmi2",
    "SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_NPROCS": "8", "SLURM_STEP_NUM_TASKS": "8",
    "SLURM_LOCALID": "1", "SLURM_NODEID": "1", "SLURM_NNODES": "2", "SLURM_STEP_NUM_NODES": "2",
    "SLURM_TASKS_PER_NODE": "4(x2)", "SLURM_STEP_TASKS_PER_NODE": "4(x2)",
    "SLURM_STEP_NODELIST": "gpu[07-08]", "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_JOB_ID": "4242",
}
# A two-node sbatch script's own variables (its step has SLURM_PROCID=0, no SLURM_STEP_*).
SBATCH_2_NODES = {"SLURM_PROCID": "0", "SLURM_NTASKS": "8", "SLURM_NNODES": "2", "SLURM_TASKS_PER_NODE": "4(x2)",
                  "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_JOB_ID": "4242", "SLURM_NODEID": "0", "SLURM_LOCALID": "0"}


def test_torchrun() -> None:
    assert discover(TORCHRUN) == LaunchInfo("torchrun", 5, 8, 1, 4, "node0", 29501)


def test_slurm_reads_nodelist_and_derives_a_shared_port() -> None:
    info = discover(SLURM)
    assert (info.launcher, info.rank, info.world_size, info.local_rank, info.local_world_size) == ("slurm", 6, 8, 2, 4)
    assert info.master_addr == "gpu07"
    # Every rank derives the same port from the job id, without talking.
    assert info.master_port == discover({**SLURM, "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}).master_port
    assert 1024 < info.master_port < 65536


def test_openmpi_single_node_defaults_to_loopback_with_port_given() -> None:
    info = discover({**OPENMPI, "MASTER_PORT": "1234"})
    assert info == LaunchInfo("openmpi", 3, 4, 3, 4, "127.0.0.1", 1234)


def test_mpich() -> None:
    assert discover(MPICH) == LaunchInfo("mpich", 2, 3, 0, 1, "h0", 4000)


def test_srun_pmi2_is_slurm_with_its_local_rank_and_first_node() -> None:
    """PMI_RANK alone made this "mpich" with no local information: one node, MASTER_ADDR 127.0.0.1."""
    assert discover(SRUN_PMI2) == LaunchInfo("slurm", 5, 8, 1, 4, "gpu07", derived_master_port(4242), job_id="4242")


def test_hydra_inside_sbatch_stays_mpich() -> None:
    # Hydra's ranks inherit the batch step's Slurm variables; MPI_LOCALRANKID says Hydra started them.
    hydra = {**SBATCH_2_NODES, "PMI_RANK": "0", "PMI_SIZE": "8", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "4",
             "MASTER_ADDR": "gpu07", "MASTER_PORT": "4000"}
    assert discover(hydra) == LaunchInfo("mpich", 0, 8, 0, 4, "gpu07", 4000)
    assert discover({**hydra, "PMI_RANK": "3", "MPI_LOCALRANKID": "3"}).launcher == "mpich"
    # Hydra inside an srun step whose task number and size happen to match: MPI_LOCALRANKID decides.
    step = {**SRUN_PMI2, "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "4", "MASTER_ADDR": "gpu07", "MASTER_PORT": "4000"}
    assert discover(step) == LaunchInfo("mpich", 5, 8, 1, 4, "gpu07", 4000)


@pytest.mark.parametrize(
    ("env", "names"),
    [
        # A PMI launcher without local ranks under a Slurm job of two nodes (SLURM_PROCID is not this rank's).
        ({**SBATCH_2_NODES, "PMI_RANK": "3", "PMI_SIZE": "8", "MASTER_ADDR": "h0", "MASTER_PORT": "1"},
         ["mpich: MPI_LOCALRANKID is not set", "SLURM_NNODES=2", "all 8 ranks"]),
        ({**SRUN_PMI2, "PMI_RANK": "4"}, ["MPI_LOCALRANKID", "SLURM_STEP_NUM_NODES=2"]),  # not the task's own rank
        # Rank 0 matches the batch step's SLURM_PROCID=0 and SLURM_NTASKS=8, but that is no srun step.
        ({**SBATCH_2_NODES, "PMI_RANK": "0", "PMI_SIZE": "8", "MASTER_ADDR": "h0", "MASTER_PORT": "1"},
         ["mpich: MPI_LOCALRANKID is not set", "SLURM_NNODES=2"]),
        # Plain RANK/WORLD_SIZE inside a two-node srun step, with the step's own SLURM_PROCID as srun sets it.
        ({"RANK": "1", "WORLD_SIZE": "4", "MASTER_ADDR": "h0", "MASTER_PORT": "1", "SLURM_PROCID": "0",
          "SLURM_NTASKS": "2", "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_NUM_NODES": "2", "SLURM_NNODES": "3"},
         ["env: LOCAL_RANK is not set", "SLURM_STEP_NUM_NODES=2", "LOCAL_WORLD_SIZE"]),
        # ... and inside a two-node batch script (SLURM_PROCID=0, the job's SLURM_NNODES).
        ({**SBATCH_2_NODES, "RANK": "3", "WORLD_SIZE": "8", "MASTER_ADDR": "h0", "MASTER_PORT": "1"},
         ["env: LOCAL_RANK is not set", "SLURM_NNODES=2"]),
    ],
)
def test_no_local_info_in_a_multi_node_slurm_job_is_refused(env: dict[str, str], names: list[str]) -> None:
    with pytest.raises(ValueError) as err:
        discover(env)
    for name in names:
        assert name in str(err.value)


def test_no_local_info_in_a_one_node_slurm_job_is_one_node() -> None:
    # `srun --pty bash` (one task: SLURM_PROCID=0) or a one-node batch script, then RANK/WORLD_SIZE by hand.
    env = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_PORT": "5555", "SLURM_NNODES": "1", "SLURM_PROCID": "0",
           "SLURM_NTASKS": "1", "SLURM_STEP_NUM_TASKS": "1", "SLURM_STEP_NUM_NODES": "1", "SLURM_LOCALID": "0",
           "SLURM_JOB_NODELIST": "gpu07", "SLURM_JOB_ID": "4242"}
    assert discover(env) == LaunchInfo("env", 1, 2, 1, 2, "127.0.0.1", 5555)


@pytest.mark.parametrize("slurm", [SBATCH_2_NODES, SRUN_PMI2 | {"PMI_RANK": "0", "PMI_SIZE": "1"}],
                         ids=["sbatch-script", "srun-pmi2"])
def test_plain_rank_and_world_size_win_over_the_slurm_job_around_them(slurm: dict[str, str]) -> None:
    """Slurm never sets RANK/WORLD_SIZE: a process given both inside a batch script, or a task without a step id,
    was placed by them. In a step with its id, only values that agree with the task's own are taken (those are
    a container hook's copies: tests/unit/test_launch_clusters.py), others refused (the test below)."""
    slurm = {k: v for k, v in slurm.items() if not k.startswith("PMI_")}
    env = {**slurm, "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "4",
           "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "5555"}
    assert discover(env) == LaunchInfo("env", 3, 4, 3, 4, "10.0.0.1", 5555)
    if "SLURM_STEP_NUM_TASKS" in slurm:  # an srun task: RANK alone is no launch, Slurm's variables place it
        assert discover({**slurm, "RANK": "3"}).launcher == "slurm"
    else:  # the batch script itself: nothing places it
        with pytest.raises(ValueError, match=r"this is the batch script .* launch with srun"):
            discover({**slurm, "RANK": "3"})


def test_rank_and_world_size_that_disagree_with_the_srun_step_are_refused() -> None:
    env = {**SLURM, "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "4",
           "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "5555"}
    with pytest.raises(ValueError, match=r"RANK=3 WORLD_SIZE=4 disagree with this srun step's SLURM_PROCID=6 "
                                         r"SLURM_STEP_NUM_TASKS=8"):
        discover(env)


def test_torchrun_attempt_comes_from_the_restart_count() -> None:
    """An elastic restart's rendezvous keys must differ from the previous attempt's (same agent store)."""
    assert discover(TORCHRUN).attempt == 0
    assert discover({**TORCHRUN, "TORCHELASTIC_RESTART_COUNT": "0"}).attempt == 0
    assert discover({**TORCHRUN, "TORCHELASTIC_RESTART_COUNT": "2"}).attempt == 2
    # Only torchrun restarts: another launcher's processes inherit a stray count from an outer torchrun's agent.
    assert discover({**OPENMPI, "MASTER_PORT": "1", "TORCHELASTIC_RESTART_COUNT": "2"}).attempt == 0
    assert discover({"RANK": "0", "WORLD_SIZE": "1", "TORCHELASTIC_RESTART_COUNT": "1"}).attempt == 0
    assert discover({}).attempt == 0
    with pytest.raises(ValueError, match=r"TORCHELASTIC_RESTART_COUNT='x' is not an integer"):
        discover({**TORCHRUN, "TORCHELASTIC_RESTART_COUNT": "x"})


def test_a_local_rank_without_the_node_size_names_the_missing_size() -> None:
    """Not "spans several nodes": with LOCAL_RANK and no LOCAL_WORLD_SIZE, nothing says where the ranks are."""
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_PORT": "5555"}
    with pytest.raises(ValueError) as err:
        discover(env)
    text = str(err.value)
    assert "LOCAL_WORLD_SIZE is not set" in text and "LOCAL_WORLD_SIZE=2" in text and "MASTER_ADDR" in text, text
    assert "spans several nodes" not in text, text
    assert discover({**env, "LOCAL_WORLD_SIZE": "2"}) == LaunchInfo("env", 1, 2, 1, 2, "127.0.0.1", 5555)
    assert discover({**env, "MASTER_ADDR": "h0"}) == LaunchInfo("env", 1, 2, 1, None, "h0", 5555)
    # A node size that says the job spans nodes still says so.
    with pytest.raises(ValueError, match=r"spans several nodes \(LOCAL_WORLD_SIZE=1\) and MASTER_ADDR is not set"):
        discover({**env, "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"})


@pytest.mark.parametrize(
    ("text", "counts"),
    [("4", [4]), ("4(x2)", [4, 4]), ("4,2", [4, 2]), ("2(x3),1", [2, 2, 2, 1]), ("1, 3(x2)", [1, 3, 3])],
)
def test_slurm_tasks_per_node_expands_the_compressed_list(text: str, counts: list[int]) -> None:
    assert slurm_tasks_per_node(text) == counts


@pytest.mark.parametrize("text", ["", "4(2)", "x4", "4(x2", "4,,2", "four"])
def test_slurm_tasks_per_node_names_a_malformed_list(text: str) -> None:
    with pytest.raises(ValueError, match=r"cannot read tasks per node from"):
        slurm_tasks_per_node(text)


@pytest.mark.parametrize(
    ("tasks_per_node", "node_id", "nodes", "local_size"),
    [
        ("4,2", "1", "2", 2),  # uneven: this node's own count
        ("4,2", "0", "2", 4),
        ("2(x3),1", "3", "4", 1),
        ("2(x3),1", "1", "4", 2),
        ("4,2", "1", "3", None),  # the list does not cover the step's nodes: cannot tell which is this one
        ("4(x2)", "1", "5", 4),  # every node alike: no need to know which
    ],
)
def test_slurm_local_size_of_uneven_steps(tasks_per_node: str, node_id: str, nodes: str, local_size: int | None) -> None:
    env = {**SLURM, "SLURM_PROCID": "5", "SLURM_LOCALID": "0", "SLURM_STEP_TASKS_PER_NODE": tasks_per_node,
           "SLURM_NODEID": node_id, "SLURM_STEP_NUM_NODES": nodes}
    assert discover(env).local_world_size == local_size


@pytest.mark.parametrize(
    ("extra", "gpus"),
    [
        ({}, None),
        ({"SLURMD_TRES_BIND": "gpu:per_task:1"}, 1),  # srun --gpus-per-task=1 (Slurm 22.05, as tests/launchers sees it)
        ({"SLURMD_TRES_BIND": "gres/gpu:per_task:2"}, 2),  # later Slurm's spelling
        ({"SLURMD_TRES_BIND": "gpu:verbose,per_task:1"}, 1),
        ({"SLURMD_TRES_BIND": "gpu:none", "SLURM_GPUS_PER_TASK": "1"}, None),  # --gpu-bind=none: tasks share
        ({"SLURMD_TRES_BIND": "gpu:closest"}, None),
        ({"SLURM_GPUS_PER_TASK": "1"}, 1),  # sbatch --gpus-per-task, no binding recorded
        ({"SLURM_GPUS_PER_TASK": "a100:2"}, 2),
    ],
)
def test_slurm_records_gpus_bound_per_task(extra: dict[str, str], gpus: int | None) -> None:
    assert discover({**SLURM, **extra}).gpus_per_task == gpus


def test_gpus_per_task_is_slurms_alone() -> None:
    # torchrun's workers inside one task share that task's GPUs.
    assert discover({**SLURM, "SLURMD_TRES_BIND": "gpu:per_task:1", **TORCHRUN}).gpus_per_task is None


def test_plain_env_without_local_info_is_one_node() -> None:
    info = discover({"RANK": "1", "WORLD_SIZE": "2", "MASTER_PORT": "5555"})
    assert info == LaunchInfo("env", 1, 2, 1, 2, "127.0.0.1", 5555)


def test_single_process_picks_a_free_port() -> None:
    info = discover({})
    assert (info.launcher, info.rank, info.world_size, info.local_rank) == ("single", 0, 1, 0)
    with socket.socket() as sock:  # the port is bindable: it really was free
        sock.bind(("127.0.0.1", info.master_port))


@pytest.mark.parametrize("env", [
    {"MASTER_ADDR": "192.0.2.7"},  # TEST-NET-1: no host's own address
    {"MASTER_ADDR": "no-such-host.invalid"},
])
def test_one_rank_on_a_master_addr_not_of_this_host_is_named(env: dict[str, str]) -> None:
    """The free port it hosts its own store on was taken there: OSError [Errno 99] or socket.gaierror, not a
    ValueError (python -m ncclkv.scenario: a traceback and exit 1 instead of a usage error)."""
    with pytest.raises(ValueError, match=r"MASTER_ADDR='(192\.0\.2\.7|no-such-host\.invalid)' is not an "
                                         r"address of this host .*unset MASTER_ADDR"):
        discover(env)


def test_one_rank_on_a_derived_master_addr_not_of_this_host_names_where_it_came_from() -> None:
    """srun -n 1 on a node name with no address, MASTER_ADDR not set: the address is the step's first node. The
    error said MASTER_ADDR='no-such-host.invalid' and 'unset MASTER_ADDR', a variable nobody set."""
    env = {"SLURM_PROCID": "0", "SLURM_STEP_ID": "3", "SLURM_STEP_NUM_TASKS": "1", "SLURM_LOCALID": "0",
           "SLURM_STEP_NODELIST": "no-such-host.invalid", "SLURM_JOB_ID": "7"}
    with pytest.raises(ValueError) as err:
        discover(env)
    text = str(err.value)
    assert "'no-such-host.invalid' (derived from the Slurm node list; MASTER_ADDR is not set) is not an address " \
           "of this host" in text, text
    assert "unset MASTER_ADDR" not in text and "set MASTER_ADDR to an address of this host" in text, text


def test_innermost_launcher_wins() -> None:
    # torchrun inside an srun step: torchrun's per-process rank is the one that counts.
    assert discover({**SLURM, **TORCHRUN}).launcher == "torchrun"
    # mpiexec inside an sbatch script: the batch step's SLURM_PROCID=0 is not this rank.
    nested = {**SBATCH_2_NODES, **OPENMPI, "MASTER_PORT": "1"}
    assert discover(nested).launcher == "openmpi"
    assert discover(nested).rank == 3


@pytest.mark.parametrize(
    ("env", "names"),
    [
        ({"RANK": "0"}, ["WORLD_SIZE"]),
        ({"OMPI_COMM_WORLD_RANK": "0"}, ["OMPI_COMM_WORLD_SIZE"]),
        ({**TORCHRUN, "RANK": "8"}, ["RANK=8", "WORLD_SIZE=8"]),
        ({**TORCHRUN, "LOCAL_RANK": "4"}, ["LOCAL_RANK=4", "4"]),
        ({k: v for k, v in TORCHRUN.items() if k != "LOCAL_RANK"}, ["LOCAL_RANK"]),
        ({**TORCHRUN, "WORLD_SIZE": "eight"}, ["WORLD_SIZE='eight'"]),
        ({**TORCHRUN, "MASTER_PORT": "70000"}, ["MASTER_PORT=70000"]),
        # No launcher (one process): its MASTER_PORT was taken as given, 70000 and 0 included.
        ({"MASTER_PORT": "70000"}, ["MASTER_PORT=70000", "not a TCP port"]),
        ({"MASTER_PORT": "0"}, ["MASTER_PORT=0", "not a TCP port"]),
        ({**OPENMPI, "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1"}, ["MASTER_ADDR"]),
        ({"RANK": "0", "WORLD_SIZE": "2"}, ["MASTER_PORT"]),
        ({**MPICH, "MPI_LOCALRANKID": "3", "MPI_LOCALNRANKS": "5"}, ["local size 5", "PMI_SIZE=3"]),
        ({**SLURM, "SLURM_PROCID": "-1"}, ["SLURM_PROCID='-1'"]),
        ({**SLURM, "SLURM_TASKS_PER_NODE": "4(2)"}, ["SLURM_TASKS_PER_NODE", "'4(2)'"]),
        ({**SLURM, "SLURM_TASKS_PER_NODE": "4,4,2", "SLURM_NNODES": "3", "SLURM_NODEID": "3"},
         ["SLURM_NODEID=3", "'4,4,2'"]),
        ({**SLURM, "SLURM_GPUS_PER_TASK": "lots"}, ["SLURM_GPUS_PER_TASK='lots'"]),
    ],
)
def test_missing_or_conflicting_values_are_named(env: dict[str, str], names: list[str]) -> None:
    with pytest.raises(ValueError) as err:
        discover(env)
    for name in names:
        assert name in str(err.value)


@pytest.mark.parametrize(
    ("nodelist", "host"),
    [("n1", "n1"), ("gpu[03-05,9],cpu1", "gpu03"), ("a-b[1,2]", "a-b1"), ("x01,x02", "x01")],
)
def test_first_slurm_host(nodelist: str, host: str) -> None:
    assert first_slurm_host(nodelist) == host


def test_free_port_is_bindable() -> None:
    port = free_port()
    assert isinstance(port, int) and 1 <= port <= 65535, port  # 0 would bind anywhere: no port at all
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))
        assert sock.getsockname()[1] == port
