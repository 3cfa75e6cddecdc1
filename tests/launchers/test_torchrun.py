"""torchrun starting the ring scenario, directly and through launch/torchrun_pd.sh, for real."""

from __future__ import annotations

import re
import sys
import uuid

import pytest
from _launch import REPO, VENV_BIN, child_env, ring_lines, run

pytestmark = pytest.mark.multiprocess

TIMEOUT_S = 120


def torchrun_scenario(*scenario_args: str) -> list[str]:
    """torchrun starting 4 ranks of ``python -m ncclkv.scenario SCENARIO_ARGS`` (skips without torchrun)."""
    torchrun = VENV_BIN / "torchrun"
    if not torchrun.exists():
        pytest.skip(f"no torchrun next to {sys.executable}")
    # Port 0: the c10d rendezvous store binds a free port; the workers get it as MASTER_PORT.
    return [
        str(torchrun), "--nproc-per-node", "4", "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0",
        "--rdzv-id", uuid.uuid4().hex, "--max-restarts", "0", "-m", "ncclkv.scenario", *scenario_args,
    ]


def test_torchrun_c10d_free_port_runs_the_ring() -> None:
    command = torchrun_scenario("--kind", "ring", "--count", "8", "--nbytes", "262144")
    done = run(command, env=child_env(), timeout_s=TIMEOUT_S)
    print(f"torchrun ring: {done.elapsed_s:.1f} s")
    assert done.returncode == 0, done.describe()
    lines = ring_lines(done.output)
    assert sorted(lines) == [0, 1, 2, 3], done.describe()
    assert all("(torchrun, cpu)" in line and "8 received byte-exact" in line for line in lines.values()), lines


def test_torchrun_pd_script_places_prefill_and_decode_ranks() -> None:
    script = REPO / "launch" / "torchrun_pd.sh"
    command = [
        "bash", str(script), "--kind", "ring", "--prefill", "1", "--prefill-tp", "2",
        "--decode", "1", "--decode-tp", "1", "--decode-pp", "2", "--", "--small",
    ]
    done = run(command, env=child_env(PYTHON=sys.executable), timeout_s=TIMEOUT_S)
    print(f"launch/torchrun_pd.sh 1P(tp2)+1D(pp2): {done.elapsed_s:.1f} s")
    assert done.returncode == 0, done.describe()
    lines = ring_lines(done.output)
    expected = {
        0: "prefill[0] tp_rank=0 pp_rank=0", 1: "prefill[0] tp_rank=1 pp_rank=0",
        2: "decode[0] tp_rank=0 pp_rank=0", 3: "decode[0] tp_rank=0 pp_rank=1",
    }
    assert sorted(lines) == sorted(expected), done.describe()
    for rank, place in expected.items():
        assert f"(torchrun as {place}, cpu): 4 tensors" in lines[rank], lines[rank]


def test_torchrun_pd_script_rejects_bad_sizes() -> None:
    done = run(["bash", str(REPO / "launch" / "torchrun_pd.sh"), "--decode-tp", "0"], env=child_env(), timeout_s=30)
    assert done.returncode == 2 and "--decode-tp must be a positive integer, got '0'" in done.output, done.describe()


def test_torchrun_runs_the_transfer_scenario() -> None:
    command = torchrun_scenario("--kind", "transfer", "--prefill", "2", "--decode", "1", "--decode-tp", "2",
                                "--small", "--deadline", "60")
    done = run(command, env=child_env(), timeout_s=TIMEOUT_S)
    print(f"torchrun transfer 2P+1D(tp2): {done.elapsed_s:.1f} s")
    assert done.returncode == 0, done.describe()
    assert "every landed byte checked against the producer's KV: OK" in done.output, done.describe()


def test_torchrun_elastic_restart_meets_on_fresh_rendezvous_keys() -> None:
    """Attempt 0: both ranks finish their ring, then rank 1 exits 1; torchrun restarts both (--max-restarts 1)
    against its agent store, which still holds attempt 0's keys. Attempt 1 must run its own ring: read under the
    same keys, rank 0 got attempt 0's addresses and the restart failed."""
    torchrun = VENV_BIN / "torchrun"
    if not torchrun.exists():
        pytest.skip(f"no torchrun next to {sys.executable}")
    command = [
        str(torchrun), "--standalone", "--nproc-per-node", "2", "--max-restarts", "1", "--monitor-interval", "0.5",
        str(REPO / "tests" / "launchers" / "_restart_once.py"), "--kind", "ring", "--small", "--deadline", "20",
    ]
    done = run(command, env=child_env(), timeout_s=TIMEOUT_S)
    print(f"torchrun ring, elastic restart: {done.elapsed_s:.1f} s")
    assert done.returncode == 0, done.describe()
    exits = {(int(m[1]), int(m[2])): int(m[3])
             for m in re.finditer(r"restart_once: rank (\d) attempt (\d) scenario exit (\d+)", done.output)}
    # Rank 0 of attempt 0 may be stopped by torchrun before it prints: the rest is certain.
    assert {key: code for key, code in exits.items() if key != (0, 0)} == {(1, 0): 0, (0, 1): 0, (1, 1): 0}, \
        done.describe()
    assert exits.get((0, 0), 0) == 0, done.describe()
    lines = ring_lines(done.output)
    assert sorted(lines) == [0, 1] and all("(torchrun, cpu): 4 tensors" in line for line in lines.values()), lines
