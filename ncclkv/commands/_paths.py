"""A folder a subcommand writes into, checked before any work: a bad one is a usage error naming its flag."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["writable_dir"]


def writable_dir(flag: str, path: Path, folder: Path | None = None) -> Path:
    """Make ``folder`` (default: ``path`` itself) if it is missing and check that it can be written into;
    ValueError naming ``flag`` and ``path`` when not (the CLI's usage error, exit 2). Returns it resolved."""
    folder = path if folder is None else folder
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ValueError(f"{flag} {path}: cannot create {err.filename or folder} ({err.strerror or err})") from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {path}: cannot write into {folder}")
    return folder.resolve()
