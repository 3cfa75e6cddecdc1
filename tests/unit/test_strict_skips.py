"""The suite's strict-skip plugin (tests/strict_skips.py), run in a real pytest subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS_DIR = Path(__file__).resolve().parents[1]
SAMPLE = """
import pytest

def test_runs():
    pass

def test_needs_a_component():
    pytest.skip("component X is not installed")
"""


def _run(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    environ = {k: v for k, v in os.environ.items() if k != "NCCLKV_ALLOW_SKIPS"} | env
    environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS_DIR), environ.get("PYTHONPATH", "")]))
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "strict_skips", "-p", "no:cacheprovider",
         "--rootdir", str(tmp_path), str(tmp_path / "test_sample.py")],
        capture_output=True, text=True, timeout=60, cwd=tmp_path, env=environ,
    )


def test_a_skip_fails_the_run_and_names_its_reason(tmp_path: Path) -> None:
    done = _run(tmp_path)
    assert done.returncode == pytest.ExitCode.TESTS_FAILED, done.stdout + done.stderr
    assert "test_needs_a_component: Skipped: component X is not installed" in done.stdout, done.stdout
    assert "1 passed, 1 skipped" in done.stdout


def test_allow_skips_accepts_them(tmp_path: Path) -> None:
    done = _run(tmp_path, NCCLKV_ALLOW_SKIPS="1")
    assert done.returncode == pytest.ExitCode.OK, done.stdout + done.stderr
    assert "skipped tests fail this run" not in done.stdout
