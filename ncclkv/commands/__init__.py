"""Subcommands of the ``ncclkv`` console script, one module each.

Each module defines ``add_parser(subparsers)`` and ``run(args) -> int``.
"""

__all__: list[str] = []
