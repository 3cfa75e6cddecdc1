"""Prefill ranks stream KV to decode ranks through the transfer engine, on every rank of an MPI job.

The set is cut from however many ranks mpiexec started (one body, any rank
count from 2 up; at 4 ranks the first case is 2P2D): the first half of the
ranks prefill, the rest decode. Each decode rank checks every landed byte
against the producer's deterministic KV (``ScenarioError`` otherwise); mpi4py
is the referee that adds up the decode ranks' bytes and compares them with
what the requests hold. Only rank 0's report is shown (tests/mpi/_rank_wrapper.py).

``test_rank_killed_mid_transfer_...`` runs only when ``NCCLKV_MPI_KILL_RANK``
names a prefill rank (tests/launchers/test_mpi.py sets it): that rank dies
with ``os._exit(9)`` after its first pushed layer, and every survivor must end
with a typed error well before mpiexec's timeout.
"""

from __future__ import annotations

import os
import time
from typing import Any

import pytest
import torch
from mpi4py import MPI

from ncclkv.errors import NcclKVError
from ncclkv.launch import LaunchInfo
from ncclkv.layout import KVGeometry, ParallelLayout
from ncclkv.scenario import PDTopology
from ncclkv.scenario._transfer import TransferConfig, pair_of, transfer_on_rank

pytestmark = pytest.mark.mpi

DEADLINE_S = 30.0  # busy, oversubscribed cores; a hang still ends well before mpiexec's --timeout
KILL_DEADLINE_S = 8.0  # the killed-rank case: survivors must notice within about this
KILL_RANK_VAR = "NCCLKV_MPI_KILL_RANK"
TOKENS = (80, 37, 64, 17, 96, 33)  # partial last blocks on both sides (blocks of 16 and 32)
CPU = torch.device("cpu")


def split_in_two(size: int) -> tuple[int, int]:
    """(prefill ranks, decode ranks) of a job of ``size`` ranks: the first half prefills."""
    if size < 2:
        pytest.skip(f"a prefill/decode set needs two ranks, mpiexec started {size}")
    prefill = size // 2
    return prefill, size - prefill


def instances(size: int) -> PDTopology:
    """Every rank an instance of its own (TP=PP=1): 2P2D at four ranks, 1P2D at three."""
    prefill, decode = split_in_two(size)
    one = ParallelLayout(1, 1)
    return PDTopology(prefill, one, decode, one)


def tp_to_pp(size: int) -> PDTopology:
    """One prefill instance sharded by heads across its ranks, one decode instance sharded by layers."""
    prefill, decode = split_in_two(size)
    return PDTopology(1, ParallelLayout(prefill, 1), 1, ParallelLayout(1, decode))


def geometry_for(topology: PDTopology) -> KVGeometry:
    """Heads a multiple of every TP size and layers a multiple of every PP size, so no shard is replicated."""
    tp = max(topology.prefill.tp_size, topology.decode.tp_size)
    pp = max(topology.prefill.pp_size, topology.decode.pp_size)
    return KVGeometry(num_layers=2 * pp, num_kv_heads=2 * tp, head_size=32, dtype="bfloat16")


def request_bytes(cfg: TransferConfig) -> int:
    """What every request's KV holds in all: K and V for each token, layer and head."""
    g = cfg.geometry
    return sum(cfg.tokens) * g.num_layers * g.num_kv_heads * g.head_size * 2 * torch.finfo(torch.bfloat16).bits // 8


@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize("shape", [instances, tp_to_pp], ids=["instances", "tp-to-pp"])
def test_transfer_is_byte_exact_on_every_decode_rank(comm: Any, launch_info: LaunchInfo, shape: Any,
                                                     mode: str) -> None:
    topology: PDTopology = shape(comm.size)
    cfg = TransferConfig(geometry_for(topology), TOKENS, mode, DEADLINE_S)
    topology.prefill.check(cfg.geometry)
    topology.decode.check(cfg.geometry)
    results = transfer_on_rank(launch_info, topology, cfg, CPU, None)  # check_landed ran on every decode rank

    place = topology.place(comm.rank)
    assert [row["place"] for row in results] == [str(topology.place(rank)) for rank in range(comm.size)]
    received = results[comm.rank]["bytes"] if place.role == "decode" else 0
    # The referee: the decode ranks together received exactly the requests' KV, once.
    assert comm.allreduce(received, op=MPI.SUM) == request_bytes(cfg), (topology, results)
    # Every rank of an instance served that instance's requests: all of them, across the instances.
    for rank, row in enumerate(results):
        where = topology.place(rank)
        side = 0 if where.role == "prefill" else 1
        assert row["requests"] == sum(pair_of(i, topology)[side] == where.instance for i in range(len(TOKENS))), row
    comm.Barrier()


def test_rank_killed_mid_transfer_is_reported_by_every_survivor(comm: Any, launch_info: LaunchInfo) -> None:
    """Needs NCCLKV_MPI_KILL_RANK (a prefill rank other than 0) and mpiexec started with
    ``--runtime-options error-nonzero-status=false,recoverable``, so that the survivors get to report
    and their MPI_Finalize does not wait for the dead rank."""
    victim = os.environ.get(KILL_RANK_VAR)
    if victim is None:
        pytest.skip(f"kills a rank; set {KILL_RANK_VAR} to run it (tests/launchers/test_mpi.py does)")
    topology = instances(comm.size)
    if not 0 < int(victim) < topology.num_prefill:
        raise ValueError(f"{KILL_RANK_VAR}={victim} must be a prefill rank other than 0 (of "
                         f"{topology.num_prefill}): rank 0 reports and hosts the rendezvous store")
    # Made before the death: the survivors' own communicator never waits for the dead rank.
    survivors = comm.Split(0 if comm.rank != int(victim) else MPI.UNDEFINED, comm.rank)
    cfg = TransferConfig(geometry_for(topology), TOKENS, "push", KILL_DEADLINE_S, kill_rank=int(victim))
    started = time.monotonic()
    try:
        transfer_on_rank(launch_info, topology, cfg, CPU, None)  # the victim never returns from here
        outcome = "finished"
    except NcclKVError as exc:
        outcome = type(exc).__name__
        print(f"rank {comm.rank} ({topology.place(comm.rank)}): {outcome} after "
              f"{time.monotonic() - started:.1f} s: {exc}")
    outcomes = survivors.gather((comm.rank, outcome), root=0)
    if survivors.rank == 0:
        by_rank = dict(outcomes)
        assert sorted(by_rank) == [rank for rank in range(comm.size) if rank != int(victim)], by_rank
        typed = {"TransferError", "TransferTimeout", "PeerLostError", "ClosedError"}
        assert all(outcome in typed for outcome in by_rank.values()), by_rank
    survivors.Free()
