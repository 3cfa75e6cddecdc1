"""Tests that run on every rank of an MPI job: ``mpiexec -n N python tests/mpi/_rank_wrapper.py -m pytest tests/mpi``.

Outside mpiexec nothing here is collected (``collect_ignore_glob``), so the
default ``pytest`` run neither imports mpi4py nor starts MPI. Under MPI a
failure on any rank prints that rank's report to its stderr and aborts every
rank with ``COMM_WORLD.Abort`` rather than leaving the others hung in a
collective; the job then exits non-zero.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from typing import Any

import pytest

UNDER_MPI = any(os.environ.get(name) for name in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE"))

if not UNDER_MPI:
    collect_ignore_glob = ["test_*.py"]
else:
    from mpi4py import MPI

    from ncclkv.launch import LaunchInfo, discover, free_port

    @pytest.fixture(scope="session")
    def comm() -> Any:
        return MPI.COMM_WORLD

    @pytest.fixture
    def launch_info(comm: Any) -> LaunchInfo:
        """discover() as this rank sees it, with a master port rank 0 picked for this test alone.

        Each test's rendezvous store then starts afresh: a rank still leaving the
        previous test's store can never meet the next test there.
        """
        port = comm.bcast(free_port() if comm.rank == 0 else None, root=0)
        return discover({**os.environ, "MASTER_PORT": str(port)})

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
        outcome = yield
        report = outcome.get_result()
        if report.failed:
            world = MPI.COMM_WORLD
            text = (f"\n===== rank {world.rank}/{world.size}: {report.nodeid} failed ({report.when}); "
                    f"aborting every rank =====\n{report.longreprtext}\n")
            sys.__stderr__.write(text)
            sys.__stderr__.flush()
            console = os.environ.get("NCCLKV_MPI_CONSOLE_FD")  # set by _rank_wrapper on ranks that log to a file
            if console:
                os.write(int(console), text.encode(errors="replace"))
            sys.stdout.flush()
            if world.size > 1:
                world.Abort(1)
