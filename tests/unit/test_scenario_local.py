"""ncclkv.scenario._local.run_local: every rank's exit code and output, a failing rank, the deadline.

A successful run is covered by ``ncclkv bench scale --quick`` (tests/unit/test_bench_quick.py)
and ``ncclkv demo``; these are the paths that must not hang or hide an error.
"""

from __future__ import annotations

import glob
import json
import os
import signal
import threading
import time

import pytest

from ncclkv.layout import KVGeometry, ParallelLayout
from ncclkv.scenario import PDTopology
from ncclkv.scenario._local import EXIT_TIMEOUT, LocalRun, run_local
from ncclkv.scenario._transfer import TransferConfig, summary_json


def test_a_rank_that_fails_gives_its_code_and_output() -> None:
    outcome = run_local(2, ["--prefill", "1", "--decode", "1", "--requests", "0"], timeout_s=120)
    assert outcome.codes == (2, 2) and outcome.returncode == 2 and not outcome.ok  # a usage error on every rank
    assert "--requests and --max-tokens must be >= 1" in outcome.outputs[0]
    assert "--- rank 1 (exit 2) ---" in outcome.failure_text()


def test_ranks_past_the_deadline_are_killed() -> None:
    outcome = run_local(2, ["--prefill", "1", "--decode", "1"], timeout_s=0.3)  # torch alone takes longer to import
    assert outcome.codes == (EXIT_TIMEOUT, EXIT_TIMEOUT) and outcome.seconds < 30


def test_bad_arguments_are_refused_before_starting_anything() -> None:
    with pytest.raises(ValueError, match="world_size"):
        run_local(0, [], timeout_s=10)
    with pytest.raises(ValueError, match="timeout_s"):
        run_local(2, [], timeout_s=0)


def test_local_run_reports_the_failure_not_its_echo() -> None:
    # Rank 2's check failed; rank 1 only saw it as a peer failure (3): the run reports 4.
    run = LocalRun((0, 3, 4, 0), ("ok", "peer failure detected", "check failed", ""), 1.0)
    text = run.failure_text(tail_chars=6)
    assert run.returncode == 4 and "--- rank 1 (exit 3) ---\ntected\n" in text and "rank 2 (exit 4)" in text
    assert "--- rank 0 (exit 0) ---\nok" in text and "rank 3" not in text  # silent successful ranks left out
    assert LocalRun((0, 3, 0), ("", "", ""), 1.0).returncode == 3  # a peer failure alone is still one
    assert LocalRun((0, 0), ("", ""), 1.0).ok


def test_summary_json_totals_the_decode_ranks() -> None:
    topology = PDTopology(2, ParallelLayout(1, 1), 1, ParallelLayout(2, 1))
    cfg = TransferConfig(KVGeometry(4, 4, 64, "bfloat16"), (10, 20, 30))
    results = [{"place": "prefill[0] tp_rank=0 pp_rank=0", "bytes": 999, "seconds": 9.0, "requests": 2, "tensors": 1},
               {"place": "decode[0] tp_rank=0 pp_rank=0", "bytes": 1000, "seconds": 0.5, "requests": 3, "tensors": 4},
               {"place": "decode[0] tp_rank=1 pp_rank=0", "bytes": 3000, "seconds": 1.0, "requests": 3, "tensors": 4}]
    data = json.loads(json.dumps(summary_json(topology, cfg, results)))  # plain JSON all the way down
    assert (data["world_size"], data["requests"], data["tokens"], data["mode"]) == (4, 3, 60, "pull")
    assert (data["decode_bytes"], data["decode_seconds"]) == (4000, 1.0)
    assert data["gbps"] == pytest.approx(4000 / 1e9) and data["requests_per_s"] == pytest.approx(3.0)


def test_inherited_launcher_variables_do_not_leak_into_the_ranks() -> None:
    # vLLM, run in-process by other tests, leaves LOCAL_WORLD_SIZE=1 behind; an enclosing
    # Slurm or MPI job leaves its own. The local ranks must see only what run_local sets.
    polluted = {**os.environ, "LOCAL_WORLD_SIZE": "1", "SLURM_PROCID": "5", "SLURM_NTASKS": "8",
                "OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "3"}
    outcome = run_local(2, ["--prefill", "1", "--decode", "1", "--small", "--deadline", "60"], 120, env=polluted)
    assert outcome.ok, outcome.failure_text()


def test_ncclkv_bind_host_auto_runs_without_the_option() -> None:
    """NCCLKV_BIND_HOST=auto in the environment, no --bind-host: each rank binds the address on its route to
    MASTER_ADDR (127.0.0.1 here), not the host 'auto'."""
    outcome = run_local(2, ["--small"], timeout_s=120, kind="ring", env={**os.environ, "NCCLKV_BIND_HOST": "auto"})
    assert outcome.ok, outcome.failure_text()
    assert all("received byte-exact" in text for text in outcome.outputs), outcome.failure_text()


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_the_transfer_scenario_runs_mla(mode: str) -> None:
    """--mla never worked: the caches were the non-MLA ones, and --kv-heads stayed 4 (an MLA geometry needs 1)."""
    outcome = run_local(2, ["--prefill", "1", "--decode", "1", "--small", "--mla", "--mode", mode], timeout_s=120)
    assert outcome.ok, outcome.failure_text()
    assert "x 1H x" in outcome.outputs[0] and "every landed byte checked" in outcome.outputs[0], outcome.outputs[0]


def _scenario_children() -> list[int]:
    """Our children (any thread's) that run ``python -m ncclkv.scenario``."""
    pids = []
    for path in glob.glob(f"/proc/{os.getpid()}/task/*/children"):
        with open(path) as children:
            pids += [int(pid) for pid in children.read().split()]
    found = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
                if b"ncclkv.scenario" in cmdline.read():
                    found.append(pid)
        except FileNotFoundError:
            pass
    return found


def test_ranks_end_on_sigterm() -> None:
    """run_local starts each rank inside signals_deferred() (no rank without its handle kept), and a child keeps
    its parent's signal mask across exec: every rank ran with SIGINT and SIGTERM blocked, so a SIGTERM (kill PID,
    timeout(1), a process-group TERM after the parent was SIGKILLed) or Ctrl-C never ended it; the run went on."""
    outcome: dict[str, object] = {}
    runner = threading.Thread(target=lambda: outcome.update(
        run=run_local(2, ["--small", "--deadline", "60"], timeout_s=60, kind="ring")))
    runner.start()
    deadline = time.monotonic() + 30
    ranks: list[int] = []
    while len(ranks) < 2 and runner.is_alive() and time.monotonic() < deadline:
        ranks = _scenario_children()
        time.sleep(0.005)  # polling /proc for the ranks run_local starts: nothing else tells us their pids
    assert len(ranks) == 2, ranks
    for pid in ranks:
        os.kill(pid, signal.SIGTERM)
    runner.join(90)
    run = outcome["run"]
    assert isinstance(run, LocalRun)
    assert run.codes == (-signal.SIGTERM, -signal.SIGTERM), run.failure_text()
