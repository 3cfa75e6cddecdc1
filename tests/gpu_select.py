"""pytest plugin: tests marked ``gpu(n)`` run where torch sees at least n GPUs and are deselected elsewhere.

Deselected, not skipped: a machine without GPUs lacks nothing the README's
test command could set up (see tests/strict_skips.py), but the run still says
how many GPU tests it left out and why, at the end of its summary.

A machine whose ``nvidia-smi -L`` lists GPUs while torch sees none (a CPU-only
torch, a broken driver or CUDA set-up) is not such a machine: its GPU tests are
kept and each fails, naming both counts. GPUs hidden on purpose
(``CUDA_VISIBLE_DEVICES`` empty or -1) are deselected as on a machine without.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from typing import Any

import pytest
import torch

__all__ = ["gpus_needed"]

_KEY = pytest.StashKey[dict[int, int]]()  # GPUs needed -> tests deselected
_BROKEN = pytest.StashKey[str]()  # why torch sees none of the GPUs this machine has
_SMI_TIMEOUT_S = 60.0


def gpus_needed(item: pytest.Item) -> int | None:
    marker = item.get_closest_marker("gpu")
    if marker is None:
        return None
    return int(marker.args[0]) if marker.args else 1


def _gpus_seen() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _gpus_listed() -> int:
    """The GPUs ``nvidia-smi -L`` lists; 0 without nvidia-smi, or where it fails (no driver, no GPU)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return 0
    try:
        done = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=_SMI_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(line.startswith("GPU ") for line in done.stdout.splitlines()) if done.returncode == 0 else 0


def _hidden_on_purpose() -> bool:
    return os.environ.get("CUDA_VISIBLE_DEVICES", "x").strip() in ("", "-1")


def _unseen_gpus() -> str | None:
    """Why torch sees no GPU on a machine that has some, or None (torch sees them, or there are none)."""
    listed = _gpus_listed()
    if listed == 0 or _hidden_on_purpose():
        return None
    return (f"nvidia-smi -L lists {listed} GPU(s) but torch {torch.__version__} (CUDA {torch.version.cuda}) sees "
            f"none (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}): a broken GPU set-up")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    seen = _gpus_seen()
    if seen == 0 and any((gpus_needed(item) or 0) > 0 for item in items):
        broken = _unseen_gpus()
        if broken is not None:  # keep every GPU test: each fails (pytest_runtest_setup), none is left out
            config.stash[_BROKEN] = broken
            config.stash[_KEY] = {}
            return
    keep, drop = [], []
    left_out: dict[int, int] = {}
    for item in items:
        need = gpus_needed(item)
        if need is None or need <= seen:
            keep.append(item)
        else:
            drop.append(item)
            left_out[need] = left_out.get(need, 0) + 1
    config.stash[_KEY] = left_out
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def pytest_runtest_setup(item: pytest.Item) -> None:
    broken = item.config.stash.get(_BROKEN, None)
    if broken is not None and (gpus_needed(item) or 0) > 0:
        pytest.fail(broken, pytrace=False)


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    broken = config.stash.get(_BROKEN, None)
    if broken is not None:
        terminalreporter.line(f"GPU tests failed unrun: {broken}", red=True, bold=True)
    left_out = config.stash.get(_KEY, {})
    for need, count in sorted(left_out.items()):
        terminalreporter.line(f"{count} GPU test(s) deselected: they need {need} GPU(s), torch sees {_gpus_seen()}")
