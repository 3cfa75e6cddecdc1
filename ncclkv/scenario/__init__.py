"""Scenarios that run on whatever launcher started the process: ``python -m ncclkv.scenario --kind NAME``.

Every rank finds its place with :func:`ncclkv.launch.discover` (torchrun,
srun, mpiexec or plain variables), runs its part of scenario ``NAME`` and
exits 0 on success, 3 on a typed peer failure (it prints "peer failure
detected"), 4 when the scenario's own check failed, 1 on anything else.
A kind is a module with ``HELP``, ``add_arguments(parser)`` and
``run(info, args) -> None`` (raising on failure), listed in ``SCENARIOS``.
"""

from ._registry import (
    EXIT_CHECK_FAILED,
    EXIT_OK,
    EXIT_PEER_FAILURE,
    SCENARIOS,
    ScenarioError,
    ScenarioModule,
    load_scenario,
)
from ._topology import PDTopology, RankPlace

__all__ = [
    "EXIT_CHECK_FAILED",
    "EXIT_OK",
    "EXIT_PEER_FAILURE",
    "PDTopology",
    "RankPlace",
    "SCENARIOS",
    "ScenarioError",
    "ScenarioModule",
    "load_scenario",
]
