"""The launch pieces and the data plane on every rank of an MPI job, at any number of ranks.

mpi4py is the referee: it carries the data-plane addresses and says what each
rank should see, while the bytes themselves cross ncclkv links.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from mpi4py import MPI

from ncclkv.launch import LaunchInfo
from ncclkv.scenario._rendezvous import StoreRendezvous
from ncclkv.scenario._ring import RingConfig, ring_exchange, ring_payload
from ncclkv.transport import DataPlane

pytestmark = pytest.mark.mpi

DEADLINE_S = 30.0  # busy shared cores; a hang still ends here, well before mpiexec's --timeout


def test_discover_agrees_with_mpi(comm: Any, launch_info: LaunchInfo) -> None:
    info = launch_info
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)  # the ranks of this node
    try:
        local_ranks = node.allgather(info.local_rank)
        assert (info.launcher, info.rank, info.world_size) == ("openmpi", comm.rank, comm.size)
        # Open MPI numbers local ranks in mapping order, not in global rank order.
        assert sorted(local_ranks) == list(range(node.size)), local_ranks
        assert info.local_world_size == node.size
        assert len(set(comm.allgather((info.master_addr, info.master_port)))) == 1
    finally:
        node.Free()


def test_store_rendezvous_matches_allgather(comm: Any, launch_info: LaunchInfo) -> None:
    rendezvous = StoreRendezvous(launch_info, prefix="mpi-test", deadline_s=DEADLINE_S)
    value = f"rank{comm.rank}:{os.getpid()}"
    assert rendezvous.exchange(value) == comm.allgather(value)
    rendezvous.finish()
    comm.Barrier()


def test_ring_over_data_plane_is_byte_exact(comm: Any) -> None:
    if comm.size < 2:
        pytest.skip("a ring needs two ranks")
    config = RingConfig(count=16, nbytes=64 * 1024, deadline_s=DEADLINE_S)
    with DataPlane() as plane:
        addresses = comm.allgather(plane.address)
        ring_exchange(plane, comm.rank, addresses, config, torch.device("cpu"), barrier=comm.Barrier)
        assert plane.links() == []  # both ring links closed after the barrier


def test_ring_payloads_agree_across_processes(comm: Any) -> None:
    """What a rank sends is what its right neighbour computes as expected (same seed, same header)."""
    left = (comm.rank - 1) % comm.size
    mine = ring_payload(comm.rank, 3, 4096).numpy().tobytes()
    from_left = comm.sendrecv(mine, dest=(comm.rank + 1) % comm.size, source=left)
    assert from_left == ring_payload(left, 3, 4096).numpy().tobytes()


def test_failure_on_one_rank_aborts_every_rank(comm: Any) -> None:
    """Runs only when NCCLKV_MPI_FAIL_RANK is set: that rank fails, the others wait in a barrier.

    tests/launchers/test_mpi.py runs it to show that the job ends at once with
    a non-zero exit code and the failing rank's report, instead of hanging.
    """
    fail_rank = os.environ.get("NCCLKV_MPI_FAIL_RANK")
    if fail_rank is None:
        pytest.skip("demonstration of the abort path; set NCCLKV_MPI_FAIL_RANK to run it")
    if comm.rank == int(fail_rank):
        raise AssertionError(f"deliberate failure on rank {comm.rank}")
    comm.Barrier()  # never completes: the failing rank aborts the job
