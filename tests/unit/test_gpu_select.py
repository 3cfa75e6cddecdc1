"""The suite's GPU plugin (tests/gpu_select.py), run in a real pytest subprocess with the strict-skip plugin."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

TESTS_DIR = Path(__file__).resolve().parents[1]
SAMPLE = """
import pytest

def test_plain():
    pass

@pytest.mark.gpu(0)
def test_needs_no_gpu():
    pass

@pytest.mark.gpu(999)
def test_needs_more_gpus_than_any_machine():
    raise AssertionError("a deselected test must not run")
"""


def test_a_test_needing_more_gpus_is_deselected_and_named_in_the_summary_not_skipped(tmp_path: Path) -> None:
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    environ = {k: v for k, v in os.environ.items() if k != "NCCLKV_ALLOW_SKIPS"}
    environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS_DIR), environ.get("PYTHONPATH", "")]))
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "strict_skips", "-p", "gpu_select", "-p", "no:cacheprovider",
         "--rootdir", str(tmp_path), str(tmp_path / "test_sample.py")],
        capture_output=True, text=True, timeout=60, cwd=tmp_path, env=environ,
    )
    assert done.returncode == pytest.ExitCode.OK, done.stdout + done.stderr
    assert "2 passed, 1 deselected" in done.stdout, done.stdout
    seen = torch.cuda.device_count() if torch.cuda.is_available() else 0
    assert f"1 GPU test(s) deselected: they need 999 GPU(s), torch sees {seen}" in done.stdout, done.stdout
