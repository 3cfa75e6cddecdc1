"""pytest plugin: a run with skipped tests fails, naming every skip.

The README's test command sets up vLLM, Slurm, MPI and torchrun itself, so a
suite that skips means a missing component, not a choice. NCCLKV_ALLOW_SKIPS=1
lets a machine without some of them run what it can.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

__all__ = ["ALLOW_SKIPS_VAR"]

ALLOW_SKIPS_VAR = "NCCLKV_ALLOW_SKIPS"


def _skips(stats: dict[str, list[Any]]) -> list[pytest.TestReport]:
    return [r for r in stats.get("skipped", []) if not hasattr(r, "wasxfail")]


def _strict() -> bool:
    return os.environ.get(ALLOW_SKIPS_VAR) != "1"


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None and exitstatus == pytest.ExitCode.OK and _skips(reporter.stats) and _strict():
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    skips = _skips(terminalreporter.stats)
    if skips and _strict():
        terminalreporter.section("skipped tests fail this run", sep="=", red=True, bold=True)
        for report in skips:
            reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
            terminalreporter.line(f"{report.nodeid}: {reason}")
        terminalreporter.line(f"set {ALLOW_SKIPS_VAR}=1 to accept them on a machine without these components")
