"""The ``ncclkv`` console script: dispatches to :mod:`ncclkv.commands`."""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
from collections.abc import Sequence

__all__ = ["main"]

# Imported lazily so that `ncclkv plan` never pays for torch or vLLM.
COMMANDS = ("plan", "demo", "bench")


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ncclkv", description="KV-cache transfer between TP/PP prefill and decode engines")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        module = importlib.import_module(f"ncclkv.commands.{name}")
        module.add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    try:
        return int(args.run(args))
    except ValueError as err:
        print(f"ncclkv {args.command}: error: {err}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # The reader left (`ncclkv plan ... | head`): end as a tool killed by SIGPIPE does, without a traceback,
        # and with stdout on /dev/null so that the interpreter's flush at exit does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE


if __name__ == "__main__":
    sys.exit(main())
