"""``ncclkv demo --quick`` end to end: real prefill, decode and single vLLM engines, as a user runs it.

The demo's own checks decide its exit code (outputs equal to the single
engine's, every prompt token's KV received, no failed load, no block left
held); this test also reads its table and confirms the byte count from the
model's shape, so a demo that silently stopped transferring would fail here.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ncclkv.demo import DemoSettings, prompt_lengths

pytestmark = pytest.mark.vllm

KV_BYTES_PER_TOKEN = 2 * 4 * 2 * 64 * 4  # layers x kv-heads x (K, V) x head size x float32


@pytest.mark.timeout(400)
def test_demo_quick(tiny_model_dir: Path, tmp_path: Path) -> None:
    t0 = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "ncclkv.cli", "demo", "--quick", "--plain", "--model-dir", str(tiny_model_dir),
         "--log-dir", str(tmp_path / "logs"), "--timeout", "240"],
        capture_output=True, text=True, timeout=380)
    seconds = time.monotonic() - t0
    print(f"\n{done.stdout}\n(ncclkv demo --quick: {seconds:.1f} s)")
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    settings = DemoSettings()
    lengths = prompt_lengths(4, 45, 200, settings.block_size)
    cells = [re.split(r"\s{2,}", line.strip()) for line in done.stdout.splitlines()]  # columns: 2+ spaces apart
    rows = {row[0]: row[1:] for row in cells if len(row) == 4}
    assert rows["prompt tokens / batch"] == [str(sum(lengths))] * 3
    assert rows["generated tokens / batch"] == [str(4 * 8)] * 3
    assert rows["outputs equal to single engine"] == ["reference", "4/4", "4/4"]  # one round: no other single batch
    megabytes = f"{sum(lengths) * KV_BYTES_PER_TOKEN / 1e6:.2f}"
    assert rows["KV bytes moved / batch"] == ["-", f"{megabytes} MB", f"{megabytes} MB"]
    assert f"({sum(lengths) * KV_BYTES_PER_TOKEN} bytes per batch) crossed through ncclkv" in done.stdout
    assert {"prefill.log", "decode.log", "single.log"} <= {p.name for p in (tmp_path / "logs").iterdir()}
