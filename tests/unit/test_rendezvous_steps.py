"""Two Slurm steps of one job: ports and rendezvous keys of their own, and a clear error for a port in use.

Two P/D sets started in one allocation (two ``launch/srun_pd.sh`` in one sbatch
script) derived one MASTER_PORT from the job id: the second step's rank 0 could
not bind it (reported as a peer failure), and its other ranks joined the first
step's store under the same keys, which broke the running transfer.
"""

from __future__ import annotations

import socket
import threading
from datetime import timedelta

import pytest
import torch.distributed as dist

from ncclkv.errors import HandshakeError, TransferTimeout
from ncclkv.launch import LaunchInfo, derived_master_port, discover, free_port
from ncclkv.scenario._rendezvous import StoreRendezvous

WAIT_S = 30.0
# An srun step's variables (two tasks on one node), as test_launch's SRUN_PMI2 but a step of its own.
SRUN_STEP = {
    "SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_STEP_NUM_TASKS": "2", "SLURM_LOCALID": "1", "SLURM_NODEID": "0",
    "SLURM_NNODES": "1", "SLURM_STEP_NUM_NODES": "1", "SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_TASKS_PER_NODE": "2",
    "SLURM_STEP_NODELIST": "gpu07", "SLURM_JOB_NODELIST": "gpu07", "SLURM_JOB_ID": "4242",
}


def test_steps_of_one_job_derive_ports_of_their_own() -> None:
    ports = {derived_master_port(4242, step) for step in range(64)}
    assert len(ports) == 64 and all(20000 <= port < 32000 for port in ports)
    assert derived_master_port(4242) == derived_master_port(4242, 0)  # a batch script's own step: 0
    assert derived_master_port(4243, 0) != derived_master_port(4242, 0)


def test_discover_takes_the_step_id_into_the_port_and_launch_info() -> None:
    step0, step1 = discover({**SRUN_STEP, "SLURM_STEP_ID": "0"}), discover({**SRUN_STEP, "SLURM_STEP_ID": "1"})
    assert (step0.step_id, step1.step_id) == (0, 1)
    assert (step0.master_port, step1.master_port) == (derived_master_port(4242, 0), derived_master_port(4242, 1))
    assert discover(SRUN_STEP).step_id == 0  # no SLURM_STEP_ID: step 0
    with pytest.raises(ValueError, match="SLURM_STEP_ID"):
        discover({**SRUN_STEP, "SLURM_STEP_ID": "batch"})
    # Given MASTER_PORT wins, the step stays in the keys (below).
    given = discover({**SRUN_STEP, "SLURM_STEP_ID": "3", "MASTER_PORT": "1234"})
    assert (given.master_port, given.step_id) == (1234, 3)


def test_two_steps_on_one_port_keep_their_keys_apart() -> None:
    """Both steps were given one MASTER_PORT: step 1's ranks meet step 0's store but read none of its keys."""
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=WAIT_S), wait_for_workers=False)

    def step_info(rank: int, step: int) -> LaunchInfo:
        return LaunchInfo("slurm", rank, 2, rank, 2, "127.0.0.1", port, store_hosted=True, step_id=step)

    results: dict[int, list[str]] = {}

    def rank_of_step0(rank: int) -> None:
        results[rank] = StoreRendezvous(step_info(rank, 0), prefix="t", deadline_s=WAIT_S).exchange(f"step0-{rank}")

    try:
        threads = [threading.Thread(target=rank_of_step0, args=(rank,)) for rank in (0, 1)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(WAIT_S)
        assert results == {0: ["step0-0", "step0-1"], 1: ["step0-0", "step0-1"]}
        alone = StoreRendezvous(step_info(1, 1), prefix="t", deadline_s=0.5)
        assert alone.prefix == "t/step1/attempt0"
        with pytest.raises(TransferTimeout, match=r"missing \['value/0'\]"):  # not step 0's value/0
            alone.exchange("step1-1")
    finally:
        del store


def test_a_hosting_rank_whose_port_is_taken_says_so_naming_the_port() -> None:
    """It read "peer failure ... lost the store: EADDRINUSE" (exit 3), as if another rank had failed."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        info = LaunchInfo("slurm", 0, 2, 0, 2, "127.0.0.1", port)
        with pytest.raises(HandshakeError, match=rf"port {port} is in use on 127\.0\.0\.1 .*export MASTER_PORT"):
            StoreRendezvous(info, prefix="t", deadline_s=5.0)
