"""``python -m ncclkv.scenario --kind NAME [options]``: run one rank of a scenario under any launcher."""

from __future__ import annotations

import argparse
import gc
import os
import sys
from collections.abc import Sequence
from typing import Any

from .._env import env_settings, take_bind_host_auto
from .._signals import unblock_stop_signals
from ..errors import ClosedError, PeerLostError, TransferError
from ..launch import LaunchInfo, discover
from ._common import add_common_arguments, checked_topology
from ._registry import (
    EXIT_CHECK_FAILED, EXIT_OK, EXIT_PEER_FAILURE, EXIT_USAGE, SCENARIOS, ScenarioError, ScenarioModule, load_scenario,
    report,
)
from ._rendezvous import ForeignStoreError

__all__ = ["build_parser", "main"]

# Errors that mean "a peer (or the link to it) failed", not "this rank is wrong".
PEER_FAILURES = (PeerLostError, TransferError, ClosedError)


def build_parser(kind: str | None) -> argparse.ArgumentParser:
    """The full parser: common options, plus those of ``kind`` when known."""
    kinds = "\n".join(f"  {name}" for name in sorted(SCENARIOS))
    parser = argparse.ArgumentParser(
        prog="python -m ncclkv.scenario",
        description=f"Run this rank's part of a scenario. Kinds:\n{kinds}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--kind", required=True, choices=sorted(SCENARIOS), help="which scenario")
    add_common_arguments(parser)
    if kind in SCENARIOS:
        module = load_scenario(kind)
        module.add_arguments(parser)
        parser.description = f"--kind {kind}: {module.HELP}"
    return parser


def _checked_run(parser: argparse.ArgumentParser, args: argparse.Namespace,
                 module: ScenarioModule) -> tuple[LaunchInfo, Any]:
    """The launcher's view and the scenario's checked run; exit 2 (a usage error, like argparse's own) naming the
    values when the launcher variables, an NCCLKV_* value, the P/D options or the kind's options are wrong."""
    try:
        info = discover()
        settings = env_settings()  # checks every NCCLKV_* value, before anything connects (--deadline given or not)
        if args.deadline is None:
            args.deadline = settings.deadline_s
        checked_topology(args, info)  # every kind's P/D options, whatever the kind makes of them
        return info, module.check(args, info)
    except ValueError as exc:
        parser.error(str(exc))  # prints usage and the message naming the values, exits 2


def main(argv: Sequence[str] | None = None) -> int:
    # --bind-host's default becomes auto, resolved for this rank (resolve_bind_host)
    bind_host_auto = take_bind_host_auto(os.environ)
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--kind")
    known, _ = pre.parse_known_args(argv)
    parser = build_parser(known.kind)
    args = parser.parse_args(argv)
    if args.bind_host is None and bind_host_auto:
        args.bind_host = "auto"
    module = load_scenario(args.kind)
    info, checked = _checked_run(parser, args, module)
    try:
        module.run(info, checked)
    except ForeignStoreError as exc:  # MASTER_ADDR:MASTER_PORT is another job's: the set-up is wrong, not a peer
        report(f"rank {info.rank}: rendezvous refused: {exc}", sys.stderr)
        return EXIT_USAGE
    except PEER_FAILURES as exc:
        report(f"rank {info.rank}: peer failure detected: {type(exc).__name__}: {exc}", sys.stderr)
        return EXIT_PEER_FAILURE
    except ScenarioError as exc:
        report(f"rank {info.rank}: check failed: {exc}", sys.stderr)
        return EXIT_CHECK_FAILED
    return EXIT_OK


if __name__ == "__main__":
    # run_local starts the ranks with SIGINT and SIGTERM blocked (signals_deferred), a mask kept across exec.
    unblock_stop_signals()
    # The heap of the imports (torch: about 174K tracked objects) is never garbage: out of the cyclic GC's full
    # collections, which otherwise stop every thread for about 50 ms each (bench transfer's analysis).
    gc.freeze()
    sys.exit(main())
