"""Run ``python -m MODULE ARGS`` on this MPI rank, sending the output of every rank but 0 to a log file.

    mpiexec -n 4 python tests/mpi/_rank_wrapper.py [--log-dir DIR] -m pytest tests/mpi -p no:cacheprovider

Under mpiexec every rank prints its own pytest report and rank 0's summary may
say "passed" while another rank failed; only rank 0 should talk. The
redirection must happen here, before pytest starts (its terminal writer holds
on to the original stdout). Rank r writes to ``DIR/rank<r>.log`` (and a failing
test's report also to the job's console, through NCCLKV_MPI_CONSOLE_FD); DIR defaults
to a folder named after the MPI job in the temp directory. The exit code is
the module's. With NCCLKV_MPI_KILL_RANK set the ranks leave without MPI_Finalize
(see main).
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys
import tempfile
from pathlib import Path

RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID")
KILL_RANK_VAR = "NCCLKV_MPI_KILL_RANK"  # tests/mpi/test_transfer_mpi.py: that rank dies mid-transfer
CONSOLE_FD_VAR = "NCCLKV_MPI_CONSOLE_FD"  # the job's stderr, kept open on ranks that log to a file


def rank_from_env() -> int:
    for name in RANK_VARS:
        if os.environ.get(name):
            return int(os.environ[name])
    return 0


def default_log_dir() -> Path:
    # PMIX_NAMESPACE names the MPI job (e.g. "prterun-host-1234@1"): all ranks agree on it.
    job = os.environ.get("PMIX_NAMESPACE") or f"ppid{os.getppid()}"
    return Path(tempfile.gettempdir()) / f"ncclkv-mpi-{job.replace('@', '-').replace('/', '-')}"


def redirect_to(path: Path) -> None:
    """Point file descriptors 1 and 2 (and so sys.stdout/sys.stderr and child processes) at ``path``."""
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def parse(argv: list[str]) -> tuple[Path | None, str, list[str]]:
    """``[--log-dir DIR] -m MODULE ARGS...`` -> (DIR, MODULE, ARGS); everything after MODULE is its own."""
    if "-m" not in argv or argv.index("-m") + 1 >= len(argv):
        raise SystemExit(f"usage: {Path(__file__).name} [--log-dir DIR] -m MODULE [ARGS...]")
    at = argv.index("-m")
    own = argparse.ArgumentParser(prog=Path(__file__).name)
    own.add_argument("--log-dir", type=Path, default=None)
    opts = own.parse_args(argv[:at])
    return opts.log_dir, argv[at + 1], argv[at + 2 :]


def main() -> None:
    log_dir, module, args = parse(sys.argv[1:])
    rank = rank_from_env()
    log_dir = log_dir or default_log_dir()
    if rank == 0:
        print(f"[rank wrapper] ranks other than 0 write to {log_dir}/rank<r>.log", flush=True)
    else:
        log_dir.mkdir(parents=True, exist_ok=True)
        # A failing rank still shows its traceback on the job's console (tests/mpi/conftest.py).
        os.environ[CONSOLE_FD_VAR] = str(os.dup(2))
        redirect_to(log_dir / f"rank{rank}.log")
    sys.argv = [module, *args]
    sys.path[0] = os.getcwd()  # what `python -m` puts first, instead of this script's folder
    if not os.environ.get(KILL_RANK_VAR):
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        return
    # A job with a killed rank: the survivors' MPI_Finalize (run by mpi4py at exit) sometimes
    # waits for the dead rank until mpiexec's --timeout, even with PRRTE's ``recoverable``
    # (3 of 5 runs in one stretch, then 0 of 12). The survivors' outcomes are
    # gathered and asserted before this point, so they leave without finalizing.
    code: object = 0
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        code = exc.code
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code if isinstance(code, int) else 1)

if __name__ == "__main__":
    main()
