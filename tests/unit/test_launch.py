"""ncclkv.launch: each launcher's variables, nesting, and the errors that name them."""

from __future__ import annotations

import socket

import pytest

from ncclkv.launch import LaunchInfo, discover, first_slurm_host, free_port

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
}
OPENMPI = {
    "OMPI_COMM_WORLD_RANK": "3",
    "OMPI_COMM_WORLD_SIZE": "4",
    "OMPI_COMM_WORLD_LOCAL_RANK": "3",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
}
MPICH = {"PMI_RANK": "2", "PMI_SIZE": "3", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "1", "MASTER_ADDR": "h0", "MASTER_PORT": "4000"}


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


def test_plain_env_without_local_info_is_one_node() -> None:
    info = discover({"RANK": "1", "WORLD_SIZE": "2", "MASTER_PORT": "5555"})
    assert info == LaunchInfo("env", 1, 2, 1, 2, "127.0.0.1", 5555)


def test_single_process_picks_a_free_port() -> None:
    info = discover({})
    assert (info.launcher, info.rank, info.world_size, info.local_rank) == ("single", 0, 1, 0)
    with socket.socket() as sock:  # the port is bindable: it really was free
        sock.bind(("127.0.0.1", info.master_port))


def test_innermost_launcher_wins() -> None:
    # torchrun inside an srun step: torchrun's per-process rank is the one that counts.
    assert discover({**SLURM, **TORCHRUN}).launcher == "torchrun"
    # mpiexec inside an sbatch script: the batch step's SLURM_PROCID=0 is not this rank.
    nested = {**SLURM, "SLURM_PROCID": "0", **OPENMPI, "MASTER_PORT": "1"}
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
        ({**OPENMPI, "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1"}, ["MASTER_ADDR"]),
        ({"RANK": "0", "WORLD_SIZE": "2"}, ["MASTER_PORT"]),
        ({**MPICH, "MPI_LOCALRANKID": "3", "MPI_LOCALNRANKS": "5"}, ["local size 5", "PMI_SIZE=3"]),
        ({**SLURM, "SLURM_PROCID": "-1"}, ["SLURM_PROCID='-1'"]),
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
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))
