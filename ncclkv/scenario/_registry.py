"""Scenario kinds by name, loaded on demand, and the exit codes of ``python -m ncclkv.scenario``."""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Any, Protocol, TextIO

from ..launch import LaunchInfo

__all__ = [
    "EXIT_CHECK_FAILED",
    "EXIT_OK",
    "EXIT_PEER_FAILURE",
    "EXIT_USAGE",
    "SCENARIOS",
    "ScenarioError",
    "ScenarioModule",
    "load_scenario",
    "report",
]

EXIT_OK = 0
EXIT_CHECK_FAILED = 4  # a scenario's own check failed (wrong bytes, wrong order); 2 is argparse's
EXIT_PEER_FAILURE = 3  # a typed peer/transfer error (PeerLostError, TransferError, TransferTimeout)
# argparse's own code, also for launcher variables refused before anything connects and a rendezvous store that
# belongs to another job or step (ForeignStoreError: the set-up, not a peer, is wrong)
EXIT_USAGE = 2

# kind -> module. A module is imported only when its kind runs, so a kind that
# needs more than torch (vLLM, ...) costs the others nothing.
SCENARIOS: dict[str, str] = {
    "ring": "ncclkv.scenario._ring",
    "transfer": "ncclkv.scenario._transfer",
}


def report(line: str, stream: TextIO | None = None) -> None:
    """Write one whole line in a single write: ranks share the launcher's pipe, and
    ``print`` writes text and newline apart, so lines of concurrent ranks would merge."""
    out = sys.stdout if stream is None else stream
    out.write(line + "\n")
    out.flush()


class ScenarioError(RuntimeError):
    """A scenario's check failed on this rank; the message names the rank and what differed."""


class ScenarioModule(Protocol):
    """What a scenario module provides."""

    HELP: str

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        """Add this kind's own options (the common ones are already there)."""

    def check(self, args: argparse.Namespace, info: LaunchInfo) -> Any:
        """This rank's run as the options and the launcher describe it, checked before anything connects: what
        ``run`` takes. ValueError naming the values (``__main__``: a usage error, exit 2)."""

    def run(self, info: LaunchInfo, checked: Any) -> None:
        """Run this rank's part of what ``check`` returned; return on success, raise on failure."""


def load_scenario(kind: str) -> ScenarioModule:
    """The module of scenario ``kind``; ValueError naming the known kinds otherwise."""
    try:
        module_name = SCENARIOS[kind]
    except KeyError:
        raise ValueError(f"unknown scenario kind {kind!r}; known: {', '.join(sorted(SCENARIOS))}") from None
    module = importlib.import_module(module_name)
    for name in ("HELP", "add_arguments", "check", "run"):
        if not hasattr(module, name):
            raise TypeError(f"scenario module {module_name} lacks {name}")
    return module  # type: ignore[return-value]  # checked above: it has the protocol's names
