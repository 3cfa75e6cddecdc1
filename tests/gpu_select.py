"""pytest plugin: tests marked ``gpu(n)`` run where torch sees at least n GPUs and are deselected elsewhere.

Deselected, not skipped: a machine without GPUs lacks nothing the README's
test command could set up (see tests/strict_skips.py), but the run still says
how many GPU tests it left out and why, at the end of its summary.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

__all__ = ["gpus_needed"]

_KEY = pytest.StashKey[dict[int, int]]()  # GPUs needed -> tests deselected


def gpus_needed(item: pytest.Item) -> int | None:
    marker = item.get_closest_marker("gpu")
    if marker is None:
        return None
    return int(marker.args[0]) if marker.args else 1


def _gpus_seen() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    seen = _gpus_seen()
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


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    left_out = config.stash.get(_KEY, {})
    for need, count in sorted(left_out.items()):
        terminalreporter.line(f"{count} GPU test(s) deselected: they need {need} GPU(s), torch sees {_gpus_seen()}")
